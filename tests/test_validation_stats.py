"""validation.stats: Spearman, Fisher-z (single rho and the mean of per-trace rho), corrections, Wilson, the bootstrap
over units — against scipy, a naive bootstrap and by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint

from core.errors import UsageError
from validation.stats import (
    FISHER_CLIP,
    adjust_pvalues,
    bootstrap_means,
    fisher_mean,
    fisher_z_interval,
    fisher_z_pvalue,
    percentile_interval,
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


def test_fisher_mean_averages_in_z_space_by_hand():
    assert fisher_mean([0.5, 0.5]).rho[0] == pytest.approx(0.5)
    # atanh(0.8) = ln 3 = 2 atanh(0.5): the z-mean of 0 and 0.8 is atanh(0.5), not the rho mean 0.4.
    mixed = fisher_mean([0.0, 0.8])
    assert mixed.rho[0] == pytest.approx(math.tanh(math.atanh(0.8) / 2)) == pytest.approx(0.5)
    assert mixed.rho[0] != pytest.approx(0.4)
    assert mixed.n_eff[0] == 2 and mixed.sd[0] == pytest.approx(np.std([0.0, 0.8], ddof=1))
    # A trace without a rho (NaN) is not a trace of n_eff.
    assert fisher_mean([0.5, np.nan, 0.5]).n_eff[0] == 2
    assert np.isnan(fisher_mean([np.nan, np.nan]).rho[0])


def test_fisher_mean_clips_perfect_rho_before_atanh():
    z_clip = math.atanh(FISHER_CLIP)
    assert fisher_mean([1.0, 0.0]).rho[0] == pytest.approx(math.tanh(z_clip / 2))
    assert fisher_mean([1.0, -1.0]).rho[0] == pytest.approx(0.0)
    perfect = fisher_mean([1.0] * 5)
    assert perfect.rho[0] == pytest.approx(FISHER_CLIP)
    lo, hi = fisher_z_interval(FISHER_CLIP, 5)
    assert np.isfinite([perfect.lo[0], perfect.hi[0]]).all() and perfect.lo[0] == pytest.approx(float(lo))
    assert perfect.hi[0] == pytest.approx(float(hi))


def test_fisher_mean_paper_interval_by_hand():
    # 28 traces: mean z = (14 atanh(0.3) + 14 atanh(0.5)) / 28, se = 1/5.
    rho = [0.3] * 14 + [0.5] * 14
    result = fisher_mean(rho)
    z = (math.atanh(0.3) + math.atanh(0.5)) / 2
    assert result.rho[0] == pytest.approx(math.tanh(z))
    assert result.lo[0] == pytest.approx(math.tanh(z - Z975 / 5))
    assert result.hi[0] == pytest.approx(math.tanh(z + Z975 / 5))
    assert result.p[0] == pytest.approx(2 * sps.norm.sf(z * 5))
    # Every trace at 0.5: the paper's interval of a single rho = 0.5 on n = 28, and a bootstrap with no spread.
    same = fisher_mean([0.5] * 28)
    assert (same.lo[0], same.hi[0]) == pytest.approx((0.15603, 0.73582), abs=1e-4)
    assert (same.boot_lo[0], same.boot_hi[0]) == pytest.approx((0.5, 0.5))
    # Three traces give no interval at all.
    few = fisher_mean([0.1, 0.2, 0.3])
    assert np.isnan([few.lo[0], few.hi[0], few.boot_lo[0], few.boot_hi[0], few.p[0]]).all()


def test_fisher_mean_bootstrap_resamples_traces():
    rng = np.random.default_rng(0)
    rho = np.tanh(rng.normal(0.2, 0.3, size=40))
    result = fisher_mean(rho, n_boot=4000, seed=7)
    # A naive bootstrap: draw 40 traces with replacement, average their z, back-transform, take percentiles.
    naive_rng = np.random.default_rng(123)
    z = np.arctanh(rho)
    naive = np.tanh([z[naive_rng.integers(0, 40, 40)].mean() for _ in range(4000)])
    assert result.boot_lo[0] == pytest.approx(np.quantile(naive, 0.025), abs=0.02)
    assert result.boot_hi[0] == pytest.approx(np.quantile(naive, 0.975), abs=0.02)
    assert result.boot_lo[0] < result.rho[0] < result.boot_hi[0]
    assert fisher_mean(rho, n_boot=4000, seed=7).boot_lo[0] == result.boot_lo[0]  # seeded
    assert fisher_mean(rho, n_boot=4000, seed=8).boot_lo[0] != result.boot_lo[0]


def test_fisher_mean_columns_keep_their_own_traces():
    # Column 0 is defined in every trace; column 1 only in the last four (constant signal elsewhere).
    rho = np.array([[0.5, np.nan], [0.5, np.nan], [0.0, 0.8], [0.8, 0.0], [0.0, 0.8], [0.8, 0.0]])
    result = fisher_mean(rho)
    assert result.n_eff.tolist() == [6, 4]
    assert result.rho[0] == pytest.approx(0.5) and result.rho[1] == pytest.approx(0.5)
    lo, hi = fisher_z_interval(0.5, 4)
    assert (result.lo[1], result.hi[1]) == pytest.approx((float(lo), float(hi)))


def test_bootstrap_means_skips_nan_per_column():
    values = np.array([[0.0, np.nan], [1.0, 2.0]])
    reps = bootstrap_means(values, 5000, np.random.default_rng(0))
    assert reps.shape == (5000, 2)
    # Column 1: a replicate that drew only the NaN unit (probability 1/4) has no mean; any other is exactly 2.
    assert np.isnan(reps[:, 1]).mean() == pytest.approx(0.25, abs=0.03)
    assert set(np.unique(reps[:, 1][np.isfinite(reps[:, 1])])) == {2.0}
    lo, hi = percentile_interval(reps, 0.95)
    assert (lo[1], hi[1]) == (2.0, 2.0) and (lo[0], hi[0]) == (0.0, 1.0)
