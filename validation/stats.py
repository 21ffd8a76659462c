"""Core statistics: Spearman rho, the Fisher-z mean of per-trace correlations with its three intervals,
multiple-comparison correction, Wilson, t and percentile intervals, and a permutation test of a rank correlation
over a handful of units.

Conventions follow EpiKV: correlations are Spearman rho (§3.2 "two-band anatomy", Appendix 6) and their effective
sample size is the number of independent *traces*, not token pairs, because tokens within a trace are correlated
(Appendix 12). The paper's interval on the mean of per-trace rho is the Fisher-z interval of a single correlation on
n_eff pairs, se = 1/sqrt(n_eff - 3): it ignores how much the traces actually disagree, and on the 40 traces of
kvscope's Qwen2.5-0.5B study it is several times wider than their spread supports. It is kept, beside two
intervals whose width comes from that spread: a t-interval on the per-trace z, which is what significance rests on
(`fisher_mean` says why), and a percentile bootstrap over traces. Everything here is a pure array function.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.errors import UsageError, unknown_choice
from core.limits import check_memory

# scipy.stats and statsmodels are imported by the functions that use them: they take seconds to import, and the
# command lines read this module's defaults before anything is computed (`--help` answers without them).

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
    from scipy import stats as sps

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
    from scipy import stats as sps

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
    from scipy import stats as sps

    return 2.0 * sps.norm.sf(stat)


# A per-trace rho of exactly +-1 (a short trace, labels with one positive, a scorer that is a function of position
# correlated with position) has an infinite Fisher z. Inside the average of a column that mixes such a trace with
# others it is clipped to +-FISHER_CLIP before atanh, so it counts as z = +-4.95 (rho = 0.9999): one perfect trace
# weighs as much as a nearly perfect one instead of making the mean infinite, and no |rho| below the clip changes. A
# column whose every defined trace is exactly +1 (or every one exactly -1) is not clipped: `fisher_mean` reports
# that value exactly.
FISHER_CLIP = 0.9999
DEFAULT_N_BOOT = 2000
DEFAULT_N_PERM = 50_000
# Bootstrap replicates are drawn in blocks so the [block, units] count matrix stays around this many entries.
_BLOCK_ENTRIES = 4_000_000


def fisher_z(rho: Any) -> np.ndarray:
    """atanh(rho) after clipping rho to [-FISHER_CLIP, FISHER_CLIP]; NaN stays NaN."""
    return np.arctanh(np.clip(np.asarray(rho, dtype=float), -FISHER_CLIP, FISHER_CLIP))


def t_interval(values: Any, level: float = 0.95) -> tuple[Any, Any, Any, Any]:
    """The mean of each column of `values` ([units] or [units, columns]; NaN entries left out) with its t-interval
    and the two-sided p-value of the one-sample t-test of H0: mean = 0.

    Interval mean -/+ t_{n-1} * s / sqrt(n), with s the sample SD (ddof 1) and t_{n-1} the two-sided Student quantile
    of `level`: the interval and test of `scipy.stats.ttest_1samp`. p < 1 - level exactly when the interval excludes
    zero. The mean needs one finite value, the rest two (NaN below). Values that do not spread (s = 0) give the point
    interval [mean, mean] and p = 0, or p = 1 when they are all zero (an infinite t, or none, against zero). Returns
    (mean, lo, hi, p), floats for 1-D `values`, else arrays [columns].
    """
    if not 0.0 < level < 1.0:
        raise UsageError(f"confidence level must be in (0, 1), got {level}")
    x = np.asarray(values, dtype=float)
    column = x.ndim == 1
    matrix = x[:, None] if column else x
    finite = np.isfinite(matrix)
    n = finite.sum(axis=0)
    mean, lo, hi, p = (np.full(matrix.shape[1], np.nan) for _ in range(4))
    some = n > 0
    mean[some] = np.where(finite, matrix, 0.0).sum(axis=0)[some] / n[some]
    ok = n > 1
    if ok.any():
        from scipy import stats as sps

        k, mu = n[ok], mean[ok]
        deviation = np.where(finite[:, ok], matrix[:, ok] - mu, 0.0)
        se = np.sqrt((deviation * deviation).sum(axis=0) / (k - 1) / k)
        half = sps.t.ppf(0.5 + level / 2.0, k - 1) * se
        lo[ok], hi[ok] = mu - half, mu + half
        with np.errstate(divide="ignore", invalid="ignore"):
            stat = np.abs(mu) / se
        p[ok] = np.where(se > 0, 2.0 * sps.t.sf(stat, k - 1), np.where(mu == 0, 1.0, 0.0))
    if column:
        return float(mean[0]), float(lo[0]), float(hi[0]), float(p[0])
    return mean, lo, hi, p


def check_replicates(n_boot: int, units: int, values: int) -> None:
    """Refuse `n_boot` bootstrap replicates of `units` resampled units when the float64 arrays they need at once,
    `values` numbers per replicate, exceed this machine's memory: refused at once rather than killed mid-way."""
    check_memory(f"--n-boot {n_boot} over {units} units", 8 * n_boot * values, remedy="lower --n-boot")


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
    check_replicates(n_boot, n, matrix.shape[1])
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

    Three intervals on the same traces (`fisher_mean` defines them and says which one significance rests on):
    `lo`/`hi` the paper's Fisher-z interval on n_eff traces (EpiKV Appendix 12) and `p` its two-sided p-value, defined
    for n_eff > 3; `t_lo`/`t_hi` the t-interval on the per-trace z and `t_p` its one-sample t-test, defined for
    n_eff >= 2; `boot_lo`/`boot_hi` the percentile bootstrap over traces, defined for n_eff > 3.
    """

    rho: np.ndarray  # tanh(mean_i atanh(rho_i)) over the traces with a defined rho (exactly +-1 when all are)
    n_eff: np.ndarray  # traces with a defined rho
    lo: np.ndarray
    hi: np.ndarray
    t_lo: np.ndarray
    t_hi: np.ndarray
    t_p: np.ndarray
    boot_lo: np.ndarray
    boot_hi: np.ndarray
    p: np.ndarray
    sd: np.ndarray  # sample SD of the per-trace rho (descriptive; NaN below two traces)


def _perfect_sign(rho: np.ndarray, defined: np.ndarray) -> np.ndarray:
    """Per column: +1 (-1) when every defined trace is exactly +1 (-1), else 0 (also when none is defined)."""
    any_defined = defined.any(axis=0)
    all_plus = any_defined & np.all(~defined | (rho == 1.0), axis=0)
    all_minus = any_defined & np.all(~defined | (rho == -1.0), axis=0)
    return all_plus.astype(float) - all_minus.astype(float)


def fisher_mean(per_trace: Any, level: float = 0.95, n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> MeanCorrelation:
    """Average per-trace correlations in Fisher-z space and give the three intervals of the mean.

    `per_trace` is [traces] (one signal) or [traces, signals], NaN where a trace has no rho (a constant signal or
    constant labels). Per column: z_i = atanh(clip(rho_i)) (`FISHER_CLIP`), rho = tanh(mean z_i), n_eff = traces with a
    defined rho. Averaging z rather than rho is what makes a normal or t interval apply: z is approximately normal,
    rho is not. Every interval is computed on z and back-transformed with tanh.

    - The paper's interval, tanh(mean z -/+ z_crit / sqrt(n_eff - 3)), and `p` its normal test (`fisher_z_interval`,
      `fisher_z_pvalue`): the width of one correlation on n_eff pairs, whatever the traces' spread.
    - The t-interval, tanh(mean z -/+ t_{n_eff-1} * sd(z) / sqrt(n_eff)), and `t_p` the one-sample t-test of the z_i
      against 0 (`t_interval`). Significance (`validation.correlation`), and through it the band edges
      (`validation.layers`) and the evidence a selected scorer carries (`validation.select`), rest on it: it measures
      how much the traces disagree, which the paper's interval ignores; it has a p-value, which the correction across
      layers needs and a percentile bootstrap does not give; it needs no seed; and with the Student quantile and the
      n - 1 SD it keeps its level on a few dozen traces, where the percentile bootstrap (plug-in SD, normal-width
      tails) is known to be too narrow.
    - The percentile bootstrap: percentiles of tanh(mean z*) over `n_boot` resamples of the traces (generator seeded
      with `seed`), a check that assumes no normality.

    A column whose every defined trace is exactly +1 (or exactly -1) reports that value exactly, as its mean and as
    each bound defined at its n_eff, with p-values 0: every trace agrees perfectly, so there is no spread to put an
    interval on, and clipping would report 0.9999 for a rho that is 1. A column that mixes +-1 with other values
    averages the clipped z (`FISHER_CLIP`).
    """
    if n_boot < 1:
        raise UsageError(f"n_boot must be >= 1, got {n_boot}")
    rho = np.asarray(per_trace, dtype=float)
    rho = rho[:, None] if rho.ndim == 1 else rho
    z = fisher_z(rho)
    defined = np.isfinite(z)
    n_eff = defined.sum(axis=0)
    mean_z, t_lo, t_hi, t_p = t_interval(z, level)
    sign = _perfect_sign(rho, defined)
    perfect = sign != 0
    estimate = np.where(perfect, sign, np.tanh(mean_z))
    t_lo, t_hi = np.tanh(t_lo), np.tanh(t_hi)
    lo, hi, boot_lo, boot_hi, p = (np.full(estimate.shape, np.nan) for _ in range(5))
    ok = n_eff > 3
    if ok.any():
        lo[ok], hi[ok] = fisher_z_interval(estimate[ok], n_eff[ok], level)
        p[ok] = fisher_z_pvalue(estimate[ok], n_eff[ok])
        replicates = bootstrap_means(z[:, ok], n_boot, np.random.default_rng(seed))
        boot_lo[ok], boot_hi[ok] = np.tanh(percentile_interval(replicates, level))
    for bound in (t_lo, t_hi, boot_lo, boot_hi):  # the clipped z put these at +-0.9999
        exact = perfect & np.isfinite(bound)
        bound[exact] = sign[exact]
    t_p[perfect & np.isfinite(t_p)] = 0.0
    sd = np.full(estimate.shape, np.nan)
    spread = n_eff > 1
    if spread.any():
        sd[spread] = np.nanstd(rho[:, spread], axis=0, ddof=1)
    return MeanCorrelation(rho=estimate, n_eff=n_eff, lo=lo, hi=hi, t_lo=t_lo, t_hi=t_hi, t_p=t_p, boot_lo=boot_lo,
                           boot_hi=boot_hi, p=p, sd=sd)


@dataclass(frozen=True)
class RankTest:
    """A rank correlation between one value per unit and outcomes measured on those units in one or more strata,
    with an interval and a p-value that act on the units (`stratified_spearman` defines every field)."""

    rho: float  # mean over strata of the within-stratum Spearman rho (one stratum: Spearman's rho)
    lo: float  # percentile bootstrap over units
    hi: float
    p: float  # two-sided permutation p-value
    p_floor: float  # the smallest p the permutation test can give on these units
    exact: bool  # every permutation enumerated (else `n_permutations` random ones)
    n_permutations: int
    n_units: int
    n_points: int
    n_strata: int  # strata with a defined rho
    n_boot: int
    n_boot_defined: int  # bootstrap replicates with a defined statistic


def _mean_over_strata(xs: np.ndarray, strata: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """For each row of `xs` ([rows, units], one assignment of x to the units): the mean over strata of Spearman's
    rho within the stratum, strata with an undefined rho left out (NaN when none has one), and how many had one."""
    per = np.array([np.atleast_1d(spearman(xs[:, units].T, y)) for units, y in strata])  # [strata, rows]
    defined = np.isfinite(per)
    count = defined.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.where(defined, per, 0.0).sum(axis=0) / count, np.nan), count


def _spearman_with_counts(x: np.ndarray, y: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Spearman's rho of the sample that holds point j `counts[r, j]` times, for each row r of `counts` ([rows, m];
    x, y [m]) -> [rows], NaN where undefined: what `spearman` gives on the expanded sample, without expanding it.

    In the expanded sample the copies of the points tied at x_j hold ranks less_j + 1 ... less_j + same_j, so their
    average rank is less_j + (same_j + 1) / 2, with less_j (same_j) the count-weighted number of points below (at) x_j;
    rho is the count-weighted Pearson correlation of those ranks.
    """
    def midranks(v: np.ndarray) -> np.ndarray:
        below = (v[:, None] < v[None, :]).astype(float)  # [i, j]: v_i < v_j
        same = (v[:, None] == v[None, :]).astype(float)
        return counts @ below + (counts @ same + 1.0) / 2.0

    rx, ry = midranks(x), midranks(y)
    n = counts.sum(axis=1, keepdims=True)
    dx = rx - (counts * rx).sum(axis=1, keepdims=True) / n
    dy = ry - (counts * ry).sum(axis=1, keepdims=True) / n
    num = (counts * dx * dy).sum(axis=1)
    den = np.sqrt((counts * dx * dx).sum(axis=1) * (counts * dy * dy).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        # Ranks are multiples of 1/2, so a sample with one distinct value centres to exactly zero.
        return np.clip(np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan), -1.0, 1.0)


