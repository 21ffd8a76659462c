"""The validity of an offline measure, on hand-made tables whose answer follows from their construction."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import UsageError
from validation.validity import Measure, Table, concordance, graded_importance, points, validity


def _table(offline: np.ndarray, deployed: np.ndarray, random: np.ndarray, average: str = "mean") -> Table:
    s, b, p = deployed.shape
    return Table([f"s{i}" for i in range(s)], list(range(b)), [f"p{i}" for i in range(p)], deployed, random,
                 {"m": Measure(offline, average)})


def test_points_by_hand():
    deployed = np.array([[[1, 1, 0, np.nan]], [[0, 0, 0, 1]]], dtype=float)  # 2 scorers, 1 budget, 4 problems
    random = np.array([[1, 0, 0, 0]], dtype=float)
    offline = np.array([[[0.2, 0.4, np.nan, 0.0]], [[0.1, 0.1, 0.1, 0.1]]])
    x, y = points(_table(offline, deployed, random), Measure(offline))
    assert x[:, 0] == pytest.approx([0.2, 0.1])  # NaN left out of the mean
    assert y[:, 0] == pytest.approx([1 / 3, 0.0])  # scorer 0 on the three problems it ran; s1: -1, 0, 0, +1
    agree, pairs = concordance(_table(offline, deployed, random), Measure(offline))
    # problem 0: s0 kept it, s1 did not, s0 higher: 1 of 1; problem 1: the same; problem 2: no difference;
    # problem 3: s0 not run
    assert agree.tolist() == [1, 1, 0, 0] and pairs.tolist() == [1, 1, 0, 0]


def test_a_measure_that_ranks_scorers_as_deployment_does_is_valid_and_noise_is_not():
    rng = np.random.default_rng(0)
    scorers, budgets, problems = 12, 3, 40
    skill = np.linspace(0.2, 0.9, scorers)  # each scorer keeps the answer with this probability
    deployed = (rng.random((scorers, budgets, problems)) < skill[:, None, None]).astype(float)
    random = (rng.random((budgets, problems)) < 0.5).astype(float)
    honest = np.broadcast_to(skill[:, None, None], deployed.shape) + rng.normal(0, 0.05, deployed.shape)
    noise = rng.normal(0, 1, deployed.shape)
    table = _table(honest, deployed, random)
    table.offline["noise"] = Measure(noise)
    good = validity(table, "m", n_perm=500, n_boot=200)
    bad = validity(table, "noise", n_perm=500, n_boot=200)
    assert good.rho > 0.8 and good.p < 0.01 and good.lo > 0.5 and good.points == scorers * budgets
    assert good.concordance > 0.6 and good.concordance_lo > 0.5
    assert abs(bad.rho) < 0.5 and bad.p > 0.01 and bad.concordance_lo < 0.5 < bad.concordance_hi


def test_a_correlation_averages_on_fisher_z_and_shapes_are_checked():
    rho = np.array([[[0.9, 0.0]], [[0.1, 0.1]]])
    deployed = np.ones((2, 1, 2))
    x, _ = points(_table(rho, deployed, np.zeros((1, 2)), "fisher"), Measure(rho, "fisher"))
    assert x[0, 0] == pytest.approx(np.tanh(np.arctanh(0.9) / 2))
    with pytest.raises(UsageError, match="shape"):
        bad = _table(rho, deployed, np.zeros((1, 2)))
        bad.offline["short"] = Measure(rho[:, :, :1])
        validity(bad, "m", n_perm=10, n_boot=10)


def test_graded_importance_is_minus_the_mean_covering_effect():
    windows = [{"start": 10, "end": 14, "effect": -2.0}, {"start": 12, "end": 16, "effect": 0.0},
               {"start": 14, "end": 18, "effect": None}]
    assert graded_importance(windows, range(10, 17)) == {10: 2.0, 11: 2.0, 12: 1.0, 13: 1.0, 14: -0.0, 15: -0.0}


def test_across_scorers_permutes_exactly_when_the_permutations_are_few():
    from validation.validity import across_scorers

    x = np.array([[1.0], [2.0], [3.0]])
    rho, p = across_scorers(x, x.copy())
    # rho 1; of the 3! orders only the identity and the reversal reach |rho| = 1
    assert rho == pytest.approx(1.0) and p == pytest.approx(2 / 6)
    rho, p = across_scorers(np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), np.array([[3.0, 1.0], [2.0, 2.0],
                                                                                       [1.0, 3.0]]))
    assert rho == pytest.approx(0.0) and p == pytest.approx(1.0)


def test_graded_importance_falls_back_on_the_outcome_of_windows_without_an_effect():
    windows = [{"start": 0, "end": 4, "flipped": True}, {"start": 2, "end": 6, "flipped": False},
               {"start": 4, "end": 8, "effect": -3.0}]
    # position 2-3: mean of -1 and 0; 4-5: mean of 0 and -3; the reasoning span cuts at 7
    assert graded_importance(windows, range(1, 7)) == {1: 1.0, 2: 0.5, 3: 0.5, 4: 1.5, 5: 1.5, 6: 3.0}
