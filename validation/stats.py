"""Core statistics: Spearman rho, Fisher-z intervals, multiple-comparison correction, Wilson intervals, and a
streaming mean/variance.

Conventions follow EpiKV (epikv.txt): correlations are Spearman rho (§3.2 "two-band anatomy", Appendix 6) and their
uncertainty is a Fisher-z interval whose effective sample size is the number of independent *traces*, not token
pairs, because tokens within a trace are correlated (Appendix 12). Everything here is a pure array function.
"""

from __future__ import annotations

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


class RunningMoments:
    """Streaming elementwise mean and variance (Welford), skipping NaN entries per element.

    `add(x)` takes one observation of a fixed shape (e.g. one trace's per-signal rho vector), so per-trace statistics
    aggregate in one pass without holding every trace. `state_dict()` / `from_state_dict()` round-trip the state.
    """

    def __init__(self, shape: tuple[int, ...] | int = ()):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.count = np.zeros(shape, dtype=np.int64)
        self._mean = np.zeros(shape)
        self._m2 = np.zeros(shape)

    def add(self, x: Any) -> None:
        x = np.asarray(x, dtype=float)
        if x.shape != self.count.shape:
            raise ValueError(f"expected an observation of shape {self.count.shape}, got {x.shape}")
        seen = np.isfinite(x)
        self.count += seen
        delta = np.where(seen, x - self._mean, 0.0)
        self._mean += np.where(seen, delta / np.maximum(self.count, 1), 0.0)
        self._m2 += np.where(seen, delta * (np.where(seen, x, 0.0) - self._mean), 0.0)

    @property
    def mean(self) -> np.ndarray:
        return np.where(self.count > 0, self._mean, np.nan)

    @property
    def var(self) -> np.ndarray:
        """Sample variance (ddof=1); NaN with fewer than two observations."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 1, self._m2 / (self.count - 1), np.nan)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    def state_dict(self) -> dict[str, list]:
        return {"count": self.count.tolist(), "mean": self._mean.tolist(), "m2": self._m2.tolist()}

    @classmethod
    def from_state_dict(cls, state: dict[str, list]) -> RunningMoments:
        count = np.asarray(state["count"], dtype=np.int64)
        moments = cls(count.shape)
        moments.count = count
        moments._mean = np.asarray(state["mean"], dtype=float)
        moments._m2 = np.asarray(state["m2"], dtype=float)
        return moments
