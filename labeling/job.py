"""A labelling run (`OcclusionJob`, `run_occlusion`): traces labelled into a run directory, resumable, on a backend.

The unit of work is a `labeling.labeler.Unit`, a group of `traces_per_batch` traces labelled together; a trace's
labels do not depend on the unit it is in, so neither the grouping nor ``--shard`` (`labeling.shards`) is part of a
run's identity. `run_occlusion` hands the units to `core.backend.run_units`: serially in this process by default,
or with ``--backend ray --workers N`` to N Ray workers (here or on a cluster), each loading the model once
(`load_label_worker`) and labelling units (`labelled_unit`) while this process alone writes the run directory, so
the records are those of a serial run, in the same order. Traces generated under eviction are refused unless
`OcclusionConfig.allow_evicted` (`refuse_evicted`): their labels would not describe the dense model.

Library::

    result = run_occlusion(OcclusionJob(config=config, traces="runs/gsm8k/generations.jsonl"), "runs/labels")

Outputs in the run directory: ``labels.jsonl`` (``labels.shard-I-of-N.jsonl`` with a shard), one
`core.schemas.Label` per trace, appended as each unit finishes (rerun to resume), and ``config.json``
(``config.shard-I-of-N.json``), the resolved configuration with the replacement used. Without `OcclusionJob.traces`
the traces are generated first (`tasks.run`'s units, greedy, with the model that labels them, on the same backend)
into ``traces/`` of the run directory, a `tasks.run` output directory; the plan (problems, traces, token counts) is
printed before the model loads, and an estimate of the time right after (`labeling.estimates`).

A run that labels nothing at all raises `NothingLabelled` after saving its records.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.backend import BackendConfig, connected, run_units
from core.errors import UsageError
from core.paths import portable_path
from core.rundir import source_revision
from core.schemas import Label, Trace, read_records
from labeling.estimates import estimate_seconds, format_duration, probe_decode_rate
from labeling.labeler import OcclusionConfig, OcclusionLabeler, TracePlan, Unit, make_units, select_traces
from labeling.shards import parse_shard, shard_run_dir, shard_suffix, shard_traces
from labeling.windows import occlusion_windows

if TYPE_CHECKING:
    from tasks.problem import Problem
    from tasks.run import GenerationConfig


def refuse_evicted(traces: Sequence[Trace], config: OcclusionConfig, where: str) -> None:
    """A `UsageError` when traces were generated under eviction, unless the config allows them."""
    evicted = [trace for trace in traces if trace.evicted]
    if evicted and not config.allow_evicted:
        policies = ", ".join(f"{policy} ({count})" for policy, count in Counter(t.policy for t in evicted).items())
        raise UsageError(f"{where}: {len(evicted)} of {len(traces)} traces were generated under eviction (policy "
                         f"{policies}); their labels would not describe the dense model; pass --allow-evicted to "
                         "label them anyway")


@dataclass(frozen=True, kw_only=True)
class OcclusionJob:
    """A labelling run: stored dense traces (`traces`), or problems of `dataset` to generate traces for first, and
    how they are labelled (`config`). Every other field is the command-line flag of the same name."""

    config: OcclusionConfig = field(default_factory=OcclusionConfig)
    traces: str | None = None  # a JSONL of dense traces (tasks.run, evictor.run --policy full); None: generate
    dataset: str | None = None  # the answer rules; with `traces`, default: the traces' dataset (if they share one)
    model: str | None = None  # default: the traces' model, else models.registry.DEFAULT_MODEL
    data_file: str | None = None  # the problems to generate for (see tasks.run)
    limit: int | None = None  # the first N problems (generation) or trace records (`traces`)
    max_new_tokens: int = 512  # length of generated traces
    shard: str | None = None  # "I/N": only `shard_traces` of the selected traces (needs `traces`)
    device: str | None = None
    threads: int | None = None  # torch CPU threads, in this process and in every worker
    max_memory: int | None = None  # bytes the labeller may use (None: the device's memory; `core.limits.MemoryLimit`)


@dataclass(frozen=True)
class OcclusionResult:
    """A finished labelling run: one `Label` per selected trace (this shard's), in trace order, and its files."""

    labels: list[Label]
    labels_path: Path
    traces_path: Path

    @property
    def labelled(self) -> list[Label]:
        return [label for label in self.labels if label.labelled]


class NoAnswerCue(UsageError):
    """A forced-answer run whose traces have no answer cue at all: bad input (exit 2), which a study reports as
    "nothing labelled" instead."""


class NothingLabelled(Exception):
    """A run that labelled no trace at all (every one skipped, or no correctly answered trace generated): its
    records are saved, but there is nothing to validate against. The command line exits with status 1."""


@dataclass
class LabelWorker:
    """What a worker holds: its own copy of the model (`models.lm.LoadedModel`) and a labeler over it.
    `live_progress` draws a bar of a unit's regenerations as they finish: the driver's own worker does (the serial
    backend), Ray workers do not."""

    lm: Any
    labeler: OcclusionLabeler
    live_progress: bool = False


@dataclass(frozen=True)
class LabelledUnit:
    """A unit's labels, in trace order, and the seconds its worker took (the driver's estimate of the rest)."""

    labels: list[Label]
    seconds: float


def load_label_worker(job: OcclusionJob) -> LabelWorker:
    """A worker's labeler: `job.model` loaded once in `job.config.dtype`, with `job.dataset`'s answer rules (`job`
    resolved by the driver: model and dataset set)."""
    from models.loading import load_model

    assert job.model is not None  # resolved by the driver
    if job.threads is not None:
        import torch

        torch.set_num_threads(job.threads)
    lm = load_model(job.model, device=job.device, dtype=job.config.dtype)
    labeler = OcclusionLabeler.for_model(lm, job.config, job.dataset)
    if job.config.engine != "hf":
        from tasks.engines import load_engine

        labeler.engine = load_engine(job.config.engine, job.model, batch_size=job.config.batch_size,
                                     dtype=job.config.dtype)
    return LabelWorker(lm, labeler)


def labelled_unit(worker: LabelWorker, unit: Unit) -> LabelledUnit:
    """The unit of work of `core.backend.run_units`: the labels of `unit`'s traces. Reads and writes no file."""
    started = time.perf_counter()
    if worker.live_progress:
        from tqdm import tqdm

        total = sum(worker.labeler.regenerations(trace) for trace in unit.traces)
        with tqdm(total=total, desc="contexts", unit="ctx", leave=False, file=sys.stderr) as bar:
            labels = worker.labeler.label_unit(unit, bar.update)
    else:
        labels = worker.labeler.label_unit(unit)
    return LabelledUnit(labels, time.perf_counter() - started)


@dataclass(frozen=True)
class _Plan:
    """A job checked before anything is written: its resolved settings, identity and the traces to label (known
    after generation when `generation` is set)."""

    job: OcclusionJob  # model and dataset resolved
    out: Path
    identity: dict[str, Any]
    shard: tuple[int, int] | None
    generation: GenerationConfig | None
    problems: list[Problem]
    eligible: list[Trace]

    @property
    def traces_path(self) -> Path:
        if self.generation:
            return self.out / "traces" / "generations.jsonl"
        assert self.job.traces is not None  # a job that generates no traces reads stored ones
        return Path(self.job.traces)


def _plan(job: OcclusionJob, out: str | os.PathLike | None) -> _Plan:
    from models.loading import model_limits
    from models.registry import DEFAULT_MODEL
    from tasks.datasets import check_dataset
    from tasks.run import GenerationConfig

    config = job.config
    shard = parse_shard(job.shard) if job.shard is not None else None
    if job.dataset is not None:
        check_dataset(job.dataset)
    generation, problems, eligible = None, [], []
    dataset: str | None
    model_name: str | None
    if job.traces is None:
        if job.dataset is None:
            raise UsageError("give --dataset (to generate traces) or --traces FILE")
        if shard is not None:
            raise UsageError("--shard needs --traces: generate the traces once (python -m tasks.run), then shard them")
        generation = GenerationConfig(dataset=job.dataset, model=job.model or DEFAULT_MODEL, data_file=job.data_file,
                                      limit=job.limit, max_new_tokens=job.max_new_tokens, dtype=config.dtype,
                                      device=job.device, max_memory=job.max_memory)
        problems = generation.problems()
        dataset, model_name = generation.dataset, generation.model
    else:
        if job.data_file is not None:
            raise UsageError(f"--data-file {job.data_file!r} is read only to generate traces; --traces gives them")
        traces = read_records(job.traces, Trace)[: job.limit]
        datasets = {t.dataset for t in traces}
        if job.dataset is not None and datasets - {job.dataset, None}:
            named = sorted(d for d in datasets if d is not None)
            raise UsageError(f"--dataset {job.dataset!r} but the traces are of {named}; leave --dataset out to label "
                             "them as what they are")
        # A trace states its own reference answer, so any trace labels: a dataset kvscope knows only adds its answer
        # rule (GSM8K's reduction to one number); traces of several or unknown datasets are read by the shared rules.
        dataset = job.dataset or (datasets.pop() if len(datasets) == 1 else None)
        models = {t.model for t in traces}
        model_name = job.model or (models.pop() if len(models) == 1 else None)
        if model_name is None:
            raise UsageError(f"the traces name {len(models)} models ({sorted(map(str, models))}); pass --model")
        if job.model is not None and {portable_path(m) for m in models} - {portable_path(job.model)}:
            raise UsageError(f"--model {job.model!r} but the traces were generated by {sorted(map(str, models))}")
        refuse_evicted(traces, config, f"--traces {job.traces}")
        check_labelling(model_name, traces, config, job.max_memory, f"--traces {job.traces}", device=job.device)
        eligible = select_traces(traces, config)
        if not eligible:
            raise UsageError(f"no correctly answered trace among {len(traces)} in {job.traces}; "
                             "pass --include-incorrect to label against the model's own answers")
        if shard is not None:
            if shard[1] > len(eligible):
                raise UsageError(f"--shard {job.shard}: only {len(eligible)} traces to label; use at most "
                                 f"{len(eligible)} shards")
            eligible = shard_traces(eligible, shard)
    model_limits(model_name).check_flags({"--window": config.window, "--max-answer-tokens": config.max_answer_tokens,
                                          "--max-new-tokens": job.max_new_tokens})
    if generation is not None:  # the traces it will generate, at their longest
        from models.loading import load_tokenizer
        from tasks.prompts import build_prompt_ids

        tokenizer = load_tokenizer(generation.model)
        check_labelling(model_name, [], config, job.max_memory, f"--dataset {dataset}", device=job.device,
                        lengths=[len(build_prompt_ids(tokenizer, p)) + job.max_new_tokens for p in problems])
    out = Path(out) if out is not None else Path("runs") / f"labels-{dataset or 'traces'}-{Path(model_name).name}"
    # Labels are per trace: which traces (--limit, --shard), how they are grouped and where they run are not part
    # of the identity.
    identity = {"model": model_name, "dataset": dataset,
                "traces": "generated" if job.traces is None else str(Path(job.traces).resolve()),
                "generation": generation.identity() if generation else None, **config.identity()}
    resolved = dataclasses.replace(job, model=model_name, dataset=dataset)
    return _Plan(resolved, out, identity, shard, generation, problems, eligible)


def check_labelling(model: str, traces: Sequence[Trace], config: OcclusionConfig, max_memory: int | None,
                    where: str, *, device: str | None = None, lengths: Sequence[int] = ()) -> None:
    """Refuse labelling `traces` (or, before they are generated, traces of `lengths` tokens) with `model` under
    `config` when the model cannot read them (`core.limits.ModelLimits`; `where` names their file), its
    --max-answer-tokens exceed its context, its --replacement is no token of its vocabulary, or the labeller would
    need more memory than the device has or --max-memory allows: a batch of ``batch_size`` rows, each holding a
    trace's cache (a token window's variant, or a cache pruned by a window or a budget draw) and forcing or
    regenerating up to ``max_answer_tokens`` verified in one forward, beside the prefix caches of
    ``traces_per_batch`` traces (`tasks.generation.generation_footprint`)."""
    from core.limits import MemoryLimit
    from labeling.replacement import resolve_replacement
    from models.footprint import model_shape
    from models.loading import load_tokenizer, model_limits
    from tasks.generation import generation_footprint

    limits = model_limits(model)
    limits.check_traces(traces, where)
    limits.check_flags({"--max-answer-tokens": config.max_answer_tokens})
    resolve_replacement(load_tokenizer(model), config.replacement)  # a token id beyond the vocabulary
    lengths = [len(trace.token_ids) for trace in traces] or list(lengths)
    if not lengths:
        return
    longest = max(lengths)
    if config.intervention == "joint":
        from labeling.joint import draws_for

        variants = draws_for(config, -(-longest // config.unit)) + 1
    else:
        variants = longest // config.stride + 2
    # The batch holds up to --batch-size variants of a unit's traces, each as long as its trace.
    rows = min(config.batch_size, config.traces_per_batch * variants)
    footprint = generation_footprint(model_shape(model, config.dtype, device or "cpu"), [longest] * rows,
                                     config.answer_cap, config.batch_size, queries=config.answer_cap + 1,
                                     prefix_tokens=config.traces_per_batch * longest)
    footprint.check(f"{model} labelling traces of up to {longest} tokens ({rows} rows at once, up to "
                    f"--max-answer-tokens {config.answer_cap} each)",
                    MemoryLimit.of(device or "cpu", max_memory),
                    "lower --batch-size, --max-answer-tokens or --traces-per-batch")


def run_occlusion(job: OcclusionJob, out: str | os.PathLike | None = None,
                  backend: BackendConfig | None = None) -> OcclusionResult:
    """Label `job`'s traces into `out` (default ``runs/labels-<dataset>-<model>``), resuming the labels already
    there; traces are generated first (into ``out/traces/``) when `job.traces` is None.

    The units run on `backend` (default: serially in this process); this process alone writes `out`, so the records
    are the same whatever the backend. Bad input is a `UsageError` raised before anything is written; a run that
    labels nothing raises `NothingLabelled` after saving its records.
    """
    backend = backend or BackendConfig()
    if job.config.engine != "hf" and backend.backend != "serial":
        raise UsageError(f"--engine {job.config.engine} regenerates every context in one engine; it does not run on "
                         f"--backend {backend.backend}")
    plan = _plan(job, out)
    job, config, generation = plan.job, plan.job.config, plan.generation
    with shard_run_dir(plan.out, plan.identity, plan.shard) as run, connected(backend):
        if generation is not None:
            _print_plan(generation, len(plan.problems), plan.traces_path.parent, config)
        # The driver's own copy resolves the replacement, plans the windows and is the serial backend's worker.
        worker = load_label_worker(job)
        worker.live_progress = True
        labeler = worker.labeler
        assert labeler.replacement is not None  # resolved when the labeler is made
        if labeler.replacement.chosen == "pad" and labeler.replacement.note:
            _say(f"note: --replacement pad: {labeler.replacement.note}; an answer that flips may reflect a broken "
                 "conversation (--replacement auto uses a neutral token)")
        try:
            eligible = plan.eligible
            if generation is not None:
                eligible = _generate_then_select(worker, generation, plan, backend)
            plans = {trace.id: labeler.plan(trace) for trace in eligible}
            regenerations = {trace_id: len(p.windows) + 1 if p.windows else 0 for trace_id, p in plans.items()}
            if not any(regenerations.values()):
                error = NoAnswerCue if config.force_answer and all(p.cue is None for p in plans.values()) else \
                    UsageError
                raise error(_nothing_to_label(plans, eligible, config))
            run.save_config(config=config.to_json(), revision=source_revision(),
                            replacement=labeler.replacement.to_json(), shard=job.shard,
                            limit=job.limit, n_traces=len(eligible), trace_ids=[t.id for t in eligible],
                            device=job.device, loaded_model=worker.lm.describe(),
                            boundary=("the answer cue: after the first </think>, the last \\boxed{ or else the last "
                                      "answer phrase" if config.force_answer else
                                      f"first </think>, else last \\boxed{{, else final {config.tail} tokens"),
                            reference="answer regenerated from the unoccluded context" +
                            (" followed by the trace's answer cue" if config.force_answer else ""),
                            no_answer_rule=config.no_answer, backend=dataclasses.asdict(backend))
            store = run.store(f"labels{shard_suffix(plan.shard)}.jsonl", key="id")
            labels = _label_into(store, worker, job, eligible, regenerations, backend)
        except KeyboardInterrupt:
            _say(f"\ninterrupted; finished traces and labels are saved in {plan.out}; rerun the same command to "
                 "resume")
            raise
        finally:
            if labeler.engine is not None:
                labeler.engine.close()
    if not any(label.labelled for label in labels):
        reasons = Counter(label.reason for label in labels)
        raise NothingLabelled(f"nothing labelled: all {len(labels)} traces were skipped ("
                              f"{'; '.join(f'{n}x {reason}' for reason, n in reasons.items())}); records in "
                              f"{store.path}")
    return OcclusionResult(labels, store.path, plan.traces_path)


def _nothing_to_label(plans: dict[str, TracePlan], traces: list[Trace], config: OcclusionConfig) -> str:
    """Why no trace has a window to test, in one line."""
    if config.force_answer and all(p.cue is None for p in plans.values()):
        return (f"--force-answer: none of the {len(traces)} traces has an answer cue (no </think>, \\boxed{{ or "
                "answer phrase such as 'The answer is' introduces its answer); label them without --force-answer")
    spans = [p.boundary.answer_start - len(t.prompt_ids) for t, p in zip(traces, plans.values())]
    return f"--window {config.window} is larger than every trace's reasoning span (longest: {max(spans)} tokens); " \
           "use a smaller --window"


def _counts(counts: dict[str, int] | None) -> str:
    return ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in (counts or {}).items() if n)


def _fraction(value: float | None) -> str:
    return "undefined (no position labelled)" if value is None else f"{value:.2f}"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _print_plan(generation: GenerationConfig, problems: int, trace_dir: Path, config: OcclusionConfig) -> None:
    span = max(0, generation.max_new_tokens - config.tail)
    windows = len(occlusion_windows(0, span, config.window, config.stride))
    which = "every trace" if config.include_incorrect else "the correctly answered traces"
    _say(f"plan: generate {problems} {generation.dataset} traces of at most {generation.max_new_tokens} new tokens "
         f"(up to {problems * generation.max_new_tokens:,} tokens) with {generation.model} into {trace_dir}, then "
         f"label {which} (window {config.window}, stride {config.stride}: up to {windows} windows per trace, each "
         f"regenerating at most {config.max_answer_tokens} tokens)")


def _generate_then_select(worker: LabelWorker, generation: GenerationConfig, plan: _Plan,
                          backend: BackendConfig) -> list[Trace]:
    """Estimate the time, generate the plan's traces, and select those to label (`NothingLabelled` if none)."""
    config, problems, labeler = plan.job.config, plan.problems, worker.labeler
    rate = probe_decode_rate(worker.lm, problems[0])
    if rate:
        generating, labelling = estimate_seconds(len(problems), generation.max_new_tokens, config, rate)
        _say(f"estimate at {rate:.1f} tokens/s (measured): generation up to {format_duration(generating)}, "
             f"labelling every trace about {format_duration(labelling)} (an order of magnitude: the naive method's "
             "decode cost, the fast method is usually several times faster); refined after the first trace, after "
             "generation and after the first labelled unit")
    trace_dir = plan.traces_path.parent
    traces = _generate_traces(worker.lm, generation, problems, trace_dir, backend)
    eligible = select_traces(traces, config)
    if not eligible:
        raise NothingLabelled(f"no correctly answered trace among the {len(traces)} generated in {trace_dir}; "
                              "nothing to label (rerun with --include-incorrect to label against the model's own "
                              "answers)")
    if rate:
        labelling = sum(labeler.decode_tokens(trace) for trace in eligible) / rate
        _say(f"labelling {len(eligible)} of the {len(traces)} generated traces: about {format_duration(labelling)} "
             f"(naive method's decode cost at {rate:.1f} tokens/s)")
    return eligible


def _workers(backend: BackendConfig, units: int) -> int:
    return 1 if backend.backend == "serial" else max(1, min(backend.workers, units))


def _generate_traces(lm, generation: GenerationConfig, problems: list[Problem], trace_dir: Path,
                     backend: BackendConfig) -> list[Trace]:
    """The traces of `problems`, generated by `tasks.run.generate_run` (with the labeller's own model on the hf
    engine) into `trace_dir`, a `tasks.run` output directory: resumed like one, and `python -m tasks.run` with the
    same settings resumes it."""
    from tqdm import tqdm

    from tasks.run import generate_run

    started = time.perf_counter()
    generated = 0

    def first(trace: Trace) -> None:
        nonlocal generated
        generated += 1
        if generated == 1 and len(problems) > 1:
            seconds = time.perf_counter() - started
            tqdm.write(f"first trace: {len(trace.generated_ids)} tokens in {seconds:.1f} s; about "
                       f"{format_duration(seconds * (len(problems) - 1))} for the other {len(problems) - 1} if "
                       "they are as long (less when some are already stored, or on several workers)", file=sys.stderr)

    return generate_run(generation, trace_dir, backend, problems=problems, lm=lm, on_trace=first,
                        label=f"generating {generation.dataset}")[0]


def _label_into(store, worker: LabelWorker, job: OcclusionJob, eligible: list[Trace], regenerations: dict[str, int],
                backend: BackendConfig) -> list[Label]:
    """Label the traces of `eligible` not yet in `store`, unit by unit on `backend`; the records of `eligible`."""
    from tqdm import tqdm

    todo = [trace for trace in eligible if trace.id not in store]
    if len(todo) < len(eligible):
        print(f"resuming: {len(eligible) - len(todo)} of {len(eligible)} traces already in {store.path}")
    units = make_units(todo, job.config.traces_per_batch)
    workers = _workers(backend, len(units))
    left = sum(regenerations[trace.id] for trace in todo)
    with tqdm(total=len(eligible), initial=len(eligible) - len(todo), desc="traces", unit="trace",
              file=sys.stderr) as bar:

        def commit(_: Unit, done: LabelledUnit) -> None:
            for label in done.labels:
                store.append(label.to_json())

        def progress(unit: Unit, done: LabelledUnit) -> None:
            nonlocal left
            first = bar.n == bar.initial
            cost = sum(regenerations[trace_id] for trace_id in unit.ids)
            left -= cost
            for label in done.labels:
                outcome = (f"{len(label.windows or [])} windows ({_counts(label.outcome_counts)}), important fraction "
                           f"{_fraction(label.important_fraction)}" if label.labelled else f"skipped: {label.reason}")
                tqdm.write(f"[{label.id}] {outcome}")
            bar.update(len(unit.traces))
            if first and left and cost:
                on = "" if workers == 1 else f" on {workers} workers"
                tqdm.write(f"{len(unit.traces)} traces ({cost} regenerations) in {done.seconds:.1f} s: about "
                           f"{format_duration(done.seconds * left / cost / workers)} for the remaining {left} "
                           f"regenerations{on}", file=sys.stderr)

        run_units(units, functools.partial(load_label_worker, job), labelled_unit, backend, on_result=commit,
                  progress=progress, local_worker=worker)
    wanted = {trace.id for trace in eligible}
    return [Label.from_json(r, str(store.path)) for r in store.records if r["id"] in wanted]
