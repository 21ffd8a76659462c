"""Paired comparison of two policies' per-problem correctness.

Reproduces the significance protocol of the Random Attention notes (§3.3 "Significance"): a paired,
problem-clustered percentile bootstrap (95% CI) plus an exact sign test. The unit of resampling is the *problem*:
when a policy was run several times per problem (R samples), its per-problem correctness is the mean over those
samples and the bootstrap resamples whole problems, so within-problem correlation never inflates the sample size.
Accuracy is the mean over problems of per-problem correctness, which equals the notes' Acc = (1/R|D|) sum sum 1[...]
when every problem has R samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from core.errors import UsageError
from validation.stats import bootstrap_means, percentile_interval, wilson_interval


@dataclass(frozen=True)
class BootstrapResult:
    estimate: float  # observed statistic (mean of per-problem differences, A - B)
    lo: float
    hi: float
    p_value: float  # two-sided, from the bootstrap distribution's mass on either side of zero
    n_boot: int


@dataclass(frozen=True)
class SignTestResult:
    a_better: int  # problems where A's correctness exceeds B's
    b_better: int
    n_discordant: int
    p_value: float  # exact two-sided binomial(n_discordant, 1/2)


def _as_pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape:
        raise UsageError(f"paired data needs two 1-D arrays of equal length, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise UsageError("paired comparison needs at least one problem present in both runs")
    return a, b


def paired_bootstrap(a, b, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> BootstrapResult:
    """Paired, problem-clustered percentile bootstrap of mean(a - b) (Random Attention notes §3.3).

    `a`, `b`: per-problem correctness of policies A and B on the same problems, in the same order (0/1, or the mean
    over several samples of that problem). Problems are resampled with replacement, keeping each problem's (a, b)
    pair together. The interval is the percentile interval of the replicates. The two-sided p-value is
    2 * min(P*(d* <= 0), P*(d* >= 0)) with the add-one correction ((count + 1) / (n_boot + 1)), capped at 1, so
    p < 1 - level essentially when the percentile interval excludes zero.
    """
    a, b = _as_pair(a, b)
    if n_boot < 1:
        raise UsageError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise UsageError(f"confidence level must be in (0, 1), got {level}")
    diff = a - b
    replicates = bootstrap_means(diff, n_boot, np.random.default_rng(seed))
    lo, hi = percentile_interval(replicates, level)
    below = (np.count_nonzero(replicates <= 0) + 1) / (n_boot + 1)
    above = (np.count_nonzero(replicates >= 0) + 1) / (n_boot + 1)
    return BootstrapResult(float(diff.mean()), lo, hi, float(min(1.0, 2.0 * min(below, above))), n_boot)


def sign_test(a, b) -> SignTestResult:
    """Exact two-sided sign test on paired per-problem correctness (Random Attention notes §3.3).

    Each problem votes for the policy with the higher correctness; ties are dropped. Under H0 the number of A wins
    among the n discordant problems is Binomial(n, 1/2), and because that distribution is symmetric the two-sided
    p-value is min(1, 2 * P(X <= min(wins_A, wins_B))), identical to `scipy.stats.binomtest(k, n, 0.5)`.
    """
    a, b = _as_pair(a, b)
    a_better = int(np.count_nonzero(a > b))
    b_better = int(np.count_nonzero(b > a))
    n = a_better + b_better
    from scipy import stats as sps  # scipy.stats takes a second to import: not before a comparison is made

    p = 1.0 if n == 0 else float(min(1.0, 2.0 * sps.binom.cdf(min(a_better, b_better), n, 0.5)))
    return SignTestResult(a_better, b_better, n, p)


def compare_paired(a, b, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """Accuracies, difference (A - B), bootstrap CI and p-value, sign-test p and discordant counts in one record."""
    a, b = _as_pair(a, b)
    boot = paired_bootstrap(a, b, n_boot=n_boot, level=level, seed=seed)
    sign = sign_test(a, b)
    return {
        "n_problems": int(a.size),
        "accuracy_a": float(a.mean()),
        "accuracy_b": float(b.mean()),
        "difference": boot.estimate,
        "ci_lo": boot.lo,
        "ci_hi": boot.hi,
        "level": level,
        "bootstrap_p": boot.p_value,
        "n_boot": boot.n_boot,
        **{f"sign_{k}": v for k, v in asdict(sign).items()},
    }


def accuracy_interval(
    per_problem: np.ndarray, samples_per_problem: np.ndarray, method: str, level: float, n_boot: int, seed: int
) -> tuple[float, float, str]:
    """A confidence interval for accuracy = mean of per-problem correctness.

    method "wilson": Wilson score interval over problems (exact only for one 0/1 sample per problem);
    "bootstrap": problem-clustered percentile bootstrap; "auto": Wilson when every problem has exactly one sample,
    else the clustered bootstrap (Wilson on R x |D| trials would treat correlated samples as independent).
    Returns (lo, hi, method used).
    """
    per_problem = np.asarray(per_problem, dtype=float)
    if method == "auto":
        method = "wilson" if np.all(np.asarray(samples_per_problem) == 1) else "bootstrap"
    if method == "wilson":
        lo, hi = wilson_interval(float(per_problem.sum()), per_problem.size, level)
    else:
        replicates = bootstrap_means(per_problem, n_boot, np.random.default_rng(seed))
        lo, hi = percentile_interval(replicates, level)
    return lo, hi, method
