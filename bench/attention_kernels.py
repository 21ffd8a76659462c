"""Attention-requiring policies on the eager kernel and inside the fast (SDPA) kernel.

    .venv/bin/python bench/attention_kernels.py [--policies snapkv,h2o,tova] [--new-tokens 512] [--repeats 3]

The engine's attention feed recomputes each new query's attention row over the resident keys in every forward
(exact under any kernel, O(n) per step), so the same policy keeps the same tokens on both kernels. Each policy runs
on each kernel and `full` on each kernel is the baseline, so the table separates the kernel's cost from the
feed's (``attn ms/tok``) and the rounds' cost. Medians over interleaved repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import check_engine_memory, checked_prompt, interleaved, median, set_threads, table  # noqa: E402
from core.cli import (  # noqa: E402
    ArgumentParser,
    add_device_arguments,
    main_guard,
    non_negative_int,
    positive_int,
    thread_count,
)
from core.errors import UsageError  # noqa: E402
from core.limits import Footprint  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bench/attention_kernels.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model (default: smollm2-135m)")
    parser.add_argument("--policies", default="snapkv,h2o,tova",
                        help="attention-requiring policies (comma list; default: snapkv,h2o,tova)")
    parser.add_argument("--budget", type=positive_int, default=256, help="K (default: 256)")
    parser.add_argument("--buffer", type=non_negative_int, default=64, help="r (default: 64)")
    parser.add_argument("--new-tokens", type=positive_int, default=512, help="decoded tokens (default: 512)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="repeats per setting, interleaved (default: 3)")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads (default: 1)")
    add_device_arguments(parser)
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from evictor.policies import get_policy
    from evictor.policy import choose_policies
    from evictor.protocol import EvictionConfig
    from models.footprint import model_shape

    policies = choose_policies(args.policies, "--policies")
    blind = [name for name in policies if not get_policy(name).needs.attention]
    if blind:
        raise UsageError(f"--policies {args.policies!r}: {', '.join(blind)} read no attention, so the kernel does not "
                         "matter to them; give attention-requiring policies (e.g. snapkv,h2o,tova)")
    config = EvictionConfig(budget=args.budget, buffer=args.buffer)
    prompt = checked_prompt(args.model, args.budget, args.buffer, args.new_tokens)
    shape = model_shape(args.model, args.dtype, args.device)
    # A copy of the model per kernel is loaded at once; the eager one runs the largest forward.
    check_engine_memory(shape, ["full", *policies], config, len(prompt), args.new_tokens, 1, args.device,
                        args.max_memory, eager=True, remedy="lower --new-tokens",
                        extra=Footprint((("sdpa copy of the weights", shape.weight_bytes),)))
    set_threads(args.threads)

    from evictor.engine import EvictionEngine
    from models.loading import load_model

    models = {kernel: load_model(args.model, device=args.device, dtype=args.dtype,
                                 attn_implementation=kernel if kernel == "eager" else None)
              for kernel in ("eager", "sdpa")}
    engines = {}
    for kernel, lm in models.items():
        engines[f"full@{kernel}"] = EvictionEngine(lm, "full", config)
        for policy in policies:
            engines[f"{policy}@{kernel}"] = EvictionEngine(lm, policy, config)
    print(f"{args.model}; prompt {len(prompt)} tokens; {args.new_tokens} new tokens; K={args.budget}, "
          f"r={args.buffer}; {args.threads} thread(s); {args.repeats} repeats")

    def run(name: str) -> dict:
        stats = engines[name].generate([prompt], args.new_tokens, ignore_eos=True).stats
        return {"tok_s": stats["decode_tokens_per_s"], "round_share": stats["round_share"],
                "round_ms": stats["round_ms_median"],
                "attn_ms": 1000 * stats["attention_s"] / max(1, stats["generated_tokens"])}

    results = interleaved(list(engines), args.repeats, run)
    base = median([r["tok_s"] for r in results["full@sdpa"]])
    rows: list[dict[str, Any]] = []
    for name, runs in results.items():
        speed = median([r["tok_s"] for r in runs])
        assert speed is not None and base is not None  # every run decoded: its time is > 0
        rows.append({"setting": name, "tok_s": speed, "ratio": speed / base,
                     "round_share": median([r["round_share"] for r in runs]),
                     "round_ms": median([r["round_ms"] or 0.0 for r in runs]),
                     "attn_ms": median([r["attn_ms"] for r in runs])})
    print()
    print(table(rows, [("setting", "setting", "s"), ("tok_s", "tok/s", ".2f"), ("ratio", "x full@sdpa", ".3f"),
                       ("round_share", "round %", ".2%"), ("round_ms", "ms/round", ".2f"),
                       ("attn_ms", "attn ms/tok", ".2f")]))
    for policy in policies:
        eager = next(r for r in rows if r["setting"] == f"{policy}@eager")
        sdpa = next(r for r in rows if r["setting"] == f"{policy}@sdpa")
        print(f"{policy}: on SDPA it runs at {sdpa['tok_s'] / eager['tok_s']:.3f}x its eager-kernel speed")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
