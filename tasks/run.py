"""Generate and grade answers to benchmark problems: ``python -m tasks.run --model M --dataset D --limit N``.

The library is `GenerationConfig` plus `generate_traces` (a loaded model and problems in, `core.schemas.Trace`
records out, one per problem as it finishes) and `summarize`; the CLI claims ``--out`` (default
``runs/<dataset>-<model>``) with a `core.rundir.RunDir` and writes there:

- ``generations.jsonl``: one trace record per problem (`core.schemas.Trace`, ``policy`` "full", and ``engine``: the
  engine's name, version and batch size), appended in problem order as soon as it and every earlier problem are
  graded;
- ``summary.json``: accuracy and counts over the requested problems;
- ``config.json``: the resolved configuration, with the identity a resumed run must match.

``--engine hf`` (the default) decodes with kvscope's own loop on transformers, ``--batch-size N`` problems together
by continuous batching (`tasks.generation.generate_batch`: greedy tokens equal single-sequence decoding's except at
exact near-ties of the top two logits); ``--engine vllm`` hands every problem to vLLM at once (`tasks.engines`), at
most ``--batch-size`` sequences per step. vLLM's greedy tokens need not equal HF's, so the engine is part of a run's
identity; the batch size is not.

Rerunning the same command after an interruption skips the problems already in ``generations.jsonl`` and continues;
a directory holding a run with other generation settings is refused, naming them, rather than mixed.

``--backend ray --workers N`` spreads the problems over N Ray workers (`core.backend`), here or on a cluster (HF
only: vLLM batches on its own); the unit of work is ``--batch-size`` problems (one by default: a generation takes
seconds, far more than handing a unit out, and single problems keep the workers evenly loaded), and the records are
those of a serial run, in the same order.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.backend import BackendConfig, add_backend_arguments, connected, run_units
from core.cli import (
    ArgumentParser,
    add_device_arguments,
    main_guard,
    non_negative_float,
    positive_int,
    seed_int,
    unit_interval,
    write_json,
)
from core.errors import UsageError
from core.limits import Footprint, MemoryLimit, ModelLimits
from core.rundir import RunDir
from core.schemas import Trace
from core.seeds import derive_seed
from models.registry import DEFAULT_MODEL, REGISTRY
from tasks import ruler
from tasks.datasets import DATASETS, grade, load_problems, resolve_source
from tasks.engines import ENGINES, check_engine
from tasks.problem import Problem


@dataclass(frozen=True)
class GenerationConfig:
    """Which model answers which problems, and how its tokens are drawn."""

    dataset: str
    model: str = DEFAULT_MODEL
    data_file: str | None = None  # the data source: this JSONL file, else $KVSCOPE_DATA_DIR or the hub
    limit: int | None = None  # the first N problems (None: all)
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling when < 1 (only with temperature > 0)
    seed: int = 0
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    device: str | None = None  # None: cuda when available
    problem_ids: tuple[str, ...] | None = None  # only these of the first `limit` problems (None: all of them)
    engine: str = "hf"  # tasks.engines.ENGINES
    batch_size: int = 1  # sequences decoded together
    max_memory: int | None = None  # bytes a run may use (None: the device's memory; `core.limits.MemoryLimit`)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> GenerationConfig:
        """The configuration among a CLI's parsed flags (``vars(args)``; each field is a flag of the same name)."""
        return cls(**{f.name: flags[f.name] for f in dataclasses.fields(cls) if f.name in flags})

    @property
    def sampling(self) -> dict[str, Any]:
        """The ``sampling`` field of every record this configuration makes."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    def identity(self) -> dict[str, Any]:
        """The settings that change what a record contains (not `limit`, `problem_ids`, `device` or `batch_size`): a
        resume must match them. The engine is named when it is not ``hf``, the one every run made before engines
        existed used, so their directories still resume."""
        source = resolve_source(self.dataset, self.data_file, tokenizer=self.model)
        return {
            "model": self.model,
            "dataset": self.dataset,
            "data_source": source,
            "max_new_tokens": self.max_new_tokens,
            **self.sampling,
            "dtype": self.dtype,
            **({"engine": self.engine} if self.engine != "hf" else {}),
        }

    def limits(self) -> ModelLimits:
        """The model's context and vocabulary, from its config (no weights are loaded)."""
        from models.loading import model_limits

        return model_limits(self.model)

    def check_prompts(self, prompts: Mapping[str, Sequence[int]]) -> None:
        """Refuse a problem (id -> prompt ids) whose prompt and ``max_new_tokens`` exceed the model's context,
        before anything is decoded."""
        limits = self.limits()
        for problem_id, ids in prompts.items():
            limits.check_tokens(f"problem {problem_id!r}: its prompt of {len(ids)} tokens + --max-new-tokens "
                                f"{self.max_new_tokens}", len(ids) + self.max_new_tokens)

    def footprint(self, prompt_lens: Sequence[int]) -> Footprint:
        """The peak memory of generating from prompts of `prompt_lens` tokens in one process: ``hf`` decodes them
        in batches of `batch_size` (`tasks.generation.generation_footprint`); vLLM sizes its own KV cache within
        what the weights leave, so only they are counted."""
        from models.footprint import model_shape
        from tasks.generation import generation_footprint

        shape = model_shape(self.model, self.dtype, self.device)
        if self.engine != "hf":
            return shape.weights()
        return generation_footprint(shape, prompt_lens, self.max_new_tokens, self.batch_size)

    def check_memory(self, prompts: Mapping[str, Sequence[int]], backend: BackendConfig) -> None:
        """Refuse generating `prompts` (id -> prompt ids) when this machine (the driver and any local Ray workers,
        `BackendConfig.footprint`) would need more memory than the device has or ``--max-memory`` allows."""
        from models.footprint import model_shape

        lengths = [len(ids) for ids in prompts.values()]
        rows = min(self.batch_size, len(lengths))
        footprint = backend.footprint(model_shape(self.model, self.dtype, self.device).weights(),
                                      self.footprint(lengths))
        workers = f" on {backend.workers} local Ray workers" if backend.local_workers else ""
        footprint.check(f"{self.model} decoding {rows} sequence(s) at once (--batch-size {self.batch_size}), each up "
                        f"to {max(lengths)} prompt + --max-new-tokens {self.max_new_tokens} tokens{workers},",
                        MemoryLimit.of(self.device, self.max_memory),
                        "lower --batch-size or --max-new-tokens" + (" or --workers" if workers else ""))

    def problems(self) -> list[Problem]:
        """The problems to run; generated (RULER) contexts are measured with this model's tokenizer. A generation
        cap or a RULER length beyond the model's context is refused before any haystack is built."""
        limits = self.limits()
        limits.check_tokens(f"--max-new-tokens {self.max_new_tokens}", self.max_new_tokens)
        generated = ruler.parse_name(self.dataset) if self.data_file is None else None
        if generated is not None:
            limits.check_tokens(f"dataset {self.dataset!r}: ruler length {generated.context_tokens}",
                                generated.context_tokens)
        problems = load_problems(self.dataset, data_file=self.data_file, limit=self.limit, tokenizer=self.model)
        if self.problem_ids is None:
            return problems
        wanted = set(self.problem_ids)
        missing = sorted(wanted - {p.id for p in problems})
        if missing:
            raise UsageError(f"problem id(s) {', '.join(missing[:5])} are not among the first {len(problems)} "
                             f"problems of {self.dataset}")
        return [p for p in problems if p.id in wanted]


