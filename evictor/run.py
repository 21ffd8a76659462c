"""Generate with decode-time KV eviction, grade, and tabulate: ``python -m evictor.run --policy P --budget K ...``.

One *cell* is a (policy, budget) pair. With one cell the records go to ``OUT/generations.jsonl``; a sweep
(``--policy all`` or a comma list, and/or a comma list of budgets) writes ``OUT/<policy>-K<budget>/generations.jsonl``
per cell. Either way ``OUT/summary.csv`` and ``OUT/summary.json`` hold one `core.schemas.Cell` row per cell (accuracy
with its Wilson 95% interval ``ci_lo``/``ci_hi``, cost, peak cache slots per head) and ``config.json`` files the
resolved settings. Records are `core.schemas.Trace` records with the eviction fields set (so ``--policy full`` output
serves as a dense trace), appended as each batch finishes.

Protocol: ``--protocol random_attention|epikv|valuediff|custom`` (`evictor.protocol.PRESETS`) sets the trigger,
buffer, recency window, budget scope, prefill blocks and sampling as that paper states them; the protocol flags
(``--buffer``, ``--trigger``, ...) override it. Each cell resolves the protocol at its own budget (EpiKV's recency
window is min(128, K/4)); every trace and summary row records the resolved protocol (``protocol``: the preset, every
setting, the protection, the sampling and which settings were explicit) and its peak cache slots per head, and each
trace its own recency window (``eviction["recency"]``).

Policies: ``--policy all`` runs every registered policy except the calibrated ones (TriAttention, ThinKV), which need
a per-model calibration file; a line says so and how to include them: ``--policy-config FILE`` (repeatable, one file
per policy) gives a policy its parameters, its calibration file among them.

``OUT`` is claimed with a `core.rundir.RunDir`: a second run on it exits at once, and a rerun resumes only with the
same shared settings (model, data, generation, protocol preset and explicit settings); each cell directory has its
own identity (policy configuration, budget, resolved protocol), so a rerun may add cells to a sweep but never mixes
records made differently.

``--backend ray --workers N`` spreads the work over N Ray workers (`core.backend`), here or on a cluster: the unit of
work is a `Batch`, one cell's batch of ``--batch-size`` problems, so the workers share the cells of a sweep, and the
records (and keep-logs) are those of a serial run, in the same order.

Library: ``run_sweep(SweepConfig(...), out)`` does all of it (problems, reference, run directory, cells, summary)
and returns the `Cell` rows; the command line parses its flags into a `SweepConfig` and prints the table.

Budget semantics (what K counts, triggers, the buffer, prompt protection): see `evictor.protocol`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import io
import json
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.backend import BackendConfig, add_backend_arguments, connected, run_units
from core.cli import ArgumentParser, add_device_arguments, atomic_write, main_guard, positive_int, seed_int, write_json
from core.errors import UsageError
from core.rundir import RunDir, check_identity
from core.schemas import Cell, Trace, read_records
from core.seeds import derive_seed
from evictor.policy import configured_policy, left_out_line, read_policy_configs, select_policies
from evictor.protocol import (
    OVERRIDABLE,
    SAMPLING_FIELDS,
    Budget,
    EvictionConfig,
    Protocol,
    add_protocol_arguments,
    parse_budgets,
    protocol_overrides,
    resolve_protocol,
    token_flags,
)
from models.loading import KERNELS
from models.registry import DEFAULT_MODEL, REGISTRY
from tasks.problem import Problem
from tasks.run import GenerationConfig, graded_trace, summarize

# Protocol fields no preset sets: the budget is per cell, the seed is the generation seed, the keep-log changes no
# token.
_PER_RUN = ("budget", "seed", "keep_log")
# A known-answer problem's constructed trace is read in blocks of this many tokens, a round after each (a chunked
# prefill under eviction, `EvictionEngine.generate`): it is context the model reads, not tokens it generates, and one
# decode step per token made the forced traces most of a sweep's time on a CPU. Every policy reads it the same way.
FORCED_BLOCK = 32
# The settings a preset chooses (sampling aside: it is part of the generation's identity).
PRESET_SETTINGS = tuple(key for key in OVERRIDABLE if key not in (*_PER_RUN, *SAMPLING_FIELDS))


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

    def identity(self) -> dict[str, Any]:
        """The settings every cell shares, as asked: the preset and every setting it chooses (None: the preset's
        value). A cell adds its policy, budget and resolved protocol."""
        settings = {key: self.protocol_settings.get(key) for key in PRESET_SETTINGS}
        return {**self.generation.identity(), "preset": self.protocol, **settings, "kernel": self.kernel,
                "reference": self.reference}


@dataclass(frozen=True)
class SweepCell:
    policy: str
    params: dict[str, Any]
    budget: Budget | None  # None: the policy never evicts

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}-K{self.budget:g}"

    @property
    def written_budget(self) -> int | float | None:
        """The budget as records, summary rows and identities write it (`Budget.to_json`); None: never evicts."""
        return None if self.budget is None else self.budget.to_json()


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


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m evictor.run",
        description="Generate answers with decode-time KV-cache eviction (physical, per KV head), grade them, and "
        "write per-problem records and a results table. --protocol chooses a paper's eviction protocol (trigger, "
        "buffer, recency window, what K counts, sampling); the flags after it override single settings. Under the "
        "default (custom) K counts the protected tokens and the recency window and the recent buffer r comes on top "
        "(after a round the cache holds K + r per head); under epikv K counts only the scored tokens.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name ({', '.join(sorted(REGISTRY))}), local HF directory, .gguf file or hub id",
    )
    p.add_argument("--dataset", required=True, help="benchmark (see tasks.datasets.DATASETS)")
    p.add_argument("--data-file", default=None, help="read problems from this JSONL instead of $KVSCOPE_DATA_DIR")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N problems")
    p.add_argument(
        "--policy",
        default=None,
        help="policy name, comma list, or 'all' (every registered policy except those that need a per-model "
        "calibration file, unless --policy-config gives one); see python -m evictor.policies",
    )
    p.add_argument(
        "--policy-config",
        action="append",
        default=None,
        metavar="FILE",
        help='JSON file {"policy": name, "params": {...}}: parameters for that policy (validation.select writes '
        "them); repeat for several policies, one file each; each file's policy runs beside those --policy names",
    )
    p.add_argument(
        "--budget",
        default="1024",
        help="K per head: a whole number of tokens >= 2, or a fraction f in (0, 1] = ceil(f * L) with L the "
        "problem's dense trace length from --reference (else --max-new-tokens; 1 is the whole L); comma list to "
        "sweep (default: 1024)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="a --policy full run (directory or generations.jsonl) giving L for fractional budgets",
    )
    add_protocol_arguments(p)
    p.add_argument(
        "--shared",
        action="store_true",
        default=None,
        help="force one keep set per layer (mean of per-head scores)",
    )
    p.add_argument(
        "--query-window",
        type=positive_int,
        default=None,
        help="for attention-requiring policies: the recent queries whose attention counts (default: the "
        "policy's own, e.g. every query since entry for H2O)",
    )
    p.add_argument("--kernel", default=None, choices=KERNELS, help="attention kernel (default: sdpa, or FA2 on CUDA)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="problems decoded together (left-padded)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="generation cap (default: 512)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="seeds random policies and sampling, per batch (default: 0)")
    p.add_argument(
        "--keep-log", action="store_true", help="save evicted positions per round/layer/head (keeplogs/*.npz)"
    )
    add_device_arguments(p)
    add_backend_arguments(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quiet", action="store_true", help="no line per batch")
    return p


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
    other = next((t for t in traces if model is not None and t.model != model), None)
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
    cell: SweepCell, problems: Sequence[Problem], reference: dict[str, int] | None, max_new_tokens: int
) -> list[int] | None:
    """Each problem's effective K: a fractional budget resolves against its reference length (else
    `max_new_tokens`)."""
    if cell.budget is None:
        return None
    lengths = [reference[p.id] if reference is not None else max_new_tokens for p in problems]
    return [cell.budget.resolve(n) for n in lengths]


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


def summarise_cell(cell: SweepCell, traces: Sequence[Trace], protocol: dict[str, Any] | None = None) -> Cell:
    """The cell's row: `tasks.run.summarize` of its traces, a Wilson 95% interval on accuracy, eviction cost, size."""
    from validation.stats import wilson_interval

    counts = summarize(traces)
    lo, hi = wilson_interval(counts["correct"], counts["problems"]) if counts["problems"] else (None, None)
    evictions = [t.eviction or {} for t in traces]

    def mean(key: str) -> float | None:
        values = [e[key] for e in evictions if e.get(key) is not None]
        return statistics.fmean(values) if values else None

    def most(key: str) -> int | None:
        return max((e[key] for e in evictions if e.get(key) is not None), default=None)

    outside = [e["outside_protocol"] for e in evictions if e.get("outside_protocol")]

    return Cell(
        id=cell.label,
        policy=cell.policy,
        budget=cell.written_budget,
        params=cell.params,
        protocol=protocol,
        ci_lo=lo,
        ci_hi=hi,
        **counts,
        mean_rounds=mean("rounds"),
        mean_round_ms=mean("round_ms_mean"),
        mean_round_share=mean("round_share"),
        max_peak_slots=most("peak_slots"),
        max_peak_cache_bytes=most("peak_cache_bytes"),
        max_peak_memory_bytes=most("peak_memory_bytes"),
        outside_protocol=f"{len(outside)} of {len(traces)} problems: {outside[0]}" if outside else None,
    )


