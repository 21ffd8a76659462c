"""Read a study directory (`python -m study --out DIR`) into the viewer's `TraceView`s.

What a study holds, by stage (each ``stages/<stage>-<key>/stage.json`` names its outputs and the keys of the stages
it read): ``traces`` the dense traces; the label kinds of `figures.viewer.layers.LABEL_KINDS` (the occlusion labels of
``labels``, the other fillers of ``agreement``); ``signals`` the replayed scores of every scorer (``replay.jsonl``:
its own aggregate and each layer's score) and the per-layer signals; ``evictor`` one directory per sweep, each cell's
generations (and keep-logs when the sweep stored them). Any of them may be missing: the page shows what is there.
Raw records committed by `core.pack` (``*.jsonl.gz``) are read as they are.

A study directory may hold several keys of one stage (a rerun with other settings keeps the old ones); the viewer
reads one consistent set, `study_stages`: of the stages no other stage read, the one that read the most stages
(transitively; the latest on a tie), with the stages it read; a stage none of those read (a side branch) is the most
recent one whose inputs agree with them.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UsageError, unknown_choice
from core.records import parse_line
from core.schemas import Signal, Trace
from figures.viewer.layers import LABEL_KINDS, LabelKind, LabelSet, is_head_signal, label_set_name, signal_group
from figures.viewer.views import Run, TraceView, trace_view

STAGE_MARKER = "stage.json"


@dataclass(frozen=True)
class Stage:
    name: str
    key: str
    inputs: dict[str, str]
    outputs: dict[str, Any]
    path: Path
    finished: float  # when its marker was written


def records(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON records of a JSONL file, gzipped or not; a malformed line is a `UsageError` naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield parse_line(line, path, number)
    except (OSError, EOFError) as err:
        raise UsageError(f"{path}: cannot read it ({err})") from None


def stored(path: Path) -> Path | None:
    """`path`, or its gzipped copy (`core.pack`), whichever exists."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def read_stages(root: Path) -> list[Stage]:
    found = []
    for marker in sorted((root / "stages").glob(f"*/{STAGE_MARKER}")):
        try:
            data = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(f"{marker}: not a stage record ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise UsageError(f"{marker}: not a stage record (no stage name)")
        found.append(Stage(data["name"], str(data.get("key")), dict(data.get("inputs") or {}),
                           dict(data.get("outputs") or {}), marker.parent, marker.stat().st_mtime))
    return found


def study_stages(root: str | os.PathLike) -> dict[str, Path]:
    """Stage name -> the directory of the study's current run of it (the module docstring says which)."""
    root = Path(root)
    try:
        found = root.is_dir()
    except OSError as err:  # a name too long for the file system
        raise UsageError(f"--study {str(root)!r}: {err.strerror}") from None
    if not found:
        raise UsageError(f"--study {str(root)!r} is not a directory")
    every = read_stages(root)
    if not every:
        raise UsageError(f"--study {str(root)!r} holds no finished stage (no stages/*/{STAGE_MARKER}); give the --out "
                         "of a python -m study run")
    by_key = {(stage.name, stage.key): stage for stage in every}
    read = {(name, key) for stage in every for name, key in stage.inputs.items()}

    def closure(stage: Stage) -> dict[str, Stage]:
        found: dict[str, Stage] = {}
        todo = [stage]
        while todo:
            current = todo.pop()
            found[current.name] = current
            todo += [by_key[item] for item in current.inputs.items() if item in by_key and item[0] not in found]
        return found

    newest = lambda stages: max(stages, key=lambda s: (s.finished, s.path.name))  # noqa: E731
    sinks = [closure(stage) for stage in every if (stage.name, stage.key) not in read]
    # the run that got furthest, the latest of those: a stale stage left by an abandoned run reaches fewer stages
    chosen = max(sinks, key=lambda found: (len(found), max(s.finished for s in found.values())))
    for name in sorted({stage.name for stage in every} - set(chosen)):
        agreeing = [s for s in every if s.name == name
                    and all(chosen[n].key == k for n, k in s.inputs.items() if n in chosen)]
        if agreeing:
            chosen[name] = newest(agreeing)
    return {name: stage.path for name, stage in chosen.items()}


def _outputs(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / STAGE_MARKER).read_text()).get("outputs") or {})


