"""Compare policies' per-problem correctness: paired clustered bootstrap, exact sign test, accuracy tables.

    python -m validation.compare --runs runs/evict runs/dense --out runs/compare
    python -m validation.compare --runs runs/evict runs/evict --policies epikv full --out runs/compare-epikv

Implements the significance protocol of the Random Attention notes (§3.3): paired, problem-clustered percentile
bootstrap (95% CI) plus an exact sign test, and the accuracy-with-CI tables across budgets that EpiKV reports
(§4.3, Appendix 7, with Appendix 12's caution that at n=30 a three-point gap is one problem).

Inputs: each --runs entry is a `tasks.run` / `evictor.run` output directory (every ``generations.jsonl`` below it is
read: one file, or one per cell of a sweep) or a single trace JSONL file. Records are `core.schemas.Trace` records;
a graded one (``correct`` true/false) counts for its (policy, budget) cell; a trace without a policy is a dense
generation, policy ``full``. Several samples of one problem (distinct ``sample`` values) are averaged into
per-problem correctness and resampling stays at the problem level.

Equal cache: a comparison is only fair at equal cache, so every cell pair must have held the same peak cache slots
per KV head (``eviction.peak_slots`` of each trace) on every paired problem where both traces evicted; otherwise the
comparison is refused with one line naming both peaks, unless --allow-unequal-cache is given (and recorded). A dense
run (``full``) is the unlimited-cache reference and is exempt. Each row states ``peak_slots_a`` / ``peak_slots_b``
(the most slots either cell held on the paired problems where it evicted) and ``equal_cache`` (true, false, or null
when no paired problem evicted under both, or the records state no peak).

Pairing: problems are paired by id. Each policy of a run holding several (a sweep) is compared with the other run's
policy; when both hold several, --policies picks one of each (``all`` keeps every policy of that side, ``full`` is
the dense generation). Within a policy pair, budgets pair as: a side with one budget (a dense run) against every
budget of the other, else the budgets both have.

The library entry point is `compare(CompareConfig(...))`. Outputs under --out: comparison.csv / comparison.json (one
row per cell pair: policies and budgets, accuracies on the paired problems, difference A - B with ``ci_lo``/``ci_hi``,
bootstrap and sign-test p-values, discordant counts, peak cache slots), accuracy.csv (each cell's accuracy over all
of its problems with ``ci_lo``/``ci_hi``), config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.cli import ArgumentParser, main_guard, non_negative_int, positive_int
from core.errors import UsageError, unknown_choice
from core.rundir import RunDir
from core.schemas import Trace, iter_records
from validation.paired import accuracy_interval, compare_paired
from validation.report import fmt, write_csv, write_json

CI_METHODS = ("auto", "wilson", "bootstrap")
TRACE_FILE = "generations.jsonl"
EVERY_POLICY = "all"
DENSE = "full"


@dataclass
class Run:
    """The graded traces of one run: (policy, budget) cell -> problem id -> correctness of each sample, and the peak
    cache slots per KV head of the problem's traces that evicted (None: none did, or none states its peak)."""

    source: str
    cells: dict[tuple[str, Any], dict[str, list[float]]]
    peaks: dict[tuple[str, Any], dict[str, int | None]] = field(default_factory=dict)

    @property
    def policies(self) -> list[str]:
        return sorted({policy for policy, _ in self.cells})

    def budgets(self, policy: str) -> list[Any]:
        return sorted((budget for p, budget in self.cells if p == policy), key=_budget_key)


@dataclass(frozen=True)
class CompareConfig:
    """Everything `compare` needs; the CLI flags of the same names document each field."""

    runs: tuple[str, str]
    policies: tuple[str, str] = (EVERY_POLICY, EVERY_POLICY)
    n_boot: int = 10_000
    level: float = 0.95
    seed: int = 0
    ci: str = "auto"
    allow_unequal_cache: bool = False

    def check(self) -> None:
        if self.ci not in CI_METHODS:
            raise unknown_choice("accuracy interval method", self.ci, CI_METHODS)
        if not 0.0 < self.level < 1.0:
            raise UsageError(f"--level must be in (0, 1), got {self.level}")

    def identity(self) -> dict[str, Any]:
        return {**asdict(self), "runs": [str(Path(run).resolve()) for run in self.runs]}