def never_evicted_warning(cell: SweepCell, traces: Sequence[Trace], protocol: EvictionConfig) -> str | None:
    """One line when a cell with a budget never ran an eviction round: it then equals dense decoding."""
    if cell.budget is None or not traces or any((t.eviction or {}).get("rounds") for t in traces):
        return None
    longest = max(len(t.prompt_ids) + len(t.generated_ids) for t in traces)
    ks = sorted({t.budget_tokens for t in traces if t.budget_tokens is not None})
    k = "-" if not ks else f"{ks[0]}" if len(ks) == 1 else f"{ks[0]}..{ks[-1]}"
    return (
        f"warning: {cell.label} equals dense decoding: none of its {len(traces)} problems ran an eviction round, "
        f"because the longest context ({longest} tokens, prompt + generated) never outgrew the budget (K={k}, "
        f"buffer {protocol.buffer}, trigger {protocol.trigger}); lower --budget or raise --max-new-tokens"
    )


def csv_value(value: Any) -> Any:
    """A value as a CSV cell: None empty, an object or list as its JSON text."""
    if value is None:
        return ""
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value


def write_summary(out: Path, cells: Sequence[Cell]) -> None:
    """``summary.json`` and ``summary.csv``: one row per cell, the columns `core.schemas.Cell`'s fields."""
    rows = [cell.to_json() for cell in cells]
    write_json(out / "summary.json", rows)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({k: csv_value(v) for k, v in row.items()} for row in rows)
    with atomic_write(out / "summary.csv") as handle:
        handle.write(buffer.getvalue())


