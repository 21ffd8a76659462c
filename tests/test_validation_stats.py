"""validation.stats: Spearman, Fisher-z (single rho and the mean of per-trace rho), the t-interval, corrections,
Wilson, the bootstrap over units, the permutation test of a rank correlation over few units — against scipy, a
naive bootstrap, full enumeration and by hand."""

from __future__ import annotations

import itertools
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
    stratified_spearman,
    t_interval,
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


def test_spearman_of_a_perfect_ranking_is_exactly_one():
    # Equal rank vectors centre to equal half-integers, so rho is 1.0 itself, not 1 - 1e-16 (recency vs position).
    assert spearman(np.arange(300.0), np.arange(300.0) + 7) == 1.0
    assert spearman(-np.arange(300.0), np.arange(300.0)) == -1.0
    # Ties: a step signal with the tie structure of binary labels.
    assert spearman([0.2, 0.2, 0.9, 0.9, 0.9], [0, 0, 1, 1, 1]) == 1.0


def test_fisher_mean_clips_plus_minus_one_inside_a_mix():
    z_clip = math.atanh(FISHER_CLIP)
    assert fisher_mean([1.0, 0.0]).rho[0] == pytest.approx(math.tanh(z_clip / 2))
    assert fisher_mean([1.0, -1.0]).rho[0] == pytest.approx(0.0)
    # Four traces: z = (z_clip + 3 atanh(0.5)) / 4; every interval stays finite and inside (-1, 1).
    mixed = fisher_mean([1.0, 0.5, 0.5, 0.5])
    z = (z_clip + 3 * math.atanh(0.5)) / 4
    assert mixed.rho[0] == pytest.approx(math.tanh(z))
    for bound in (mixed.lo, mixed.hi, mixed.t_lo, mixed.t_hi, mixed.boot_lo, mixed.boot_hi):
        assert -1 < bound[0] < 1


def test_fisher_mean_of_perfect_traces_is_exactly_plus_minus_one():
    perfect = fisher_mean([1.0] * 5)
    assert perfect.rho[0] == 1.0  # not FISHER_CLIP
    for bound in (perfect.lo, perfect.hi, perfect.t_lo, perfect.t_hi, perfect.boot_lo, perfect.boot_hi):
        assert bound[0] == 1.0
    assert perfect.p[0] == 0.0 and perfect.t_p[0] == 0.0 and perfect.sd[0] == 0.0
    # Columns: all -1 with an undefined trace; all +1 on two traces (only the t-interval is defined at n_eff = 2); a
    # single perfect trace (a mean, no interval).
    rho = np.array([[-1.0, 1.0, np.nan], [np.nan, 1.0, np.nan], [-1.0, np.nan, 1.0], [-1.0, np.nan, np.nan],
                    [-1.0, np.nan, np.nan]])
    result = fisher_mean(rho)
    assert result.n_eff.tolist() == [4, 2, 1]
    assert result.rho.tolist() == [-1.0, 1.0, 1.0]
    assert [result.lo[0], result.hi[0], result.t_lo[0], result.t_hi[0], result.boot_lo[0]] == [-1.0] * 5
    assert (result.t_lo[1], result.t_hi[1], result.t_p[1]) == (1.0, 1.0, 0.0) and np.isnan(result.lo[1])
    assert np.isnan([result.t_lo[2], result.t_p[2], result.lo[2], result.boot_lo[2]]).all()


def test_t_interval_by_hand():
    # [1, 2, 3]: mean 2, s = 1, se = 1/sqrt(3). With 2 degrees of freedom the Student CDF is
    # 1/2 + t / (2 sqrt(2 + t^2)), so the 97.5% quantile solves t / sqrt(2 + t^2) = 0.95, i.e.
    # t = 0.95 sqrt(2 / (1 - 0.95^2)); the two-sided p of t = 2 sqrt(3) is 1 - t / sqrt(2 + t^2) = 1 - sqrt(12 / 14).
    mean, lo, hi, p = t_interval([1.0, 2.0, 3.0])
    quantile = 0.95 * math.sqrt(2 / (1 - 0.95**2))
    assert quantile == pytest.approx(4.302652729911275)
    assert mean == 2.0
    assert (lo, hi) == pytest.approx((2 - quantile / math.sqrt(3), 2 + quantile / math.sqrt(3)))
    assert p == pytest.approx(1 - math.sqrt(12 / 14))
    # No spread: a point interval, p = 0 (or 1 at zero itself); one value: a mean and nothing else.
    assert t_interval([0.5, 0.5, 0.5]) == (0.5, 0.5, 0.5, 0.0)
    assert t_interval([0.0, 0.0]) == (0.0, 0.0, 0.0, 1.0)
    single = t_interval([0.7, np.nan])
    assert single[0] == 0.7 and np.isnan(single[1:]).all()


