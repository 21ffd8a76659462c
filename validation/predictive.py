"""Does the offline statistic predict what eviction keeps? Each scorer's offline statistic beside its deployed
accuracy difference against random, and the rank correlation between the two across scorers.

Offline: the within-trace rho of a scorer's keep score with the occlusion labels, at the layer or aggregate it was
chosen with (`validation.select`), with its interval. Deployed: its accuracy minus random's at the same budget, on
the same problems at equal peak cache, with the paired interval (`validation.compare`). If validating against the
labels means anything for eviction, scorers that rank the labels better should lose less against random, so the rank
correlation across scorers should be positive.

Inputs are plain rows (numbers may be strings, as a CSV reader gives them; empty or None is undefined):

- offline rows, one per scorer: ``scorer, rho, rho_lo, rho_hi`` (`OFFLINE_COLUMNS`), and ``signal`` (the ranked
  signal the statistic belongs to) when known;
- deployed rows, one per (scorer, budget): ``scorer, budget, difference, ci_lo, ci_hi, n_problems``
  (`DEPLOYED_COLUMNS`). Budgets are matched as given, so give every row of one budget the same value.

`predictive` joins them on ``scorer`` into one row per (scorer, budget), in the order of the deployed rows, with the
columns `TABLE_COLUMNS`: ``offline_rho, offline_lo, offline_hi`` (the offline statistic and its interval) and
``difference, ci_lo, ci_hi`` (the accuracy difference and its interval). The agreement is
`validation.stats.stratified_spearman`: per budget, Spearman's rho across the scorers that ran there; across budgets
(``overall``), the mean of the per-budget rho, so that each budget is ranked on its own and what a budget costs every
scorer alike does not enter. A scorer is the unit, since its budgets share one offline value and the same problems:
the permutation p-value permutes the offline statistic over scorers and the interval resamples scorers. With k
scorers the exact test cannot give a p below about 2/k! (`RankTest.p_floor`; 1/12 for 4 scorers), and `describe`
says so. A point whose offline rho or difference is undefined stays in the table and out of the correlation.

The correlation is between point estimates: each point's own uncertainty is in the table beside it, not in the rho.

From files (``python -m validation.predictive``): a ranking table (`validation.select`'s or the study's
``ranking.csv``) and one or more comparison tables (the study's ``compare.csv``, `validation.compare`'s
``comparison.csv``), so that budgets evicted by separate runs on the same labels are ranked together. A configuration
deployed at its defaults is validated by its policy's aggregate score ``<policy>.agg.raw`` (`offline_from_ranking`);
a selected configuration (a layer, a band) by the signal it was selected on, which the ranking's ``config`` column
names (`selected_signals`) or ``--signal NAME=SIGNAL`` gives.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from core.cli import ArgumentParser, main_guard, positive_int, seed_int
from core.errors import UsageError, unknown_choice
from core.rundir import RunDir
from validation.report import fmt, write_csv, write_json
from validation.stats import DEFAULT_N_BOOT, DEFAULT_N_PERM, RankTest, stratified_spearman

OFFLINE_COLUMNS = ("scorer", "rho", "rho_lo", "rho_hi")
DEPLOYED_COLUMNS = ("scorer", "budget", "difference", "ci_lo", "ci_hi", "n_problems")
RANKING_COLUMNS = ("signal", "within_rho", "within_t_lo", "within_t_hi")
COMPARISON_COLUMNS = ("policy_a", "policy_b", "budget_a", "difference", "ci_lo", "ci_hi", "n_problems")
SELECTED_PREFIX = "selected-"  # how the study names a selected configuration that equals no default
TABLE_COLUMNS = ("scorer", "signal", "budget", "offline_rho", "offline_lo", "offline_hi", "difference", "ci_lo",
                 "ci_hi", "n_problems")


@dataclass(frozen=True)
class Predictive:
    """The joined table and the rank agreement between its offline and deployed columns."""

    rows: list[dict]  # one per (scorer, budget), columns `TABLE_COLUMNS`
    per_budget: dict[Any, RankTest]  # budget -> Spearman's rho across the scorers that ran at it
    overall: RankTest  # the mean of the per-budget rho, scorers as units
    level: float
    not_validated: list[str] = field(default_factory=list)  # deployed scorers without an offline row (not joined)
    not_deployed: list[str] = field(default_factory=list)  # offline scorers that never ran in the evictor


def _number(row: Mapping, key: str, what: str) -> float:
    value = row[key]
    if value is None or value == "":
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{what}: {key} {value!r} is not a number") from None


def _count(row: Mapping, where: str) -> int | None:
    value = _number(row, "n_problems", where)
    if not math.isfinite(value):
        return None
    if value != int(value) or value < 0:
        raise UsageError(f"{where}: n_problems {row['n_problems']!r} is not a count")
    return int(value)


def _checked(rows: Iterable[Mapping], columns: tuple[str, ...], kind: str) -> list[Mapping]:
    rows = list(rows)
    for i, row in enumerate(rows, start=1):
        missing = [c for c in columns if c not in row]
        if missing:
            raise UsageError(f"{kind} row {i} has no {', '.join(missing)} (a {kind} row needs {', '.join(columns)})")
    return rows


def predictive(offline: Iterable[Mapping], deployed: Iterable[Mapping], level: float = 0.95,
               n_boot: int = DEFAULT_N_BOOT, n_perm: int = DEFAULT_N_PERM, seed: int = 0) -> Predictive:
    """Join offline and deployed rows on the scorer and measure their rank agreement (see the module docstring).

    A repeated scorer among the offline rows, or a repeated (scorer, budget) among the deployed ones, is a
    `UsageError`, as is a missing column or a value that is not a number.
    """
    offline = _checked(offline, OFFLINE_COLUMNS, "offline")
    deployed = _checked(deployed, DEPLOYED_COLUMNS, "deployed")
    validated: dict[str, Mapping] = {}
    for i, row in enumerate(offline, start=1):
        scorer = str(row["scorer"])
        if scorer in validated:
            raise UsageError(f"offline row {i}: scorer {scorer!r} appears twice; give one offline statistic each")
        validated[scorer] = row
    rows, seen, not_validated = [], set(), []
    for i, row in enumerate(deployed, start=1):
        scorer, budget = str(row["scorer"]), row["budget"]
        if (scorer, budget) in seen:
            raise UsageError(f"deployed row {i}: scorer {scorer!r} at budget {budget!r} appears twice")
        seen.add((scorer, budget))
        if scorer not in validated:
            not_validated.append(scorer)
            continue
        stat, where = validated[scorer], f"deployed row {i}"
        rows.append({
            "scorer": scorer, "signal": stat.get("signal"), "budget": budget,
            **{f"offline_{name}": _number(stat, key, f"offline row of {scorer!r}")
               for name, key in (("rho", "rho"), ("lo", "rho_lo"), ("hi", "rho_hi"))},
            **{key: _number(row, key, where) for key in ("difference", "ci_lo", "ci_hi")},
            "n_problems": _count(row, where),
        })
    scorers = list(dict.fromkeys(r["scorer"] for r in rows))
    index = {s: j for j, s in enumerate(scorers)}
    x = np.array([_number(validated[s], "rho", f"offline row of {s!r}") for s in scorers], dtype=float)
    strata: dict[Any, tuple[list[int], list[float]]] = {}
    for r in rows:
        units, y = strata.setdefault(r["budget"], ([], []))
        units.append(index[r["scorer"]])
        y.append(r["difference"])
    per_budget = {budget: stratified_spearman(x, [group], level, n_boot, n_perm, seed)
                  for budget, group in strata.items()}
    overall = stratified_spearman(x, list(strata.values()), level, n_boot, n_perm, seed)
    return Predictive(rows, per_budget, overall, level, list(dict.fromkeys(not_validated)),
                      [s for s in validated if s not in index])


def describe(test: RankTest, level: float = 0.95) -> str:
    """One sentence for a report: the rank correlation, its interval and p-value, and what k scorers allow."""
    if not math.isfinite(test.rho):
        return (f"no rank correlation: {test.n_units} scorer(s) with both an offline statistic and a deployed "
                "difference, and no budget with two of them that differ in both")
    across = f" at {test.n_strata} budgets (the mean of the per-budget rho)" if test.n_strata > 1 else ""
    text = (f"Spearman rho {fmt(test.rho, 2)} over {test.n_units} scorers{across}; {level:.0%} bootstrap interval "
            f"over scorers [{fmt(test.lo, 2)}, {fmt(test.hi, 2)}] ({test.n_boot_defined} of {test.n_boot} resamples "
            f"defined); {'exact' if test.exact else 'Monte Carlo'} permutation p = {test.p:.3g} over "
            f"{test.n_permutations} permutations")
    alpha = 1.0 - level
    if test.p_floor >= alpha:
        text += (f"; with {test.n_units} scorers no p below {test.p_floor:.3g} is possible, so this test cannot "
                 f"reach {alpha:g} whatever the agreement")
    return text


def offline_from_ranking(ranking: Iterable[Mapping], policies: Mapping[str, str],
                         signals: Mapping[str, str] | None = None) -> list[dict]:
    """Offline rows for the configurations `policies` (name -> the policy it runs) from a ranking table's rows
    (``signal``, ``within_rho``, ``within_t_lo``, ``within_t_hi``: the t-interval over per-trace rho that the study
    bases significance on). A configuration's signal is ``signals[name]`` (a selected layer or band), else
    ``<policy>.agg.raw`` (a policy at its defaults deploys its aggregate score). A signal named in `signals` that the
    ranking lacks is a `UsageError`; a default one that it lacks leaves the configuration without an offline row
    (`Predictive.not_validated`)."""
    signals = dict(signals or {})
    by_signal = {str(row["signal"]): row for row in _checked(ranking, ("signal", "within_rho"), "ranking")}
    missing = sorted(set(signals.values()) - set(by_signal))
    if missing:
        raise UsageError(f"--signal: {', '.join(missing)} not in the ranking (its signals include "
                         f"{', '.join(list(by_signal)[:8])}, ...)")
    rows = []
    for name, policy in policies.items():
        row = by_signal.get(signals.get(name, f"{policy}.agg.raw"))
        if row is not None:
            rows.append({"scorer": name, "signal": row["signal"], "rho": row["within_rho"],
                         "rho_lo": row.get("within_t_lo"), "rho_hi": row.get("within_t_hi")})
    return rows


def selected_signals(ranking: Iterable[Mapping], names: Iterable[str]) -> dict[str, str]:
    """The signal `validation.select` chose each compared configuration on, read from the ranking's ``config``
    column: a configuration named there (``X``, or ``selected-X`` as the study names one that differs from every
    default) takes that row's signal. Where both ``X`` and ``selected-X`` were compared, ``X`` is the default of the
    same name and is left to its aggregate score."""
    chosen = {str(row["config"]): str(row["signal"]) for row in ranking if row.get("config")}
    names = list(names)
    signals = {}
    for name in names:
        base = name.removeprefix(SELECTED_PREFIX)
        if base in chosen and (name != base or SELECTED_PREFIX + name not in names):
            signals[name] = chosen[base]
    return signals


def deployed_from_comparisons(comparisons: Iterable[Mapping], reference: str = "random") -> list[dict]:
    """Deployed rows from comparison rows (``config`` or ``policy_a``, ``policy_b``, ``budget_a``, ``difference``,
    ``ci_lo``, ``ci_hi``, ``n_problems``; ``error`` where a pair could not be compared): each configuration that
    evicted by a score against `reference`, with the policy it ran (``policy_a``). A row without a budget (full
    attention) deploys no score, the reference against itself differs by nothing by construction, and a row with an
    error has no difference."""
    rows = []
    for row in comparisons:
        budget = _budget(row.get("budget_a"))
        if (row.get("policy_b", reference) != reference or row.get("policy_a") == reference or row.get("error")
                or budget is None):
            continue
        rows.append({"scorer": row.get("config") or row["policy_a"], "policy": row.get("policy_a"), "budget": budget,
                     **{key: row[key] for key in ("difference", "ci_lo", "ci_hi", "n_problems")}})
    return rows


def _budget(value: Any) -> Any:
    """A budget as comparison tables write it (a token count or a fraction; a CSV cell is text), None when absent."""
    if value is None or value == "" or isinstance(value, float) and math.isnan(value):
        return None
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise UsageError(f"budget_a {value!r} is not a budget (a token count or a fraction)")


def _read_csv(path: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """A table's rows, refusing (`UsageError`) a file that cannot be read, is not UTF-8 CSV, has no row, or lacks
    one of `columns`."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            header = reader.fieldnames or []
    except OSError as err:
        raise UsageError(f"{path}: {err.strerror}") from None
    except (UnicodeDecodeError, csv.Error) as err:
        raise UsageError(f"{path}: not a UTF-8 CSV table ({err})") from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise UsageError(f"{path}: no column {', '.join(missing)} (a table here needs {', '.join(columns)})")
    if not rows:
        raise UsageError(f"{path}: a header and no row")
    return rows