def _format_table(cells: Sequence[Cell]) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    header = (
        f"{'cell':<28} {'n':>4} {'acc':>6} {'95% CI':>13} {'noans':>5} {'empty':>5} {'trunc':>5} {'tokens':>7} "
        f"{'tok/s':>7} {'rounds':>7} {'ms/rnd':>7} {'share':>6} {'slots':>6} {'cacheMB':>8}"
    )
    lines = [header, "-" * len(header)]
    for c in cells:
        cache_mb = None if c.max_peak_cache_bytes is None else c.max_peak_cache_bytes / 2**20
        interval = "-" if c.ci_lo is None else f"{c.ci_lo:.1%}-{c.ci_hi:.1%}"
        lines.append(
            f"{c.id[:28]:<28} {c.problems:>4} {c.accuracy:>6.1%} {interval:>13} {c.no_answer:>5} {c.empty_output:>5} "
            f"{c.truncated:>5} {fmt(c.mean_generated, '7.1f')} {fmt(c.median_tokens_per_s, '7.2f')} "
            f"{fmt(c.mean_rounds, '7.1f')} {fmt(c.mean_round_ms, '7.2f')} {fmt(c.mean_round_share, '6.1%')} "
            f"{fmt(c.max_peak_slots, '6d')} {fmt(cache_mb, '8.2f')}"
        )
    return "\n".join(lines)


