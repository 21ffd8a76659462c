"""Run a study: each stage's output kept under a key of its settings and its inputs' keys, reused when unchanged.

    result = run_study(StudyConfig(dataset="gsm8k", budgets=study_budgets("0.5"), limit=4, ...), "runs/study")

A stage's directory is ``stages/<stage>-<key>/``; its ``stage.json`` (written when the stage finishes) holds the key,
the settings and inputs it was computed from, its wall time and its outputs. Settings name files by their portable
spelling (`core.paths`: ``runs/...``, ``$KVSCOPE_DATA_DIR/...``), so committed stages keep their keys in any
checkout. A rerun of the same command finds every ``stage.json`` and reuses the stage; a stage interrupted before its
``stage.json`` resumes from its own records (each wrapped library resumes); changing one stage's settings gives that
stage, and every stage whose inputs it feeds, a new key and so a new directory, while the stages before it are
reused. Directories of other keys stay, so going back to earlier settings reuses them too.

Progress: before each stage one line names it and estimates its time and the time left, from the decode rate the
dense traces imply for kvscope's decoding (`estimate_seconds`); the wrapped stages draw their own progress bars.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.backend import BackendConfig, connected
from core.cli import write_json
from core.paths import portable
from core.rundir import RunDir, source_revision
from labeling.estimates import estimate_seconds as labelling_seconds
from labeling.estimates import format_duration
from study import stages
from study.config import LONG_CONTEXT_LABELS, StudyConfig, is_known_answer, is_long_context

STAGES = ("traces", "labels", "cache_labels", "joint_labels", "agreement", "signals", "selection", "known", "forced",
          "evictor", "compare")
# The label kinds with a stage of their own beside token occlusion's (`StudyConfig.labels`).
KIND_STAGES = {"cache": "cache_labels", "joint": "joint_labels"}
MARKER = "stage.json"
STAGE_DIR = "stages"
IDENTITY = {"run": "kvscope study"}  # refuses an --out that holds another tool's run
# Measured ratios of a stage's wall time to its decode-token count at the traces' decode rate (SmolLM2, 2 cores):
# the fast occlusion labeller verifies most regenerated tokens in batches; replay and eviction decode one token per
# step with scoring on top.
LABEL_SPEEDUP = 3.0
STEP_OVERHEAD = 1.3
# evictor.replay feeds a trace 32 tokens per forward: measured 12x faster than one step per token on a Qwen2.5-0.5B
# trace; a conservative factor here.
REPLAY_SPEEDUP = 8.0
DECODING_STAGES = ("labels", "agreement", "signals", "evictor")  # the stages whose time the decode rate sets


@dataclass
class StageRecord:
    """One stage of a study run: where it lives, whether it was computed, resumed, reused or off, and its outputs."""

    name: str
    key: str | None
    path: str | None  # relative to the study directory
    status: str  # computed | resumed | reused | off
    seconds: float
    settings: dict[str, Any]
    inputs: dict[str, str]
    outputs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "path": self.path, "status": self.status,
                "seconds": round(self.seconds, 2), "settings": self.settings, "inputs": self.inputs,
                "outputs": self.outputs}


@dataclass
class StudyResult:
    config: StudyConfig
    out: Path
    stages: dict[str, StageRecord]
    command: list[str]
    seconds: float

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.stages[name].outputs


def stage_key(name: str, settings: dict[str, Any], inputs: dict[str, str]) -> str:
    """12 hex digits of the SHA-256 of the stage's name, settings and input keys (canonical JSON). `Study` passes
    the settings with their paths portable (`core.paths`), so a key names the same stage in every checkout."""
    text = json.dumps({"stage": name, "settings": settings, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def file_digest(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stage_settings(config: StudyConfig, problems) -> dict[str, dict[str, Any]]:
    """Each stage's own settings: what its records depend on (not where they run)."""
    from evictor.protocol import resolve_protocol

    ids = [p.id for p in problems]
    if config.traces is not None:
        traces = {"file": str(Path(config.traces).resolve()), "sha256": file_digest(config.traces), "problems": ids}
    else:
        traces = {"generation": stages.generation_config(config, engine=config.engine).identity(), "problems": ids}
    labels = config.occlusion().identity()
    sampling = resolve_protocol(config.protocol, config.protocol_settings).sampling
    generation = stages.generation_config(config, temperature=sampling.temperature, top_p=sampling.top_p)
    return {
        "traces": traces,
        "labels": labels,
        "agreement": {**labels, "traces": config.agreement_traces, "replacements": list(stages.AGREEMENT_REPLACEMENTS)},
        "signals": {"scorers": list(config.scorers), "window": config.signal_window, "tail": config.tail,
                    "seed": config.seed, "dtype": config.dtype, "signals": stages.SMOOTHED_SIGNALS},
        "selection": {"top": config.top, "level": config.level, "n_boot": config.n_boot, "seed": config.seed,
                      "family": stages.BAND_FAMILY, "window": config.signal_window},
        "evictor": {"generation": generation.identity(), "problems": ids,
                    "budgets": [budget.to_json() for budget in config.budgets],
                    "protocol": config.protocol, "protect": config.protect, "evict_problems": config.evict_problems,
                    **config.protocol_overrides,
                    **({"deployed_scorers": list(config.deployed_scorers)} if config.deploy_scorers else {})},
        **{stage: config.occlusion(intervention=kind).identity() if kind in config.labels else {}
           for kind, stage in KIND_STAGES.items()},
        "known": {"level": config.level, "n_boot": config.n_boot, "seed": config.seed},
        "forced": {"budgets": [budget.to_json() for budget in config.budgets], "protocol": config.protocol,
                   "protect": config.protect, **config.protocol_overrides, "teacher_block": config.teacher_block,
                   "seed": config.seed,
                   **({"deployed_scorers": list(config.deployed_scorers)} if config.deploy_scorers else {})},
        "compare": {"n_boot": config.compare_n_boot, "level": config.level, "seed": config.seed,
                    "reference": stages.REFERENCE},
    }


