"""The statistics of one probe condition: retrieval with its Wilson interval (one 0/1 trial per instance), mean
log p with an instance-bootstrap interval and graded recall R (Random Attention notes §3.3) with an
instance-clustered bootstrap interval."""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np

from validation.paired import bootstrap_means, percentile_interval
from validation.stats import check_replicates, wilson_interval


def graded_recall(lp, lp_kept, lp_del) -> float:
    """Random Attention notes §3.3: R = sum(LP - LP_del) / sum(LP_kept - LP_del) over instances.

    1 = as good as keeping the fact everywhere, 0 = as good as deleting it; NaN when keeping does not beat deleting
    on aggregate (the denominator is <= 0 and R has no meaning).
    """
    lp, lp_kept, lp_del = (np.asarray(x, dtype=float) for x in (lp, lp_kept, lp_del))
    den = float(np.sum(lp_kept - lp_del))
    return float(np.sum(lp - lp_del)) / den if den > 0 else math.nan


def ratio_bootstrap(num, den, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Replicates of sum(num) / sum(den), resampling instances (pairs kept together) with replacement; NaN where
    a replicate's denominator is <= 0."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    check_replicates(n_boot, num.size, 3 * num.size)  # the drawn indices, then the numerators and denominators drawn
    idx = rng.integers(0, num.size, size=(n_boot, num.size))
    top, bottom = num[idx].sum(axis=1), den[idx].sum(axis=1)
    return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), np.nan)


def interval(replicates: np.ndarray, level: float) -> tuple[float, float]:
    finite = replicates[np.isfinite(replicates)]
    return percentile_interval(finite, level) if finite.size else (math.nan, math.nan)


class _Retrieval(TypedDict):
    """The statistics of every condition (`RetrievalStatistics`)."""

    n: int
    retrieval: float
    retrieval_lo: float
    retrieval_hi: float
    mean_lp: float
    lp_lo: float
    lp_hi: float


class RetrievalStatistics(_Retrieval, total=False):
    """What `retrieval_statistics` returns, keyed by `ProbeRow` field: graded recall R and its interval only given
    the kept / deleted references."""

    R: float
    R_lo: float
    R_hi: float


def retrieval_statistics(retrieved, lp, n_boot: int, level: float, seed: int, kept=None,
                         deleted=None) -> RetrievalStatistics:
    """The statistics of one condition, keyed by their `ProbeRow` fields: retrieval with its Wilson interval (one
    0/1 trial per instance), mean log p with an instance-bootstrap interval and, given the kept / deleted references
    of the same instances, graded recall R with an instance-clustered bootstrap interval."""
    retrieved, lp = np.asarray(retrieved, dtype=float), np.asarray(lp, dtype=float)
    n = lp.size
    rng = np.random.default_rng(seed)
    lo, hi = wilson_interval(float(retrieved.sum()), n, level)
    lp_lo, lp_hi = interval(bootstrap_means(lp, n_boot, rng), level)
    row: RetrievalStatistics = {"n": n, "retrieval": float(retrieved.mean()), "retrieval_lo": lo, "retrieval_hi": hi,
                                "mean_lp": float(lp.mean()), "lp_lo": lp_lo, "lp_hi": lp_hi}
    if kept is not None:
        kept, deleted = np.asarray(kept, dtype=float), np.asarray(deleted, dtype=float)
        r_lo, r_hi = interval(ratio_bootstrap(lp - deleted, kept - deleted, n_boot, rng), level)
        row.update({"R": graded_recall(lp, kept, deleted), "R_lo": r_lo, "R_hi": r_hi})
    return row
