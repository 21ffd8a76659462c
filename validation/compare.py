"""Compare two policies' per-problem correctness: paired clustered bootstrap, exact sign test, accuracy tables.

    python -m validation.compare --runs runs/epikv runs/h2o --out runs/compare

Implements the significance protocol of the Random Attention notes (§3.3): paired, problem-clustered percentile
bootstrap (95% CI) plus an exact sign test, and the accuracy-with-CI tables across budgets that EpiKV reports
(§4.3, Appendix 7, with Appendix 12's caution that at n=30 a three-point gap is one problem).

Inputs: each --runs entry is an `evictor.run` / `tasks.run` output directory (every *.jsonl under it is read) or a
single JSONL file. A record counts when it has "id" (the problem) and "correct" (bool, or 0/1); optional "policy",
"budget" and "sample" (several samples per problem are averaged into per-problem correctness, and resampling stays
at the problem level). Two records with the same (policy, budget, id) need distinct "sample" values.

Pairing: problems are paired by id within a budget. When both runs have several budgets they are compared budget
by budget (budgets present in both); a run with a single budget (e.g. a no-eviction baseline, run once) is compared
against every budget of the other run.

Outputs under --out: comparison.csv / comparison.json (one row per budget pair: accuracies on the paired problems,
difference A - B, bootstrap CI and p-value, sign-test p, discordant counts), accuracy.csv (each run's accuracy and CI
per budget, on all of its problems), config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.cli import main_guard, non_negative_int, positive_int, save_config
from core.errors import UsageError, unknown_choice
from core.records import read_jsonl
from validation.paired import accuracy_interval, compare_paired
from validation.report import fmt, write_csv, write_json

CI_METHODS = ("auto", "wilson", "bootstrap")


@dataclass
class Run:
    """One policy's results: budget -> problem id -> correctness of each sample."""

    source: str
    policy: str | None
    by_budget: dict[Any, dict[str, list[float]]]


def _run_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
        if files:
            return files
        raise UsageError(f"run directory {path} holds no .jsonl files")
    raise UsageError(f"run not found: {path}")


def _correct(value: Any, where: str) -> float:
    if isinstance(value, bool) or value in (0, 1):
        return float(value)
    raise UsageError(f"{where}: 'correct' must be true/false (or 0/1), got {value!r}")


def _scalar(value: Any) -> Any:
    """A hashable stand-in for a JSON value used as a key (budgets are numbers or strings such as "0.5x")."""
    return value if value is None or isinstance(value, (str, int, float)) else json.dumps(value, sort_keys=True)


def read_run(path: str | os.PathLike, policy: str | None = None) -> Run:
    """Read a run; `policy` selects one policy when the run holds several (required then)."""
    path = Path(path)
    records = []
    for file in _run_files(path):
        for number, rec in enumerate(read_jsonl(file), start=1):
            if "id" in rec and "correct" in rec:
                records.append((f"{file}: record {number}", rec))
    if not records:
        raise UsageError(f"{path}: no records with both 'id' and 'correct'")
    policies = sorted({str(r.get("policy")) for _, r in records if r.get("policy") is not None})
    if policy is not None:
        if policy not in policies:
            raise unknown_choice(f"policy in {path}", policy, policies)
        records = [(w, r) for w, r in records if r.get("policy") == policy]
    elif len(policies) > 1:
        raise UsageError(f"{path} holds several policies ({', '.join(policies)}); choose with --policies A B")
    by_budget: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    seen: set[tuple] = set()
    for where, rec in records:
        key = (_scalar(rec.get("budget")), str(rec["id"]), _scalar(rec.get("sample")))
        if key in seen:
            raise UsageError(f"{where}: duplicate record for problem {key[1]!r} at budget {key[0]!r}"
                             + (f" sample {key[2]!r}" if key[2] is not None else " without a distinct 'sample'"))
        seen.add(key)
        by_budget[key[0]][key[1]].append(_correct(rec["correct"], where))
    chosen = policy if policy is not None else (policies[0] if policies else None)
    return Run(str(path), chosen, {b: dict(p) for b, p in by_budget.items()})


def _budget_key(budget: Any) -> tuple:
    # None (no budget) first, then numbers in order, then anything else by its text.
    if budget is None:
        return (0, 0.0, "")
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return (1, float(budget), "")
    return (2, 0.0, str(budget))


def budget_pairs(a: Run, b: Run) -> list[tuple[Any, Any]]:
    """Which budget of A is compared with which budget of B (see the module docstring)."""
    budgets_a = sorted(a.by_budget, key=_budget_key)
    budgets_b = sorted(b.by_budget, key=_budget_key)
    if len(budgets_a) == 1:
        return [(budgets_a[0], bb) for bb in budgets_b]
    if len(budgets_b) == 1:
        return [(ba, budgets_b[0]) for ba in budgets_a]
    common = [x for x in budgets_a if x in b.by_budget]
    if not common:
        raise UsageError(f"the runs share no budget (A: {budgets_a}; B: {budgets_b})")
    return [(x, x) for x in common]