def graded_trace(
    problem: Problem,
    *,
    model: str,
    prompt_ids: list[int],
    generated_ids: list[int],
    text: str,
    finish_reason: str,
    timings: dict[str, Any],
    sampling: dict[str, Any],
    **fields: Any,
) -> Trace:
    """The trace of one generation, graded against `problem`; `fields` sets the eviction fields of `Trace`, and
    names it does not know go to ``extra``."""
    graded = grade(text, problem)
    known = {f.name for f in dataclasses.fields(Trace)}
    return Trace(
        id=problem.id,
        dataset=problem.dataset,
        model=model,
        prompt_ids=list(prompt_ids),
        generated_ids=list(generated_ids),
        text=text,
        answer=graded["answer"],
        extracted_by=graded["extracted_by"],
        gold=problem.answer,
        correct=graded["correct"],
        finish_reason=finish_reason,
        empty_output=not text.strip(),
        no_answer=graded["no_answer"],
        timings=timings,
        sampling=sampling,
        **{k: v for k, v in fields.items() if k in known},
        extra={k: v for k, v in fields.items() if k not in known},
    )


def generate_traces(engine, problems: Iterable[Problem], config: GenerationConfig) -> Iterator[Trace]:
    """Generate and grade each problem with `engine` (a `tasks.engines` engine, or a `models.lm.LoadedModel`,
    decoded by `tasks.engines.HFEngine` at ``config.batch_size``), yielding the traces in problem order, each as
    soon as it and every earlier one have finished.

    Each problem draws from its own seed (`core.seeds.derive_seed` of the run seed and its id), so a resumed run, a
    longer ``limit``, another order or another batch size reproduces every trace.
    """
    from tasks.engines import HFEngine
    from tasks.generation import Request
    from tasks.prompts import build_prompt_ids

    if not hasattr(engine, "stream"):
        engine = HFEngine(engine, config.batch_size)
    problems = list(problems)
    prompts = [build_prompt_ids(engine.tokenizer, problem) for problem in problems]
    requests = [Request(tuple(ids), config.max_new_tokens, config.temperature, config.top_p,
                        derive_seed(config.seed, [problem.id])) for ids, problem in zip(prompts, problems)]
    described = engine.describe()
    finished, first_unsent = {}, 0
    for index, result in engine.stream(requests):
        finished[index] = result
        while first_unsent in finished:
            result = finished.pop(first_unsent)
            yield graded_trace(
                problems[first_unsent],
                model=config.model,
                prompt_ids=prompts[first_unsent],
                generated_ids=result.generated_ids,
                text=result.text,
                finish_reason=result.finish_reason,
                sampling=config.sampling,
                timings={
                    "prefill_s": round(result.prefill_s, 4),
                    "decode_s": round(result.decode_s, 4),
                    "tokens_per_s": round(result.tokens_per_s, 3),
                },
                engine=described,
            )
            first_unsent += 1


