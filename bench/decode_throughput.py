"""Decode throughput with eviction vs `full`, and eviction-round cost as a share of decode time.

    .venv/bin/python bench/decode_throughput.py [--budget 256] [--new-tokens 1024] [--repeats 3]

A fixed prompt, generation forced to exactly --new-tokens (EOS ignored), greedy, batch --batch-size. For each policy
it prints the median decode tokens/s and its ratio to `full` (no eviction) measured in the same run, and from the
same runs the time spent in eviction rounds (scoring + compaction) as a share of decode time, against the 5% target;
`observe` (scores frozen at generation time: EpiKV, KV-key, ...) is reported beside it because it is per-step work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

TARGET_SHARE = 0.05


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bench/decode_throughput.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model (default: smollm2-135m)")
    parser.add_argument("--policies", default="random,valuediff,keydiff,epikv",
                        help="policies compared with full (comma list; default: random,valuediff,keydiff,epikv)")
    parser.add_argument("--budget", type=positive_int, default=256, help="K (default: 256)")
    parser.add_argument("--buffer", type=non_negative_int, default=64, help="r (default: 64)")
    parser.add_argument("--trigger", default="interval", choices=["interval", "step"], help="eviction trigger")
    parser.add_argument("--new-tokens", type=positive_int, default=1024,
                        help="forced generation length (default: 1024)")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="copies of the prompt decoded together")
    parser.add_argument("--repeats", type=positive_int, default=3, help="repeats per policy, interleaved (default: 3)")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads (default: 1)")
    add_device_arguments(parser)
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from evictor.policy import choose_policies
    from evictor.protocol import EvictionConfig
    from models.footprint import model_shape

    names = ["full"] + [p for p in choose_policies(args.policies, "--policies") if p != "full"]
    config = EvictionConfig(budget=args.budget, buffer=args.buffer, trigger=args.trigger)
    prompt = checked_prompt(args.model, args.budget, args.buffer, args.new_tokens)
    check_engine_memory(model_shape(args.model, args.dtype, args.device), names, config, len(prompt),
                        args.new_tokens, args.batch_size, args.device, args.max_memory)
    set_threads(args.threads)

    from evictor.engine import EvictionEngine
    from models.loading import load_model

    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    engines = {name: EvictionEngine(lm, name, config) for name in names}
    print(f"{args.model} ({lm.kernel}, {lm.device}, {args.threads} thread(s)); prompt {len(prompt)} tokens; "
          f"{args.new_tokens} new tokens; K={args.budget}, r={args.buffer}, trigger {args.trigger}; "
          f"batch {args.batch_size}; {args.repeats} repeats")

    def run(name: str) -> dict:
        stats = engines[name].generate([prompt] * args.batch_size, args.new_tokens, ignore_eos=True).stats
        return {
            "tok_s": stats["decode_tokens_per_s"],
            "round_share": stats["round_share"],
            "observe_share": stats["observe_s"] / stats["decode_s"],
            "round_ms": stats["round_ms_median"],
            "rounds": stats["decode_rounds"],
            "peak_slots": stats["peak_slots"],
            "cache_mb": stats["peak_cache_bytes"] / 2**20,
        }

    results = interleaved(names, args.repeats, run)
    base = median([r["tok_s"] for r in results["full"]])
    rows = []
    for name in names:
        runs = results[name]
        speed = median([r["tok_s"] for r in runs])
        share = median([r["round_share"] for r in runs])
        assert speed is not None and base is not None and share is not None  # every run decoded: its time is > 0
        rows.append({
            "policy": name,
            "tok_s": speed,
            "ratio": speed / base,
            "round_share": share,
            "observe_share": median([r["observe_share"] for r in runs]),
            "round_ms": median([r["round_ms"] for r in runs]),
            "rounds": runs[0]["rounds"],
            "peak_slots": runs[0]["peak_slots"],
            "cache_mb": runs[0]["cache_mb"],
            "target": "-" if name == "full" else ("ok" if share < TARGET_SHARE else "OVER"),
        })
    print()
    print(table(rows, [("policy", "policy", "s"), ("tok_s", "tok/s", ".2f"), ("ratio", "x full", ".3f"),
                       ("round_share", "round %", ".2%"), ("target", "<5%?", "s"),
                       ("observe_share", "observe %", ".2%"), ("round_ms", "ms/round", ".2f"),
                       ("rounds", "rounds", "d"), ("peak_slots", "peak slots", "d"), ("cache_mb", "cache MB", ".2f")]))
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