def _sweep_config(args: argparse.Namespace) -> tuple[SweepConfig, list[str]]:
    """The typed configuration of the command line and the policies ``--policy all`` left out; every flag is checked
    here, before --out is claimed."""
    params = read_policy_configs(args.policy_config or [])
    policies, left_out = select_policies(args.policy or ",".join(params), params)
    budgets = parse_budgets(args.budget)
    flags = vars(args)
    settings = {k: v for k, v in protocol_overrides(flags).items() if k not in _PER_RUN and v is not None}
    sampling = resolve_protocol(args.protocol, settings).sampling
    generation = GenerationConfig.from_flags({**flags, **dataclasses.asdict(sampling)})
    config = SweepConfig(
        generation=generation,
        policies=tuple(policies),
        budgets=budgets,
        protocol=args.protocol,
        protocol_settings=settings,
        policy_params=params,
        kernel=args.kernel,
        reference=args.reference,
        batch_size=args.batch_size,
        keep_log=args.keep_log,
    )
    config.check()
    return config, left_out


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
    for budget in (b for b in config.budgets if b.tokens is not None):
        limits.check_tokens(f"--budget {budget}", budget.tokens, "the cache could never fill, so no cell would evict")
    limits.check_flags(token_flags(config.protocol_settings))
    cells = sweep_cells(config)  # an unknown --policy-config parameter is refused before --out is claimed
    reference = reference_lengths(config.reference, generation.model) if config.reference is not None else None
    problems = generation.problems()
    if reference is not None:
        missing = [p.id for p in problems if p.id not in reference]
        if missing:
            raise UsageError(f"--reference {config.reference!r} has no record for problem(s) {', '.join(missing[:5])}")

    out = Path(out)
    shared = config.identity()
    with RunDir(out, shared) as run, connected(backend):
        from models.loading import load_model
        from tasks.known_answer import scripted_ids
        from tasks.prompts import build_prompt_ids

        # The driver's own copy checks the settings against the model and is the serial backend's worker.
        lm = load_model(
            generation.model, device=generation.device, dtype=generation.dtype, attn_implementation=config.kernel
        )
        local = SweepWorker(build_engines(lm, config), config)
        prompts = {p.id: build_prompt_ids(lm.tokenizer, p) for p in problems}
        # A known-answer problem's constructed trace is teacher-forced through the evicting decode path, then the
        # model answers from what the cache kept; every other problem generates its own trace.
        scripts = {p.id: scripted_ids(p, lm.tokenizer) for p in problems}
        generation.check_prompts(prompts)
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
            budgets = problem_budgets(cell, problems, reference, generation.max_new_tokens) or []
            for problem, k in zip(problems, budgets):  # protected prompt vs budget: fail now, not mid-run
                engine.sequence_budgets([k], [len(prompts[problem.id])],
                                        names=[f"{cell.label}, problem {problem.id}"])

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
            for start in range(0, len(todo), config.batch_size):
                chunk = todo[start : start + config.batch_size]
                budgets = problem_budgets(cell, chunk, reference, generation.max_new_tokens)
                forced = [scripts[p.id] or [] for p in chunk]
                batches.append(Batch(cell, tuple(chunk), [prompts[p.id] for p in chunk], budgets,
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
                say(
                    f"[{batch.cell.label}] "
                    + "; ".join(
                        f"{t.id}: {'correct' if t.correct else 'wrong'} ({len(t.generated_ids)} tok, "
                        f"{t.eviction['rounds']} rounds)"
                        for t in decoded.traces
                    )
                )

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


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config, left_out = _sweep_config(args)
    backend = BackendConfig.from_flags(vars(args))
    if left_out:
        print(left_out_line(left_out), file=sys.stderr)
    try:
        rows = run_sweep(config, args.out, backend=backend, quiet=args.quiet)
    except KeyboardInterrupt:
        print("\ninterrupted; finished batches are saved; rerun the same command to resume", file=sys.stderr)
        return 130
    print(_format_table(rows))
    print(f"\nwritten to {args.out}/ (summary.csv, summary.json; generations.jsonl per cell)")
    return 0


def _write_keep_log(path: Path, arrays: dict[str, Any]) -> None:
    import numpy as np

    with atomic_write(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)


main = main_guard(_run)

if __name__ == "__main__":
    from evictor.run import main  # this module under its own name, so Ray workers unpickle its functions from there

    raise SystemExit(main())
