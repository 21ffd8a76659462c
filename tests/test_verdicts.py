"""Verdicts by one rule, on hand-made evidence whose verdict follows from the rule; pooling against statsmodels."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import UsageError
from validation.verdicts import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    Claim,
    Evidence,
    adjust,
    judge,
    pool_paired,
    random_effects,
)


def test_an_effect_claim_needs_its_interval_clear_of_zero_in_its_direction():
    up = Claim("effect", direction=1)
    assert judge(up, Evidence(0.2, 0.05, 0.35)).verdict == REPRODUCED
    assert judge(up, Evidence(-0.2, -0.35, -0.05)).verdict == NOT_REPRODUCED
    assert judge(up, Evidence(0.1, -0.05, 0.25)).verdict == INCONCLUSIVE
    # significant alone, not after the study's adjustment
    assert judge(up, Evidence(0.2, 0.05, 0.35, p_adjusted=0.06)).verdict == INCONCLUSIVE
    assert judge(up, Evidence(0.2, 0.05, 0.35, p_adjusted=0.01)).verdict == REPRODUCED
    # equivalent to zero: the claimed effect is not there
    assert judge(up, Evidence(0.0, -0.03, 0.03, tost_lo=-0.02, tost_hi=0.02)).verdict == NOT_REPRODUCED


def test_a_null_claim_is_reproduced_only_by_equivalence():
    null = Claim("null", margin=0.05)
    wide = Evidence(0.0, -0.15, 0.15, tost_lo=-0.12, tost_hi=0.12)  # spans zero, but ±15 points: no evidence
    verdict = judge(null, wide)
    assert verdict.verdict == INCONCLUSIVE and "not shown equivalent" in verdict.reason
    assert judge(null, Evidence(0.0, -0.06, 0.06, tost_lo=-0.04, tost_hi=0.04)).verdict == REPRODUCED
    assert judge(null, Evidence(0.2, 0.05, 0.35, tost_lo=0.08, tost_hi=0.32)).verdict == NOT_REPRODUCED
    assert judge(null, Evidence(0.0, -0.04, 0.04)).verdict == INCONCLUSIVE  # no TOST interval given: not shown


def test_bad_claims_are_refused():
    with pytest.raises(UsageError, match="claim kind"):
        Claim("trend")
    with pytest.raises(UsageError, match="margin"):
        Claim("null", margin=0)


def test_adjusted_pvalues_by_hand():
    found = adjust([0.01, 0.04, 0.03, 0.5])
    # Holm: sorted 0.01, 0.03, 0.04, 0.5 times 4, 3, 2, 1, made monotone
    assert found["holm"] == pytest.approx([0.04, 0.09, 0.09, 0.5])
    # Benjamini-Hochberg: p * 4 / rank (0.04, 0.06, 0.053, 0.5 in rank order), made monotone from the top
    assert found["bh"] == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.5])


def test_pooled_paired_differences_use_every_problem():
    pooled = pool_paired([[1, 0, 0, 1], [0, 0, -1]], n_boot=2000)
    assert pooled.units == 7 and pooled.estimate == pytest.approx(1 / 7)
    assert pooled.lo < pooled.estimate < pooled.hi


def test_random_effects_match_statsmodels():
    from statsmodels.stats.meta_analysis import combine_effects

    y, se = np.array([0.225, 0.156, 0.054]), np.array([0.09, 0.08, 0.07])
    ours = random_effects(y, se)
    theirs = combine_effects(y, se ** 2, method_re="dl")
    assert ours.estimate == pytest.approx(theirs.mean_effect_re, abs=1e-9)
    assert ours.tau2 == pytest.approx(theirs.tau2, abs=1e-9)
    lo, hi = theirs.conf_int()[1]  # (fixed effect, random effects, ...)
    assert (ours.lo, ours.hi) == pytest.approx((lo, hi), abs=1e-9)
    with pytest.raises(UsageError, match="two or more"):
        random_effects([0.1], [0.05])