def _study_file(root: Path, recorded: str) -> Path | None:
    """A file a stage recorded (relative to the study, or absolute), or its gzipped copy."""
    path = Path(recorded)
    return stored(path if path.is_absolute() else root / path)


def read_traces(root: Path, stages: dict[str, Path], file: Path | None = None) -> list[Trace]:
    """The dense traces of the study's traces stage, or of `file` (what the study itself resolved)."""
    if "traces" not in stages:
        raise UsageError(f"study {str(root)!r} has no finished traces stage: nothing to show")
    recorded = _outputs(stages["traces"]).get("traces")
    if file is None:
        file = _study_file(root, recorded) if isinstance(recorded, str) else None
    if file is None:
        raise UsageError(f"study {str(root)!r}: the traces stage's file {recorded!r} is missing (restore committed "
                         "stages with python -m core.pack --restore)")
    return [Trace.from_json(r, f"{file}: record {n}") for n, r in enumerate(records(file), start=1)]


def _label_files(kind: LabelKind, directory: Path) -> list[Path]:
    files = {p.with_suffix("") if p.suffix == ".gz" else p: p
             for p in [*directory.glob(kind.pattern), *directory.glob(kind.pattern + ".gz")]}
    return [files[name] for name in sorted(files)]


def read_label_sets(stages: dict[str, Path]) -> list[LabelSet]:
    """One `LabelSet` per label file of every declared kind the study has, named by kind and filler."""
    sets: dict[str, LabelSet] = {}
    for kind in LABEL_KINDS:
        if kind.stage not in stages:
            continue
        for file in _label_files(kind, stages[kind.stage]):
            by_id = {str(r["id"]): r for r in records(file) if "id" in r}
            if not by_id:
                continue
            inside = file.parent != stages[kind.stage]  # the agreement stage keeps each filler in a folder
            name = label_set_name(kind, next(iter(by_id.values())), file.parent.name if inside else None)
            sets.setdefault(name, LabelSet(kind, name, by_id))
    return list(sets.values())


def missing_files(root: Path, stages: dict[str, Path]) -> list[str]:
    """The signal files the signals stage lists that this copy of the study lacks (a committed study may leave its
    large raw records out)."""
    listed = _outputs(stages["signals"]).get("files") or [] if "signals" in stages else []
    return [str(name) for name in listed if _study_file(root, str(name)) is None]


def read_signals(root: Path, stages: dict[str, Path], *, heads: bool = False) -> dict[str, list[tuple[str, Signal]]]:
    """Trace id -> (group, record) of every signal file of the signals stage; the per-KV-head scores of a replay only
    with `heads` (left out before the records are checked, which is most of the time reading them takes)."""
    if "signals" not in stages:
        return {}
    listed = _outputs(stages["signals"]).get("files") or []
    files = [f for f in (_study_file(root, str(name)) for name in listed) if f is not None]
    by_trace: dict[str, list[tuple[str, Signal]]] = {}
    for file in files:
        for number, data in enumerate(records(file), start=1):
            if not heads and isinstance(data.get("signals"), dict):
                data["signals"] = {name: v for name, v in data["signals"].items() if not is_head_signal(name)}
            record = Signal.from_json(data, f"{file}: record {number}")
            by_trace.setdefault(record.id, []).append((signal_group(record), record))
    return by_trace


def read_runs(root: Path, stages: dict[str, Path]) -> dict[str, list[Run]]:
    """Problem id -> its generations under every configuration and budget of the evictor stage, named as the
    study's tables name them (a policy, or a selected configuration's name), with their keep-logs when stored."""
    if "evictor" not in stages:
        return {}
    runs: dict[str, list[Run]] = {}
    for sweep in (_outputs(stages["evictor"]).get("sweeps") or {}).values():
        for problem, found in runs_by_problem(root / sweep["path"], sweep.get("configs") or None).items():
            runs.setdefault(problem, []).extend(found)
    return runs


