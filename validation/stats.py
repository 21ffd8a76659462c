"""Core statistics: Spearman rho, the Fisher-z mean of per-trace correlations with its two intervals,
multiple-comparison correction, Wilson and percentile intervals.

Conventions follow EpiKV: correlations are Spearman rho (§3.2 "two-band anatomy", Appendix 6) and their uncertainty
is a Fisher-z interval whose effective sample size is the number of independent *traces*, not token pairs, because
tokens within a trace are correlated (Appendix 12). Everything here is a pure array function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

from core.errors import UsageError, unknown_choice

CORRECTIONS = (
    "none",
    "bonferroni",
    "sidak",
    "holm-sidak",
    "holm",
    "simes-hochberg",
    "hommel",
    "fdr_bh",
    "fdr_by",
    "fdr_tsbh",
    "fdr_tsbky",
)


def spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rho between each column of `x` ([n] or [n, k]) and `y` ([n]); ties get average ranks.

    This is Pearson's r on average ranks, the definition `scipy.stats.spearmanr` uses. A constant column (or a
    constant `y`, or n < 2) has no rank correlation and gives NaN. Returns a scalar array for 1-D `x`, else [k].
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape[0] != y.shape[0] or y.ndim != 1:
        raise ValueError(f"spearman needs x [n] or [n, k] and y [n]; got {x.shape} and {y.shape}")
    column = x.ndim == 1
    x2 = x[:, None] if column else x
    if x2.shape[0] < 2:
        rho = np.full(x2.shape[1], np.nan)
        return rho[0] if column else rho
    rx = sps.rankdata(x2, axis=0)
    ry = sps.rankdata(y)
    rx -= rx.mean(axis=0)
    ry -= ry.mean()
    num = ry @ rx
    den = np.sqrt((rx * rx).sum(axis=0) * (ry @ ry))
    with np.errstate(invalid="ignore", divide="ignore"):
        # Centred ranks of a constant column are exactly zero, so den == 0 marks "no correlation defined".
        rho = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    rho = np.clip(rho, -1.0, 1.0)
    return rho[0] if column else rho


def _critical(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise UsageError(f"confidence level must be in (0, 1), got {level}")
    return float(sps.norm.ppf(0.5 + level / 2.0))


def _check_n_eff(n_eff: np.ndarray) -> None:
    if np.any(n_eff <= 3):
        raise UsageError(
            f"too few independent traces for a Fisher-z interval: n_eff={int(np.min(n_eff))} (need n_eff > 3)"
        )


def fisher_z_interval(rho: Any, n_eff: Any, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Fisher-z confidence interval for a correlation with `n_eff` independent units (EpiKV Appendix 12).

    z = atanh(rho), se = 1 / sqrt(n_eff - 3), interval = tanh(z -/+ z_crit * se) with z_crit the two-sided normal
    quantile of `level`. `n_eff` is the number of traces, never the number of tokens. Raises `UsageError` when any
    n_eff <= 3 (the standard error is undefined there). Broadcasts over arrays; NaN rho gives a NaN interval.
    """
    rho = np.asarray(rho, dtype=float)
    n_eff = np.asarray(n_eff, dtype=float)
    _check_n_eff(n_eff)
    half = _critical(level) / np.sqrt(n_eff - 3.0)
    with np.errstate(divide="ignore"):
        z = np.arctanh(rho)
    return np.tanh(z - half), np.tanh(z + half)


def fisher_z_pvalue(rho: Any, n_eff: Any) -> np.ndarray:
    """Two-sided p-value of H0: rho = 0 under the same Fisher-z normal approximation as `fisher_z_interval`.

    p < 1 - level exactly when that interval excludes zero, so "significant" and "interval excludes zero" agree.
    """
    rho = np.asarray(rho, dtype=float)
    n_eff = np.asarray(n_eff, dtype=float)
    _check_n_eff(n_eff)
    with np.errstate(divide="ignore"):
        stat = np.abs(np.arctanh(rho)) * np.sqrt(n_eff - 3.0)
    return 2.0 * sps.norm.sf(stat)


# A per-trace rho of exactly +-1 (short traces, labels with few positives) has an infinite Fisher z and would make the
# mean infinite. It is clipped to +-FISHER_CLIP before atanh: such a trace then counts as z = +-4.95 (rho = 0.9999).
# No |rho| below the clip changes.
FISHER_CLIP = 0.9999
DEFAULT_N_BOOT = 2000
# Bootstrap replicates are drawn in blocks so the [block, units] count matrix stays around this many entries.
_BLOCK_ENTRIES = 4_000_000


def fisher_z(rho: Any) -> np.ndarray:
    """atanh(rho) after clipping rho to [-FISHER_CLIP, FISHER_CLIP]; NaN stays NaN."""
    return np.arctanh(np.clip(np.asarray(rho, dtype=float), -FISHER_CLIP, FISHER_CLIP))