@dataclass
class Generator:
    """What a worker holds: a loaded model (`models.lm.LoadedModel`) and how it generates."""

    lm: Any
    config: GenerationConfig


def load_generator(config: GenerationConfig) -> Generator:
    """A worker's `Generator`: the model of `config`, loaded once."""
    from models.loading import load_model

    return Generator(load_model(config.model, device=config.device, dtype=config.dtype), config)


def generate_one(generator: Generator, problem: Problem) -> Trace:
    """The unit of work of `core.backend.run_units`: one problem's graded trace."""
    (trace,) = generate_traces(generator.lm, [problem], generator.config)
    return trace


def generate_chunk(generator: Generator, problems: list[Problem]) -> list[Trace]:
    """The unit of work of `tasks.run` on Ray: a batch of problems' graded traces, in order."""
    return list(generate_traces(generator.lm, problems, generator.config))


def summarize(traces: Sequence[Trace]) -> dict[str, Any]:
    """Accuracy and counts over `traces` (the fields `core.schemas.Cell` shares with a dense run)."""
    n = len(traces)
    correct = sum(bool(t.correct) for t in traces)
    speeds = [t.timings["tokens_per_s"] for t in traces if t.timings.get("tokens_per_s")]
    return {
        "problems": n,
        "correct": correct,
        "accuracy": correct / n if n else 0.0,
        "no_answer": sum(t.no_answer for t in traces),
        "empty_output": sum(t.empty_output for t in traces),
        "truncated": sum(t.finish_reason == "length" for t in traces),
        "mean_generated": statistics.fmean(len(t.generated_ids) for t in traces) if n else None,
        "median_tokens_per_s": statistics.median(speeds) if speeds else None,
    }


