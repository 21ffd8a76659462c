"""GPU check: long-context decode with eviction on a random-init 8B-shaped Llama, vs `full`; then the prefill
memory wall on the same model.

    python bench/gpu_check.py                 # CUDA: 32 layers, 32 q / 8 kv heads, d_head 128, hidden 4096, bf16
    python bench/gpu_check.py --small         # CPU: a 4-layer model, fp32, SDPA, short context

No weights are needed: the model is random-init (speed and memory do not depend on the weights). The context is a
random prompt of --context tokens; eviction policies prefill it in blocks of --block, evicting to K + r at each
boundary (prompt protection: --protect, default sinks, so the context itself is compressed), then decode
--new-tokens tokens (EOS ignored). Printed per policy: prefill time, decode tokens/s and its ratio to `full`, round
share, peak slots, peak KV-cache bytes and the peak allocator memory (CUDA) or RSS (CPU).

Before timing, a correctness check compares the engine's next-token logits with eviction under the chosen kernel
against the same session run under a reference kernel (batch 2, left-padded): SDPA for FlashAttention-2, eager for
SDPA.

Last, the prefill memory of scoring a context (`bench/prefill_memory.py`: eager + output_attentions + H2O against
SDPA + ValueDiff / EpiKV) at --prefill-ctx lengths on the full-depth model, measured directly (CUDA peak allocated;
an out-of-memory error marks the row OOM and skips longer contexts of that setup), written to
--prefill-out/prefill_memory.csv for `figures.prefill_memory`. --prefill-ctx none skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BIG, SMALL, build_llama, check_engine_memory, llama_config  # noqa: E402
from core.cli import ArgumentParser, main_guard, memory_size, positive_int  # noqa: E402
from core.errors import UsageError  # noqa: E402
from core.limits import ModelLimits  # noqa: E402


def check_against_reference(lm, kernel: str, device) -> str:
    """Same batch, policy and seed under `kernel` and a reference kernel: the logits after evictions must agree as
    closely as they do without eviction (`full`), which calibrates what the dtype alone makes the kernels differ by."""
    from evictor.engine import EvictionEngine
    from evictor.protocol import EvictionConfig

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (300, 220)]
    tokens = torch.randint(3, 1000, (48, 2), generator=torch.Generator().manual_seed(2)).to(device)
    config = EvictionConfig(budget=128, buffer=16, block=64, protect="sinks", seed=5)
    reference = "eager" if kernel == "sdpa" else "sdpa"
    lines = []
    for policy in ("full", "random"):
        outputs = {}
        for name in (kernel, reference):
            lm.model.config._attn_implementation = name  # transformers looks the kernel up at every call
            engine = EvictionEngine(lm, policy, config)
            with torch.inference_mode(), engine.session(prompts, max_new_tokens=48) as session:
                logits = session.prefill()
                for step in range(48):
                    logits = session.step(tokens[step])
                outputs[name] = (logits.float(), sum(session.rounds))
        (a, rounds), (b, _) = outputs[kernel], outputs[reference]
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        lines.append(f"{kernel} vs {reference}, {policy} ({rounds} eviction rounds): max |logit diff| "
                     f"{(a - b).abs().max().item():.3g} (logit std {a.std().item():.3g}), top-1 agreement {agree:.0%}")
    lm.model.config._attn_implementation = kernel
    return "\n".join(lines)


def prefill_contexts(text: str) -> int | None:
    """argparse type for --prefill-ctx: a context length, or 'none' (skip the measurement)."""
    return None if text == "none" else positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    from evictor.protocol import PROTECTIONS
    from models.loading import KERNELS

    parser = ArgumentParser(prog="bench/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized model, fp32, SDPA (runs anywhere)")
    parser.add_argument("--context", type=positive_int, default=None,
                        help="prompt tokens (default: 16384; small: 1024)")
    parser.add_argument("--new-tokens", type=positive_int, default=None,
                        help="decoded tokens (default: 256; small: 128)")
    parser.add_argument("--budget", type=positive_int, default=None, help="K (default: 2048; small: 128)")
    parser.add_argument("--buffer", type=positive_int, default=None, help="r (default: 64; small: 16)")
    parser.add_argument("--block", type=positive_int, default=None, help="prefill block B (default: 1024; small: 128)")
    parser.add_argument("--protect", default="sinks", choices=PROTECTIONS, help="prompt protection (default: sinks)")
    parser.add_argument("--policies", default="random,valuediff,keydiff", help="compared with full (comma list)")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="copies of the prompt decoded together")
    parser.add_argument("--kernel", default=None, choices=KERNELS,
                        help="default: flash_attention_2 on CUDA when installed, else sdpa")
    parser.add_argument("--skip-check", action="store_true",
                        help="skip the correctness check against the reference kernel")
    parser.add_argument("--prefill-ctx", type=prefill_contexts, nargs="+", default=None,
                        help="context lengths of the prefill-memory measurement, or 'none' to skip it (default: "
                        "1024 ... 65536 doubling on CUDA; small: 256 512 1024)")
    parser.add_argument("--prefill-out", default="runs/gpu-check-prefill-memory",
                        help="directory for the prefill-memory CSV (default: runs/gpu-check-prefill-memory)")
    parser.add_argument("--max-memory", type=memory_size, default=None,
                        help="the memory the check may use, with its unit (e.g. 40GiB): a setting whose estimated "
                        "peak exceeds it is refused before the model is built (default: the device's memory)")
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from core.rundir import RunDir
    from evictor.policy import choose_policies
    from evictor.protocol import EvictionConfig
    from models.footprint import config_shape
    from models.loading import choose_kernel

    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.small:
        raise UsageError("no CUDA device: run with --small for the CPU-sized check")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kernel = choose_kernel(args.kernel or ("sdpa" if args.small else None), device)
    context = args.context or (1024 if args.small else 16384)
    new_tokens = args.new_tokens or (128 if args.small else 256)
    buffer = args.buffer or (16 if args.small else 64)
    budget = args.budget or (128 if args.small else 2048)
    block = args.block or (128 if args.small else 1024)
    names = ["full"] + [p for p in choose_policies(args.policies, "--policies") if p != "full"]
    contexts = check_prefill_contexts(args.prefill_ctx, args.small)
    shape_config = SMALL if args.small else BIG
    model_config = llama_config(shape_config)
    ModelLimits("the random-init model", context=model_config.max_position_embeddings).check_flags(
        {"--context + --new-tokens": context + new_tokens, "--budget": budget, "--buffer": buffer, "--block": block})
    config = EvictionConfig(budget=budget, buffer=buffer, block=block, protect=args.protect)
    shape = config_shape("random-llama-small" if args.small else "random-llama-8b-shape", model_config,
                         dtype.itemsize)
    check_engine_memory(shape, names, config, context, new_tokens, args.batch_size, str(device), args.max_memory,
                        eager=kernel == "eager", remedy="lower --context, --new-tokens or --batch-size")
    prefill = RunDir(args.prefill_out, {"contexts": contexts, "small": args.small}) if contexts else None

    with prefill if prefill is not None else contextlib.nullcontext():
        lm = build_llama(shape_config, kernel, device, dtype, shape.model)
        decode_check(lm, args, kernel, device, config, context, new_tokens, names)
        if prefill is not None:
            prefill_memory(lm, prefill.path, contexts, device)
    return 0


def check_prefill_contexts(given: list[int | None] | None, small: bool) -> list[int]:
    """The contexts of the prefill-memory measurement: --prefill-ctx's lengths, none for ``none`` alone, else the
    defaults."""
    if given is None:
        return [256, 512, 1024] if small else [1024 * 2**i for i in range(7)]
    if given == [None]:
        return []
    if None in given:
        raise UsageError("--prefill-ctx takes token counts, or 'none' alone to skip the measurement")
    return [n for n in given if n is not None]


def decode_check(lm, args, kernel: str, device, config, context: int, new_tokens: int, names: list[str]) -> None:
    """The correctness of eviction under `kernel` (unless --skip-check), then every policy's speed and memory."""
    from evictor.engine import EvictionEngine

    cfg = lm.config
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), kernel "
          f"{kernel}, {lm.model.dtype}; model {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q / "
          f"{cfg.num_key_value_heads} kv heads, d_head {cfg.head_dim}, hidden {cfg.hidden_size} (built in "
          f"{lm.load_seconds:.1f} s); context {context}, {new_tokens} new tokens, K={config.budget}, "
          f"r={config.buffer}, B={config.block}, protect {config.protect}, batch {args.batch_size}", flush=True)
    if not args.skip_check:
        print(check_against_reference(lm, kernel, device), flush=True)

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, min(cfg.vocab_size, 30000), (context,), generator=generator).tolist()
    rows = []
    for name in names:
        engine = EvictionEngine(lm, name, config)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        stats = engine.generate([prompt] * args.batch_size, new_tokens, ignore_eos=True).stats
        memory = stats.get("cuda_peak_allocated_bytes", stats.get("peak_rss_bytes"))
        assert memory is not None  # the engine reports one of the two
        rows.append((name, stats, memory))
        print(f"  {name:<10} prefill {stats['prefill_s']:.2f} s, decode {stats['decode_tokens_per_s']:.2f} tok/s, "
              f"{stats['decode_rounds']} rounds ({(stats['round_share'] or 0):.2%} of decode), peak slots "
              f"{stats['peak_slots']}, KV cache {stats['peak_cache_bytes'] / 2**30:.3f} GiB, peak memory "
              f"{memory / 2**30:.2f} GiB", flush=True)
    base_speed, base_memory = rows[0][1]["decode_tokens_per_s"], rows[0][2]
    base_cache = rows[0][1]["peak_cache_bytes"]
    print(f"\n{'policy':<10} {'tok/s':>9} {'x full':>7} {'round %':>8} {'cache GiB':>10} {'x full':>7} "
          f"{'peak GiB':>9} {'x full':>7}")
    for name, stats, memory in rows:
        print(f"{name:<10} {stats['decode_tokens_per_s']:>9.2f} {stats['decode_tokens_per_s'] / base_speed:>7.3f} "
              f"{(stats['round_share'] or 0):>8.2%} {stats['peak_cache_bytes'] / 2**30:>10.3f} "
              f"{stats['peak_cache_bytes'] / base_cache:>7.3f} {memory / 2**30:>9.2f} {memory / base_memory:>7.3f}")
    if device.type == "cpu":
        print("(CPU: peak memory is the process RSS, dominated by the weights; the KV-cache column is the tracked "
              "cache tensors)")


def prefill_memory(lm, out: Path, contexts: list[int], device) -> None:
    """The prefill-memory measurement of `bench/prefill_memory.py` on this full-depth model, written to a CSV in the
    claimed directory `out`."""
    from bench.prefill_memory import measure, print_table
    from models.memory import write_rows

    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"\nprefill memory of scoring, {lm.name} ({lm.config.num_hidden_layers} layers, {lm.model.dtype}), "
          f"contexts {contexts}", flush=True)
    rows = measure(lm, contexts)
    path = write_rows(out / "prefill_memory.csv", rows)
    print_table(rows)
    capacity = f" --capacity-gb {torch.cuda.get_device_properties(device).total_memory / 2**30:.0f}" \
        if device.type == "cuda" else ""
    print(f"written to {path}; draw it with python -m figures.prefill_memory --input {path} --out figs{capacity}")


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
