"""Generate with decode-time KV eviction, grade, and tabulate: ``python -m evictor.run --policy P --budget K ...``.

One *cell* is a (policy, budget) pair. With one cell the records go to ``OUT/generations.jsonl``; a sweep
(``--policy all`` or a comma list, and/or a comma list of budgets) writes ``OUT/<policy>-K<budget>/generations.jsonl``
per cell. Either way ``OUT/summary.csv`` and ``OUT/summary.json`` hold one row per cell and ``config.json`` files
the resolved settings. Records are a superset of `tasks.run`'s (so ``--policy full`` output serves as a dense trace),
appended as each batch finishes; rerunning the same command resumes.

Budget semantics (what K counts, triggers, the buffer, prompt protection): see `evictor.protocol`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evictor.protocol import (
    ATTENTION_SOURCES,
    BUDGET_SCOPES,
    DEFAULT_BLOCK,
    DEFAULT_BUFFER,
    DEFAULT_SINKS,
    ON_LONG_PROMPT,
    PROTECTIONS,
    TRIGGERS,
    EvictionConfig,
    resolve_budget,
    sequence_budgets,
)
from core.cli import ArgumentParser, atomic_write, main_guard, non_negative_int, positive_int, save_config
from core.errors import UsageError, unknown_choice
from models.loading import KERNELS
from models.registry import DEFAULT_MODEL, REGISTRY

# Settings that change what a record contains: a resumed cell must match them exactly.
CELL_IDENTITY = ("model", "dataset", "data_source", "policy", "budget", "protocol", "max_new_tokens", "temperature",
                 "seed", "dtype", "kernel", "reference")


def parse_budgets(text: str) -> list[float]:
    """``"256,512,0.25"`` -> [256, 512, 0.25]; each a positive whole number of tokens or a fraction in (0, 1)."""
    budgets = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise UsageError(f"--budget {part!r} is not a number (tokens, or a fraction in (0, 1))") from None
        if not value > 0 or (value >= 1 and value != int(value)):
            raise UsageError(f"--budget {part!r} must be a positive whole number of tokens or a fraction in (0, 1)")
        budgets.append(int(value) if value >= 1 else value)
    return budgets


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m evictor.run",
        description="Generate answers with decode-time KV-cache eviction (physical, per KV head), grade them, and "
        "write per-problem records and a results table. Budget semantics: K counts the protected tokens and the "
        "recency window; the recent buffer r comes on top (after a round the cache holds K + r per head).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry name ({', '.join(sorted(REGISTRY))}), local HF directory, .gguf file or hub id")
    p.add_argument("--dataset", required=True, help="benchmark (see tasks.datasets.DATASETS)")
    p.add_argument("--data-file", default=None, help="read problems from this JSONL instead of $KVSCOPE_DATA_DIR")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N problems")
    p.add_argument("--policy", default=None,
                   help="policy name, comma list, or 'all' (every registered policy); see python -m evictor.policies")
    p.add_argument("--policy-config", default=None,
                   help='JSON file {"policy": name, "params": {...}}: parameters for that policy (it is also the '
                   "default --policy)")
    p.add_argument("--budget", default="1024",
                   help="K per head, tokens; or a fraction f in (0,1) = ceil(f * L) with L the problem's dense trace "
                   "length from --reference (else --max-new-tokens); comma list to sweep (default: 1024)")
    p.add_argument("--reference", default=None,
                   help="a --policy full run (directory or generations.jsonl) giving L for fractional budgets")
    p.add_argument("--buffer", type=non_negative_int, default=DEFAULT_BUFFER,
                   help=f"recent buffer r: the r newest tokens are never scored nor evicted, on top of K (default: {DEFAULT_BUFFER})")
    p.add_argument("--block", type=positive_int, default=DEFAULT_BLOCK,
                   help=f"prefill block size B; eviction at every block boundary, prefill peak K + r + B "
                   f"(B >= prompt length = ordinary prefill; default: {DEFAULT_BLOCK})")
    p.add_argument("--trigger", default="interval", choices=TRIGGERS,
                   help="interval: evict every r steps once the cache reaches K + 2r (Random Attention); step: evict "
                   "whenever over K + r (EpiKV/ValueDiff) (default: interval)")
    p.add_argument("--protect", default=None, choices=PROTECTIONS,
                   help="never evict the whole prompt, the first --n-sinks tokens, or nothing (default: the policy's)")
    p.add_argument("--n-sinks", type=non_negative_int, default=DEFAULT_SINKS, help=f"sink tokens for --protect sinks (default: {DEFAULT_SINKS})")
    p.add_argument("--recency", type=non_negative_int, default=0,
                   help="recency window w inside K: the w tokens before the buffer are kept unscored (EpiKV uses "
                   "min(128, K/4) with --buffer 0; default: 0)")
    p.add_argument("--budget-scope", default="all", choices=BUDGET_SCOPES,
                   help="all: K counts protected tokens and the recency window; trace: K counts only scored survivors")
    p.add_argument("--on-long-prompt", default="error", choices=ON_LONG_PROMPT,
                   help="if the protected prompt + recency window exceed K: error (default), expand K to fit it, or "
                   "protect only sinks for that problem")
    p.add_argument("--shared", action="store_true", help="force one keep set per layer (mean of per-head scores)")
    p.add_argument("--attention-source", default=None, choices=ATTENTION_SOURCES,
                   help="for attention-requiring policies: eager kernel weights (needs --kernel eager) or recomputed "
                   "attention of a window of recent queries (default: eager iff --kernel eager)")
    p.add_argument("--query-window", type=positive_int, default=None,
                   help="queries the attention covers (default: the policy's; 'since entry' = r with the window source)")
    p.add_argument("--kernel", default=None, choices=KERNELS, help="attention kernel (default: sdpa, or FA2 on CUDA)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="problems decoded together (left-padded)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="generation cap (default: 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="seeds random policies and sampling, per batch (default: 0)")
    p.add_argument("--keep-log", action="store_true", help="save evicted positions per round/layer/head (keeplogs/*.npz)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quiet", action="store_true", help="no line per batch")
    return p


@dataclass
class Cell:
    policy: str
    params: dict[str, Any]
    budget: float | None  # None: the policy never evicts
    directory: Path

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}-K{self.budget:g}"


def _policy_list(args, names: list[str], file_config: dict | None) -> list[str]:
    text = args.policy or (file_config or {}).get("policy")
    if not text:
        raise UsageError("give --policy (a name, a comma list or 'all') or --policy-config")
    if text == "all":
        return list(names)
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    for name in chosen:
        if name not in names:
            raise unknown_choice("policy", name, names)
    return list(dict.fromkeys(chosen))


def _read_policy_config(path: str | None) -> dict | None:
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"--policy-config {path!r} does not exist")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"--policy-config {path!r} is not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(config, dict) or "policy" not in config or not isinstance(config.get("params", {}), dict):
        raise UsageError(f'--policy-config {path!r} must be {{"policy": name, "params": {{...}}}}')
    return config


def _reference_lengths(path: str | None) -> dict[str, int] | None:
    if path is None:
        return None
    from core.records import read_jsonl

    file = Path(path).expanduser()
    file = file / "generations.jsonl" if file.is_dir() else file
    if not file.is_file():
        raise UsageError(f"--reference {path!r}: no generations.jsonl there")
    return {str(r["id"]): len(r["generated_ids"]) for r in read_jsonl(file)}


def _check_resumable(directory: Path, identity: dict) -> None:
    config_path = directory / "config.json"
    if not config_path.exists():
        return
    try:
        previous = json.loads(config_path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{config_path} is not valid JSON; use another --out") from None
    diffs = [k for k in CELL_IDENTITY if json.dumps(previous.get(k), sort_keys=True, default=str)
             != json.dumps(identity.get(k), sort_keys=True, default=str)]
    if diffs:
        raise UsageError(f"{directory} holds a run with different {', '.join(diffs)}; use another --out")


def _summarise(label: str, cell: Cell, records: list[dict]) -> dict:
    n = len(records)
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    evictions = [r["eviction"] for r in records]
    speeds = [r["timings"]["tokens_per_s"] for r in records if r["timings"]["tokens_per_s"]]
    round_ms = [e["round_ms_mean"] for e in evictions if e["round_ms_mean"] is not None]
    shares = [e["round_share"] for e in evictions if e["round_share"] is not None]
    return {
        "cell": label,
        "policy": cell.policy,
        "budget": "" if cell.budget is None else cell.budget,
        "problems": n,
        "correct": sum(r["correct"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / n if n else 0.0,
        "no_answer": sum(r["no_answer"] for r in records),
        "empty_output": sum(r["empty_output"] for r in records),
        "truncated": sum(r["finish_reason"] == "length" for r in records),
        "mean_generated": mean([len(r["generated_ids"]) for r in records]),
        "median_tokens_per_s": statistics.median(speeds) if speeds else None,
        "mean_rounds": mean([e["rounds"] for e in evictions]),
        "mean_round_ms": mean(round_ms),
        "mean_round_share": mean(shares),
        "max_peak_slots": max((e["peak_slots"] for e in evictions), default=None),
        "max_peak_cache_bytes": max((e["peak_cache_bytes"] for e in evictions), default=None),
        "max_peak_memory_bytes": max((e["peak_memory_bytes"] for e in evictions), default=None),
    }


def _format_table(rows: list[dict]) -> str:
    def fmt(value, spec):
        return "-" if value is None or value == "" else format(value, spec)

    header = (f"{'cell':<28} {'n':>4} {'acc':>6} {'noans':>5} {'empty':>5} {'trunc':>5} {'tokens':>7} {'tok/s':>7} "
              f"{'rounds':>7} {'ms/rnd':>7} {'share':>6} {'slots':>6} {'cacheMB':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        cache_mb = None if r["max_peak_cache_bytes"] is None else r["max_peak_cache_bytes"] / 2**20
        lines.append(
            f"{r['cell'][:28]:<28} {r['problems']:>4} {r['accuracy']:>6.1%} {r['no_answer']:>5} {r['empty_output']:>5} "
            f"{r['truncated']:>5} {fmt(r['mean_generated'], '7.1f')} {fmt(r['median_tokens_per_s'], '7.2f')} "
            f"{fmt(r['mean_rounds'], '7.1f')} {fmt(r['mean_round_ms'], '7.2f')} {fmt(r['mean_round_share'], '6.1%')} "
            f"{fmt(r['max_peak_slots'], '6d')} {fmt(cache_mb, '8.2f')}"
        )
    return "\n".join(lines)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # Every check runs before the output directory is created: nothing half-written on bad input.
    from evictor.engine import EvictionEngine
    from evictor.policy import get_policy, policy_names
    from tasks.datasets import load_problems, resolve_source

    file_config = _read_policy_config(args.policy_config)
    names = policy_names()
    if file_config is not None and file_config["policy"] not in names:
        raise unknown_choice("policy", file_config["policy"], names)
    policies = _policy_list(args, names, file_config)
    budgets = parse_budgets(args.budget)
    reference = _reference_lengths(args.reference)
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if args.data_file is not None and not Path(args.data_file).expanduser().is_file():
        raise UsageError(f"data file {args.data_file!r} does not exist")
    protocol = EvictionConfig(
        budget=budgets[0], buffer=args.buffer, block=args.block, trigger=args.trigger, protect=args.protect,
        n_sinks=args.n_sinks, recency=args.recency, budget_scope=args.budget_scope,
        on_long_prompt=args.on_long_prompt, shared=args.shared, attention_source=args.attention_source,
        query_window=args.query_window, seed=args.seed, keep_log=args.keep_log,
    )
    problems = load_problems(args.dataset, data_file=args.data_file, limit=args.limit)
    if reference is not None:
        missing = [p.id for p in problems if p.id not in reference]
        if missing:
            raise UsageError(f"--reference has no record for problem(s) {', '.join(missing[:5])}")

    from models.loading import load_model
    from tasks.prompts import build_prompt_ids

    lm = load_model(args.model, device=args.device, dtype=args.dtype, attn_implementation=args.kernel)
    prompts = {p.id: build_prompt_ids(lm.tokenizer, p) for p in problems}
    out = Path(args.out)
    engines, cells = {}, []
    sweep = len(policies) * len(budgets) > 1
    for name in policies:
        params = dict(file_config.get("params", {})) if file_config and file_config["policy"] == name else {}
        try:
            policy = get_policy(name, **params)
        except TypeError as err:  # an unknown parameter name in --policy-config
            raise UsageError(f"--policy-config: {name}: {err}") from None
        engine = EvictionEngine(lm, policy, protocol)
        engines[name] = engine
        cell_budgets = [None] if engine.policy.scores_nothing else budgets
        for budget in cell_budgets:
            cell = Cell(name, params, budget, out)
            if sweep:
                cell.directory = out / cell.label
            cells.append(cell)
            if budget is None:
                continue
            for problem in problems:  # protected prompt vs budget: fail now, not mid-run
                length = reference[problem.id] if reference is not None else args.max_new_tokens
                sequence_budgets([resolve_budget(budget, length)], [len(prompts[problem.id])], engine.protect,
                                 protocol, names=[f"{cell.label}, problem {problem.id}"])
    identities = {}
    for cell in cells:
        engine = engines[cell.policy]
        identities[cell.label] = {
            "model": args.model, "dataset": args.dataset, "data_source": resolve_source(args.dataset, args.data_file),
            "policy": engine.policy.config(), "budget": cell.budget,
            "protocol": {k: v for k, v in engine.describe().items() if k not in ("policy", "budget", "seed", "keep_log")},
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
            "dtype": args.dtype, "kernel": engine.kernel, "reference": args.reference,
        }
        _check_resumable(cell.directory, identities[cell.label])

    from tqdm import tqdm

    from core.records import JsonlStore
    from tasks.grading import grade

    out.mkdir(parents=True, exist_ok=True)
    save_config(out, {"command": sys.argv, "cells": [c.label for c in cells], "loaded_model": lm.describe(),
                      **{k: v for k, v in vars(args).items()}}, name="sweep.json" if sweep else "run.json")
    total = len(cells) * len(problems)
    stores = {}
    for cell in cells:
        cell.directory.mkdir(parents=True, exist_ok=True)
        save_config(cell.directory, {**identities[cell.label], "limit": args.limit, "loaded_model": lm.describe()})
        stores[cell.label] = JsonlStore(cell.directory / "generations.jsonl", key=lambda r: r["id"])
    done = sum(len([p for p in problems if p.id in stores[c.label]]) for c in cells)
    say = (lambda *_: None) if args.quiet else tqdm.write
    try:
        with tqdm(total=total, initial=done, unit="problem", file=sys.stderr, desc="evictor") as bar:
            for cell in cells:
                store = stores[cell.label]
                todo = [p for p in problems if p.id not in store]
                for start in range(0, len(todo), args.batch_size):
                    batch = todo[start : start + args.batch_size]
                    records = _run_batch(engines[cell.policy], cell, batch, prompts, reference, args, lm, grade)
                    for record in records:
                        store.append(record)
                    bar.update(len(batch))
                    say(f"[{cell.label}] " + "; ".join(
                        f"{r['id']}: {'correct' if r['correct'] else 'wrong'} ({len(r['generated_ids'])} tok, "
                        f"{r['eviction']['rounds']} rounds)" for r in records))
    except KeyboardInterrupt:
        print("\ninterrupted; finished batches are saved; rerun the same command to resume", file=sys.stderr)
        return 130

    wanted = {p.id for p in problems}
    rows = [_summarise(c.label, c, [r for r in stores[c.label].records if r["id"] in wanted]) for c in cells]
    with atomic_write(out / "summary.json") as handle:
        json.dump(rows, handle, indent=2)
        handle.write("\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    with atomic_write(out / "summary.csv") as handle:
        handle.write(buffer.getvalue())
    print(_format_table(rows))
    print(f"\nwritten to {out}/ (summary.csv, summary.json; generations.jsonl per cell)")
    return 0


def _batch_seed(seed: int, ids: list[str]) -> int:
    """A seed that depends only on the run seed and the batch's problems, so a resumed run redraws the same."""
    return (seed * 1_000_003 + zlib.crc32("\x1f".join(ids).encode())) % (2**63)


