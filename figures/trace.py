"""The trace viewer: one trace's tokens coloured by a chosen per-token quantity, with what a policy kept.

    python -m figures.trace --study runs/demo                   # writes runs/demo/trace-viewer.html
    python -m figures.trace --study runs/demo --trace ID --out one.html

One self-contained HTML page per study (data, style and script inline; it fetches nothing), opened in any browser or
shown inline in a notebook. A selector picks the trace and what colours its tokens:

- each label set's per-token fields (`figures.viewer.layers.LABEL_KINDS`: the occlusion labels' flips and window
  outcomes, graded effects where the records carry them, the other fillers of the agreement stage);
- each replayed scorer's score at each layer and its aggregate, as a value or as the token's rank in the trace
  (1 = kept first), and the per-layer signals;
- on a known-answer task, each reasoning token's class: planted, key, decoy, filler.

A second selector picks a policy and budget of the evictor's runs: the page says what that run answered and where
its tokens left the dense trace's, and, when the sweep stored keep-logs (``evictor.run --keep-log``), draws under each
token which KV heads of the chosen layer still held it at the end of the run (one strip per head, or their share)
and strikes through the tokens every head evicted. A study's evictor stage stores no keep-logs unless asked, and a
kept set cannot be recomputed from the records without decoding again, so without them the page shows the answers
and cache sizes only and says so. Hovering a token shows its numbers: every quantity's value (and rank) at the chosen
layer, the occlusion windows over it with the answer each gave, and the heads that held it.

Library::

    from figures.trace import study_viewer, trace_viewer, write_study_viewer

    study_viewer("runs/demo")                      # in a notebook: shows inline
    write_study_viewer("runs/demo")                # -> runs/demo/trace-viewer.html
    trace_viewer(traces, tokenizer=lm.tokenizer, labels=labels, signals=scores,
                 runs=sweep_runs("runs/evict"))    # records in memory, an evictor.run directory's runs

Budget: a 1,000-token trace with 12 replayed scorers at every layer is about 2.5 MB and opens in well under a second
(`tests/test_trace_browser.py` measures both in headless Chromium). This module is the library's face and the
command line; `figures.viewer` holds the data model (`figures.viewer.views`), the study reader
(`figures.viewer.study`), the declared label layers (`figures.viewer.layers`) and the page.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from core.cli import ArgumentParser, check_output_file, main_guard
from core.schemas import Label, Signal, Trace
from figures.viewer.layers import LABEL_KINDS, LabelKind, LabelSet, TokenField, label_set_name, signal_group
from figures.viewer.page import Viewer
from figures.viewer.study import runs_by_problem, study_views
from figures.viewer.views import Run, trace_view

__all__ = ["LABEL_KINDS", "VIEWER_FILE", "LabelKind", "Run", "TokenField", "Viewer", "study_viewer", "sweep_runs",
           "trace_viewer", "write_study_viewer"]

VIEWER_FILE = "trace-viewer.html"  # a study's viewer, in the study directory


def study_viewer(study: str | os.PathLike, traces: Sequence[str] | None = None, *, heads: bool = False,
                 stages: Mapping[str, str | os.PathLike] | None = None, model: str | None = None,
                 traces_file: str | os.PathLike | None = None) -> Viewer:
    """The viewer of a study directory's traces (`traces`: ids, default all), read from its current stages (or from
    `stages`: stage name -> directory, as the study's own record names them); `heads` adds each replayed scorer's
    per-KV-head scores (the page grows with the model's KV heads: 2.3 times for SmolLM2's 3); `model` names the
    model whose tokenizer reads the tokens (default: the traces' own), `traces_file` the dense traces (default: the
    traces stage's file)."""
    found = study_views(study, traces, heads=heads, model=model,
                        traces_file=None if traces_file is None else Path(traces_file),
                        stages=None if stages is None else {name: Path(path) for name, path in stages.items()})
    return Viewer(found.title, found.traces, found.notes)


def write_study_viewer(study: str | os.PathLike, out: str | os.PathLike | None = None,
                       traces: Sequence[str] | None = None, *, heads: bool = False,
                       stages: Mapping[str, str | os.PathLike] | None = None, model: str | None = None,
                       traces_file: str | os.PathLike | None = None) -> Path:
    """Write `study_viewer(...)`'s page to `out` (default: ``<study>/trace-viewer.html``); returns its path."""
    viewer = study_viewer(study, traces, heads=heads, stages=stages, model=model, traces_file=traces_file)
    return viewer.save(out or Path(study) / VIEWER_FILE)


def sweep_runs(directory: str | os.PathLike) -> list[Run]:
    """Every generation of an `evictor.sweep` output directory (``evictor.run --out``), with the keep-logs it
    stored: what `trace_viewer`'s `runs` takes."""
    return [run for found in runs_by_problem(directory).values() for run in found]


def trace_viewer(traces: Iterable[Trace], *, tokenizer, labels: Iterable[Label] = (), signals: Iterable[Signal] = (),
                 runs: Iterable[Run | Trace] = (), title: str | None = None, heads: bool = False) -> Viewer:
    """The viewer of records in memory: dense `traces`, their occlusion `labels` (`labeling`), `signals` (a replay's
    scores, `evictor.replay`, or per-layer signals, `signals.traces`) and `runs` (their problems decoded under
    eviction: `Trace` records of `evictor.sweep`, or `Run`s carrying a keep-log, as `sweep_runs` reads them), read
    with `tokenizer`."""
    traces = list(traces)
    sets: dict[str, LabelSet] = {}
    for label in labels:
        record = label.to_json()
        name = label_set_name(LABEL_KINDS[0], record)
        sets.setdefault(name, LabelSet(LABEL_KINDS[0], name)).records[label.id] = record
    by_trace: dict[str, list[tuple[str, Signal]]] = {}
    for signal in signals:
        by_trace.setdefault(signal.id, []).append((signal_group(signal), signal))
    by_problem: dict[str, list[Run]] = {}
    for run in runs:
        run = run if isinstance(run, Run) else Run(run)
        by_problem.setdefault(run.trace.id, []).append(run)
    views = [trace_view(trace, tokenizer, labels=list(sets.values()), signals=by_trace.get(trace.id, []),
                        runs=by_problem.get(trace.id, []), heads=heads) for trace in traces]
    models = sorted({trace.model for trace in traces})
    return Viewer(title or ", ".join(models) or "kvscope traces", views)


# --- command line ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m figures.trace",
        description="Write one self-contained HTML page (no network) showing a study's traces token by token: "
        "coloured by each label set, each replayed scorer's score or rank at any layer, the per-layer signals and a "
        "known-answer trace's planted/decoy/filler classes; for a chosen policy and budget, the answer it gave and, "
        "where the evictor stored keep-logs, which KV heads held each token. Hover a token for its numbers.")
    parser.add_argument("--study", required=True, help="a study directory (the --out of python -m study)")
    parser.add_argument("--trace", action="append", metavar="ID",
                        help="show only this trace (repeatable; default: every trace of the study)")
    parser.add_argument("--head-scores", action="store_true",
                        help="also offer each replayed scorer's per-KV-head scores (the page grows with the model's KV "
                        "heads: 2.3 times for SmolLM2's 3)")
    parser.add_argument("--out", help="the HTML file to write (default: STUDY/trace-viewer.html, or "
                        "STUDY/trace-viewer-<ID>.html with one --trace)")
    return parser


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    study = Path(args.study)
    out = Path(args.out) if args.out else study / VIEWER_FILE
    if args.out is None and args.trace and len(args.trace) == 1:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in args.trace[0])
        out = out.with_name(f"{out.stem}-{safe}{out.suffix}")
    check_output_file(out)
    page = study_viewer(study, args.trace, heads=args.head_scores)
    page.save(out)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB, {len(page.traces)} traces): open it in a browser")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
