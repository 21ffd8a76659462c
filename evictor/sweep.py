"""An eviction sweep as a library: ``run_sweep(SweepConfig(...), out)`` decodes every problem under every cell (one
(policy, budget) pair) with decode-time KV eviction, grades it, and returns the `core.schemas.Cell` rows.

The unit of work is a `Batch` (one cell's ``batch_size`` problems, decoded together by `run_batch` on a worker's
`SweepWorker`), so `core.backend` can spread a sweep's cells over Ray workers; records are appended as each batch
finishes, and ``out`` is a `core.rundir.RunDir` whose cells carry their own identity, so a rerun resumes and may add
cells but never mixes records made differently. `evictor.run` is its command line; `evictor.summary` tabulates it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.backend import BackendConfig, connected, run_units
from core.cli import atomic_write
from core.errors import UsageError
from core.limits import Footprint, MemoryLimit
from core.paths import portable_path
from core.rundir import RunDir, check_identity
from core.schemas import Cell, Trace, read_records
from core.seeds import derive_seed
from evictor.policy import configured_policy
from evictor.protocol import (
    OVERRIDABLE,
    SAMPLING_FIELDS,
    Budget,
    Protocol,
    resolve_protocol,
    sequence_budgets,
    token_flags,
)
from evictor.summary import SweepCell, never_evicted_warning, summarise_cell, write_summary
from tasks.problem import Problem
from tasks.run import GenerationConfig, graded_trace

# Protocol fields no preset sets: the budget is per cell, the seed is the generation seed, the keep-log changes no
# token.
PER_RUN = ("budget", "seed", "keep_log")
# A known-answer problem's constructed trace is read in blocks of this many tokens, a round after each (a chunked
# prefill under eviction, `EvictionEngine.generate`): it is context the model reads, not tokens it generates, and one
# decode step per token made the forced traces most of a sweep's time on a CPU. Every policy reads it the same way.
FORCED_BLOCK = 32
# The settings a preset chooses (sampling aside: it is part of the generation's identity).
PRESET_SETTINGS = tuple(key for key in OVERRIDABLE if key not in (*PER_RUN, *SAMPLING_FIELDS))


@dataclass(frozen=True)
class SweepConfig:
    """An eviction sweep: what is generated (`GenerationConfig`, its sampling the protocol's), under which protocol
    (a preset of `evictor.protocol` and the settings given explicitly), with which cells."""

    generation: GenerationConfig
    policies: tuple[str, ...]
    budgets: tuple[Budget, ...]  # tokens, or fractions of the reference length
    protocol: str = "custom"
    protocol_settings: dict[str, Any] = field(default_factory=dict)  # explicit settings: they override the preset
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy name (--policy-config)
    kernel: str | None = None  # None: sdpa, or FlashAttention-2 on CUDA
    reference: str | None = None  # a dense run giving the length L of fractional budgets
    batch_size: int = 1
    keep_log: bool = False

    def protocol_for(self, budget: Budget | None) -> Protocol:
        """The resolved protocol of the cell at `budget` (None: a never-evicting cell); a fraction leaves the protocol
        without a K of its own, each problem getting its own. Budget-dependent settings (EpiKV's recency window
        min(128, K/4)) resolve per problem, from each problem's own K."""
        resolved = resolve_protocol(self.protocol, self.protocol_settings)
        config = dataclasses.replace(resolved.config, budget=(self.budgets[0] if budget is None else budget).tokens,
                                     seed=self.generation.seed, keep_log=self.keep_log)
        return dataclasses.replace(resolved, config=config)

    def check(self) -> None:
        """Refuse a sweep no cell can run, before anything is loaded or written: no policy or budget, a budget or
        protocol setting no protocol takes, or a generation that does not sample as the protocol says (records state
        the protocol's sampling: set it in `protocol_settings`, ``temperature`` and ``top_p``, and in `generation`)."""
        if not self.policies or not self.budgets:
            raise UsageError(f"a sweep needs at least one policy and one budget, got policies {list(self.policies)} "
                             f"and budgets {list(self.budgets)}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UsageError(f"--batch-size must be a positive integer, got {self.batch_size!r}")
        sampling = dataclasses.asdict(self.protocol_for(None).sampling)
        for budget in self.budgets[1:]:
            self.protocol_for(budget)
        generated = {key: getattr(self.generation, key) for key in sampling}
        if generated != sampling:
            raise UsageError(f"the generation samples with {generated} but protocol {self.protocol!r} with {sampling}; "
                             "give the protocol's sampling to both (protocol_settings and the GenerationConfig)")

    def footprint(self, prompt_lens: Mapping[str, int], forced: int, reference: Mapping[str, int] | None
                  ) -> Footprint:
        """The peak memory of the sweep's largest cell (cells run one after another) over problems whose prompts
        have `prompt_lens` tokens (id -> length) and whose forced traces at most `forced`
        (`evictor.engine.eviction_footprint`; fractional budgets resolve as `problem_budgets` does)."""
        from evictor.engine import eviction_footprint
        from models.footprint import model_shape

        generation = self.generation
        shape = model_shape(generation.model, generation.dtype, generation.device)
        policies = make_policies(self)
        footprints = []
        for cell in sweep_cells(self):
            budgets = problem_budgets(cell, list(prompt_lens), reference, generation.max_new_tokens)
            footprints.append(eviction_footprint(
                shape, policies[cell.policy], self.protocol_for(cell.budget).config, list(prompt_lens.values()),
                forced + generation.max_new_tokens, self.batch_size, budget=max(budgets) if budgets else None,
                eager=self.kernel == "eager"))
        return max(footprints, key=lambda footprint: footprint.total)

    def check_memory(self, prompt_lens: Mapping[str, int], forced: int, reference: Mapping[str, int] | None,
                     backend: BackendConfig) -> None:
        """Refuse the sweep when this machine (the driver and any local Ray workers, `BackendConfig.footprint`)
        would need more memory for its largest cell than the device has or ``--max-memory`` allows."""
        from models.footprint import model_shape

        generation = self.generation
        driver = model_shape(generation.model, generation.dtype, generation.device).weights()
        rows = min(self.batch_size, len(prompt_lens))
        workers = f" on {backend.workers} local Ray workers" if backend.local_workers else ""
        backend.footprint(driver, self.footprint(prompt_lens, forced, reference)).check(
            f"{generation.model} decoding {rows} sequence(s) at once (--batch-size {self.batch_size}), each up to "
            f"{max(prompt_lens.values())} prompt + {forced} forced + --max-new-tokens {generation.max_new_tokens} "
            f"tokens{workers},",
            MemoryLimit.of(generation.device, generation.max_memory),
            "lower --batch-size, --max-new-tokens or --budget" + (" or --workers" if workers else ""))

    def identity(self) -> dict[str, Any]:
        """The settings every cell shares, as asked: the preset and every setting it chooses (None: the preset's
        value). A cell adds its policy, budget and resolved protocol."""
        settings = {key: self.protocol_settings.get(key) for key in PRESET_SETTINGS}
        return {**self.generation.identity(), "preset": self.protocol, **settings, "kernel": self.kernel,
                "reference": self.reference}


@dataclass(frozen=True)
class Batch:
    """The unit of work of a sweep: one cell's problems, decoded together, with their prompts and effective budgets
    (resolved by the driver, which alone reads the data and the reference run)."""

    cell: SweepCell
    problems: tuple[Problem, ...]
    prompts: list[list[int]]
    budgets: list[int] | None  # None: the policy never evicts
    forced: list[list[int]] | None = None  # per problem, the scripted trace teacher-forced first (known-answer tasks)


@dataclass
class DecodedBatch:
    """A `Batch`'s traces, and each problem's keep-log arrays (None without --keep-log) for the driver to write."""

    traces: list[Trace]
    keep_logs: list[dict[str, Any] | None]


@dataclass
class SweepWorker:
    """What a worker holds: one `evictor.engine.EvictionEngine` per cell of the sweep (by label), over one loaded
    model."""

    engines: dict[str, Any]
    config: SweepConfig


def reference_lengths(path: str, model: str | None = None) -> dict[str, int]:
    """Problem id -> dense generated length of a ``--policy full`` run (a directory or its generations.jsonl) of
    `model` (None: any)."""
    file = Path(path).expanduser()
    file = file / "generations.jsonl" if file.is_dir() else file
    if not file.is_file():
        raise UsageError(f"--reference {path!r}: no generations.jsonl there")
    try:
        traces = read_records(file, Trace)
    except UsageError as err:
        raise UsageError(f"--reference: {err}") from None
    evicted = next((t for t in traces if t.policy != "full"), None)
    if evicted is not None:
        raise UsageError(
            f"--reference {path!r}: problem {evicted.id!r} was generated under eviction (policy "
            f"{evicted.policy!r}), so its length is not the dense L; give a --policy full run"
        )
    other = next((t for t in traces if model is not None and portable_path(t.model) != portable_path(model)), None)
    if other is not None:
        raise UsageError(f"--reference {path!r}: problem {other.id!r} was generated by {other.model!r}, not by "
                         f"--model {model!r}, so its length is not this model's dense L")
    return {t.id: len(t.generated_ids) for t in traces}


def make_policies(config: SweepConfig) -> dict[str, Any]:
    """The sweep's policies by name, configured; an unknown parameter in --policy-config is a `UsageError`."""
    return {name: configured_policy(name, config.policy_params.get(name, {})) for name in config.policies}


def sweep_cells(config: SweepConfig) -> list[SweepCell]:
    """One cell per (policy, budget); a policy that never evicts has one cell, without a budget."""
    return [SweepCell(name, config.policy_params.get(name, {}), budget)
            for name, policy in make_policies(config).items()
            for budget in ([None] if policy.scores_nothing else config.budgets)]


def build_engines(lm, config: SweepConfig) -> dict[str, Any]:
    """Cell label -> `EvictionEngine` of that cell's policy under that cell's protocol."""
    from evictor.engine import EvictionEngine

    policies = make_policies(config)
    return {cell.label: EvictionEngine(lm, policies[cell.policy], config.protocol_for(cell.budget).config)
            for cell in sweep_cells(config)}


def load_sweep_worker(config: SweepConfig) -> SweepWorker:
    """A worker's `SweepWorker`: the model of `config`, loaded once, and its engines."""
    from models.loading import load_model

    generation = config.generation
    lm = load_model(
        generation.model, device=generation.device, dtype=generation.dtype, attn_implementation=config.kernel
    )
    return SweepWorker(build_engines(lm, config), config)


def problem_budgets(
    cell: SweepCell, problem_ids: Sequence[str], reference: Mapping[str, int] | None, max_new_tokens: int
) -> list[int] | None:
    """Each problem's effective K: a fractional budget resolves against its reference length (else
    `max_new_tokens`)."""
    if cell.budget is None:
        return None
    lengths = [reference[problem_id] if reference is not None else max_new_tokens for problem_id in problem_ids]
    return [cell.budget.resolve(n) for n in lengths]


def check_budgets_fit(config: SweepConfig, prompt_lens: Mapping[str, int], reference: Mapping[str, int] | None) -> None:
    """Refuse a sweep in which some problem's protected prompt (plus its recency window) does not fit some cell's
    budget (`evictor.protocol.sequence_budgets`), from the lengths alone: `prompt_lens` and `reference` map problem
    ids to prompt and dense generated lengths (None: fractions resolve against max_new_tokens). The sweep checks it
    before it writes anything, and a study right after its traces, hours before its evictor stage would fail."""
    policies = make_policies(config)
    for cell in sweep_cells(config):
        budgets = problem_budgets(cell, list(prompt_lens), reference, config.generation.max_new_tokens)
        if budgets is None:
            continue
        policy, eviction = policies[cell.policy], config.protocol_for(cell.budget).config
        protect = eviction.protect or policy.default_protection
        for (problem_id, prompt_len), budget in zip(prompt_lens.items(), budgets):
            sequence_budgets([budget], [prompt_len], protect, eviction, [f"{cell.label}, problem {problem_id}"],
                             policy.kept_recent)


def keep_log_name(problem_id: str) -> str:
    """Where a problem's keep-log goes, relative to its cell's directory."""
    return f"keeplogs/{zlib.crc32(problem_id.encode()):08x}.npz"


def record_protocol(engine, protocol: Protocol) -> dict[str, Any]:
    """The resolved protocol a cell ran with, as every record and summary row states it: the preset, every eviction
    setting, the protection and kernel the engine resolved, the sampling, and which settings were given explicitly
    (policy and budget are recorded on their own)."""
    resolved = {k: v for k, v in engine.describe().items() if k not in ("policy", "budget", "keep_log")}
    return {"protocol": protocol.preset, **resolved, **dataclasses.asdict(protocol.sampling),
            "explicit": list(protocol.explicit)}


def cell_identity(engine, protocol: Protocol, cell: SweepCell, shared: dict[str, Any]) -> dict[str, Any]:
    """What a cell's records depend on: the shared settings, the policy as configured, the budget, the resolved
    protocol (protection, kernel, query window)."""
    resolved = {k: v for k, v in record_protocol(engine, protocol).items() if k != "seed"}
    return {**shared, "policy": engine.policy.config(), "budget": cell.written_budget, "protocol": resolved}


def run_batch(worker: SweepWorker, batch: Batch) -> DecodedBatch:
    """Decode `batch` together under its policy's engine and grade it: one `Trace` per problem, eviction fields set.

    The batch draws from a seed derived from the run seed and its problems, so a resumed run redraws the same. Nothing
    is written: keep-logs come back as arrays, and the trace names the file the driver writes them to.
    """
    import numpy as np

    engine, generation, cell = worker.engines[batch.cell.label], worker.config.generation, batch.cell
    ids = [p.id for p in batch.problems]
    started = time.perf_counter()
    result = engine.generate(
        batch.prompts,
        generation.max_new_tokens,
        budgets=batch.budgets,
        temperature=generation.temperature,
        top_p=generation.top_p,
        seed=derive_seed(generation.seed, ids),
        forced=batch.forced,
        forced_block=FORCED_BLOCK,
    )
    wall = time.perf_counter() - started
    stats = result.stats
    memory = stats.get("cuda_peak_allocated_bytes", stats.get("peak_rss_bytes"))
    protocol = record_protocol(engine, worker.config.protocol_for(cell.budget))
    traces, keep_logs = [], []
    for problem, seq in zip(batch.problems, result.sequences):
        keep_log = None if seq.keep_log is None else {**seq.keep_log, "problem_id": np.asarray(problem.id)}
        keep_logs.append(keep_log)
        later = len(seq.generated_ids) - 1
        traces.append(
            graded_trace(
                problem,
                model=generation.model,
                prompt_ids=seq.prompt_ids,
                generated_ids=seq.generated_ids,
                text=engine.lm.tokenizer.decode(seq.generated_ids, skip_special_tokens=True),
                finish_reason=seq.finish_reason,
                sampling=generation.sampling,
                timings={
                    "prefill_s": round(stats["prefill_s"], 4),
                    "decode_s": round(stats["decode_s"], 4),
                    "tokens_per_s": round(later / stats["decode_s"], 3) if later > 0 and stats["decode_s"] > 0 else 0.0,
                    "batch_decode_tokens_per_s": stats["decode_tokens_per_s"],
                    "wall_s": round(wall, 4),
                },
                policy=cell.policy,
                policy_config=engine.policy.config(),
                budget=cell.written_budget,
                budget_tokens=seq.budget,
                protocol=protocol,
                eviction={
                    "rounds": seq.rounds,
                    "recency": seq.recency,  # this problem's window: EpiKV's min(128, K/4) differs per problem
                    "outside_protocol": seq.outside_protocol,  # why not the method's protocol (None: it is)
                    "batch_decode_rounds": stats["decode_rounds"],
                    "round_ms_mean": stats["round_ms_mean"],
                    "round_ms_median": stats["round_ms_median"],
                    "round_share": stats["round_share"],
                    "score_s": stats["score_s"],
                    "compact_s": stats["compact_s"],
                    "observe_s": stats["observe_s"],
                    "prefill_rounds": stats["prefill_rounds"],
                    "peak_slots": max(seq.cache_sizes),
                    "peak_cache_bytes": stats["peak_cache_bytes"],
                    "cache_allocated_peak_bytes": stats["cache_allocated_peak_bytes"],
                    "peak_memory_bytes": memory,
                    "memory_kind": "cuda_allocator" if "cuda_peak_allocated_bytes" in stats else "process_rss",
                    "attention_requests": stats["attention_requests"],
                },
                cache_sizes=seq.cache_sizes,
                batch={"size": len(batch.problems), "ids": ids},
                keep_log=None if keep_log is None else keep_log_name(problem.id),
            )
        )
    return DecodedBatch(traces, keep_logs)



def run_sweep(config: SweepConfig, out: str | Path, *, backend: BackendConfig | None = None,
              quiet: bool = False) -> list[Cell]:
    """Run the sweep `config` into the directory `out` and return its `Cell` rows (also in summary.csv/.json).

    Everything is checked before `out` is claimed or written (the policies and their parameters, the protocol,
    the problems, the --reference run, then, with the model loaded, each problem's protected prompt against its
    budget); bad input is a `UsageError`. Finished problems in `out` are reused: a rerun resumes, and may add cells.
    A line per batch goes to stderr unless `quiet`; a cell that never evicted is a warning line on stderr. A
    KeyboardInterrupt propagates after the finished batches are saved.
    """
    backend = backend or BackendConfig()
    config.check()
    generation = config.generation
    limits = generation.limits()
    for budget in config.budgets:
        if budget.tokens is not None:
            limits.check_tokens(f"--budget {budget}", budget.tokens,
                                "the cache could never fill, so no cell would evict")
    limits.check_flags(token_flags(config.protocol_settings))
    cells = sweep_cells(config)  # an unknown --policy-config parameter is refused before --out is claimed
    reference = reference_lengths(config.reference, generation.model) if config.reference is not None else None
    problems = generation.problems()
    if reference is not None:
        missing = [p.id for p in problems if p.id not in reference]
        if missing:
            raise UsageError(f"--reference {config.reference!r} has no record for problem(s) {', '.join(missing[:5])}")

    from models.loading import load_model, load_tokenizer
    from tasks.known_answer import scripted_ids
    from tasks.prompts import build_prompt_ids

    tokenizer = load_tokenizer(generation.model)
    prompts = {p.id: build_prompt_ids(tokenizer, p) for p in problems}
    # A known-answer problem's constructed trace is teacher-forced through the evicting decode path, then the
    # model answers from what the cache kept; every other problem generates its own trace.
    scripts = {p.id: scripted_ids(p, tokenizer) for p in problems}
    generation.check_prompts(prompts)
    check_budgets_fit(config, {p.id: len(prompts[p.id]) for p in problems}, reference)
    config.check_memory({p.id: len(prompts[p.id]) for p in problems},
                        max(len(script or []) for script in scripts.values()), reference, backend)

    out = Path(out)
    shared = config.identity()
    with RunDir(out, shared) as run, connected(backend):
        # The driver's own copy checks the settings against the model and is the serial backend's worker.
        lm = load_model(
            generation.model, device=generation.device, dtype=generation.dtype, attn_implementation=config.kernel
        )
        local = SweepWorker(build_engines(lm, config), config)
        sweep = len(cells) > 1 or len(config.budgets) > 1
        protocols = {cell.label: config.protocol_for(cell.budget) for cell in cells}
        runs = {}
        # Every check that needs the model runs before anything is written: nothing half-written on bad input.
        for cell in cells:
            engine = local.engines[cell.label]
            identity = cell_identity(engine, protocols[cell.label], cell, shared)
            if sweep:
                runs[cell.label] = run.child(cell.label, identity)
            else:  # the one cell lives in --out itself: its config holds the cell's identity
                check_identity(run.config_path, identity, f"--out {str(out)!r}")
                run.identity = identity
                runs[cell.label] = run

        from tqdm import tqdm

        settings = {
            "command": sys.argv,
            "generation": dataclasses.asdict(generation),
            "protocol": {label: protocol.to_dict() for label, protocol in protocols.items()},
            "kernel": config.kernel,
            "reference": config.reference,
            "batch_size": config.batch_size,
            "loaded_model": lm.describe(),
            "backend": dataclasses.asdict(backend),
        }
        if sweep:
            run.save_config(cells=[c.label for c in cells], **settings)
        stores = {}
        for cell in cells:
            runs[cell.label].save_config(**settings)
            stores[cell.label] = runs[cell.label].store("generations.jsonl")
        batches = []
        for cell in cells:
            todo = [p for p in problems if p.id not in stores[cell.label]]
            if reference is not None:  # a batch decodes until its longest row stops: batch problems of like length
                todo.sort(key=lambda p: reference[p.id])
            for start in range(0, len(todo), config.batch_size):
                chunk = todo[start : start + config.batch_size]
                chunk_budgets = problem_budgets(cell, [p.id for p in chunk], reference, generation.max_new_tokens)
                forced = [scripts[p.id] or [] for p in chunk]
                batches.append(Batch(cell, tuple(chunk), [prompts[p.id] for p in chunk], chunk_budgets,
                                     forced if any(forced) else None))
        total = len(cells) * len(problems)
        say = (lambda *_: None) if quiet else tqdm.write

        def commit(batch: Batch, decoded: DecodedBatch) -> None:
            cell_dir = runs[batch.cell.label].path
            for trace, keep_log in zip(decoded.traces, decoded.keep_logs):
                if keep_log is not None:
                    _write_keep_log(cell_dir / trace.extra["keep_log"], keep_log)
                stores[batch.cell.label].append(trace.to_json())

        with tqdm(
            total=total,
            initial=total - sum(len(b.problems) for b in batches),
            unit="problem",
            file=sys.stderr,
            desc="evictor",
        ) as bar:

            def progress(batch: Batch, decoded: DecodedBatch) -> None:
                bar.update(len(batch.problems))
                done = []
                for t in decoded.traces:
                    assert t.eviction is not None  # run_batch sets every trace's eviction fields
                    done.append(f"{t.id}: {'correct' if t.correct else 'wrong'} ({len(t.generated_ids)} tok, "
                                f"{t.eviction['rounds']} rounds)")
                say(f"[{batch.cell.label}] " + "; ".join(done))

            run_units(
                batches,
                functools.partial(load_sweep_worker, config),
                run_batch,
                backend,
                on_result=commit,
                progress=progress,
                local_worker=local,
            )

        wanted = {p.id for p in problems}
        rows = []
        for cell in cells:
            store = stores[cell.label]
            traces = [
                Trace.from_json(r, f"{store.path}: record {r.get('id')!r}")
                for r in store.records
                if str(r.get("id")) in wanted
            ]
            engine = local.engines[cell.label]
            rows.append(summarise_cell(cell, traces, record_protocol(engine, protocols[cell.label])))
            warning = never_evicted_warning(cell, traces, engine.config)
            if warning:
                print(warning, file=sys.stderr)
        write_summary(out, rows)
    return rows


def _write_keep_log(path: Path, arrays: dict[str, Any]) -> None:
    import numpy as np

    with atomic_write(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)