def stratified_spearman(x: Any, strata: list[tuple[Any, Any]], level: float = 0.95, n_boot: int = DEFAULT_N_BOOT,
                        n_perm: int = DEFAULT_N_PERM, seed: int = 0) -> RankTest:
    """How well one value per unit ranks the outcomes measured on the units, stratum by stratum, with a test and an
    interval that respect how few units there are.

    `x` is [units], one value per unit (a scorer's offline statistic); `strata` a list of (units, y) pairs, one per
    stratum (a budget): `units` [m] the indices into `x` of the units measured in it, each at most once, and `y` [m]
    their outcomes. A point whose x or y is not finite is left out, and with it a stratum of fewer than two points.
    The statistic T is the mean over strata of Spearman's rho between x[units] and y inside the stratum (a stratum
    where rho is undefined is left out; one stratum gives plain Spearman's rho). Ranking inside each stratum keeps
    what moves every outcome of a stratum together (a tighter budget costs every scorer) out of the correlation.

    All points of a unit share its one x, so the unit is what is independent, and both the test and the interval act
    on units:

    - `p`: two-sided permutation test of "x is unrelated to the outcomes". The x values are permuted over the k
      units (one permutation for every stratum), p = the share of permutations with |T*| >= |T|. Every permutation is
      enumerated when k! <= `n_perm` (`exact`, the identity among them), else `n_perm` random ones are drawn and
      p = (count + 1) / (n_perm + 1). `p_floor` is the smallest p the test can give here (exact: the share of
      permutations reaching the largest |T*|, 2 / k! without ties; random: 1 / (n_perm + 1)): with 4 units it is
      1/12, so so few units cannot be significant at 0.05 whatever their agreement.
    - `lo`, `hi`: percentile interval of T over `n_boot` resamples of the k units with replacement (generator seeded
      with `seed`; a resampled unit brings its points in every stratum, a repeated one its points again). With few
      units a resample often holds one distinct x in a stratum, where rho is undefined; `n_boot_defined` counts the
      resamples that had a statistic. Resampling cannot leave the sample's own agreement: on points ranked in
      perfect agreement every resample agrees perfectly too, and the interval is [1, 1]; the permutation p, not the
      interval, then says how much so few units can show.

    Everything but the counts is NaN when T is undefined (no stratum with two units of distinct x and y).
    """
    if n_boot < 1 or n_perm < 1:
        raise UsageError(f"n_boot and n_perm must be >= 1, got {n_boot} and {n_perm}")
    if not 0.0 < level < 1.0:
        raise UsageError(f"confidence level must be in (0, 1), got {level}")
    x = np.asarray(x, dtype=float)
    kept = []
    for units, y in strata:
        units, y = np.asarray(units, dtype=np.int64), np.asarray(y, dtype=float)
        if units.ndim != 1 or units.shape != y.shape:
            raise ValueError(f"a stratum needs units [m] and y [m]; got {units.shape} and {y.shape}")
        if np.unique(units).size != units.size:
            raise ValueError("a unit appears twice in one stratum")
        keep = np.isfinite(y) & np.isfinite(x[units])
        if keep.sum() >= 2:
            kept.append((units[keep], y[keep]))
    used = np.unique(np.concatenate([u for u, _ in kept])) if kept else np.zeros(0, dtype=np.int64)
    k, xs = used.size, x[used]
    strata_k = [(np.searchsorted(used, u), y) for u, y in kept]  # units renumbered 0..k-1
    n_points = int(sum(u.size for u, _ in strata_k))
    nan = float("nan")
    if not strata_k:
        return RankTest(nan, nan, nan, nan, nan, False, 0, k, n_points, 0, n_boot, 0)
    observed, n_defined = _mean_over_strata(xs[None, :], strata_k)
    rho, n_strata = float(observed[0]), int(n_defined[0])
    if not math.isfinite(rho):
        return RankTest(nan, nan, nan, nan, nan, False, 0, k, n_points, n_strata, n_boot, 0)
    rng = np.random.default_rng(seed)
    exact = math.factorial(k) <= n_perm
    if exact:
        orders = np.array(list(itertools.permutations(range(k))), dtype=np.int64)
    else:
        orders = rng.permuted(np.tile(np.arange(k), (n_perm, 1)), axis=1)
    null = np.abs(_mean_over_strata(xs[orders], strata_k)[0])
    tolerance = 1e-12  # T is a mean of rank correlations: equal orderings must count as equally extreme
    extreme = int(np.count_nonzero(null >= abs(rho) - tolerance))
    if exact:
        p = extreme / orders.shape[0]
        p_floor = int(np.count_nonzero(null >= np.nanmax(null) - tolerance)) / orders.shape[0]
    else:
        p, p_floor = (extreme + 1) / (n_perm + 1), 1.0 / (n_perm + 1)
    check_replicates(n_boot, k, 2 * k + len(strata_k))  # the draws as int64, then as float, and each stratum's rho
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot).astype(float)  # [n_boot, k] draws per unit
    per = np.array([_spearman_with_counts(xs[units], y, counts[:, units]) for units, y in strata_k])
    present = np.isfinite(per)
    with np.errstate(invalid="ignore", divide="ignore"):
        replicates = np.where(present.any(axis=0), np.where(present, per, 0.0).sum(axis=0) / present.sum(axis=0),
                              np.nan)
    defined = np.isfinite(replicates)
    lo, hi = percentile_interval(replicates[defined], level) if defined.any() else (nan, nan)
    return RankTest(rho, lo, hi, float(p), float(p_floor), exact, int(orders.shape[0]), k, n_points, n_strata,
                    n_boot, int(defined.sum()))


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
            from statsmodels.stats.multitest import multipletests

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
