"""Label kinds side by side: where each finds the windows an answer needs, and how far they agree.

    python -m validation.label_kinds --labels token=runs/l-token/labels.jsonl cache=runs/l-cache/labels.jsonl \\
        joint=runs/l-joint/labels.jsonl --out runs/label-kinds

For label sets of the same traces (each from ``python -m labeling.occlusion``, any ``--intervention``), it writes

- ``places.csv``: per kind and place in the reasoning span (fifths by window start, the window ending at the answer
  boundary on its own; `labeling.breakdown.effect_breakdown`), the windows, the important ones, their share of all
  important windows and the mean graded effect: is there ground truth before the last fifth?
- ``agreement.csv``: per pair of kinds, Cohen's kappa over the reasoning positions both label
  (`labeling.agreement.label_agreement`) and, where both tested the same windows (token and cache-level), over
  those windows;
- ``kinds.md``: both tables, and per kind what it measures; ``config.json``: the files read.

With ``--study DIR`` (a study whose signals stage replayed its scorers and whose compare stage deployed them against
random), it also measures each kind's validity as an offline measure (issue: does the offline statistic predict
deployment?):

- ``scorers.csv``: per kind and scorer, the Fisher-z mean over traces of the within-trace Spearman rho between the
  scorer's replayed score and the kind's graded importance (minus the mean effect of the windows covering a
  position, `validation.validity.graded_importance`), with its t-interval over traces; and, as the null model,
  the scorer's rho with position (``position`` rows);
- ``validity.csv``: per measure, Spearman's rho across scorer x budget points between that mean rho and the deployed
  accuracy minus random's at the budget (the compare stage's paired differences), with its exact permutation p
  (scorers permuted; `validation.validity.across_scorers`). The study keeps no per-problem eviction records, so
  there is no bootstrap over problems or within-problem analysis here.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from core.cli import ArgumentParser, main_guard
from core.errors import UsageError
from core.paths import portable_path
from core.rundir import RunDir
from core.schemas import Label, read_records
from labeling.agreement import pairwise_agreement
from labeling.breakdown import effect_breakdown
from labeling.labeler import INTERVENTIONS


def kind_of(labels: list[Label]) -> str:
    """The intervention a label set was made with (records made before there were others are token occlusion)."""
    kinds = {label.intervention or "token" for label in labels}
    if len(kinds) != 1:
        raise UsageError(f"a label file mixes kinds {sorted(kinds)}; give one file per kind")
    return kinds.pop()


def places_rows(sets: dict[str, list[Label]]) -> list[dict[str, Any]]:
    return [{"kind": name, **row} for name, labels in sets.items() for row in effect_breakdown(labels)]


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown(places: list[dict[str, Any]], agreement: list[dict[str, Any]], files: dict[str, str]) -> str:
    from labeling.breakdown import PLACES

    kinds = list(dict.fromkeys(row["kind"] for row in places))
    header = ["where", *[f"{k} {c}" for k in kinds for c in ("important", "share", "mean effect")]]
    lines = ["# Label kinds side by side", "",
             "Per label kind: the important windows in each fifth of the reasoning span (by start; the window ending "
             "at the answer boundary on its own), their share of all important windows, and the mean graded effect "
             "(the change of the reference answer's log-probability when the window, or a joint label's unit with "
             "the rest of the cache evicted at its budget, is taken away: negative where the answer needs it). "
             "Files: " + ", ".join(f"{k}: `{f}`" for k, f in files.items()) + ".", "",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for place in (*PLACES, "all"):
        cells = [place]
        for kind in kinds:
            row = next(r for r in places if r["kind"] == kind and r["where"] == place)
            share = "–" if row["share"] is None else f"{100 * row['share']:.0f}%"
            cells += [f"{row['important']} / {row['windows']}", share, _fmt(row["mean_effect"])]
        lines.append("| " + " | ".join(cells) + " |")
    if agreement:
        lines += ["", "Agreement between kinds: Cohen's kappa over the reasoning positions both label, and over the "
                  "windows both tested (token and cache-level labels share their windows).", "",
                  "| A | B | traces | positions | kappa | important A | important B | windows | window kappa |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += ["| " + " | ".join(_fmt(row[k]) for k in ("a", "b", "traces", "positions", "kappa", "important_a",
                                                          "important_b", "windows", "window_kappa")) + " |"
                  for row in agreement]
    return "\n".join(lines) + "\n"


POSITION = "position"


def replayed_scores(path: Path) -> dict[str, dict[str, Any]]:
    """Per trace id: its reasoning span and each replayed scorer's aggregated score per position (a signals
    stage's ``replay.jsonl.gz``, or the same file unpacked)."""
    opener = gzip.open if path.suffix == ".gz" else open
    found: dict[str, dict[str, Any]] = {}
    with opener(path, "rt") as handle:
        for line in handle:
            if not line.strip():
                continue
            record = json.loads(line)
            scores = {name: dict(zip(record["positions"], values["agg"], strict=True))
                      for name, values in record["signals"].items() if "agg" in values}
            found[record["id"]] = {"reasoning": range(record["reasoning_start"], record["answer_start"]),
                                   "scores": scores}
    return found