INPUTS = {"traces": (), "labels": ("traces",), "cache_labels": ("traces",), "joint_labels": ("traces",),
          "agreement": ("traces", "labels"), "signals": ("traces", "labels"),
          "selection": ("labels", "signals", "agreement"),
          "known": ("traces", "labels", "signals", "cache_labels", "joint_labels"),
          "forced": ("labels", "selection", "known"), "evictor": ("traces", "selection", "known"),
          "compare": ("evictor",)}


def estimate_seconds(name: str, config: StudyConfig, done: dict[str, StageRecord], n_problems: int,
                     rate: float | None, workers: int = 1) -> float | None:
    """An order of magnitude of stage `name`'s wall time from kvscope's single-sequence decode rate `rate` (tokens/s,
    `stages.kvscope_decode_rate` of the dense traces) with `workers` running the stages that take a backend (labels,
    agreement, evictor) side by side; None before the traces exist or without a rate. Labels:
    `labeling.estimates.estimate_seconds` over the traces to label, divided by the fast labeller's usual speed-up;
    signals: every reasoning token once per scorer, teacher-forced in blocks (`REPLAY_SPEEDUP`); evictor: every cell
    the stage runs (full once, every other configuration at every budget) decoding as many tokens as the dense traces
    did on the problems it runs, batching taken to gain about the square root of the batch size on a CPU."""
    traces = done.get("traces")
    if traces is None or not rate:
        return None
    if name in ("labels", "agreement", "signals") and is_long_context(config.dataset):
        return 0.0
    length = traces.outputs["mean_generated"]
    to_label = traces.outputs["n"] if config.include_incorrect else traces.outputs["correct"]
    labelled = done["labels"].outputs.get("labelled", 0) if "labels" in done else to_label
    labelling = labelling_seconds(to_label, config.max_new_tokens, config.occlusion(), rate)[1] / LABEL_SPEEDUP
    if name == "labels":
        return labelling / workers
    if name == "agreement":
        relabelled = labelled if config.agreement_traces is None else min(config.agreement_traces, labelled)
        return (len(stages.AGREEMENT_REPLACEMENTS) - 1) * labelling * relabelled / max(1, to_label) / workers
    if name == "signals":
        steps = labelled * (len(config.scorers) + 1) * max(0, length - config.tail)
        return steps * STEP_OVERHEAD / rate / REPLAY_SPEEDUP
    if name == "evictor":
        selection = done["selection"].outputs if "selection" in done else {}
        known = done["known"].outputs if "known" in done else None
        plan = stages.sweeps(config, {"configs": selection.get("configs", {})}, known)
        cells = 1 + (sum(len(configs) for configs in plan.values()) - 1) * len(config.budgets)
        evicted = labelled if config.evict_problems == "labelled" and labelled else n_problems
        return cells * evicted * length * STEP_OVERHEAD / rate / config.batch_size ** 0.5 / workers
    return 0.0


