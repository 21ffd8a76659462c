"""Per-signal Spearman correlations with occlusion labels and with position, pooled and within-trace.

Two aggregations of the same rho (EpiKV §3.2, §4.2, Appendix 6):

- *pooled*: one rho over every (token, label) pair of every trace. EpiKV §3.2 ("temporal-trend correction") warns
  that this aggregate is driven partly by cross-problem structure and overstates within-trace ranking quality.
- *within-trace*: one rho per trace, averaged in Fisher-z space (`validation.stats.fisher_mean`). A trace whose labels
  or signal are constant has no rho and is left out, so n_eff = traces with a defined rho.

Intervals use n_eff = traces (Appendix 12), never tokens. The pooled rho has the paper's Fisher-z interval. The
within-trace mean has three (`validation.stats.fisher_mean` defines them): the paper's Fisher-z interval
(``within_lo/within_hi``, ``within_p``), kept so the paper's protocol stays readable; the t-interval on the per-trace
z (``within_t_lo/within_t_hi``, ``within_t_p``), which measures how much the traces disagree and is **the
significance interval**; and a percentile bootstrap over traces (``within_boot_lo/within_boot_hi``) as a check. A
rho of exactly +-1 in every trace is reported as exactly +-1. The positional confound check (§3.2) is the
within-trace rho between a signal and absolute position. Nothing here knows a signal by name: every function works
on whatever columns the `Aligned` set holds (hidden-state layers, K/V statistics, a policy's replayed scores).

Each p-value is corrected across the layers of a (family, transform) group (`signal_table`). What bands
(`validation.layers`) and selection evidence (`validation.select`) call significant is `SIGNIFICANCE`:
``within_t_significant`` for the within-trace rho, ``pooled_significant`` for the pooled one (which has no per-trace
values to resample, so only the paper's interval). ``within_p_adj/within_significant`` are the paper's decision on
the Fisher-z p-value, beside it.

Columns of `signal_table` (one row per signal; intervals are ``<name>_lo`` / ``<name>_hi``):
``signal, family, layer, transform, n_traces, n_tokens``;
``pooled_rho, pooled_lo, pooled_hi, pooled_p``;
``within_rho, within_lo, within_hi, within_t_lo, within_t_hi, within_boot_lo, within_boot_hi, within_n_eff,
within_sd, within_p, within_t_p``;
``position_rho, position_lo, position_hi, position_t_lo, position_t_hi, position_boot_lo, position_boot_hi,
position_n_eff``;
``pooled_p_adj, pooled_significant, within_p_adj, within_significant, within_t_p_adj, within_t_significant``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from validation.signals import Aligned, parse_signal_name
from validation.stats import (
    DEFAULT_N_BOOT,
    MeanCorrelation,
    adjust_pvalues,
    fisher_mean,
    fisher_z_interval,
    fisher_z_pvalue,
    spearman,
)

TARGETS = ("labels", "position")
# The columns ``<prefix>_p_adj`` / ``<prefix>_significant`` that decide significance for each rho (the keys are the
# band statistics of `validation.layers`): the within-trace mean by its t-test over traces, for the reasons
# `validation.stats.fisher_mean` gives; the pooled rho by the paper's Fisher-z test.
SIGNIFICANCE = {"within": "within_t", "pooled": "pooled"}
# The p-value columns the correction runs on: the decisions above and the paper's own on the within-trace mean.
_CORRECTED = ("pooled", "within", "within_t")


@dataclass(frozen=True)
class Pooled:
    """One rho per signal over all tokens, with the Fisher-z interval and p-value on n_eff = traces (NaN if <= 3)."""

    rho: np.ndarray  # [signals]
    n_eff: np.ndarray  # [signals] traces
    lo: np.ndarray
    hi: np.ndarray
    p: np.ndarray


def _target(trace, target: str) -> np.ndarray:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    return trace.labels if target == "labels" else trace.positions.astype(float)


def per_trace_rho(aligned: Aligned, target: str = "labels") -> np.ndarray:
    """[traces, signals]: Spearman rho of each signal with the target inside each trace (NaN where undefined)."""
    return np.array([np.atleast_1d(spearman(t.values, _target(t, target))) for t in aligned.traces])


def within_trace(aligned: Aligned, target: str = "labels", level: float = 0.95, n_boot: int = DEFAULT_N_BOOT,
                 seed: int = 0) -> MeanCorrelation:
    """Fisher-z mean of per-trace rho, n_eff = traces with a defined rho, its three intervals (EpiKV §3.2, App. 12;
    `validation.stats.fisher_mean`)."""
    return fisher_mean(per_trace_rho(aligned, target), level, n_boot, seed)


def pooled(aligned: Aligned, target: str = "labels", level: float = 0.95) -> Pooled:
    """One rho over all tokens of all traces; its interval still uses n_eff = traces (Appendix 12)."""
    values = np.concatenate([t.values for t in aligned.traces])
    y = np.concatenate([_target(t, target) for t in aligned.traces])
    rho = np.atleast_1d(spearman(values, y))
    n_eff = np.full(rho.shape, len(aligned.traces))
    lo, hi, p = (np.full(rho.shape, np.nan) for _ in range(3))
    ok = (n_eff > 3) & np.isfinite(rho)
    if ok.any():
        lo[ok], hi[ok] = fisher_z_interval(rho[ok], n_eff[ok], level)
        p[ok] = fisher_z_pvalue(rho[ok], n_eff[ok])
    return Pooled(rho, n_eff, lo, hi, p)


def informative_traces(aligned: Aligned) -> int:
    """Traces whose labels vary, i.e. that can contribute a within-trace rho."""
    return sum(int(np.unique(t.labels).size > 1) for t in aligned.traces)


def _columns(prefix: str, stat, i: int, names: tuple[str, ...]) -> dict:
    return {f"{prefix}_{name}": float(getattr(stat, name)[i]) for name in names}


def signal_table(aligned: Aligned, level: float = 0.95, correction: str = "fdr_bh", alpha: float = 0.05,
                 n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> list[dict]:
    """One row per signal (columns in the module docstring): pooled and within-trace label rho, within-trace
    position rho, corrected p-values.

    The multiple-comparison correction runs across the layers of each (family, transform) group, separately for
    the pooled p (``pooled_p``), the paper's within-trace p (``within_p``) and the t-test's (``within_t_p``); a
    layerless signal is a family of one. ``<prefix>_significant`` is "``<prefix>_p_adj`` < alpha"; with correction
    "none" and alpha = 1 - level it is exactly "the ``<prefix>`` interval excludes zero". `SIGNIFICANCE` names the
    decision the rest of kvscope uses (``within_t_significant`` for the within-trace rho).
    """
    pool = pooled(aligned, "labels", level)
    within = within_trace(aligned, "labels", level, n_boot, seed)
    position = within_trace(aligned, "position", level, n_boot, seed)
    parsed = [parse_signal_name(n) for n in aligned.names]
    n_tokens = int(sum(t.labels.size for t in aligned.traces))
    rows = []
    for i, sig in enumerate(parsed):
        rows.append({
            "signal": sig.name, "family": sig.family, "layer": sig.layer, "transform": sig.transform,
            "n_traces": len(aligned.traces), "n_tokens": n_tokens,
            **_columns("pooled", pool, i, ("rho", "lo", "hi", "p")),
            **_columns("within", within, i, ("rho", "lo", "hi", "t_lo", "t_hi", "boot_lo", "boot_hi")),
            "within_n_eff": int(within.n_eff[i]),
            **_columns("within", within, i, ("sd", "p", "t_p")),
            **_columns("position", position, i, ("rho", "lo", "hi", "t_lo", "t_hi", "boot_lo", "boot_hi")),
            "position_n_eff": int(position.n_eff[i]),
        })
    groups: dict[tuple[str, str], list[int]] = {}
    for i, sig in enumerate(parsed):
        groups.setdefault((sig.family, sig.transform), []).append(i)
    for members in groups.values():
        for stat in _CORRECTED:
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
