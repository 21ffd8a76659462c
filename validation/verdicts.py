"""Verdicts by one rule: what a measured comparison says about a paper's claim, decided by a function, not by prose.

A claim is one of two kinds (`Claim`):

- an **effect** in a stated direction ("the z-score removes the trend", "ValueDiff beats random"): *reproduced* when
  the stated interval excludes zero in the claim's direction and, where the study made several comparisons, the
  adjusted p-value is below alpha; *not reproduced* when the interval excludes zero in the opposite direction, or an
  equivalence test shows the effect is within the margin of zero; *inconclusive* otherwise;
- a **null** claim ("random matches the best scored policy", "a shared draw scores as the per-head draw"):
  *reproduced* only by an equivalence test, TOST at the stated margin (the ``1 - 2 alpha`` interval lies inside
  ``[-margin, +margin]``), a margin fixed before looking; *not reproduced* when the difference is significant
  (the interval excludes zero, adjusted p below alpha); *inconclusive* otherwise: an interval that spans zero is
  absence of evidence, not evidence of equivalence.

One interval per kind of statistic (`INTERVALS`): a paired accuracy difference is judged by its paired percentile
bootstrap, a mean correlation by its t-interval over the per-trace values (each trace one unit), a proportion by its
Wilson interval. p-values within one study are adjusted together (`adjust`: Holm and Benjamini-Hochberg beside the
raw p; the verdict uses Holm, which controls the family-wise error). A claim repeated across studies also gets a
pooled estimate (`pool_paired`: the per-problem differences of every study pooled, problems as units;
`random_effects`: a DerSimonian-Laird random-effects mean of the per-study estimates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import UsageError, unknown_choice

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE)
KINDS = ("effect", "null")
# The interval each kind of statistic is judged by.
INTERVALS = {"accuracy difference": "paired percentile bootstrap over problems",
             "correlation": "t-interval over the per-trace values",
             "proportion": "Wilson interval"}
# The equivalence margin of a null claim about accuracy, in accuracy units (5 points), stated before looking.
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Claim:
    """What a paper claims: an effect in `direction` (+1: positive, -1: negative), or a null within `margin`."""

    kind: str
    direction: int = 1
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise unknown_choice("claim kind", self.kind, KINDS)
        if self.direction not in (1, -1):
            raise UsageError(f"a claim's direction is +1 or -1, got {self.direction!r}")
        if not self.margin > 0:
            raise UsageError(f"an equivalence margin must be positive, got {self.margin!r}")


@dataclass(frozen=True)
class Evidence:
    """A measured comparison: the estimate, its interval at `level` and the (1 - 2 alpha) interval the equivalence
    test reads (`tost_lo`, `tost_hi`; None: not computed), and its p-value adjusted within the study (None: the
    only comparison, or no p-value)."""

    estimate: float
    lo: float
    hi: float
    tost_lo: float | None = None
    tost_hi: float | None = None
    p_adjusted: float | None = None
    alpha: float = 0.05


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str


def _significant(evidence: Evidence) -> bool:
    return evidence.p_adjusted is None or evidence.p_adjusted < evidence.alpha


def equivalent(evidence: Evidence, margin: float) -> bool:
    """TOST: both one-sided tests at alpha reject, i.e. the (1 - 2 alpha) interval lies inside (-margin, margin)."""
    if evidence.tost_lo is None or evidence.tost_hi is None:
        return False
    return -margin < evidence.tost_lo and evidence.tost_hi < margin


def judge(claim: Claim, evidence: Evidence) -> Verdict:
    """The verdict `evidence` gives `claim` (see the module docstring)."""
    excludes_zero = evidence.lo > 0 or evidence.hi < 0
    sign = 1 if evidence.lo > 0 else -1 if evidence.hi < 0 else 0
    if claim.kind == "effect":
        if excludes_zero and sign == claim.direction and _significant(evidence):
            return Verdict(REPRODUCED, "the interval excludes zero in the claimed direction"
                           + ("" if evidence.p_adjusted is None else ", adjusted p below alpha"))
        if excludes_zero and sign == -claim.direction and _significant(evidence):
            return Verdict(NOT_REPRODUCED, "the interval excludes zero against the claimed direction")
        if equivalent(evidence, claim.margin):
            return Verdict(NOT_REPRODUCED, f"equivalent to zero within ±{claim.margin:g} (TOST)")
        if excludes_zero:
            return Verdict(INCONCLUSIVE, "the interval excludes zero but the adjusted p-value does not")
        return Verdict(INCONCLUSIVE, "the interval spans zero")
    if equivalent(evidence, claim.margin):
        return Verdict(REPRODUCED, f"equivalent within ±{claim.margin:g} (TOST)")
    if excludes_zero and _significant(evidence):
        return Verdict(NOT_REPRODUCED, "a significant difference")
    why = "the interval spans zero" if not excludes_zero else "the adjusted p-value is not below alpha"
    return Verdict(INCONCLUSIVE, f"not shown equivalent within ±{claim.margin:g}; {why}")


def adjust(pvalues: Sequence[float]) -> dict[str, list[float]]:
    """Holm and Benjamini-Hochberg adjusted p-values of one study's comparisons, beside the raw ones (NaN kept)."""
    from validation.stats import adjust_pvalues

    raw = [float(p) for p in pvalues]
    return {"raw": raw, "holm": adjust_pvalues(raw, "holm")[1].tolist(),
            "bh": adjust_pvalues(raw, "fdr_bh")[1].tolist()}


