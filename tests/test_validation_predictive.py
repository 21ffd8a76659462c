"""validation.predictive: the offline statistic of each scorer beside its deployed difference against random, and
their rank agreement across scorers and budgets, on hand-made rows."""

from __future__ import annotations

import math

import pytest

from core.errors import UsageError
from validation.predictive import TABLE_COLUMNS, describe, predictive


def _offline(scorer: str, rho, signal: str | None = None) -> dict:
    row = {"scorer": scorer, "rho": rho, "rho_lo": None if rho is None else rho - 0.1,
           "rho_hi": None if rho is None else rho + 0.1}
    return row if signal is None else {**row, "signal": signal}


def _deployed(scorer: str, budget, difference, n: int = 40) -> dict:
    return {"scorer": scorer, "budget": budget, "difference": difference, "ci_lo": difference - 0.1,
            "ci_hi": difference + 0.1, "n_problems": n}


OFFLINE = [_offline("h2o", 0.05, "h2o.agg.raw"), _offline("keydiff", 0.20), _offline("valuediff", 0.30),
           _offline("recency", 0.66), _offline("tova", 0.10)]


def test_the_table_joins_on_the_scorer_in_the_deployed_order():
    deployed = [_deployed("valuediff", 0.5, -0.025), _deployed("h2o", 0.5, -0.2), _deployed("full", None, 0.025)]
    result = predictive(OFFLINE, deployed, n_boot=100)
    assert [tuple(r) for r in result.rows] == [TABLE_COLUMNS] * 2
    first, second = result.rows
    assert first == {"scorer": "valuediff", "signal": None, "budget": 0.5, "offline_rho": 0.30,
                     "offline_lo": pytest.approx(0.20), "offline_hi": pytest.approx(0.40), "difference": -0.025,
                     "ci_lo": pytest.approx(-0.125), "ci_hi": pytest.approx(0.075), "n_problems": 40}
    assert second["signal"] == "h2o.agg.raw"
    assert result.not_validated == ["full"]  # ran, but has no offline statistic
    assert result.not_deployed == ["keydiff", "recency", "tova"]


def test_rank_agreement_per_budget_and_across_budgets_by_hand():
    # Budget 0.5: the differences follow the offline order exactly (rho 1). Budget 0.25 costs everyone 0.3 more and
    # swaps keydiff and valuediff: d^2 = 2, rho = 1 - 6 * 2 / (4 * 15) = 0.8. Across budgets: (1 + 0.8) / 2.
    order = ["h2o", "keydiff", "valuediff", "recency"]
    half = dict(zip(order, [-0.4, -0.2, -0.1, 0.0]))
    quarter = dict(zip(order, [-0.7, -0.4, -0.5, -0.3]))
    deployed = [_deployed(s, 0.5, half[s]) for s in order] + [_deployed(s, 0.25, quarter[s]) for s in order]
    result = predictive(OFFLINE, deployed, n_boot=200)
    assert list(result.per_budget) == [0.5, 0.25]
    assert result.per_budget[0.5].rho == pytest.approx(1.0)
    assert result.per_budget[0.25].rho == pytest.approx(0.8)
    overall = result.overall
    assert overall.rho == pytest.approx(0.9) and overall.n_strata == 2
    assert (overall.n_units, overall.n_points, overall.n_permutations, overall.exact) == (4, 8, 24, True)
    # Four scorers: the exact test's floor is 2 / 4! = 1/12, which the report must say.
    assert result.per_budget[0.5].p == pytest.approx(1 / 12) and result.per_budget[0.5].p_floor == pytest.approx(1 / 12)
    text = describe(result.per_budget[0.5])
    assert "over 4 scorers" in text and "exact permutation p = 0.0833" in text
    assert "no p below 0.0833 is possible" in text and "cannot reach 0.05" in text
    assert "at 2 budgets" in describe(overall)


def test_enough_scorers_can_show_agreement_and_the_report_does_not_warn():
    names = [f"s{k}" for k in range(7)]
    offline = [_offline(s, 0.1 * k) for k, s in enumerate(names)]
    result = predictive(offline, [_deployed(s, 256, -0.3 + 0.05 * k) for k, s in enumerate(names)], n_boot=200)
    test = result.per_budget[256]
    assert test.rho == pytest.approx(1.0) and test.p == pytest.approx(2 / math.factorial(7))
    assert "cannot reach" not in describe(test)


def test_undefined_points_stay_in_the_table_and_out_of_the_correlation():
    offline = [*OFFLINE[:4], _offline("tova", None)]
    deployed = [_deployed(s, 0.5, d) for s, d in zip(["h2o", "keydiff", "valuediff", "recency", "tova"],
                                                      [-0.3, -0.2, -0.1, 0.0, 0.1])]
    deployed[0] = {**deployed[0], "difference": "", "ci_lo": "", "ci_hi": ""}  # a failed comparison
    result = predictive(offline, deployed, n_boot=100)
    assert len(result.rows) == 5 and math.isnan(result.rows[0]["difference"])
    assert math.isnan(result.rows[4]["offline_rho"])
    assert result.overall.n_units == 3 and result.overall.rho == pytest.approx(1.0)
    lonely = predictive(OFFLINE[:1], [_deployed("h2o", 0.5, -0.1)], n_boot=100)
    assert math.isnan(lonely.overall.rho) and describe(lonely.overall).startswith("no rank correlation")


def test_csv_strings_read_as_numbers():
    offline = [{"scorer": s, "rho": str(r), "rho_lo": "0", "rho_hi": "1"} for s, r in [("a", 0.1), ("b", 0.2),
                                                                                        ("c", 0.3)]]
    deployed = [{"scorer": s, "budget": "0.5", "difference": d, "ci_lo": "-1", "ci_hi": "1", "n_problems": "40"}
                for s, d in [("a", "-0.2"), ("b", "-0.1"), ("c", "0.0")]]
    result = predictive(offline, deployed, n_boot=100)
    assert result.rows[0]["offline_rho"] == 0.1 and result.rows[0]["n_problems"] == 40
    assert result.per_budget["0.5"].rho == pytest.approx(1.0)


@pytest.mark.parametrize("offline,deployed,message", [
    ([{"scorer": "a", "rho": 0.1}], [], "offline row 1 has no rho_lo, rho_hi"),
    ([_offline("a", 0.1), _offline("a", 0.2)], [], "scorer 'a' appears twice"),
    ([_offline("a", 0.1)], [_deployed("a", 0.5, 0.0), _deployed("a", 0.5, 0.1)], "budget 0.5 appears twice"),
    ([_offline("a", 0.1)], [{**_deployed("a", 0.5, 0.0), "difference": "high"}], "difference 'high' is not a number"),
    ([_offline("a", 0.1)], [{**_deployed("a", 0.5, 0.0), "n_problems": 2.5}], "n_problems 2.5 is not a count"),
    ([_offline("a", 0.1)], [{"scorer": "a", "budget": 0.5}], "deployed row 1 has no difference, ci_lo, ci_hi"),
])
def test_bad_rows_are_one_usage_error(offline, deployed, message):
    with pytest.raises(UsageError, match=message):
        predictive(offline, deployed, n_boot=10)