def scorer_rhos(sets: dict[str, list[Label]], replay: dict[str, dict[str, Any]]) -> dict[tuple[str, str], list[float]]:
    """Per (kind, scorer): the within-trace Spearman rho of the scorer's score with the kind's graded importance on
    every labelled trace the replay holds; per (``position``, scorer): the scorer's rho with position on the traces
    of the first kind."""
    from validation.validity import graded_importance, spearman

    rhos: dict[tuple[str, str], list[float]] = {}
    first = next(iter(sets))
    for kind, labels in sets.items():
        for label in labels:
            trace = replay.get(label.id)
            if label.status != "labelled" or trace is None or not label.windows:
                continue
            importance = graded_importance(label.windows, trace["reasoning"])
            for scorer, scores in trace["scores"].items():
                kept = [p for p in importance if scores.get(p) is not None]
                rho = spearman(np.array([scores[p] for p in kept]), np.array([importance[p] for p in kept]))
                if np.isfinite(rho):
                    rhos.setdefault((kind, scorer), []).append(rho)
                if kind == first:
                    span = [p for p in trace["reasoning"] if scores.get(p) is not None]
                    rho = spearman(np.array([scores[p] for p in span]), np.array(span, dtype=float))
                    if np.isfinite(rho):
                        rhos.setdefault((POSITION, scorer), []).append(rho)
    return rhos


def scorer_rows(rhos: dict[tuple[str, str], list[float]], level: float = 0.95) -> list[dict[str, Any]]:
    """Per (kind, scorer): the traces, the Fisher-z mean rho and its t-interval over traces."""
    from scipy import stats

    rows = []
    for (kind, scorer), values in sorted(rhos.items(), key=lambda item: item[0][0] == POSITION):  # the null last
        z = np.arctanh(np.clip(values, -0.9999, 0.9999))
        mean = float(np.mean(z))
        half = (float(stats.t.ppf((1 + level) / 2, len(z) - 1) * np.std(z, ddof=1) / math.sqrt(len(z)))
                if len(z) > 1 else float("nan"))
        rows.append({"measure": kind, "scorer": scorer, "traces": len(values), "rho": math.tanh(mean),
                     "rho_lo": math.tanh(mean - half), "rho_hi": math.tanh(mean + half)})
    return rows


def deployed_differences(study: Path) -> dict[tuple[str, float], float]:
    """(scorer, budget) -> deployed accuracy minus random's at the same budget, from a study's compare.csv."""
    path = study / "compare.csv"
    if not path.is_file():
        raise UsageError(f"--study {str(study)!r} has no compare.csv: run the study's compare stage first")
    with path.open() as handle:
        return {(row["policy_a"], float(row["budget_a"])): float(row["difference"]) for row in csv.DictReader(handle)
                if row["policy_b"] == "random" and row["budget_a"] == row["budget_b"] and row["difference"]}


def validity_rows(scorers: list[dict[str, Any]], deployed: dict[tuple[str, float], float]) -> list[dict[str, Any]]:
    """Per measure: Spearman across the scorer x budget points both have, with its exact permutation p."""
    from validation.validity import across_scorers

    budgets = sorted({budget for _, budget in deployed})
    rows = []
    for measure in dict.fromkeys(row["measure"] for row in scorers):
        mean = {row["scorer"]: row["rho"] for row in scorers if row["measure"] == measure}
        names = sorted(name for name in mean if all((name, b) in deployed for b in budgets))
        x = np.array([[mean[name]] * len(budgets) for name in names])
        y = np.array([[deployed[(name, b)] for b in budgets] for name in names])
        rho, p = across_scorers(x, y) if len(names) >= 3 else (float("nan"), float("nan"))
        rows.append({"measure": measure, "rho": rho, "p": p, "points": x.size, "scorers": " ".join(names),
                     "budgets": " ".join(f"{b:g}" for b in budgets)})
    return rows