@dataclass
class Comparison:
    runs: tuple[Run, Run]
    comparisons: list[dict]  # one per cell pair
    accuracy: list[dict]  # one per cell of each run


def _trace_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob(TRACE_FILE))
        if files:
            return files
        raise UsageError(f"run directory {path} holds no {TRACE_FILE} (a tasks.run or evictor.run output)")
    raise UsageError(f"run {path} does not exist")


def _correct(value: Any, where: str) -> float:
    if isinstance(value, bool) or value in (0, 1):
        return float(value)
    raise UsageError(f"{where}: 'correct' must be true/false (or 0/1), got {value!r}")


def _scalar(value: Any) -> Any:
    """A hashable stand-in for a JSON value used as a key (budgets are numbers or strings such as "0.5x")."""
    return value if value is None or isinstance(value, (str, int, float)) else json.dumps(value, sort_keys=True)


def read_run(path: str | os.PathLike, policy: str | None = None) -> Run:
    """The graded traces of a run; `policy` (or None / "all": every policy) selects one policy's cells."""
    path = Path(path)
    records = []
    for file in _trace_files(path):
        for number, trace in enumerate(iter_records(file, Trace), start=1):
            if trace.correct is not None:
                records.append((f"{file}: record {number}", trace))
    if not records:
        raise UsageError(f"{path}: no graded trace (a record with 'correct' true or false)")
    policies = sorted({trace.policy or DENSE for _, trace in records})
    if policy is not None and policy != EVERY_POLICY:
        if policy not in policies:
            raise unknown_choice(f"policy in {path}", policy, policies)
        records = [(where, trace) for where, trace in records if (trace.policy or DENSE) == policy]
    cells: dict[tuple[str, Any], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    peaks: dict[tuple[str, Any], dict[str, int | None]] = defaultdict(dict)
    seen: set[tuple] = set()
    for where, trace in records:
        cell = (trace.policy or DENSE, _scalar(trace.budget))
        key = (*cell, trace.id, _scalar(trace.extra.get("sample")))
        if key in seen:
            raise UsageError(f"{where}: duplicate record for problem {trace.id!r} of {cell[0]} at budget {cell[1]!r}"
                             + (f" sample {key[3]!r}" if key[3] is not None else " without a distinct 'sample'"))
        seen.add(key)
        cells[cell][trace.id].append(_correct(trace.correct, where))
        peak = (trace.eviction or {}).get("peak_slots") if trace.evicted else None
        known = peaks[cell].get(trace.id)
        peaks[cell][trace.id] = peak if known is None else known if peak is None else max(known, peak)
    return Run(str(path), {cell: dict(problems) for cell, problems in cells.items()},
               {cell: dict(problems) for cell, problems in peaks.items()})


def _budget_key(budget: Any) -> tuple:
    # None (no budget) first, then numbers in order, then anything else by its text.
    if budget is None:
        return (0, 0.0, "")
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return (1, float(budget), "")
    return (2, 0.0, str(budget))


def budget_pairs(budgets_a: list[Any], budgets_b: list[Any]) -> list[tuple[Any, Any]]:
    """Which budget of A is compared with which budget of B (see the module docstring)."""
    if len(budgets_a) == 1:
        return [(budgets_a[0], bb) for bb in budgets_b]
    if len(budgets_b) == 1:
        return [(ba, budgets_b[0]) for ba in budgets_a]
    return [(x, x) for x in budgets_a if x in budgets_b]


def cell_pairs(a: Run, b: Run) -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    """The (policy, budget) cells of A and B that are compared (see the module docstring)."""
    if len(a.policies) > 1 and len(b.policies) > 1:
        raise UsageError(f"both runs hold several policies (A: {', '.join(a.policies)}; B: {', '.join(b.policies)}); "
                         f"choose one of each with --policies PA PB ('{EVERY_POLICY}' keeps every policy of one side)")
    pairs = []
    for policy_a in a.policies:
        for policy_b in b.policies:
            budgets = budget_pairs(a.budgets(policy_a), b.budgets(policy_b))
            if not budgets:
                raise UsageError(f"{policy_a} in A and {policy_b} in B share no budget (A: {a.budgets(policy_a)}; "
                                 f"B: {b.budgets(policy_b)})")
            pairs += [((policy_a, budget_a), (policy_b, budget_b)) for budget_a, budget_b in budgets]
    return pairs


def _means(problems: dict[str, list[float]], ids: list[str]) -> np.ndarray:
    return np.array([np.mean(problems[i]) for i in ids])


def _describe(side: str, cell: tuple[str, Any]) -> str:
    return f"{side} {cell[0]} at budget {cell[1]!r}"


def cache_check(a: Run, b: Run, cell_a, cell_b, ids: list[str], allow_unequal: bool) -> dict[str, Any]:
    """The peak cache columns of a comparison row; unequal peaks on a paired problem where both cells evicted are a
    `UsageError` naming both peaks, unless `allow_unequal` (a dense `full` cell is exempt: the unlimited reference)."""
    pa, pb = a.peaks.get(cell_a, {}), b.peaks.get(cell_b, {})
    peak_a = max((p for p in map(pa.get, ids) if p is not None), default=None)
    peak_b = max((p for p in map(pb.get, ids) if p is not None), default=None)
    both = [i for i in ids if pa.get(i) is not None and pb.get(i) is not None]
    unequal = [i for i in both if pa[i] != pb[i]]
    equal = None if not both else not unequal
    dense = DENSE in (cell_a[0], cell_b[0])
    if unequal and not dense and not allow_unequal:
        first = unequal[0]
        raise UsageError(f"{_describe('A', cell_a)} and {_describe('B', cell_b)} held unequal peak cache: {peak_a} "
                         f"vs {peak_b} slots per KV head (problem {first!r}: {pa[first]} vs {pb[first]}); compare "
                         "cells of equal peak cache (budgets matched per protocol), or pass --allow-unequal-cache")
    return {"peak_slots_a": peak_a, "peak_slots_b": peak_b, "equal_cache": None if dense else equal}


def compare_runs(a: Run, b: Run, n_boot: int, level: float, seed: int, allow_unequal_cache: bool = False) -> list[dict]:
    """Every cell pair's comparison (`cell_pairs`), after the equal-cache check (`cache_check`) of each."""
    pairs = []
    for cell_a, cell_b in cell_pairs(a, b):
        pa, pb = a.cells[cell_a], b.cells[cell_b]
        ids = sorted(set(pa) & set(pb))
        if not ids:
            raise UsageError(f"no problem id appears in both runs for {cell_a[0]} at budget {cell_a[1]!r} / "
                             f"{cell_b[0]} at budget {cell_b[1]!r}")
        pairs.append((cell_a, cell_b, ids, cache_check(a, b, cell_a, cell_b, ids, allow_unequal_cache)))
    rows = []
    for cell_a, cell_b, ids, cache in pairs:  # every pair is checked before any bootstrap runs
        pa, pb = a.cells[cell_a], b.cells[cell_b]
        row = {"policy_a": cell_a[0], "budget_a": cell_a[1], "policy_b": cell_b[0], "budget_b": cell_b[1]}
        row.update(compare_paired(_means(pa, ids), _means(pb, ids), n_boot=n_boot, level=level, seed=seed))
        row["only_in_a"] = len(set(pa) - set(pb))
        row["only_in_b"] = len(set(pb) - set(pa))
        row.update(cache)
        rows.append(row)
    return rows


def accuracy_table(run: Run, name: str, method: str, level: float, n_boot: int, seed: int) -> list[dict]:
    """Accuracy of each cell over all of its problems, with a Wilson or clustered-bootstrap interval.

    Columns follow the cell schema (`core.schemas.Cell`): policy, budget, problems, accuracy, ci_lo, ci_hi; plus the
    run's name and source, the graded samples behind the accuracy, and the interval's method and level.
    """
    rows = []
    for policy, budget in sorted(run.cells, key=lambda cell: (cell[0], _budget_key(cell[1]))):
        problems = run.cells[(policy, budget)]
        ids = sorted(problems)
        per_problem = _means(problems, ids)
        samples = np.array([len(problems[i]) for i in ids])
        lo, hi, used = accuracy_interval(per_problem, samples, method, level, n_boot, seed)
        rows.append({"run": name, "source": run.source, "policy": policy, "budget": budget, "problems": len(ids),
                     "samples": int(samples.sum()), "accuracy": float(per_problem.mean()), "ci_lo": lo, "ci_hi": hi,
                     "ci_method": used, "level": level})
    return rows


def compare(config: CompareConfig) -> Comparison:
    """Read both runs, pair their cells and compute every comparison and accuracy row."""
    config.check()
    run_a, run_b = (read_run(path, policy) for path, policy in zip(config.runs, config.policies))
    comparisons = compare_runs(run_a, run_b, config.n_boot, config.level, config.seed, config.allow_unequal_cache)
    accuracy = [row for name, run in (("A", run_a), ("B", run_b))
                for row in accuracy_table(run, name, config.ci, config.level, config.n_boot, config.seed)]
    return Comparison((run_a, run_b), comparisons, accuracy)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m validation.compare",
        description="Paired comparison of two runs' per-problem correctness: clustered bootstrap CI and p-value, "
        "exact sign test, accuracy with CIs per policy and budget (Random Attention notes §3.3).",
    )
    parser.add_argument("--runs", nargs=2, required=True, metavar=("A", "B"),
                        help="two run directories (every generations.jsonl below each is read: a tasks.run output, "
                        "an evictor.run cell or a whole sweep) or trace JSONL files; difference is A - B")
    parser.add_argument("--policies", nargs=2, metavar=("PA", "PB"), default=[EVERY_POLICY, EVERY_POLICY],
                        help=f"policy to take from each run: a policy name, '{DENSE}' for the dense generation, or "
                        f"'{EVERY_POLICY}' (default) to compare each of the run's policies; needed when both runs "
                        "hold several policies")
    parser.add_argument("--out", help="output directory; without it the summary is printed and nothing is written")
    parser.add_argument("--n-boot", type=positive_int, default=10_000,
                        help="bootstrap replicates (default 10000)")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level (default 0.95)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="bootstrap random seed (default 0)")
    parser.add_argument("--ci", default="auto",
                        help="accuracy interval: wilson, bootstrap (problem-clustered), or auto (Wilson when every "
                        "problem has one sample, else bootstrap; default)")
    parser.add_argument("--allow-unequal-cache", action="store_true",
                        help="compare cells that held different peak cache slots per KV head (different protocols "
                        "at the same K, say); refused by default, since more cache is not a better policy; recorded "
                        "in the output")
    return parser


