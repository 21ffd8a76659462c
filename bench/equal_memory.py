"""Decode throughput at equal KV memory: each policy at the largest batch whose cache fits a memory cap, vs `full`.

    .venv/bin/python bench/equal_memory.py [--memory-gb 1] [--context 4096] [--budget 256] [--new-tokens 64]
                                           [--max-batch 16] [--policies random,valuediff,epikv,h2o] [--out DIR]

Random Attention's equal-memory serving table (its Tables 10-11): eviction pays in batch, because the memory it
frees holds more sequences. For every policy (and `full`, the baseline) in one run:

1. **Batch.** The engine (`evictor.engine.EvictionEngine`) allocates, per sequence, a cache of ``capacity`` slots in
   every layer and KV head: keys and values (``2 x head_dim`` in the model's dtype), the slot's position (int32) and
   the policy's own per-slot state (EpiKV's frozen score, H2O's accumulated attention: float32). ``capacity`` is
   ``context + new_tokens`` for `full` and ``K + 2r + B + 1`` for an evicting policy (the block prefill peaks at
   ``K + r + B``, the interval trigger at ``K + 2r``). The bytes per sequence are read from the engine's own cache,
   allocated for one sequence, and the batch is ``floor(cap / bytes per sequence)``, lowered to ``--max-batch``
   when given. After the run the cache the engine really allocated is printed beside the cap.
2. **Throughput.** That batch decodes ``--new-tokens`` tokens per sequence (EOS ignored, greedy) after a
   ``--context``-token prompt of random token ids (decode speed does not depend on the content). Eviction
   policies protect only the first 4 tokens (sinks), so the context itself is compressed, in blocks of B during
   the prefill (ValueDiff's protocol); `full` keeps everything. tokens/s counts every sequence of the batch.
3. **Ratio.** ``x full`` = the policy's decode tokens/s / full's, both measured in this run at their own batches
   (medians over ``--repeats`` runs, interleaved across policies): the throughput a server with that much KV memory
   would gain by running the policy. Prefill time is printed but not in the ratio.

``--short-prompt`` (for a CPU, where prefilling ``batch x context`` tokens for 40-odd sequences can take an hour): the
evicting policies prefill only the first ``K + r + B`` tokens of the prompt. After the prefill their cache holds
``K + r`` slots either way (ValueDiff's block prefill evicts down to it at every block), so decode reads the same
amount of cache at the same batch; only the positions differ, which decode speed does not depend on. `full` always
prefills ``--context`` tokens. The per-sequence bytes are unchanged (same capacity), the prefill time is not
comparable, and the decode throughput is what the ratio compares anyway.

The weights, activations and the allocator's slack are outside the cap: it is the KV budget of a server whose
weights are already loaded. On a CPU the ratio is smaller than on a GPU, where decode at small batch is bound by
reading the weights and the batch is nearly free; it grows with the context (full's cache grows, the others' do
not) and shrinks with K.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.cli import (  # noqa: E402
    ArgumentParser,
    add_device_arguments,
    main_guard,
    non_negative_float,
    positive_int,
    seed_int,
)
from core.errors import UsageError  # noqa: E402

GB = 2**30
MB = 2**20


def sequence_bytes(engine, context: int, new_tokens: int) -> int:
    """Bytes of the cache `engine` allocates for one sequence of `context` prompt tokens and `new_tokens` new ones:
    its own `EvictingCache`, sized by a session and allocated at its capacity, as the first forward would."""
    session = engine.session([[0] * context], max_new_tokens=new_tokens)
    config = engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dummy = torch.empty((1, config.num_key_value_heads, 1, head_dim), dtype=engine.model.dtype)
    for layer in session.cache.layers:
        layer.lazy_initialization(dummy, dummy)
    return session.cache.nbytes()


def measure(lm, policies: list[str], *, memory: int, context: int, new_tokens: int, budget: int, buffer: int,
            block: int, max_batch: int | None, repeats: int = 1, short_prompt: bool = False,
            seed: int = 0) -> list[dict]:
    """One row per policy (`full` first): bytes per sequence, the batch that fits `memory`, the batch run, and the
    median decode throughput over `repeats` runs at that batch, interleaved with the other policies' so that load
    drifting on a shared machine hits all alike; ``ratio`` is tokens/s over full's. With `short_prompt`, evicting
    policies prefill only the first ``K + r + B`` tokens of the prompt (see the module docstring)."""
    from bench.common import interleaved, median
    from evictor.engine import EvictionEngine
    from evictor.protocol import EvictionConfig

    config = EvictionConfig(budget=budget, buffer=buffer, block=block, protect="sinks", seed=seed)
    vocab = lm.model.get_input_embeddings().num_embeddings
    prompt = torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    rows: dict[str, dict[str, Any]] = {}
    engines, prompts = {}, {}
    for name in ["full"] + [p for p in policies if p != "full"]:
        engine = EvictionEngine(lm, name, config)
        short = short_prompt and name != "full"
        prompts[name] = prompt[: budget + buffer + block] if short else prompt
        per_sequence = sequence_bytes(engine, len(prompts[name]), new_tokens)
        fits = memory // per_sequence
        batch = min(fits, max_batch) if max_batch else fits
        rows[name] = {"policy": name, "fa": "yes" if engine.needs.fa_compatible else "no",
                      "seq_mb": per_sequence / MB, "fits": fits, "batch": batch, "prompt": len(prompts[name])}
        if batch == 0:
            print(f"  {name}: one sequence needs {per_sequence / MB:.1f} MB, more than the cap", flush=True)
        else:
            engines[name] = engine

    def run(name: str) -> dict:
        stats = engines[name].generate([prompts[name]] * rows[name]["batch"], new_tokens, ignore_eos=True).stats
        return {"tok_s": stats["decode_tokens_per_s"], "prefill_s": stats["prefill_s"],
                "round_share": stats["round_share"], "kv_mb": stats["cache_allocated_peak_bytes"] / MB}

    for name, runs in interleaved(list(engines), repeats, run).items():
        rows[name].update({key: median([r[key] for r in runs]) for key in runs[0]})
    base = rows["full"].get("tok_s")
    for row in rows.values():
        row["ratio"] = row["tok_s"] / base if base and row.get("tok_s") else None
    return list(rows.values())


def _cell(row: dict, key: str, spec: str, width: int) -> str:
    value = row.get(key)
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_table(rows: list[dict]) -> None:
    header = (f"{'policy':<10} {'FA':>3} {'prompt':>6} {'MB/seq':>8} {'fits':>5} {'batch':>5} {'KV MB':>8} "
              f"{'prefill s':>9} {'tok/s':>8} {'x full':>7} {'round %':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['policy']:<10} {row['fa']:>3} {row['prompt']:>6} {_cell(row, 'seq_mb', '.1f', 8)} "
              f"{row['fits']:>5} {row['batch']:>5} {_cell(row, 'kv_mb', '.0f', 8)} {_cell(row, 'prefill_s', '.1f', 9)} "
              f"{_cell(row, 'tok_s', '.1f', 8)} {_cell(row, 'ratio', '.2f', 7)} {_cell(row, 'round_share', '.2%', 8)}")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bench/equal_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model (default: smollm2-135m)")
    parser.add_argument("--policies", default="random,valuediff,epikv,h2o",
                        help="policies compared with full (comma list; default: random,valuediff,epikv,h2o)")
    parser.add_argument("--memory-gb", type=non_negative_float, default=1.0, help="KV-memory cap in GiB (default: 1)")
    parser.add_argument("--context", type=positive_int, default=4096, help="prompt tokens (default: 4096)")
    parser.add_argument("--budget", type=positive_int, default=256, help="K (default: 256)")
    parser.add_argument("--buffer", type=positive_int, default=64, help="r (default: 64)")
    parser.add_argument("--block", type=positive_int, default=128, help="prefill block B (default: 128)")
    parser.add_argument("--new-tokens", type=positive_int, default=64,
                        help="decoded tokens per sequence (default: 64; at least r + 1 for a decode eviction round)")
    parser.add_argument("--max-batch", type=positive_int, default=None,
                        help="run at most this batch (the batch that fits is still computed and printed); on a "
                        "CPU the prefill of a large batch at a long context takes long")
    parser.add_argument("--short-prompt", action="store_true",
                        help="evicting policies prefill only K + r + B prompt tokens (their decode cache is the same "
                        "K + r slots); saves the prefill of --context tokens at a large batch on a CPU")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs per policy, interleaved across policies; the table shows medians (default: 1)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the random prompt and of random policies")
    add_device_arguments(parser)
    parser.add_argument("--out", default=None,
                        help="also write the table to OUT/equal_memory.csv with the settings in OUT/config.json "
                        "(default: print only)")
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from core.rundir import RunDir
    from evictor.policy import choose_policies
    from models.loading import load_model, model_limits
    from validation.report import write_csv as write_rows

    if args.memory_gb <= 0:
        raise UsageError(f"--memory-gb must be positive, got {args.memory_gb:g}")
    policies = choose_policies(args.policies, "--policies")  # an unknown name fails here, before the model loads
    model_limits(args.model).check_flags({"--context": args.context + args.new_tokens, "--budget": args.budget,
                                          "--buffer": args.buffer, "--block": args.block})
    check_memory(args, ["full", *policies])
    torch.set_num_threads(args.threads)
    identity = {k: v for k, v in vars(args).items() if k not in ("out", "threads", "max_memory")}
    with RunDir(args.out, identity) if args.out else contextlib.nullcontext() as run:
        rows = _measure_and_print(args, policies, load_model(args.model, device=args.device, dtype=args.dtype))
        if run is not None:
            write_rows(run.path / "equal_memory.csv", rows)
            run.save_config(threads=args.threads)
            print(f"\nwritten to {run.path}/equal_memory.csv")
    return 0


def check_memory(args, policies: list[str]) -> None:
    """Refuse settings whose largest run would need more memory than the device has or --max-memory allows: each
    policy at the batch whose cache fills --memory-gb (at most --max-batch), prefilling a block of every sequence
    at once (`evictor.engine.eviction_footprint`)."""
    from core.limits import MemoryLimit
    from evictor.engine import eviction_footprint
    from evictor.policies import get_policy
    from evictor.protocol import EvictionConfig
    from models.footprint import model_shape

    shape = model_shape(args.model, args.dtype, args.device)
    config = EvictionConfig(budget=args.budget, buffer=args.buffer, block=args.block, protect="sinks")
    worst = None
    for name in policies:
        policy = get_policy(name)
        context = args.context if name == "full" or not args.short_prompt else args.budget + args.buffer + args.block
        one = eviction_footprint(shape, policy, config, [context], args.new_tokens, 1)
        cache = dict(one.parts)["KV cache"]
        batch = max(1, min(int(args.memory_gb * GB) // cache, args.max_batch or 2**62))
        footprint = eviction_footprint(shape, policy, config, [context] * batch, args.new_tokens, batch)
        worst = footprint if worst is None or footprint.total > worst.total else worst
    assert worst is not None  # `full` is always measured
    worst.check(f"{args.model} filling a --memory-gb {args.memory_gb:g} KV cap at --context {args.context}",
                MemoryLimit.of(args.device, args.max_memory), "lower --memory-gb, --context or --max-batch")


def _measure_and_print(args, policies: list[str], lm) -> list[dict]:
    memory = int(args.memory_gb * GB)
    print(f"{args.model} ({lm.kernel}, {lm.model.dtype}, {lm.device}, {args.threads} thread(s)); KV cap "
          f"{memory / GB:.2f} GiB; context {args.context}, {args.new_tokens} new tokens; K={args.budget}, "
          f"r={args.buffer}, B={args.block}, sinks protected; max batch {args.max_batch or 'none'}; "
          f"{args.repeats} repeat(s){'; evicting policies prefill K + r + B tokens' if args.short_prompt else ''}",
          flush=True)
    rows = measure(lm, policies, memory=memory, context=args.context, new_tokens=args.new_tokens,
                   budget=args.budget, buffer=args.buffer, block=args.block, max_batch=args.max_batch,
                   repeats=args.repeats, short_prompt=args.short_prompt, seed=args.seed)
    print()
    print_table(rows)
    return rows


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