def runs_by_problem(directory: str | os.PathLike, configs: Mapping[str, Any] | None = None) -> dict[str, list[Run]]:
    """Problem id -> its generations in an `evictor.sweep` output directory (every cell, gzipped or not), with the
    keep-logs the sweep stored. A run is named after its policy, or, when `configs` (the study's configurations of
    this sweep, by name) does not name that policy, after the sweep's configuration."""
    directory = Path(directory)
    runs: dict[str, list[Run]] = {}
    for file in sorted([*directory.rglob("generations.jsonl"), *directory.rglob("generations.jsonl.gz")]):
        for number, data in enumerate(records(file), start=1):
            trace = Trace.from_json(data, f"{file}: record {number}")
            label = trace.policy if not configs or trace.policy in configs else next(iter(configs))
            log = trace.extra.get("keep_log")
            keep = _keep_log(file.parent / log) if isinstance(log, str) else None
            runs.setdefault(trace.id, []).append(Run(trace, label, keep))
    return runs


def _keep_log(path: Path) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    with np.load(path) as arrays:
        return {name: arrays[name] for name in arrays.files}


def cache_shape(model: str) -> tuple[int, int] | None:
    """(layers, KV heads) of `model`'s cache, from its config (None when it cannot be read)."""
    from models.loading import model_config

    try:
        config = model_config(model)
    except UsageError:
        return None
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return int(config.num_hidden_layers), int(heads)


@dataclass
class StudyViews:
    """A study's `TraceView`s and what the page should say about them."""

    title: str
    traces: list[TraceView]
    notes: list[str]


def study_views(root: str | os.PathLike, traces: Sequence[str] | None = None, *,
                stages: dict[str, Path] | None = None, heads: bool = False, tokenizer=None,
                model: str | None = None, traces_file: Path | None = None) -> StudyViews:
    """The `TraceView`s of a study directory's traces (`traces`: ids to keep, in that order; default every trace),
    read from `stages` (stage name -> directory; default `study_stages`). `heads` adds the replayed per-KV-head
    scores; `tokenizer` defaults to `model`'s, else the traces' model's (as they spell it: a path relative to the
    checkout that wrote them, for a study committed from another); `traces_file` is the dense traces' file when the
    caller has resolved it (a study reusing --traces from elsewhere)."""
    root = Path(root)
    stages = stages if stages is not None else study_stages(root)
    dense = read_traces(root, stages, traces_file)
    by_id = {t.id: t for t in dense}
    for wanted in traces or ():
        if wanted not in by_id:
            raise unknown_choice("trace", wanted, list(by_id))
    chosen = [by_id[i] for i in traces] if traces else dense
    models = [model] if model is not None else sorted({t.model for t in chosen})
    if tokenizer is None:
        from models.loading import load_tokenizer

        if len(models) > 1:
            raise UsageError(f"the traces are of several models ({', '.join(models)}); one tokenizer reads them all")
        tokenizer = load_tokenizer(models[0])
    label_sets, runs = read_label_sets(stages), read_runs(root, stages)
    signals = read_signals(root, stages, heads=heads)
    keep_logs = any(run.keep_log is not None for found in runs.values() for run in found)
    shape = cache_shape(models[0]) if keep_logs else None
    views = [trace_view(trace, tokenizer, labels=label_sets, signals=signals.get(trace.id, []),
                        runs=runs.get(trace.id, []), cache_shape=shape, heads=heads) for trace in chosen]
    notes = []
    if missing := missing_files(root, stages):
        notes.append(f"Not in this copy of the study, so not shown: {', '.join(missing)}.")
    evicted = [run for found in runs.values() for run in found if run.trace.evicted]
    if evicted and not keep_logs:
        notes.append("The evictor stage stored no keep-logs, so the page shows each run's answer and cache size but "
                     "not which tokens it kept; an evictor.run --keep-log run of a cell records them.")
    dataset = next((t.dataset for t in chosen if t.dataset), "")
    return StudyViews(f"{models[0]} on {dataset}" if dataset else models[0], views, notes)
