"""validation.paired: sign test = exact binomial, bootstrap by hand and by coverage simulation."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from core.errors import UsageError
from validation.paired import (
    accuracy_interval,
    compare_paired,
    paired_bootstrap,
    sign_test,
)
from validation.stats import bootstrap_means


def test_sign_test_hand_case():
    a = [1, 1, 1, 0, 1, 0]
    b = [0, 0, 0, 0, 1, 0]
    # 3 discordant, all won by A: p = 2 * P(X <= 0) = 2 / 8.
    result = sign_test(a, b)
    assert (result.a_better, result.b_better, result.n_discordant) == (3, 0, 3)
    assert result.p_value == pytest.approx(0.25)


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (3, 10), (5, 10), (7, 10), (0, 20), (12, 25), (40, 100), (1, 2)])
def test_sign_test_equals_scipy_binomtest(k, n):
    a = np.r_[np.ones(k), np.zeros(n - k), np.ones(4)]  # 4 tied problems are ignored
    b = np.r_[np.zeros(k), np.ones(n - k), np.ones(4)]
    result = sign_test(a, b)
    assert result.n_discordant == n
    assert result.p_value == pytest.approx(sps.binomtest(k, n, 0.5).pvalue, rel=1e-12)


def test_sign_test_with_sample_means_and_no_discordance():
    # Per-problem means over samples: only the direction of the difference counts.
    assert sign_test([0.75, 0.5, 1.0], [0.25, 0.5, 0.0]).a_better == 2
    assert sign_test([1, 0], [1, 0]).p_value == 1.0


def test_bootstrap_degenerate_cases():
    # Every problem differs by exactly +1: every replicate is 1, CI [1, 1], p = 2 / (B + 1).
    boot = paired_bootstrap(np.ones(20), np.zeros(20), n_boot=999)
    assert (boot.estimate, boot.lo, boot.hi) == (1.0, 1.0, 1.0)
    assert boot.p_value == pytest.approx(2 / 1000)
    # No difference at all: p = 1 and CI [0, 0].
    same = paired_bootstrap(np.r_[np.ones(5), np.zeros(5)], np.r_[np.ones(5), np.zeros(5)], n_boot=500)
    assert (same.estimate, same.lo, same.hi, same.p_value) == (0.0, 0.0, 0.0, 1.0)


def test_bootstrap_is_paired_and_seeded():
    rng = np.random.default_rng(0)
    shared = rng.random(60)
    a, b = shared + 0.05, shared  # huge between-problem variance, constant within-pair difference
    boot = paired_bootstrap(a, b, n_boot=2000, seed=3)
    assert boot.lo == pytest.approx(0.05) and boot.hi == pytest.approx(0.05)  # unpaired resampling would be wide
    assert paired_bootstrap(a, b, n_boot=2000, seed=3) == boot


def test_bootstrap_means_distribution():
    values = np.array([0.0, 1.0])
    reps = bootstrap_means(values, 20000, np.random.default_rng(0))
    # Mean of 2 draws from {0, 1}: 0, 0.5, 1 with probability 1/4, 1/2, 1/4.
    assert set(np.unique(reps)) == {0.0, 0.5, 1.0}
    assert np.mean(reps == 0.5) == pytest.approx(0.5, abs=0.02)


def _simulate_paired(n_sets: int, n_problems: int, samples: int, delta: float, rng) -> tuple[np.ndarray, np.ndarray]:
    """Per-problem correctness (mean over samples) of two policies whose true accuracy differs by `delta`."""
    difficulty = rng.uniform(0.2, 0.8, size=(n_sets, n_problems, 1))
    a = rng.random((n_sets, n_problems, samples)) < difficulty + delta / 2
    b = rng.random((n_sets, n_problems, samples)) < difficulty - delta / 2
    return a.mean(axis=2), b.mean(axis=2)


def _binomial_band(n: int, p: float) -> tuple[float, float]:
    return sps.binom.ppf(0.001, n, p) / n, sps.binom.ppf(0.999, n, p) / n


@pytest.mark.parametrize("samples", [1, 3])
def test_bootstrap_ci_covers_truth_at_nominal_rate(samples):
    rng = np.random.default_rng(12345)
    n_sets, delta = 200, 0.10
    a, b = _simulate_paired(n_sets, 80, samples, delta, rng)
    covered = []
    for i in range(n_sets):
        boot = paired_bootstrap(a[i], b[i], n_boot=1000, seed=i)
        covered.append(boot.lo <= delta <= boot.hi)
    low, high = _binomial_band(n_sets, 0.95)
    assert low <= np.mean(covered) <= high


def test_bootstrap_p_value_rejects_at_nominal_rate_under_null():
    rng = np.random.default_rng(7)
    n_sets = 200
    a, b = _simulate_paired(n_sets, 80, 1, 0.0, rng)
    rejected = [paired_bootstrap(a[i], b[i], n_boot=1000, seed=i).p_value < 0.05 for i in range(n_sets)]
    assert np.mean(rejected) <= _binomial_band(n_sets, 0.05)[1]


def test_compare_paired_record():
    a = np.array([1, 1, 0, 1, 0, 1, 1, 1.0])
    b = np.array([0, 1, 0, 0, 0, 1, 0, 1.0])
    row = compare_paired(a, b, n_boot=2000)
    assert row["n_problems"] == 8
    assert row["accuracy_a"] == pytest.approx(6 / 8) and row["accuracy_b"] == pytest.approx(3 / 8)
    assert row["difference"] == pytest.approx(3 / 8)
    assert row["ci_lo"] <= 3 / 8 <= row["ci_hi"]
    assert row["sign_n_discordant"] == 3 and row["sign_a_better"] == 3
    assert row["sign_p_value"] == pytest.approx(0.25)


def test_paired_input_errors():
    with pytest.raises(UsageError):
        paired_bootstrap([1, 0], [1, 0, 1])
    with pytest.raises(UsageError):
        sign_test([], [])


def test_accuracy_interval_methods():
    per_problem = np.r_[np.ones(30), np.zeros(70)]
    lo, hi, used = accuracy_interval(per_problem, np.ones(100), "auto", 0.95, 2000, 0)
    assert used == "wilson" and lo < 0.3 < hi
    lo_b, hi_b, used_b = accuracy_interval(per_problem, np.full(100, 3), "auto", 0.95, 4000, 0)
    assert used_b == "bootstrap" and lo_b < 0.3 < hi_b
    # Both approximate the same binomial spread here (one sample per problem in substance).
    assert hi_b - lo_b == pytest.approx(hi - lo, rel=0.15)