def _run_batch(engine, cell: Cell, batch, prompts, reference, args, lm, grade) -> list[dict]:
    import numpy as np

    ids = [p.id for p in batch]
    budgets = None
    if cell.budget is not None:
        lengths = [reference[i] if reference is not None else args.max_new_tokens for i in ids]
        budgets = [resolve_budget(cell.budget, n) for n in lengths]
    started = time.perf_counter()
    result = engine.generate(
        [prompts[i] for i in ids], args.max_new_tokens, budgets=budgets, temperature=args.temperature,
        seed=_batch_seed(args.seed, ids),
    )
    wall = time.perf_counter() - started
    stats = result.stats
    memory = stats.get("cuda_peak_allocated_bytes", stats.get("peak_rss_bytes"))
    records = []
    for problem, seq in zip(batch, result.sequences):
        text = lm.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
        graded = grade(text, problem)
        later = len(seq.generated_ids) - 1
        keep_path = None
        if seq.keep_log is not None:
            keep_dir = cell.directory / "keeplogs"
            keep_dir.mkdir(exist_ok=True)
            keep_path = keep_dir / f"{zlib.crc32(problem.id.encode()):08x}.npz"
            with atomic_write(keep_path, "wb") as handle:
                np.savez_compressed(handle, **seq.keep_log, problem_id=np.asarray(problem.id))
        records.append({
            "id": problem.id,
            "dataset": problem.dataset,
            "model": args.model,
            "prompt_ids": seq.prompt_ids,
            "generated_ids": seq.generated_ids,
            "text": text,
            "answer": graded["answer"],
            "extracted_by": graded.get("extracted_by"),
            "gold": problem.answer,
            "correct": graded["correct"],
            "finish_reason": seq.finish_reason,
            "empty_output": not text.strip(),
            "no_answer": graded["no_answer"],
            "timings": {
                "prefill_s": round(stats["prefill_s"], 4),
                "decode_s": round(stats["decode_s"], 4),
                "tokens_per_s": round(later / stats["decode_s"], 3) if later > 0 and stats["decode_s"] > 0 else 0.0,
                "batch_decode_tokens_per_s": stats["decode_tokens_per_s"],
                "wall_s": round(wall, 4),
            },
            "policy": cell.policy,
            "policy_config": engine.policy.config(),
            "budget": cell.budget,
            "budget_tokens": seq.budget,
            "protocol": {k: v for k, v in engine.describe().items() if k not in ("policy", "budget", "keep_log")},
            "eviction": {
                "rounds": seq.rounds,
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
                "attention_source": stats["attention_source"],
                "attention_requests": stats["attention_requests"],
            },
            "cache_sizes": seq.cache_sizes,
            "batch": {"size": len(batch), "ids": [p.id for p in batch]},
            "keep_log": None if keep_path is None else str(keep_path.relative_to(cell.directory)),
        })
    return records


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