def test_t_interval_matches_scipy_per_column_and_agrees_with_its_p():
    rng = np.random.default_rng(4)
    values = rng.normal(0.1, 0.3, size=(15, 4))
    values[[2, 7], 1] = np.nan  # a column with two undefined units
    mean, lo, hi, p = t_interval(values, level=0.9)
    for k in range(4):
        column = values[:, k][np.isfinite(values[:, k])]
        ref = sps.ttest_1samp(column, 0.0)
        ci = ref.confidence_interval(0.9)
        assert (mean[k], lo[k], hi[k], p[k]) == pytest.approx((column.mean(), ci.low, ci.high, ref.pvalue))
    for shift in np.linspace(-0.4, 0.4, 17):
        _, lo, hi, p = t_interval(values[:, 0] + shift)
        assert (p < 0.05) == (lo > 0 or hi < 0)


def test_t_interval_keeps_its_level_on_forty_units():
    # 4000 samples of 40 N(0.2, 0.3) values: the 95% t-interval covers 0.2 in 95% of them (binomial SD 0.0034).
    values = np.random.default_rng(5).normal(0.2, 0.3, size=(40, 4000))
    _, lo, hi, _ = t_interval(values)
    assert np.mean((lo <= 0.2) & (0.2 <= hi)) == pytest.approx(0.95, abs=0.015)


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
    assert (same.t_lo[0], same.t_hi[0], same.t_p[0]) == pytest.approx((0.5, 0.5, 0.0))
    # Three traces give neither the paper's interval nor the bootstrap; the t-interval needs only two.
    few = fisher_mean([0.1, 0.2, 0.3])
    assert np.isnan([few.lo[0], few.hi[0], few.boot_lo[0], few.boot_hi[0], few.p[0]]).all()
    assert np.isfinite([few.t_lo[0], few.t_hi[0], few.t_p[0]]).all()


def test_fisher_mean_t_interval_by_hand():
    # z = 0.1, 0.2, 0.3, 0.4: mean 0.25, s = sqrt(0.05 / 3), se = s / 2; t_3 quantile 3.182446305284263.
    z = np.array([0.1, 0.2, 0.3, 0.4])
    result = fisher_mean(np.tanh(z))
    half = 3.182446305284263 * math.sqrt(0.05 / 3) / 2
    assert result.rho[0] == pytest.approx(math.tanh(0.25))
    assert (result.t_lo[0], result.t_hi[0]) == pytest.approx((math.tanh(0.25 - half), math.tanh(0.25 + half)))
    assert result.t_p[0] == pytest.approx(sps.ttest_1samp(z, 0.0).pvalue)


def test_t_interval_reflects_the_spread_the_paper_interval_ignores():
    # Issue 18's layer 20: 40 traces, mean z -0.3, SD of z 0.3. The paper's half-width 1.96 / sqrt(37) = 0.32 spans
    # zero; the t half-width t_39 * 0.3 / sqrt(40) = 0.096 does not, and is close to the bootstrap's.
    draws = np.random.default_rng(6).normal(size=40)
    z = -0.3 + 0.3 * (draws - draws.mean()) / draws.std(ddof=1)
    result = fisher_mean(np.tanh(z), n_boot=4000)
    half = sps.t.ppf(0.975, 39) * 0.3 / math.sqrt(40)
    assert (result.t_lo[0], result.t_hi[0]) == pytest.approx((math.tanh(-0.3 - half), math.tanh(-0.3 + half)))
    assert result.lo[0] < 0 < result.hi[0] and result.t_hi[0] < 0 and result.t_p[0] < 1e-4
    boot_width = result.boot_hi[0] - result.boot_lo[0]
    assert result.t_hi[0] - result.t_lo[0] == pytest.approx(boot_width, rel=0.2)
    assert result.hi[0] - result.lo[0] > 3 * boot_width




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


def _enumerated_p(x, strata):
    """Two-sided permutation p of the mean within-stratum Spearman rho, enumerating every permutation with scipy."""
    def statistic(xs):
        return np.mean([sps.spearmanr(np.asarray(xs)[units], y).statistic for units, y in strata])

    observed = abs(statistic(x))
    null = [abs(statistic(np.asarray(x)[list(order)])) for order in itertools.permutations(range(len(x)))]
    return np.mean(np.asarray(null) >= observed - 1e-12)


def test_stratified_spearman_one_stratum_by_hand():
    # Five scorers in perfect agreement: of the 5! = 120 orderings only it and its reverse reach |rho| = 1.
    perfect = stratified_spearman([1, 2, 3, 4, 5], [([0, 1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4, 0.5])], n_boot=200)
    assert (perfect.rho, perfect.exact, perfect.n_permutations) == (1.0, True, 120)
    assert perfect.p == pytest.approx(2 / 120) and perfect.p_floor == pytest.approx(2 / 120)
    assert (perfect.n_units, perfect.n_points, perfect.n_strata) == (5, 5, 1)
    # Four scorers cannot reach p < 0.05 however well they agree: the floor is 2 / 4! = 1/12.
    four = stratified_spearman([1, 2, 3, 4], [([0, 1, 2, 3], [1, 2, 3, 4])], n_boot=200)
    assert four.p == pytest.approx(1 / 12) and four.p_floor == pytest.approx(1 / 12)
    # One swapped pair of six: rho = 1 - 6 * 2 / (6 * 35); p by enumeration of all 720 orderings.
    x, y = [1, 2, 3, 4, 5, 6], [1, 2, 4, 3, 5, 6]
    result = stratified_spearman(x, [(list(range(6)), y)], n_boot=200)
    assert result.rho == pytest.approx(1 - 12 / 210)
    assert result.p == pytest.approx(_enumerated_p(x, [(list(range(6)), y)]))