def validity_markdown(scorers: list[dict[str, Any]], validity: list[dict[str, Any]], study: str) -> str:
    kinds = list(dict.fromkeys(row["measure"] for row in scorers))
    names = sorted({row["scorer"] for row in scorers})
    lines = ["", "## Which label kind predicts deployment", "",
             f"Study `{study}`. Per scorer, the mean within-trace Spearman rho of its replayed score with each kind's "
             "graded importance (Fisher-z mean over traces, 95% t-interval), and with position (the null model); then, "
             "per measure, Spearman's rho across scorer x budget between that mean and the deployed accuracy minus "
             "random's, with its exact permutation p (scorers permuted).", "",
             "| scorer | " + " | ".join(kinds) + " |", "| --- |" + " --- |" * len(kinds)]
    for name in names:
        cells = []
        for kind in kinds:
            row = next((r for r in scorers if r["measure"] == kind and r["scorer"] == name), None)
            cells.append("–" if row is None else f"{row['rho']:+.3f} [{row['rho_lo']:+.2f}, {row['rho_hi']:+.2f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| measure | rho with deployed − random | permutation p | points |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['measure']} | {_fmt(r['rho'])} | {_fmt(r['p'])} | {r['points']} |" for r in validity]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m validation.label_kinds",
                            description="Label kinds of the same traces side by side: where each finds the windows "
                            "the answer needs (fifths of the reasoning span) and how far they agree.")
    parser.add_argument("--labels", nargs="+", required=True, metavar="KIND=FILE",
                        help=f"label files, each named by its kind ({', '.join(INTERVENTIONS)} or any name); the "
                        "first is the reference of the agreement table")
    parser.add_argument("--study", default=None,
                        help="a study directory whose signals stage replayed its scorers (stages/signals-*/"
                        "replay.jsonl.gz) and whose compare.csv compares them with random: adds scorers.csv and "
                        "validity.csv, each kind's validity as an offline measure of deployment")
    parser.add_argument("--out", required=True, help="output directory: kinds.md, places.csv, agreement.csv")
    return parser


def _run(argv: list[str] | None) -> int:
    from validation.report import write_csv

    args = build_parser().parse_args(argv)
    files: dict[str, str] = {}
    for item in args.labels:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            raise UsageError(f"--labels {item!r}: write KIND=FILE, e.g. token=runs/labels/labels.jsonl")
        if name in files:
            raise UsageError(f"--labels names {name!r} twice; give each kind once")
        files[name] = file
    sets = {name: read_records(file, Label) for name, file in files.items()}
    for labels in sets.values():
        kind_of(labels)
    replay_files = sorted(Path(args.study).glob("stages/signals-*/replay.jsonl*")) if args.study else []
    if args.study is not None:
        if not Path(args.study).is_dir():
            raise UsageError(f"--study {args.study!r} is not a directory")
        if len(replay_files) != 1:
            raise UsageError(f"--study {args.study!r} holds {len(replay_files)} replayed score files "
                             "(stages/signals-*/replay.jsonl.gz); give a study with one signals stage")
        deployed = deployed_differences(Path(args.study))
    places, agreement = places_rows(sets), pairwise_agreement(sets)
    text = markdown(places, agreement, files)
    if args.study is not None:
        scorers = scorer_rows(scorer_rhos(sets, replayed_scores(replay_files[0])))
        validity = validity_rows(scorers, deployed)
        text += validity_markdown(scorers, validity, args.study)
    # spelled from the checkout (core.paths), so a committed output names no machine's directories
    identity = {"labels": {name: portable_path(str(Path(file).resolve())) for name, file in files.items()},
                "study": None if args.study is None else portable_path(str(Path(args.study).resolve()))}
    with RunDir(args.out, identity) as run:
        out = run.path
        write_csv(out / "places.csv", places)
        write_csv(out / "agreement.csv", agreement)
        if args.study is not None:
            write_csv(out / "scorers.csv", scorers)
            write_csv(out / "validity.csv", validity)
        (out / "kinds.md").write_text(text)
        run.save_config(labels=files, study=args.study)
    print(f"written to {out / 'kinds.md'}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