def _print_summary(result: Comparison, out) -> None:
    for r in result.accuracy:
        print(f"{r['run']} {r['policy']} budget {r['budget']}: acc {fmt(r['accuracy'], sign=False)} "
              f"[{fmt(r['ci_lo'], sign=False)}, {fmt(r['ci_hi'], sign=False)}] n={r['problems']} "
              f"({r['ci_method']})", file=out)
    for r in result.comparisons:
        print(f"A {r['policy_a']}@{r['budget_a']} - B {r['policy_b']}@{r['budget_b']}: "
              f"{fmt(r['accuracy_a'], sign=False)} vs {fmt(r['accuracy_b'], sign=False)}, diff {fmt(r['difference'])} "
              f"[{fmt(r['ci_lo'])}, {fmt(r['ci_hi'])}] bootstrap p={r['bootstrap_p']:.4g}, sign-test "
              f"p={r['sign_p_value']:.4g} (discordant {r['sign_n_discordant']}: A {r['sign_a_better']} / "
              f"B {r['sign_b_better']}), n={r['n_problems']}, peak cache {r['peak_slots_a']} vs {r['peak_slots_b']} "
              "slots per KV head" + ("" if r["equal_cache"] is not False else " (UNEQUAL: --allow-unequal-cache)"),
              file=out)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = CompareConfig(runs=tuple(args.runs), policies=tuple(args.policies), n_boot=args.n_boot,
                           level=args.level, seed=args.seed, ci=args.ci, allow_unequal_cache=args.allow_unequal_cache)
    config.check()
    if not args.out:
        _print_summary(compare(config), sys.stdout)
        return 0
    with RunDir(args.out, config.identity()) as run:
        result = compare(config)
        _print_summary(result, sys.stdout)
        write_csv(run.path / "comparison.csv", result.comparisons)
        write_csv(run.path / "accuracy.csv", result.accuracy)
        write_json(run.path / "comparison.json", {"comparisons": result.comparisons, "accuracy": result.accuracy})
        run.save_config(policies_a=result.runs[0].policies, policies_b=result.runs[1].policies)
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