@dataclass(frozen=True)
class Pooled:
    """A pooled estimate over studies: the estimate and its interval, the units pooled and the heterogeneity."""

    estimate: float
    lo: float
    hi: float
    units: int
    method: str
    tau2: float | None = None  # random effects: the between-study variance
    i2: float | None = None


def pool_paired(differences: Sequence[Sequence[float]], n_boot: int = 10_000, level: float = 0.95,
                seed: int = 0) -> Pooled:
    """The per-problem differences (A - B) of every study pooled, problems as units: their mean with a percentile
    bootstrap over problems, resampled within each study so every study keeps its size."""
    from validation.stats import percentile_interval

    studies = [np.asarray(d, dtype=float) for d in differences if len(d)]
    if not studies:
        raise UsageError("no per-problem difference to pool")
    rng = np.random.default_rng(seed)
    total = sum(len(d) for d in studies)
    replicates = np.zeros(n_boot)
    for d in studies:
        replicates += rng.choice(d, size=(n_boot, len(d)), replace=True).sum(axis=1)
    replicates /= total
    lo, hi = percentile_interval(replicates, level)
    return Pooled(float(np.concatenate(studies).mean()), float(lo), float(hi), total, "paired problems pooled")


def random_effects(estimates: Sequence[float], standard_errors: Sequence[float], level: float = 0.95) -> Pooled:
    """DerSimonian-Laird random-effects mean of per-study `estimates` with their `standard_errors`, with a normal
    interval, the between-study variance tau^2 and I^2."""
    from scipy import stats

    y, se = np.asarray(estimates, dtype=float), np.asarray(standard_errors, dtype=float)
    if y.size < 2 or y.shape != se.shape or np.any(se <= 0):
        raise UsageError("random effects need two or more studies, each with a positive standard error")
    w = 1 / se ** 2
    fixed = float((w * y).sum() / w.sum())
    q = float((w * (y - fixed) ** 2).sum())
    df = y.size - 1
    tau2 = max(0.0, (q - df) / (w.sum() - (w ** 2).sum() / w.sum()))
    w_star = 1 / (se ** 2 + tau2)
    mean = float((w_star * y).sum() / w_star.sum())
    half = float(stats.norm.ppf(0.5 + level / 2)) * math.sqrt(1 / w_star.sum())
    i2 = max(0.0, (q - df) / q) if q > 0 else 0.0
    return Pooled(mean, mean - half, mean + half, int(y.size), "DerSimonian-Laird random effects", tau2, i2)
