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

from bench.common import fixed_prompt, interleaved, median, set_threads, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="snapkv,h2o,tova", help="attention-requiring policies (comma list)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--buffer", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)

    from evictor.engine import EvictionEngine
    from evictor.protocol import EvictionConfig
    from models.loading import load_model

    models = {"eager": load_model(args.model, attn_implementation="eager"), "sdpa": load_model(args.model)}
    prompt = fixed_prompt(models["sdpa"])
    engines = {}
    for kernel, lm in models.items():
        engines[f"full@{kernel}"] = EvictionEngine(lm, "full", EvictionConfig(budget=args.budget, buffer=args.buffer))
        for policy in args.policies.split(","):
            engines[f"{policy}@{kernel}"] = EvictionEngine(lm, policy, EvictionConfig(budget=args.budget,
                                                                                      buffer=args.buffer))
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
    for policy in args.policies.split(","):
        eager = next(r for r in rows if r["setting"] == f"{policy}@eager")
        sdpa = next(r for r in rows if r["setting"] == f"{policy}@sdpa")
        print(f"{policy}: on SDPA it runs at {sdpa['tok_s'] / eager['tok_s']:.3f}x its eager-kernel speed")


if __name__ == "__main__":
    main()