def _signal_option(text: str) -> tuple[str, str]:
    name, sep, signal = text.partition("=")
    if not sep or not name or not signal:
        raise UsageError(f"--signal {text!r}: expected NAME=SIGNAL (a configuration and a ranking signal, e.g. "
                         "epikv=band:hidden_diff.mean64)")
    return name, signal


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m validation.predictive",
        description="Does the offline statistic predict eviction? Each deployed configuration's within-trace rho "
        "with the labels beside its accuracy difference against random, and Spearman's rho between the two across "
        "configurations, per budget and across budgets (scorers as units).")
    parser.add_argument("--ranking", required=True,
                        help="ranking table with signal, within_rho, within_t_lo, within_t_hi (validation.select's "
                        "or the study's ranking.csv)")
    parser.add_argument("--compare", nargs="+", required=True, metavar="CSV",
                        help="comparison tables against the reference (the study's compare.csv, validation.compare's "
                        "comparison.csv); several runs' budgets on the same labels are ranked together, and a "
                        "configuration at one budget given twice is refused")
    parser.add_argument("--signal", action="append", default=[], metavar="NAME=SIGNAL",
                        help="the ranking signal a configuration was chosen on (repeatable); without it a "
                        "configuration the ranking's config column names takes that row's signal, any other its "
                        "policy's aggregate score at defaults, <policy>.agg.raw")
    parser.add_argument("--against", default="random",
                        help="the policy every configuration was compared with in the tables (default random)")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level (default 0.95)")
    parser.add_argument("--n-boot", type=positive_int, default=DEFAULT_N_BOOT,
                        help=f"bootstrap resamples over scorers (default {DEFAULT_N_BOOT})")
    parser.add_argument("--n-perm", type=positive_int, default=DEFAULT_N_PERM,
                        help="permutations when there are too many scorers to enumerate them all "
                        f"(default {DEFAULT_N_PERM})")
    parser.add_argument("--seed", type=seed_int, default=0, help="bootstrap and permutation seed (default 0)")
    parser.add_argument("--out", help="output directory for predictive.csv and predictive.json; without it the "
                        "table is printed and nothing is written")
    return parser