def _short(text: str | None, width: int) -> str:
    text = "-" if text is None else " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(traces: Sequence[Trace]) -> str:
    header = f"{'#':>3}  {'id':<36} {'gold':<18} {'answer':<18} {'ok':<3} {'tokens':>6} {'finish':<6} {'tok/s':>6}"
    lines = [header, "-" * len(header)]
    for i, t in enumerate(traces, start=1):
        lines.append(
            f"{i:>3}  {_short(t.id, 36):<36} {_short(t.gold, 18):<18} {_short(t.answer, 18):<18} "
            f"{'yes' if t.correct else 'no':<3} {len(t.generated_ids):>6} {t.finish_reason:<6} "
            f"{t.timings.get('tokens_per_s', 0.0):>6.1f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m tasks.run",
        description="Generate answers to benchmark problems with a causal LM, grade them, and write per-problem "
        "records (resumable) plus an accuracy summary.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name ({', '.join(sorted(REGISTRY))}), a local HF model directory, a .gguf file or a hub id "
        f"(default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--dataset", required=True, help=f"benchmark to run: {', '.join(DATASETS)}")
    parser.add_argument(
        "--limit", type=positive_int, default=None, help="run only the first N problems of the dataset (default: all)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=512,
        help="stop a generation after this many new tokens (finish_reason 'length'; default: 512)",
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 = greedy decoding (default); > 0 samples from the softmax at this temperature",
    )
    parser.add_argument(
        "--top-p",
        type=unit_interval,
        default=1.0,
        help="nucleus sampling: draw only from the most probable tokens whose mass reaches P, in "
        "(0, 1] (with --temperature > 0; default: 1 = the whole softmax)",
    )
    parser.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help="seed for sampling; each problem draws from a seed derived from this one and its id, so "
        "reruns and resumes reproduce (default: 0)",
    )
    parser.add_argument(
        "--data-file", default=None, help="read problems from this JSONL file instead of $KVSCOPE_DATA_DIR or the hub"
    )
    parser.add_argument(
        "--engine",
        default="hf",
        help=f"generation engine: {', '.join(ENGINES)} (default: hf, kvscope's own decoding on transformers; vllm "
        "needs its environment, docs/engines.md)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="sequences decoded together: hf continuous batching (1 = one problem at a time), vllm's max_num_seqs "
        "(default: 1)",
    )
    parser.add_argument("--out", default=None, help="output directory (default: runs/<dataset>-<model>)")
    add_device_arguments(parser)
    add_backend_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="do not print a line per problem")
    return parser


def _default_out(model: str, dataset: str) -> Path:
    return Path("runs") / f"{dataset}-{Path(model).name.removesuffix('.gguf')}"


