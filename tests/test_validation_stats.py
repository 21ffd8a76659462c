"""validation.stats: Spearman, Fisher-z, corrections, Wilson, streaming moments — against scipy and by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint

from core.errors import UsageError
from validation.stats import (
    RunningMoments,
    adjust_pvalues,
    fisher_z_interval,
    fisher_z_pvalue,
    spearman,
    wilson_interval,
)

Z975 = 1.959963984540054


def test_spearman_hand_cases():
    # One swapped pair: sum d^2 = 2, rho = 1 - 6*2 / (4 * 15) = 0.8.
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # Tie in x: ranks [1.5, 1.5, 3, 4] vs [1, 2, 3, 4]; Pearson on ranks = 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10).
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10))
    assert spearman([4, 3, 2, 1], [1, 2, 3, 4]) == pytest.approx(-1.0)


def test_spearman_matches_scipy_with_ties_and_columns():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(200, 6)).astype(float)  # many ties
    y = (x[:, 0] + rng.integers(0, 3, size=200) > 3).astype(float)  # binary labels, like occlusion labels
    ours = spearman(x, y)
    assert ours.shape == (6,)
    for k in range(6):
        assert ours[k] == pytest.approx(sps.spearmanr(x[:, k], y).statistic, abs=1e-12)
    assert spearman(x[:, 0], y) == pytest.approx(sps.spearmanr(x[:, 0], y).statistic, abs=1e-12)


def test_spearman_undefined_is_nan():
    assert np.isnan(spearman([1.0, 1.0, 1.0], [1, 2, 3]))
    assert np.isnan(spearman([1, 2, 3], [0, 0, 0]))
    assert np.isnan(spearman([1.0], [1.0]))
    both = spearman(np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]), np.array([1.0, 2.0, 3.0]))
    assert both[0] == pytest.approx(1.0) and np.isnan(both[1])


def test_fisher_z_interval_hand_derived():
    # n_eff = 28 -> se = 1/5; z = atanh(0.5).
    rho, n = 0.5, 28
    z, se = math.atanh(rho), 1 / math.sqrt(n - 3)
    lo, hi = fisher_z_interval(rho, n)
    assert float(lo) == pytest.approx(math.tanh(z - Z975 * se), abs=1e-12)
    assert float(hi) == pytest.approx(math.tanh(z + Z975 * se), abs=1e-12)
    assert float(lo) == pytest.approx(0.15603, abs=1e-4) and float(hi) == pytest.approx(0.73582, abs=1e-4)
    # rho = 0 is symmetric; a 90% interval is narrower.
    lo0, hi0 = fisher_z_interval(0.0, 103)
    assert float(hi0) == pytest.approx(math.tanh(Z975 / 10)) and float(lo0) == pytest.approx(-float(hi0))
    lo90, hi90 = fisher_z_interval(0.0, 103, level=0.90)
    assert float(hi90) == pytest.approx(math.tanh(1.6448536269514722 / 10))


def test_fisher_z_pvalue_agrees_with_interval():
    # p < 0.05 exactly when the 95% interval excludes zero.
    for rho in np.linspace(-0.6, 0.6, 25):
        lo, hi = fisher_z_interval(rho, 20)
        p = float(fisher_z_pvalue(rho, 20))
        assert (p < 0.05) == (lo > 0 or hi < 0)
    assert float(fisher_z_pvalue(0.5, 28)) == pytest.approx(2 * sps.norm.sf(math.atanh(0.5) * 5))


@pytest.mark.parametrize("n_eff", [0, 2, 3])
def test_fisher_z_needs_more_than_three_traces(n_eff):
    with pytest.raises(UsageError, match="n_eff"):
        fisher_z_interval(0.3, n_eff)
    with pytest.raises(UsageError, match="n_eff"):
        fisher_z_pvalue(0.3, n_eff)


def test_adjust_pvalues_bh_by_hand_and_statsmodels():
    p = [0.01, 0.04, 0.03, 0.5]
    # BH: sorted 0.01, 0.03, 0.04, 0.5 -> 0.04, 0.06, 0.0533, 0.5 -> step-up minimum -> 0.04, 0.0533, 0.0533, 0.5.
    reject, adjusted = adjust_pvalues(p)
    assert adjusted == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.5])
    assert reject.tolist() == [True, False, False, False]
    for method in ("bonferroni", "holm", "fdr_by"):
        rej, adj = adjust_pvalues(p, method)
        ref = multipletests(p, method=method)
        assert adj == pytest.approx(ref[1]) and rej.tolist() == ref[0].tolist()
    rej, adj = adjust_pvalues(p, "none")
    assert adj == pytest.approx(p) and rej.tolist() == [True, True, True, False]


def test_adjust_pvalues_leaves_nan_out_of_the_family():
    reject, adjusted = adjust_pvalues([0.01, np.nan, 0.02], "bonferroni")
    assert adjusted[0] == pytest.approx(0.02) and adjusted[2] == pytest.approx(0.04) and np.isnan(adjusted[1])
    assert reject.tolist() == [True, False, True]


def test_adjust_pvalues_unknown_method():
    with pytest.raises(UsageError, match="fdr_bh"):
        adjust_pvalues([0.1], "fdr_bhh")


def test_wilson_interval():
    # 0 of n: lower 0, upper z^2 / (n + z^2).
    lo, hi = wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(Z975**2 / (10 + Z975**2))
    for k, n in [(3, 10), (50, 100), (29, 30)]:
        assert wilson_interval(k, n) == pytest.approx(proportion_confint(k, n, method="wilson"))


def test_running_moments_matches_numpy_skipping_nan():
    rng = np.random.default_rng(1)
    data = rng.normal(size=(50, 3))
    data[rng.random(data.shape) < 0.2] = np.nan
    moments = RunningMoments(3)
    for row in data:
        moments.add(row)
    assert moments.count.tolist() == np.isfinite(data).sum(axis=0).tolist()
    assert moments.mean == pytest.approx(np.nanmean(data, axis=0))
    assert moments.var == pytest.approx(np.nanvar(data, axis=0, ddof=1))
    restored = RunningMoments.from_state_dict(moments.state_dict())
    restored.add(np.array([1.0, 2.0, 3.0]))
    moments.add(np.array([1.0, 2.0, 3.0]))
    assert restored.mean == pytest.approx(moments.mean) and restored.std == pytest.approx(moments.std)


def test_running_moments_undefined_until_enough_data():
    moments = RunningMoments(2)
    assert np.isnan(moments.mean).all()
    moments.add([1.0, np.nan])
    assert moments.mean[0] == 1.0 and np.isnan(moments.mean[1]) and np.isnan(moments.var).all()
    with pytest.raises(ValueError):
        moments.add([1.0, 2.0, 3.0])
