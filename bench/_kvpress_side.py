"""The kvpress side of bench/kvpress_compare.py; runs inside bench/.venv-kvpress (transformers < 5.3, kvpress 0.5.5).

Prints one JSON line: for "none" (plain generate) and "press" (DecodingPress(KnormPress)) the decode tokens/s,
computed as (N - 1) / (t(N tokens) - t(1 token)), and the largest KV-cache length any forward attended over.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--interval", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from kvpress import DecodingPress, KnormPress

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([json.loads(args.prompt_ids)])
    peak = {"slots": 0}

    def track(module, args_, kwargs, output):
        cache = kwargs.get("past_key_values")
        if cache is not None:
            peak["slots"] = max(peak["slots"], cache.layers[0].keys.shape[-2])

    handle = model.model.layers[0].self_attn.register_forward_hook(track, with_kwargs=True)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - start

    result = {}
    for name in ("none", "press"):
        peak["slots"] = 0
        if name == "press":
            press = DecodingPress(base_press=KnormPress(), compression_interval=args.interval, target_size=args.target)
            with press(model):
                first, total = timed(1), timed(args.new_tokens)
        else:
            first, total = timed(1), timed(args.new_tokens)
        slots = peak["slots"]
        cfg = model.config
        per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
        result[name] = {"tok_s": (args.new_tokens - 1) / (total - first), "peak_slots": slots,
                        "peak_cache_bytes": slots * per_slot}
    handle.remove()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
