"""validation.predictive: the offline statistic of each scorer beside its deployed difference against random, and
their rank agreement across scorers and budgets, on hand-made rows."""

from __future__ import annotations

import csv
import json
import math

import pytest

from core.errors import UsageError
from validation.predictive import (
    SELECTED_PREFIX,
    TABLE_COLUMNS,
    deployed_from_comparisons,
    describe,
    main,
    offline_from_ranking,
    predictive,
    selected_signals,
)


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


def _compared(config, budget, difference, **extra) -> dict:
    return {"config": config, "policy_a": config, "budget_a": budget, "policy_b": "random", "difference": difference,
            "ci_lo": difference - 0.1, "ci_hi": difference + 0.1, "n_problems": 40, **extra}


def test_the_deployed_rows_leave_out_full_errors_and_other_references():
    comparisons = [_compared(name, budget, diff) for budget in (0.25, 0.5)
                   for name, diff in (("epikv", -0.4), ("recency", 0.0), ("h2o", -0.1))]
    comparisons += [_compared("full", None, 0.05), _compared("full", "", 0.02),  # no budget: it deploys no score
                    _compared("random", 0.5, 0.0),  # the reference against itself
                    _compared("valuediff", 0.5, 0.0, error="unequal peak cache"),
                    _compared("keydiff", 0.5, 0.1, policy_b="recency")]
    rows = deployed_from_comparisons(comparisons)
    assert [(r["scorer"], r["budget"]) for r in rows] == [(n, b) for b in (0.25, 0.5)
                                                          for n in ("epikv", "recency", "h2o")]
    offline = [_offline(name, rho) for name, rho in (("epikv", -0.3), ("recency", 0.6), ("h2o", 0.1))]
    found = predictive(offline, rows)
    assert sorted(found.per_budget) == [0.25, 0.5]
    # the offline order (recency > h2o > epikv) is the deployed order at both budgets
    assert all(test.rho == pytest.approx(1.0) for test in found.per_budget.values())
    assert [r["budget"] for r in deployed_from_comparisons([_compared("a", "192", 0.0), _compared("b", "0.5", 0.0)])]\
        == [192, 0.5]  # CSV text: a token count stays an integer, a fraction a float


RANKING = [{"signal": signal, "within_rho": rho, "within_t_lo": rho - 0.05, "within_t_hi": rho + 0.05}
           for signal, rho in (("recency.l0.raw", 0.6), ("recency.agg.raw", 0.6), ("epikv.agg.raw", -0.3),
                               ("band:hidden_diff.mean64", 0.4), ("h2o.agg.raw", 0.1), ("keydiff.agg.raw", 0.2))]


def test_offline_rows_take_the_aggregate_score_unless_a_selected_signal_is_named():
    policies = {"recency": "recency", "selected-epikv": "epikv", "epikv": "epikv", "h2o-sinks": "h2o", "tova": "tova"}
    rows = offline_from_ranking(RANKING, policies, {"selected-epikv": "band:hidden_diff.mean64"})
    assert [(r["scorer"], r["signal"], r["rho"]) for r in rows] == [
        ("recency", "recency.agg.raw", 0.6), ("selected-epikv", "band:hidden_diff.mean64", 0.4),
        ("epikv", "epikv.agg.raw", -0.3), ("h2o-sinks", "h2o.agg.raw", 0.1)]  # tova: not in the ranking
    with pytest.raises(UsageError, match="band:nothing not in the ranking"):
        offline_from_ranking(RANKING, {"epikv": "epikv"}, {"epikv": "band:nothing"})


def _write_csv(path, rows):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def test_the_cli_ranks_budgets_from_separate_runs_together(tmp_path, capsys):
    ranking = _write_csv(tmp_path / "ranking.csv", RANKING)
    quarter = _write_csv(tmp_path / "quarter.csv", [_compared("full", "", 0.3)] + [
        _compared(n, 0.25, d) for n, d in (("epikv", -0.5), ("recency", 0.0), ("h2o", -0.4), ("keydiff", 0.1))])
    half = _write_csv(tmp_path / "half.csv", [
        _compared(n, 0.5, d) for n, d in (("epikv", -0.2), ("recency", 0.05), ("h2o", -0.1), ("keydiff", 0.0))])
    out = tmp_path / "out"
    assert main(["--ranking", ranking, "--compare", quarter, half, "--n-boot", "200", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "all budgets: Spearman rho" in printed
    table = list(csv.DictReader((out / "predictive.csv").open()))
    assert [(r["scorer"], r["budget"]) for r in table] == [(n, b) for b in ("0.25", "0.5")
                                                           for n in ("epikv", "recency", "h2o", "keydiff")]
    stored = json.loads((out / "predictive.json").read_text())
    # offline order epikv < h2o < keydiff < recency; deployed: quarter epikv < h2o < recency < keydiff (rho 0.8),
    # half epikv < h2o < keydiff < recency (rho 1.0): their mean
    assert [b["rho"] for b in stored["per_budget"]] == [pytest.approx(0.8), pytest.approx(1.0)]
    assert stored["overall"]["rho"] == pytest.approx(0.9) and stored["overall"]["n_strata"] == 2
    direct = predictive(offline_from_ranking(RANKING, {n: n for n in ("epikv", "recency", "h2o", "keydiff")}),
                        deployed_from_comparisons(list(csv.DictReader(open(quarter))) +
                                                  list(csv.DictReader(open(half)))), n_boot=200)
    assert stored["overall"]["p"] == direct.overall.p and stored["overall"]["lo"] == direct.overall.lo
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("extra,message", [
    (["--signal", "epikv"], "--signal 'epikv': expected NAME=SIGNAL"),
    (["--signal", "epikv=band:nothing"], "band:nothing not in the ranking"),
    (["--against", "h2o"], "no row compares a configuration at a budget with 'h2o'"),
    (["--level", "1.5"], "--level 1.5: must lie between 0 and 1"),
])
def test_cli_bad_input_is_one_line_and_exit_2_without_output(tmp_path, capsys, extra, message):
    ranking = _write_csv(tmp_path / "ranking.csv", RANKING)
    compared = _write_csv(tmp_path / "compare.csv", [_compared("epikv", 0.5, -0.2), _compared("h2o", 0.5, 0.0)])
    out = tmp_path / "out"
    assert main(["--ranking", ranking, "--compare", compared, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_the_ranking_names_the_signal_each_selected_configuration_was_chosen_on():
    import study.stages

    assert SELECTED_PREFIX == study.stages.SELECTED  # the study's name for a selected non-default configuration
    ranking = [{"signal": "keydiff.l2.raw", "config": "keydiff"}, {"signal": "band:hidden_diff.z64", "config": "epikv"},
               {"signal": "recency.l0.raw", "config": "recency"}, {"signal": "h2o.agg.raw", "config": ""}]
    # validation.select + evictor.run: the configuration runs under its selection name
    assert selected_signals(ranking, ["keydiff", "h2o"]) == {"keydiff": "keydiff.l2.raw"}
    # the study: epikv's selected bands run as selected-epikv beside the default epikv, which keeps its aggregate
    assert selected_signals(ranking, ["epikv", "selected-epikv", "recency"]) == {
        "selected-epikv": "band:hidden_diff.z64", "recency": "recency.l0.raw"}