def _print_summary(found: Predictive, out) -> None:
    for r in found.rows:
        print(f"{r['scorer']} ({r['signal']}) @ {r['budget']}: offline rho {fmt(r['offline_rho'])} "
              f"[{fmt(r['offline_lo'])}, {fmt(r['offline_hi'])}], diff {fmt(r['difference'])} "
              f"[{fmt(r['ci_lo'])}, {fmt(r['ci_hi'])}], n={r['n_problems']}", file=out)
    for budget, test in found.per_budget.items():
        print(f"budget {budget}: {describe(test, found.level)}", file=out)
    if len(found.per_budget) > 1:
        print(f"all budgets: {describe(found.overall, found.level)}", file=out)
    if found.not_validated:
        print(f"no offline row: {', '.join(found.not_validated)}", file=out)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.level < 1:
        raise UsageError(f"--level {args.level}: must lie between 0 and 1")
    signals = dict(_signal_option(text) for text in args.signal)
    deployed = [row for path in args.compare
                for row in deployed_from_comparisons(_read_csv(path, COMPARISON_COLUMNS), args.against)]
    if not deployed:
        raise UsageError(f"--compare: no row compares a configuration at a budget with {args.against!r} in "
                         f"{', '.join(args.compare)}")
    policies = {r["scorer"]: r["policy"] or r["scorer"] for r in deployed}
    for name in signals:
        if name not in policies:  # a configuration no comparison deploys would have its signal silently unused
            raise unknown_choice("--signal configuration", name, policies)
    ranking = _read_csv(args.ranking, RANKING_COLUMNS)
    offline = offline_from_ranking(ranking, policies, {**selected_signals(ranking, policies), **signals})
    found = predictive(offline, deployed, level=args.level, n_boot=args.n_boot, n_perm=args.n_perm, seed=args.seed)
    if not args.out:
        _print_summary(found, sys.stdout)
        return 0
    identity = {"ranking": args.ranking, "compare": list(args.compare), "signals": signals,
                "against": args.against, "level": args.level, "n_boot": args.n_boot, "n_perm": args.n_perm,
                "seed": args.seed}
    with RunDir(args.out, identity) as run:
        _print_summary(found, sys.stdout)
        write_csv(run.path / "predictive.csv", found.rows)
        write_json(run.path / "predictive.json", {
            "rows": found.rows, "per_budget": [{"budget": b, **asdict(t)} for b, t in found.per_budget.items()],
            "overall": asdict(found.overall), "not_validated": found.not_validated,
            "not_deployed": found.not_deployed})
        run.save_config()
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
