"""kvscope vs kvpress at the same cache target: decode tokens/s and peak KV-cache size on SmolLM2.

    bash bench/setup_kvpress.sh            # once: bench/.venv-kvpress (torch 2.13.0, kvpress 0.5.5, transformers<5.3)
    .venv/bin/python bench/kvpress_compare.py [--target 256] [--interval 16] [--new-tokens 256] [--repeats 3]

kvscope needs transformers 5.x and kvpress pins transformers < 5.3, so each side runs in its own venv: kvscope in
this process, kvpress in a subprocess of bench/.venv-kvpress (`_kvpress_side.py`), alternating per repeat. Both load
the same converted SmolLM2 weights, fp32 SDPA, the same prompt, greedy, exactly --new-tokens new tokens.

Matched settings: kvpress `DecodingPress(KnormPress(), compression_interval=I, target_size=T)` compresses every I
decode steps to T tokens (the prompt is not protected), so its cache oscillates between T and T + I. kvscope runs
`keynorm` (the same -||k|| score) with K = T - I, buffer r = I, interval trigger, no protection: the cache
oscillates between K + r = T and K + 2r = T + I. (kvscope never scores the I newest tokens; kvpress may evict them.)
Decode tokens/s: kvscope's own decode clock; kvpress (N - 1) / (t(N) - t(1)).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from common import ROOT, fixed_prompt, median, set_threads, table

VENV_PYTHON = ROOT / "bench" / ".venv-kvpress" / "bin" / "python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=int, default=256, help="cache target T (default: 256)")
    parser.add_argument("--interval", type=int, default=16, help="compression interval I (default: 16)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not VENV_PYTHON.exists():
        raise SystemExit(f"{VENV_PYTHON} is missing: run bash bench/setup_kvpress.sh first")
    set_threads(args.threads)

    from evictor.engine import EvictionEngine
    from evictor.protocol import EvictionConfig
    from models.loading import load_model

    lm = load_model("smollm2-135m")
    model_dir = Path(lm.model.name_or_path)
    prompt = fixed_prompt(lm)
    config = EvictionConfig(budget=args.target - args.interval, buffer=args.interval, trigger="interval",
                            protect="none", block=4096)
    engines = {"full": EvictionEngine(lm, "full", config), "keynorm": EvictionEngine(lm, "keynorm", config)}
    print(f"SmolLM2 ({model_dir}); prompt {len(prompt)} tokens; {args.new_tokens} new tokens; target T={args.target}, "
          f"interval I={args.interval}; {args.threads} thread(s); {args.repeats} repeats")

    side_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    side_env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    runs: dict[str, list[dict]] = {name: [] for name in ("kvscope full", "kvscope keynorm", "kvpress none",
                                                         "kvpress DecodingPress(Knorm)")}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            stats = engine.generate([prompt], args.new_tokens, ignore_eos=True).stats
            runs[f"kvscope {name}"].append({"tok_s": stats["decode_tokens_per_s"], "peak_slots": stats["peak_slots"],
                                            "peak_cache_bytes": stats["peak_cache_bytes"]})
        out = subprocess.run(
            [str(VENV_PYTHON), str(ROOT / "bench" / "_kvpress_side.py"), "--model-dir", str(model_dir),
             "--prompt-ids", json.dumps(prompt), "--target", str(args.target), "--interval", str(args.interval),
             "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)],
            capture_output=True, text=True, env=side_env,
        )
        if out.returncode != 0:
            raise SystemExit(f"kvpress side failed:\n{out.stderr[-3000:]}")
        side = json.loads(out.stdout.strip().splitlines()[-1])
        runs["kvpress none"].append(side["none"])
        runs["kvpress DecodingPress(Knorm)"].append(side["press"])
        print(f"  repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]['tok_s']:.2f} tok/s" for k, v in runs.items()),
              flush=True)

    rows = []
    for name, values in runs.items():
        rows.append({"setting": name, "tok_s": median([v["tok_s"] for v in values]),
                     "peak_slots": values[0]["peak_slots"], "cache_mb": values[0]["peak_cache_bytes"] / 2**20})
    for row in rows:
        baseline = rows[0] if row["setting"].startswith("kvscope") else rows[2]
        row["ratio"] = row["tok_s"] / baseline["tok_s"]
    print()
    print(table(rows, [("setting", "setting", "s"), ("tok_s", "tok/s", ".2f"), ("ratio", "x own full", ".3f"),
                       ("peak_slots", "peak slots", "d"), ("cache_mb", "peak KV MB", ".2f")]))
    ours, theirs = rows[1], rows[3]
    print(f"\nkvscope keynorm / kvpress DecodingPress(Knorm): {ours['tok_s'] / theirs['tok_s']:.3f}x tokens/s, "
          f"{ours['peak_slots'] / theirs['peak_slots']:.3f}x peak cache slots")


if __name__ == "__main__":
    main()
