"""Per-signal Spearman correlations with occlusion labels and with position, pooled and within-trace.

Two aggregations of the same rho (EpiKV §3.2, §4.2, Appendix 6):

- *pooled*: one rho over every (token, label) pair of every trace. EpiKV §3.2 ("temporal-trend correction") warns
  that this aggregate is driven partly by cross-problem structure and overstates within-trace ranking quality.
- *within-trace*: one rho per trace, averaged over traces (plain mean of per-trace rho, accumulated in one streaming
  pass with `RunningMoments`). A trace whose labels or signal are constant has no rho and is left out.

Both intervals are Fisher-z intervals with n_eff = number of traces that contributed (Appendix 12), never the number
of tokens. The positional confound check (§3.2) is the within-trace rho between a signal and absolute position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from validation.signals import Aligned, parse_signal_name
from validation.stats import RunningMoments, adjust_pvalues, fisher_z_interval, fisher_z_pvalue, spearman

TARGETS = ("labels", "position")


@dataclass
class Correlation:
    """One correlation per signal: rho, n_eff (traces), Fisher-z interval and p-value (NaN where n_eff <= 3)."""

    rho: np.ndarray  # [signals]
    n_eff: np.ndarray  # [signals] traces contributing
    lo: np.ndarray
    hi: np.ndarray
    p: np.ndarray
    sd: np.ndarray  # [signals] spread of per-trace rho (within-trace only; NaN for pooled)


def _with_interval(rho: np.ndarray, n_eff: np.ndarray, sd: np.ndarray, level: float) -> Correlation:
    lo, hi, p = (np.full(rho.shape, np.nan) for _ in range(3))
    ok = (n_eff > 3) & np.isfinite(rho)
    if ok.any():
        lo[ok], hi[ok] = fisher_z_interval(rho[ok], n_eff[ok], level)
        p[ok] = fisher_z_pvalue(rho[ok], n_eff[ok])
    return Correlation(rho, n_eff, lo, hi, p, sd)


def _target(trace, target: str) -> np.ndarray:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    return trace.labels if target == "labels" else trace.positions.astype(float)


def within_trace(aligned: Aligned, target: str = "labels", level: float = 0.95) -> Correlation:
    """Mean of per-trace rho with n_eff = traces with a defined rho (EpiKV §3.2, Appendix 12)."""
    moments = RunningMoments(len(aligned.names))
    for trace in aligned.traces:
        moments.add(spearman(trace.values, _target(trace, target)))
    return _with_interval(moments.mean, moments.count, moments.std, level)


def pooled(aligned: Aligned, target: str = "labels", level: float = 0.95) -> Correlation:
    """One rho over all tokens of all traces; its interval still uses n_eff = traces (Appendix 12)."""
    values = np.concatenate([t.values for t in aligned.traces])
    y = np.concatenate([_target(t, target) for t in aligned.traces])
    rho = np.atleast_1d(spearman(values, y))
    n_eff = np.full(rho.shape, len(aligned.traces))
    return _with_interval(rho, n_eff, np.full(rho.shape, np.nan), level)


def informative_traces(aligned: Aligned) -> int:
    """Traces whose labels vary, i.e. that can contribute a within-trace rho."""
    return sum(int(np.unique(t.labels).size > 1) for t in aligned.traces)


def signal_table(
    aligned: Aligned, level: float = 0.95, correction: str = "fdr_bh", alpha: float = 0.05
) -> list[dict]:
    """One row per signal: pooled and within-trace label rho, within-trace position rho, corrected p-values.

    The multiple-comparison correction runs across the layers of each (family, transform) group, separately for
    the pooled and the within-trace p-values; a layerless signal is a family of one. `significant_*` is
    "corrected p < alpha"; with correction "none" and alpha = 1 - level it is exactly "interval excludes zero".
    """
    pool = pooled(aligned, "labels", level)
    within = within_trace(aligned, "labels", level)
    position = within_trace(aligned, "position", level)
    parsed = [parse_signal_name(n) for n in aligned.names]
    rows = []
    for i, sig in enumerate(parsed):
        rows.append(
            {
                "signal": sig.name,
                "family": sig.family,
                "layer": sig.layer,
                "transform": sig.transform,
                "n_traces": len(aligned.traces),
                "n_tokens": int(sum(t.labels.size for t in aligned.traces)),
                **{f"pooled_{k}": float(getattr(pool, k)[i]) for k in ("rho", "lo", "hi", "p")},
                "within_rho": float(within.rho[i]),
                "within_sd": float(within.sd[i]),
                "within_n_eff": int(within.n_eff[i]),
                **{f"within_{k}": float(getattr(within, k)[i]) for k in ("lo", "hi", "p")},
                "position_rho": float(position.rho[i]),
                "position_lo": float(position.lo[i]),
                "position_hi": float(position.hi[i]),
                "position_n_eff": int(position.n_eff[i]),
            }
        )
    groups: dict[tuple[str, str], list[int]] = {}
    for i, sig in enumerate(parsed):
        groups.setdefault((sig.family, sig.transform), []).append(i)
    for members in groups.values():
        for stat in ("pooled", "within"):
            reject, adjusted = adjust_pvalues([rows[i][f"{stat}_p"] for i in members], correction, alpha)
            for j, i in enumerate(members):
                rows[i][f"{stat}_p_adj"] = float(adjusted[j])
                rows[i][f"{stat}_significant"] = bool(reject[j])
    return rows


def rank_scorers(rows: list[dict]) -> list[dict]:
    """Candidate scorers ordered by within-trace rho with the labels, best first (higher score = keep).

    Ranking is on signed rho because a policy keeps high-scoring tokens; a signal with negative rho would have to be
    negated to be useful, which is what the band combination does. Undefined rho sorts last.
    """
    return sorted(rows, key=lambda r: (np.isnan(r["within_rho"]), -np.nan_to_num(r["within_rho"], nan=0.0)))