class Study:
    """A study directory being run: claims it, runs or reuses each stage, and records what happened."""

    def __init__(self, config: StudyConfig, out: Path, backend: BackendConfig, quiet: bool):
        self.config, self.out, self.backend, self.quiet = config, out, backend, quiet
        self.paths = stages.Paths(out)
        self.records: dict[str, StageRecord] = {}

    def run(self, name: str, settings: dict[str, Any], compute, *, off: str | None = None) -> StageRecord:
        settings = portable(settings)  # the key of a stage made in another checkout is this one's
        keys = {n: self.records[n].key for n in INPUTS[name]}
        inputs = {n: key for n, key in keys.items() if key is not None}
        if off is not None:
            record = StageRecord(name, None, None, "off", 0.0, settings, inputs, {"reason": off})
            self.records[name] = record
            self.say(f"[{self.position(name)} {name}] off: {off}")
            return record
        key = stage_key(name, settings, inputs)
        directory = self.out / STAGE_DIR / f"{name}-{key}"
        marker = directory / MARKER
        if marker.is_file():
            stored = json.loads(marker.read_text())
            record = StageRecord(name, key, self.paths.rel(directory), "reused", stored["seconds"], settings, inputs,
                                 stored["outputs"])
            self.records[name] = record
            self.say(f"[{self.position(name)} {name}] reused {record.path} (computed in "
                     f"{format_duration(record.seconds)})")
            return record
        status = "resumed" if directory.exists() else "computed"
        self.say(f"[{self.position(name)} {name}] {'resuming' if status == 'resumed' else 'computing'} "
                 f"{self.paths.rel(directory)}{self.eta(name)}")
        started = time.perf_counter()
        outputs = compute(directory)
        seconds = time.perf_counter() - started
        record = StageRecord(name, key, self.paths.rel(directory), status, seconds, settings, inputs, outputs)
        directory.mkdir(parents=True, exist_ok=True)
        write_json(marker, record.to_json())
        self.records[name] = record
        return record

    def position(self, name: str) -> str:
        return f"stage {STAGES.index(name) + 1}/{len(STAGES)}"

    @functools.cached_property
    def decode_rate(self) -> float | None:
        """kvscope's single-sequence tokens/s that the dense traces imply; read once, after the traces stage."""
        traces = stages.traces_file(self.config, self.records["traces"].outputs, self.paths)
        return stages.kvscope_decode_rate(stages.read_traces(traces))

    def eta(self, name: str) -> str:
        traces = self.records.get("traces")
        if traces is None:
            return ""
        if self.decode_rate is None:
            return ("; no time estimate (these traces do not time kvscope's own decoding), its progress bar gives one"
                    if name in DECODING_STAGES else "")
        estimates = [estimate_seconds(n, self.config, self.records, len(traces.settings["problems"]),
                                      self.decode_rate, self.backend.workers)  # 1 on the serial backend
                     for n in STAGES[STAGES.index(name):]]
        rest = sum(e or 0 for e in estimates)
        if estimates[0] is None or rest < 1:
            return ""
        return (f"; about {format_duration(estimates[0])} for this stage, {format_duration(rest)} left in all "
                "(an order of magnitude)")

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def check_stage_records(out: Path) -> None:
    """Refuse to resume a study whose stage records are damaged (a line that is not a record, a record without its
    id, an id twice), before any stage starts: each stage's store would refuse its own file, but only after the
    stages before it had run. Every stage stores records keyed by their id."""
    from core.records import read_resumable

    for path in sorted(out.glob("stages/**/*.jsonl")):
        read_resumable(path, lambda record: record["id"])