def _means(problems: dict[str, list[float]], ids: list[str]) -> np.ndarray:
    return np.array([np.mean(problems[i]) for i in ids])


def compare_runs(a: Run, b: Run, n_boot: int, level: float, seed: int) -> list[dict]:
    rows = []
    for budget_a, budget_b in budget_pairs(a, b):
        pa, pb = a.by_budget[budget_a], b.by_budget[budget_b]
        ids = sorted(set(pa) & set(pb))
        if not ids:
            raise UsageError(f"no problem id appears in both runs at budgets {budget_a!r} / {budget_b!r}")
        row = {"budget_a": budget_a, "budget_b": budget_b, "policy_a": a.policy, "policy_b": b.policy}
        row.update(compare_paired(_means(pa, ids), _means(pb, ids), n_boot=n_boot, level=level, seed=seed))
        row["only_in_a"] = len(set(pa) - set(pb))
        row["only_in_b"] = len(set(pb) - set(pa))
        rows.append(row)
    return rows


def accuracy_table(run: Run, name: str, method: str, level: float, n_boot: int, seed: int) -> list[dict]:
    """Accuracy per budget over all of the run's problems, with a Wilson or clustered-bootstrap interval."""
    rows = []
    for budget in sorted(run.by_budget, key=_budget_key):
        problems = run.by_budget[budget]
        ids = sorted(problems)
        per_problem = _means(problems, ids)
        samples = np.array([len(problems[i]) for i in ids])
        lo, hi, used = accuracy_interval(per_problem, samples, method, level, n_boot, seed)
        rows.append({"run": name, "source": run.source, "policy": run.policy, "budget": budget,
                     "n_problems": len(ids), "n_records": int(samples.sum()), "accuracy": float(per_problem.mean()),
                     "ci_lo": lo, "ci_hi": hi, "ci_method": used, "level": level})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m validation.compare",
        description="Paired comparison of two runs' per-problem correctness: clustered bootstrap CI and p-value, "
        "exact sign test, accuracy with CIs per budget (Random Attention notes §3.3).",
    )
    parser.add_argument("--runs", nargs=2, required=True, metavar=("A", "B"),
                        help="two run directories (every *.jsonl inside is read) or JSONL files; difference is A - B")
    parser.add_argument("--policies", nargs=2, metavar=("PA", "PB"),
                        help="policy to take from each run, needed when a run holds several policies")
    parser.add_argument("--out", help="output directory; without it the summary is printed and nothing is written")
    parser.add_argument("--n-boot", type=positive_int, default=10_000,
                        help="bootstrap replicates (default 10000)")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level (default 0.95)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="bootstrap random seed (default 0)")
    parser.add_argument("--ci", default="auto",
                        help="accuracy interval: wilson, bootstrap (problem-clustered), or auto (Wilson when every "
                        "problem has one sample, else bootstrap; default)")
    return parser


def _print_summary(comparisons: list[dict], accuracy: list[dict], out) -> None:
    for r in accuracy:
        print(f"{r['run']} ({r['policy']}) budget {r['budget']}: acc {fmt(r['accuracy'], sign=False)} "
              f"[{fmt(r['ci_lo'], sign=False)}, {fmt(r['ci_hi'], sign=False)}] n={r['n_problems']} "
              f"({r['ci_method']})", file=out)
    for r in comparisons:
        print(f"A@{r['budget_a']} - B@{r['budget_b']}: {fmt(r['accuracy_a'], sign=False)} vs "
              f"{fmt(r['accuracy_b'], sign=False)}, diff {fmt(r['difference'])} [{fmt(r['ci_lo'])}, "
              f"{fmt(r['ci_hi'])}] bootstrap p={r['bootstrap_p']:.4g}, sign-test p={r['sign_p_value']:.4g} "
              f"(discordant {r['sign_n_discordant']}: A {r['sign_a_better']} / B {r['sign_b_better']}), "
              f"n={r['n_problems']}", file=out)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ci not in CI_METHODS:
        raise unknown_choice("accuracy interval method", args.ci, CI_METHODS)
    if not 0.0 < args.level < 1.0:
        raise UsageError(f"--level must be in (0, 1), got {args.level}")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    policies = args.policies or (None, None)
    run_a, run_b = (read_run(path, policy) for path, policy in zip(args.runs, policies))
    comparisons = compare_runs(run_a, run_b, args.n_boot, args.level, args.seed)
    accuracy = [row for name, run in (("A", run_a), ("B", run_b))
                for row in accuracy_table(run, name, args.ci, args.level, args.n_boot, args.seed)]
    _print_summary(comparisons, accuracy, sys.stdout)
    if not args.out:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "comparison.csv", comparisons)
    write_csv(out / "accuracy.csv", accuracy)
    write_json(out / "comparison.json", {"comparisons": comparisons, "accuracy": accuracy})
    save_config(out, {**vars(args), "policy_a": run_a.policy, "policy_b": run_b.policy})
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
