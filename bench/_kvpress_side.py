"""The kvpress side of bench/kvpress_compare.py; runs inside bench/.venv-kvpress (transformers < 5.3, kvpress 0.5.5).

    python _kvpress_side.py speed --model-dir D --prompt-ids JSON --target T --interval I --new-tokens N
    python _kvpress_side.py kept --model-dir D --prompt-ids JSON --ratio R --presses JSON --out FILE

``speed`` prints one JSON line: for "none" (plain generate) and "press" (DecodingPress(KnormPress)) the decode
tokens/s, computed as (N - 1) / (t(N tokens) - t(1 token)), and the largest KV-cache length any forward attended
over.

``kept`` prefills the prompt once per press (``{"name": ..., "press": class name, "params": {...}, "block": B or
null, "kernel": "sdpa" | "eager"}``; a block wraps the press in ``BlockPress(press, block_size=B)``) at compression
ratio R and writes to FILE, per press, the prompt positions each (layer, KV head) kept: ``{name: {"n_kept": n,
"kept": [[[positions] per head] per layer]}}``. Positions are read from what the press's own ``compress`` returned:
each kept key row is found, bit for bit, among the keys it was given, so no press internals are re-implemented here.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel


def load(model_dir: str, kernel: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=kernel).eval()


def speed(args: argparse.Namespace) -> None:
    from kvpress import DecodingPress, KnormPress

    model = load(args.model_dir)
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


def kept_rows(kept_keys: torch.Tensor, keys: torch.Tensor) -> list[list[int]]:
    """Per KV head of batch row 0, the sorted positions of `keys` ``[b, kv, n, d]`` whose rows `kept_keys`
    ``[b, kv, m, d]`` are (exact equality: the press gathered them from these very tensors)."""
    heads = []
    for head in range(keys.shape[1]):
        same = (kept_keys[0, head][:, None, :] == keys[0, head][None, :, :]).all(-1)  # [m, n]
        if not bool(same.any(-1).all()):
            raise SystemExit("a kept key row matches no key the press was given")
        heads.append(sorted(int(i) for i in same.float().argmax(-1)))
    return heads


def build_press(spec: dict, ratio: float):
    import kvpress

    press = getattr(kvpress, spec["press"])(compression_ratio=ratio, **spec.get("params", {}))
    return kvpress.BlockPress(press=press, block_size=spec["block"]) if spec.get("block") else press


def kept(args: argparse.Namespace) -> None:
    ids = torch.tensor([json.loads(args.prompt_ids)])
    models: dict[str, PreTrainedModel] = {}
    result = {}
    for spec in json.loads(args.presses):
        kernel = spec.get("kernel", "sdpa")
        model = models.get(kernel) or models.setdefault(kernel, load(args.model_dir, kernel))
        press = build_press(spec, args.ratio)
        layers: dict[int, list[list[int]]] = {}
        compress = press.compress

        def recording(module, hidden_states, keys, values, attentions, kwargs, compress=compress, layers=layers):
            out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            layers[module.layer_idx] = kept_rows(out_keys, keys)
            return out_keys, out_values

        press.compress = recording  # the instance's own compress, observed: forward_hook calls self.compress
        with torch.inference_mode(), press(model):
            model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True,
                  output_attentions=kernel == "eager")
        n_kept = {len(head) for layer in layers.values() for head in layer}
        if len(layers) != model.config.num_hidden_layers or len(n_kept) != 1:
            raise SystemExit(f"{spec['name']}: compressed {len(layers)} layers, kept sizes {sorted(n_kept)}")
        result[spec["name"]] = {"n_kept": n_kept.pop(), "kept": [layers[i] for i in range(len(layers))]}
    with open(args.out, "w") as handle:
        json.dump(result, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    timing = commands.add_parser("speed")
    timing.add_argument("--target", type=int, required=True)
    timing.add_argument("--interval", type=int, required=True)
    timing.add_argument("--new-tokens", type=int, required=True)
    sets = commands.add_parser("kept")
    sets.add_argument("--ratio", type=float, required=True, help="kvpress compression_ratio")
    sets.add_argument("--presses", required=True, help="JSON list of press specifications")
    sets.add_argument("--out", required=True, help="JSON file the kept positions are written to")
    for sub in (timing, sets):
        sub.add_argument("--model-dir", required=True)
        sub.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
        sub.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"speed": speed, "kept": kept}[args.command](args)


if __name__ == "__main__":
    main()
