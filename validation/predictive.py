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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import UsageError
from validation.report import fmt
from validation.stats import DEFAULT_N_BOOT, DEFAULT_N_PERM, RankTest, stratified_spearman

OFFLINE_COLUMNS = ("scorer", "rho", "rho_lo", "rho_hi")
DEPLOYED_COLUMNS = ("scorer", "budget", "difference", "ci_lo", "ci_hi", "n_problems")
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