def test_stratified_spearman_ranks_each_stratum_on_its_own():
    # Budget B costs every scorer 0.5 more than budget A. Inside each budget the order is the scorers' (A) or has one
    # swap (B: rho 0.8), so T = (1 + 0.8) / 2; pooled over both budgets the budget's cost would blur the ranking.
    x = np.array([0.1, 0.2, 0.3, 0.4])
    a = np.array([-0.3, -0.2, -0.1, 0.0])
    b = a[[1, 0, 2, 3]] - 0.5
    strata = [([0, 1, 2, 3], a), ([0, 1, 2, 3], b)]
    result = stratified_spearman(x, strata, n_boot=500)
    assert result.rho == pytest.approx(0.9) and result.n_strata == 2 and result.n_points == 8
    assert sps.spearmanr(np.r_[x, x], np.r_[a, b]).statistic < 0.5  # what pooling the points would say
    # One permutation of the offline values for both budgets at once, checked against full enumeration.
    assert result.p == pytest.approx(_enumerated_p(x, strata)) and result.exact
    # A scorer that ran at one budget only is still one unit.
    partial = stratified_spearman(np.r_[x, 0.5], [([0, 1, 2, 3, 4], np.r_[a, 0.1]), ([0, 1, 2, 3], b)], n_boot=200)
    assert partial.n_units == 5 and partial.n_permutations == 120
    assert partial.rho == pytest.approx((1 + 0.8) / 2)


def test_stratified_spearman_monte_carlo_when_enumeration_is_too_long():
    rng = np.random.default_rng(7)
    x = rng.normal(size=6)
    y = x + rng.normal(size=6)
    strata = [(list(range(6)), y)]
    exact = stratified_spearman(x, strata, n_boot=100)
    sampled = stratified_spearman(x, strata, n_boot=100, n_perm=700, seed=1)  # 700 < 6! = 720
    assert exact.exact and exact.n_permutations == 720 and exact.p == pytest.approx(_enumerated_p(x, strata))
    assert not sampled.exact and sampled.n_permutations == 700 and sampled.p_floor == pytest.approx(1 / 701)
    # The sampled p is (count + 1) / 701 with count ~ Binomial(700, exact p): within 4 SD of it.
    assert sampled.p == pytest.approx(exact.p, abs=4 * math.sqrt(exact.p * (1 - exact.p) / 700) + 1 / 701)


def test_stratified_spearman_bootstrap_resamples_units():
    rng = np.random.default_rng(8)
    x = rng.normal(size=10)
    y = 0.5 * x + rng.normal(size=10)
    result = stratified_spearman(x, [(list(range(10)), y)], n_boot=4000, seed=3)
    # A naive bootstrap: draw 10 scorers with replacement, Spearman on the drawn points.
    naive_rng = np.random.default_rng(99)
    naive = []
    for _ in range(1500):
        draw = naive_rng.integers(0, 10, 10)
        naive.append(spearman(x[draw], y[draw]))
    naive = np.asarray(naive)
    naive = naive[np.isfinite(naive)]
    assert result.lo == pytest.approx(np.quantile(naive, 0.025), abs=0.05)
    assert result.hi == pytest.approx(np.quantile(naive, 0.975), abs=0.05)
    # Three scorers: a resample of one scorer three times (3 of 27) has no rho.
    three = stratified_spearman([1, 2, 3], [([0, 1, 2], [3, 1, 2])], n_boot=5000)
    assert three.n_boot_defined / 5000 == pytest.approx(24 / 27, abs=0.015)  # binomial SD 0.0044


def test_stratified_spearman_leaves_out_undefined_points_and_refuses_repeats():
    result = stratified_spearman([1, 2, np.nan, 3, 4], [([0, 1, 2, 3, 4], [1, 2, 3, np.nan, 4])], n_boot=100)
    assert (result.n_units, result.n_points, result.rho) == (3, 3, 1.0)
    undefined = stratified_spearman([1, 2, 3], [([0, 1, 2], [5, 5, 5])], n_boot=100)
    assert np.isnan([undefined.rho, undefined.p, undefined.lo]).all() and undefined.n_units == 3
    assert np.isnan(stratified_spearman([1.0], [([0], [1.0])]).rho)
    with pytest.raises(ValueError, match="twice"):
        stratified_spearman([1, 2, 3], [([0, 1, 1], [1, 2, 3])])