def generate_run(config: GenerationConfig, out: str | Path, backend: BackendConfig | None = None, *,
                 problems: Sequence[Problem] | None = None, lm=None, on_trace: Callable[[Trace], None] | None = None,
                 label: str | None = None) -> tuple[list[Trace], dict[str, Any]]:
    """Generate and grade `problems` (default: `config.problems()`) into the `tasks.run` output directory `out`,
    resuming the records already there; returns their traces, in problem order, and the run's summary.

    The one dense-trace generator: the command line, the occlusion labeller and the study all call it. `lm` (a
    loaded model) is reused by the ``hf`` engine instead of loading another copy; `on_trace(trace)` is called as
    each new trace is stored; `label` names the progress bar. On `backend` ray the units are chunks of
    ``config.batch_size`` problems and the driver alone writes, in problem order. A KeyboardInterrupt propagates
    after the finished traces are saved.
    """
    from tqdm import tqdm

    from models.loading import load_tokenizer
    from tasks.engines import HFEngine, load_engine
    from tasks.prompts import build_prompt_ids, uses_chat_template

    backend = backend or BackendConfig()
    check_engine(config.engine)  # a missing vLLM is reported before anything is read or loaded
    if config.engine == "vllm" and backend.backend != "serial":
        raise UsageError("--engine vllm batches every problem in one vLLM engine; it does not run on --backend ray")
    # Bad input, a request beyond the model's context or the machine's memory: refused before --out is claimed.
    problems = list(config.problems() if problems is None else problems)
    tokenizer = lm.tokenizer if lm is not None else load_tokenizer(config.model)
    prompts = {p.id: build_prompt_ids(tokenizer, p) for p in problems}
    config.check_prompts(prompts)
    config.check_memory(prompts, backend)
    out = Path(out)
    with RunDir(out, config.identity()) as run, connected(backend):
        store = run.store("generations.jsonl")  # a damaged output is refused before the model loads
        # The driver's engine describes the run and is the serial backend's worker.
        engine = load_engine(config.engine, config.model, batch_size=config.batch_size, device=config.device,
                             dtype=config.dtype, seed=config.seed, lm=lm)
        try:
            run.save_config(
                **dataclasses.asdict(config),
                out=str(out),
                loaded_model=engine.lm.describe() if isinstance(engine, HFEngine) else {"name": config.model},
                loaded_engine=engine.describe(),
                prompt_format="chat_template" if uses_chat_template(engine.tokenizer) else "plain (no chat template)",
                backend=dataclasses.asdict(backend),
            )
            todo = [p for p in problems if p.id not in store]
            if len(todo) < len(problems):
                print(f"resuming: {len(problems) - len(todo)} of {len(problems)} problems already in {store.path}")
            with tqdm(total=len(problems), initial=len(problems) - len(todo), desc=label or config.dataset,
                      unit="problem", file=sys.stderr) as bar:

                def finished(trace: Trace) -> None:
                    store.append(trace.to_json())
                    bar.update(1)
                    if on_trace is not None:
                        on_trace(trace)

                def finished_chunk(_: list[Problem], traces: list[Trace]) -> None:
                    for trace in traces:
                        finished(trace)

                if backend.backend == "serial":
                    for trace in generate_traces(engine, todo, config):
                        finished(trace)
                else:
                    size = config.batch_size
                    run_units([todo[i:i + size] for i in range(0, len(todo), size)],
                              functools.partial(load_generator, config), generate_chunk, backend,
                              on_result=finished_chunk)
        finally:
            engine.close()
        wanted = {p.id for p in problems}
        by_id = {str(r.get("id")): Trace.from_json(r, f"{store.path}: record {r.get('id')!r}")
                 for r in store.records if str(r.get("id")) in wanted}
        traces = [by_id[p.id] for p in problems]
        summary = {**summarize(traces), "model": config.model, "dataset": config.dataset, "engine": engine.describe()}
        write_json(out / "summary.json", summary)
    return traces, summary


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config = GenerationConfig.from_flags(vars(args))
    backend = BackendConfig.from_flags(vars(args))
    out = Path(args.out) if args.out else _default_out(config.model, config.dataset)

    def report(trace: Trace) -> None:
        if args.quiet:
            return
        from tqdm import tqdm

        tqdm.write(f"[{trace.id}] gold={_short(trace.gold, 30)} answer={_short(trace.answer, 30)} "
            f"{'correct' if trace.correct else 'wrong'} ({len(trace.generated_ids)} tokens, {trace.finish_reason}, "
            f"{trace.timings['tokens_per_s']:.1f} tok/s)")

    try:
        traces, summary = generate_run(config, out, backend, on_trace=report)
    except KeyboardInterrupt:
        print(f"\ninterrupted; the finished traces are saved in {out / 'generations.jsonl'}; rerun the same command "
              "to resume", file=sys.stderr)
        return 130
    speed = summary["median_tokens_per_s"]
    print(format_table(traces))
    print(
        f"\n{config.dataset} with {config.model}: accuracy {summary['accuracy']:.1%} "
        f"({summary['correct']}/{summary['problems']}); no answer {summary['no_answer']}, "
        f"empty {summary['empty_output']}, hit max-new-tokens {summary['truncated']}; "
        f"median {'-' if speed is None else f'{speed:.1f}'} tok/s\n"
        f"written to {out}/ (generations.jsonl, summary.json, config.json)"
    )
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    from tasks.run import main  # this module under its own name, so Ray workers unpickle its functions from there

    raise SystemExit(main())