def run_study(config: StudyConfig, out: str | Path, backend: BackendConfig | None = None, *, quiet: bool = False,
              command: list[str] | None = None) -> StudyResult:
    """Run (or resume) the study `config` into `out` and write its report; bad input is a `UsageError` raised before
    anything is written. `command` is the command line the report gives for reproducing it."""
    from models.loading import shared_loads
    from study.report import write_report, write_viewer

    backend = backend or BackendConfig()
    config.check()
    problems = stages.generation_config(config).problems()
    if config.traces is not None:
        stages.check_reused_traces(config, problems)
    stages.check_memory(config, problems, backend)
    check_stage_records(Path(out))
    settings = stage_settings(config, problems)
    out = Path(out)
    started = time.perf_counter()
    # One copy of the model for every stage that runs in this process (Ray workers load their own, once each).
    with RunDir(out, IDENTITY) as run, connected(backend), shared_loads():
        run.save_config(study=config.to_json(), command=command, backend=dataclasses.asdict(backend),
                        revision=source_revision())
        study = Study(config, out, backend, quiet)
        paths, rec = study.paths, study.records
        study.run("traces", settings["traces"],
                  lambda d: stages.traces_stage(config, problems, d, paths, backend))
        stages.check_budgets_fit(config, problems, rec["traces"].outputs, paths)
        long_context = is_long_context(config.dataset)
        unlabellable = None if long_context else stages.labellable(config, rec["traces"].outputs, paths)
        if unlabellable:
            study.say(f"nothing to label: {unlabellable}; the labels, signals and selection stages will have nothing "
                      "to work on, and the evictor runs only the baselines and the papers' default scorers")
        study.run("labels", settings["labels"],
                  lambda d: stages.labels_stage(config, rec["traces"].outputs, d, paths, backend),
                  off=LONG_CONTEXT_LABELS if long_context else None)
        for kind, stage in KIND_STAGES.items():
            study.run(stage, settings[stage],
                      functools.partial(lambda d, k: stages.labels_stage(config, rec["traces"].outputs, d, paths,
                                                                         backend, k), k=kind),
                      off=LONG_CONTEXT_LABELS if long_context else None if kind in config.labels else
                      f"--labels {','.join(config.labels)} does not ask for {kind} labels")
        labelled = rec["labels"].outputs.get("labelled", 0)
        off = ("--agreement-traces 0" if config.agreement_traces == 0 else
               None if labelled else "no labelled trace to relabel")
        study.run("agreement", settings["agreement"],
                  lambda d: stages.agreement_stage(config, rec["traces"].outputs, rec["labels"].outputs, d, paths,
                                                   backend), off=off)
        study.run("signals", settings["signals"],
                  lambda d: stages.signals_stage(config, rec["traces"].outputs, rec["labels"].outputs, d, paths),
                  off=None if labelled else "no labelled trace")
        study.run("selection", settings["selection"],
                  lambda d: stages.selection_stage(config, rec["labels"].outputs, rec["signals"].outputs, d, paths,
                                                   rec["agreement"].outputs))
        study.run("known", settings["known"],
                  lambda d: stages.known_stage(config, rec["traces"].outputs, rec["labels"].outputs,
                                               rec["signals"].outputs, paths,
                                               {kind: rec[stage].outputs for kind, stage in KIND_STAGES.items()}),
                  off=None if is_known_answer(config.dataset) else "not a known-answer task (tasks.known_answer)")
        study.run("forced", settings["forced"],
                  lambda d: stages.forced_stage(config, rec["labels"].outputs, rec["selection"].outputs,
                                                rec["known"].outputs, d, paths),
                  off=None if config.teacher_forced else "--teacher-forced not given")
        study.run("evictor", settings["evictor"],
                  lambda d: stages.evictor_stage(config, rec["traces"].outputs, rec["labels"].outputs,
                                                 rec["selection"].outputs, rec["known"].outputs, d, paths, backend,
                                                 quiet))
        study.run("compare", settings["compare"], lambda d: stages.compare_stage(config, rec["evictor"].outputs, paths))
        result = StudyResult(config, out, dict(rec), command or [], time.perf_counter() - started)
        write_report(result)
        write_viewer(result)
    return result