def bootstrap_means(values: Any, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """`n_boot` bootstrap replicates of the mean of `values` ([units] or [units, columns]), resampling units.

    Each replicate draws the units with replacement (multinomial counts, so a block of replicates is one matrix
    product); NaN entries are left out of a column's mean, and a replicate that drew no finite entry of a column is
    NaN there. Returns [n_boot] for 1-D `values`, else [n_boot, columns].
    """
    values = np.asarray(values, dtype=float)
    column = values.ndim == 1
    matrix = values[:, None] if column else values
    n = matrix.shape[0]
    finite = np.isfinite(matrix)
    filled = np.where(finite, matrix, 0.0)
    out = np.empty((n_boot, matrix.shape[1]))
    block = max(1, _BLOCK_ENTRIES // max(n, 1))
    for start in range(0, n_boot, block):
        stop = min(n_boot, start + block)
        counts = rng.multinomial(n, np.full(n, 1.0 / n), size=stop - start).astype(float)
        used = counts @ finite
        with np.errstate(invalid="ignore", divide="ignore"):
            out[start:stop] = np.where(used > 0, (counts @ filled) / used, np.nan)
    return out[:, 0] if column else out


def percentile_interval(replicates: np.ndarray, level: float) -> tuple[Any, Any]:
    """The percentile interval of bootstrap replicates (per column of a [n_boot, columns] array; NaN ignored)."""
    tail = (1.0 - level) / 2.0
    lo, hi = np.nanquantile(replicates, [tail, 1.0 - tail], axis=0)
    return (float(lo), float(hi)) if np.ndim(lo) == 0 else (lo, hi)


@dataclass(frozen=True)
class MeanCorrelation:
    """The Fisher-z mean of per-trace correlations, one entry per column (signal); NaN where undefined.

    `lo`/`hi` are the Fisher-z interval on n_eff traces (EpiKV Appendix 12) and `p` its two-sided p-value, defined
    for n_eff > 3; `boot_lo`/`boot_hi` the percentile bootstrap over traces, on the same traces.
    """

    rho: np.ndarray  # tanh(mean_i atanh(rho_i)) over the traces with a defined rho
    n_eff: np.ndarray  # traces with a defined rho
    lo: np.ndarray
    hi: np.ndarray
    boot_lo: np.ndarray
    boot_hi: np.ndarray
    p: np.ndarray
    sd: np.ndarray  # sample SD of the per-trace rho (descriptive; NaN below two traces)


def fisher_mean(per_trace: Any, level: float = 0.95, n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> MeanCorrelation:
    """Average per-trace correlations in Fisher-z space and give both of their intervals.

    `per_trace` is [traces] (one signal) or [traces, signals], NaN where a trace has no rho (a constant signal or
    constant labels). Per column: z_i = atanh(clip(rho_i)) (`FISHER_CLIP`), rho = tanh(mean z_i), n_eff = traces with a
    defined rho; the paper's interval is tanh(mean z -/+ z_crit / sqrt(n_eff - 3)); the bootstrap resamples traces
    (`n_boot` replicates, generator seeded with `seed`) and takes percentiles of tanh(mean z*). Averaging z rather
    than rho is what makes the 1/sqrt(n - 3) standard error apply: z is approximately normal, rho is not.
    """
    if n_boot < 1:
        raise UsageError(f"n_boot must be >= 1, got {n_boot}")
    rho = np.asarray(per_trace, dtype=float)
    rho = rho[:, None] if rho.ndim == 1 else rho
    z = fisher_z(rho)
    defined = np.isfinite(z)
    n_eff = defined.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_z = np.where(n_eff > 0, np.where(defined, z, 0.0).sum(axis=0) / np.maximum(n_eff, 1), np.nan)
    estimate = np.tanh(mean_z)
    lo, hi, boot_lo, boot_hi, p = (np.full(estimate.shape, np.nan) for _ in range(5))
    ok = n_eff > 3
    if ok.any():
        lo[ok], hi[ok] = fisher_z_interval(estimate[ok], n_eff[ok], level)
        p[ok] = fisher_z_pvalue(estimate[ok], n_eff[ok])
        replicates = bootstrap_means(z[:, ok], n_boot, np.random.default_rng(seed))
        boot_lo[ok], boot_hi[ok] = np.tanh(percentile_interval(replicates, level))
    sd = np.full(estimate.shape, np.nan)
    spread = n_eff > 1
    if spread.any():
        sd[spread] = np.nanstd(rho[:, spread], axis=0, ddof=1)
    return MeanCorrelation(estimate, n_eff, lo, hi, boot_lo, boot_hi, p, sd)


def adjust_pvalues(pvalues: Any, method: str = "fdr_bh", alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Correct a family of p-values (one per layer) with `statsmodels.stats.multitest.multipletests`.

    Returns (reject, adjusted p). NaN entries stay NaN / not rejected and are left out of the family. `method`
    is any multipletests method, or "none" (no correction: reject = p < alpha).
    """
    if method not in CORRECTIONS:
        raise unknown_choice("multiple-comparison correction", method, CORRECTIONS)
    if not 0.0 < alpha < 1.0:
        raise UsageError(f"alpha must be in (0, 1), got {alpha}")
    p = np.asarray(pvalues, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    reject = np.zeros(p.shape, dtype=bool)
    finite = np.isfinite(p)
    if finite.any():
        if method == "none":
            adjusted[finite] = p[finite]
            reject[finite] = p[finite] < alpha
        else:
            rej, padj, _, _ = multipletests(p[finite], alpha=alpha, method=method)
            adjusted[finite] = padj
            reject[finite] = rej
    return reject, adjusted


def wilson_interval(successes: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (accuracy over `n` independent problems).

    center = (p + z^2/2n) / (1 + z^2/n), half-width = z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n).
    """
    if n <= 0:
        raise UsageError("a Wilson interval needs at least one problem")
    z = _critical(level)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Clamped to contain p: at p = 0 or 1 rounding can leave the bound a hair on the wrong side of the estimate.
    return float(min(p, max(0.0, center - half))), float(max(p, min(1.0, center + half)))
