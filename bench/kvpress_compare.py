"""kvscope against kvpress, a second implementation of the same methods: kept sets after prefill, and speed.

    bash bench/setup_kvpress.sh            # once: bench/.venv-kvpress (torch 2.13.0, kvpress 0.5.5, transformers<5.3)
    .venv/bin/python bench/kvpress_compare.py kept [--model smollm2-135m|tiny-llama] [--ctx 1024] [--ratio 0.75]
    .venv/bin/python bench/kvpress_compare.py speed [--target 256] [--interval 16] [--new-tokens 256] [--repeats 3]

kvscope needs transformers 5.x and kvpress pins transformers < 5.3, so each side runs in its own venv: kvscope in
this process, kvpress in a subprocess of bench/.venv-kvpress (`_kvpress_side.py`). Both load the same weights from
disk (SmolLM2: the converted directory under the kvscope cache; ``tiny-llama``: the random-init tiny Llama saved to a
temporary directory), fp32, the same prompt token ids (``kept``: ``--ctx`` tokens of the first geometry calibration
text; ``speed``: the GSM8K-style benchmark prompt).

``kept``: for every method both libraries implement, the prompt is prefilled once and compressed once; kvpress
keeps ``n = compute_n_kept(L, ratio)`` of the L prompt tokens per (layer, KV head) and kvscope runs the matching
policy with K = n (no buffer, step trigger, one prefill block, no recency window and the policy's own protection
unless the method names others), so both keep n tokens. The table gives, per method, the Jaccard index
|A & B| / |A | B| of the two kept position sets over every (layer, KV head) pair: its minimum and mean, and how many
pairs are identical (in all layers, and in layer 0 alone). ``matched`` methods have the same definition in both
libraries and must agree on every pair; the others (``difference``) are definitional differences, each written in
the kvscope policy's deviations.
``--out`` writes the per-pair Jaccard as CSV.

``speed``: kvpress `DecodingPress(KnormPress(), compression_interval=I, target_size=T)` compresses every I decode
steps to T tokens (the prompt is not protected), so its cache oscillates between T and T + I. kvscope runs `keynorm`
(the same -||k|| score) with K = T - I, buffer r = I, interval trigger, no protection: the cache oscillates between
K + r = T and K + 2r = T + I. (kvscope never scores the I newest tokens; kvpress may evict them.) Decode tokens/s:
kvscope's own decode clock; kvpress (N - 1) / (t(N) - t(1)); alternating per repeat, greedy, exactly N new tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, check_engine_memory, fixed_prompt, median, set_threads, table  # noqa: E402
from core.cli import (  # noqa: E402
    ArgumentParser,
    atomic_write,
    check_output_file,
    distinct,
    main_guard,
    memory_size,
    open_unit_interval,
    positive_int,
    thread_count,
)
from core.errors import UsageError, unknown_choice  # noqa: E402

VENV_PYTHON = ROOT / "bench" / ".venv-kvpress" / "bin" / "python"
SIDE = ROOT / "bench" / "_kvpress_side.py"
MODELS = ("smollm2-135m", "tiny-llama")


@dataclass(frozen=True)
class Method:
    """One method in both libraries: the kvscope policy (and any protocol settings it is compared under) and the
    kvpress press; `difference` names the definitional difference when the two are not the same method."""

    name: str
    policy: str
    press: str
    press_params: dict = field(default_factory=dict)
    protect: str | None = None  # None: the policy's own protection
    block: int | None = None  # a prefill block size on both sides (kvpress: BlockPress)
    recency: int = 0  # kvscope's recency window: the newest tokens kept unscored inside K
    kernel: str = "sdpa"  # kvpress side: "eager" for presses that read returned attention maps
    difference: str | None = None

    def press_spec(self) -> dict:
        return {"name": self.name, "press": self.press, "params": self.press_params, "block": self.block,
                "kernel": self.kernel}


METHODS = (
    Method("snapkv", "snapkv", "SnapKVPress", {"window_size": 32, "kernel_size": 5}),
    Method("tova", "tova", "TOVAPress",
           difference="kvpress's TOVAPress always keeps the newest token (its own comment: TOVA does not); kvscope's "
           "tova scores it like any other, as TOVA's TOVACache does (tova_newest keeps it and must match)"),
    Method("tova_newest", "tova", "TOVAPress", recency=1),
    Method("streaming_llm", "streaming_llm", "StreamingLLMPress", {"n_sink": 4}),
    Method("keydiff", "keydiff", "KeyDiffPress"),
    Method("keynorm", "keynorm", "KnormPress"),
    Method("h2o", "h2o", "ObservedAttentionPress", protect="none", kernel="eager",
           difference="kvpress divides each key's received attention by the number of queries that saw it (a mean "
           "over L - i queries); H2O sums it, which favours old keys"),
    Method("keydiff_block128", "keydiff", "KeyDiffPress", block=128,
           difference="kvpress's BlockPress scores the keys of one full-prompt forward (its own note: not a true "
           "chunked prefill); kvscope's block prefill computes each block over the compressed cache (ValueDiff "
           "§2.2), so only layer 0, whose keys do not depend on attention, sees the same keys. With n_kept a "
           "multiple of the block (256 of 1024) the two block schedules coincide and layer 0 must match"),
)


def jaccard(a: set[int], b: set[int]) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets)."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def kvpress_kept(model_dir: str, prompt: list[int], ratio: float, methods: tuple[Method, ...],
                 threads: int = 1) -> dict:
    """Run the kvpress side (`_kvpress_side.py kept`) in bench/.venv-kvpress; its per-press kept positions."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kept.json"
        done = subprocess.run(
            [str(VENV_PYTHON), str(SIDE), "kept", "--model-dir", model_dir, "--prompt-ids", json.dumps(prompt),
             "--ratio", str(ratio), "--presses", json.dumps([m.press_spec() for m in methods]), "--out", str(out),
             "--threads", str(threads)],
            capture_output=True, text=True, env=env,
        )
        if done.returncode != 0:
            raise UsageError(f"the kvpress side failed: {side_error(done)}")
        return json.loads(out.read_text())


def require_side() -> None:
    """Refuse to start without the kvpress side's environment, once every setting has been checked."""
    if not VENV_PYTHON.exists():
        raise UsageError(f"{VENV_PYTHON} is missing: run bash bench/setup_kvpress.sh first")


def side_error(done: subprocess.CompletedProcess) -> str:
    """What the kvpress side's failure says, in one line: the last line of its stderr (its exception)."""
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def kvscope_kept(lm, prompt: list[int], budget: int, method: Method) -> list[list[list[int]]]:
    """The prompt positions each (layer, KV head) keeps after kvscope's prefill round at budget K = `budget`."""
    from evictor.cache import SlotLayer
    from evictor.engine import EvictionEngine
    from evictor.protocol import WHOLE_PROMPT, EvictionConfig

    config = EvictionConfig(budget=budget, buffer=0, recency=method.recency, trigger="step", protect=method.protect,
                            block=method.block or WHOLE_PROMPT)
    engine = EvictionEngine(lm, method.policy, config)
    with torch.inference_mode(), engine.session([prompt], [budget]) as session:  # no autograd graph kept
        session.prefill()
        kept: list[list[list[int]]] = []
        for layer in session.cache.layers:
            assert isinstance(layer, SlotLayer) and layer.positions is not None  # an EvictingCache layer, prefilled
            kept.append([sorted(p for p in layer.positions[0, head].tolist() if p >= 0)
                         for head in range(layer.positions.shape[1])])
        return kept


def compare_kept(lm, model_dir: str, prompt: list[int], ratio: float, methods: tuple[Method, ...] = METHODS,
                 threads: int = 1) -> tuple[list[dict], list[dict]]:
    """(one summary row per method, one row per method and (layer, KV head) pair) of the two libraries' kept sets."""
    theirs = kvpress_kept(model_dir, prompt, ratio, methods, threads)
    summary, pairs = [], []
    for method in methods:
        n_kept = theirs[method.name]["n_kept"]
        ours = kvscope_kept(lm, prompt, n_kept, method)
        rows = [{"method": method.name, "layer": layer, "head": head, "n_kept": n_kept,
                 "kvscope_kept": len(mine), "jaccard": jaccard(set(mine), set(other))}
                for layer, (our_layer, their_layer) in enumerate(zip(ours, theirs[method.name]["kept"]))
                for head, (mine, other) in enumerate(zip(our_layer, their_layer))]
        pairs += rows
        values = [row["jaccard"] for row in rows]
        summary.append({"method": method.name, "policy": method.policy, "press": method.press, "n_kept": n_kept,
                        "pairs": len(rows), "identical": sum(v == 1.0 for v in values),
                        "layer0_identical": sum(row["jaccard"] == 1.0 for row in rows if row["layer"] == 0),
                        "min_jaccard": min(values),
                        "mean_jaccard": sum(values) / len(values),
                        "kind": "difference" if method.difference else "matched", "difference": method.difference})
    return summary, pairs


def load_side_by_side(name: str, workdir: str):
    """(kvscope's loaded model, the directory kvpress loads the same weights from)."""
    from models.loading import load_model, locate_weights
    from models.tiny import save_tiny_model

    if name.startswith("tiny-"):
        directory = save_tiny_model(name.removeprefix("tiny-"), Path(workdir) / name)
        return load_model(directory, dtype="float32", attn_implementation="sdpa"), directory
    weights_dir, _, _ = locate_weights(name)
    return load_model(name, dtype="float32", attn_implementation="sdpa"), str(weights_dir)


def context_prompt(lm, ctx: int) -> list[int]:
    """`ctx` tokens of natural text (the first geometry calibration sequence), long enough for blocks to matter."""
    from geometry.calibration import calibration_prompts

    return list(calibration_prompts(lm.tokenizer, 1, ctx)[0].input_ids)


def kept_command(args: argparse.Namespace) -> None:
    chosen = choose_methods(args.methods)
    if args.out:
        check_output_file(Path(args.out))
    check_memory(args, {method.policy for method in chosen}, args.ctx, 1)
    require_side()
    with tempfile.TemporaryDirectory() as tmp:
        lm, directory = load_side_by_side(args.model, tmp)
        prompt = context_prompt(lm, args.ctx)
        summary, pairs = compare_kept(lm, directory, prompt, args.ratio, tuple(chosen), args.threads)
    print(f"{args.model}: prompt {len(prompt)} tokens, kvpress compression_ratio {args.ratio}, "
          f"{lm.model.config.num_hidden_layers} layers x {lm.model.config.num_key_value_heads} KV heads")
    print(table(summary, [("method", "method", "s"), ("press", "kvpress press", "s"), ("n_kept", "kept", "d"),
                          ("identical", "J = 1 pairs", "d"), ("pairs", "of", "d"),
                          ("layer0_identical", "J = 1 in layer 0", "d"), ("min_jaccard", "min J", ".3f"),
                          ("mean_jaccard", "mean J", ".3f"), ("kind", "kind", "s")]))
    for row in summary:
        if row["difference"]:
            print(f"  {row['method']}: {row['difference']}")
    for row in pairs:
        if row["jaccard"] < 1.0 and not next(m for m in METHODS if m.name == row["method"]).difference:
            print(f"  matched method below 1.0: {row['method']} layer {row['layer']} head {row['head']} "
                  f"J = {row['jaccard']:.3f}")
    if args.out:
        with atomic_write(args.out) as handle:
            writer = csv.DictWriter(handle, fieldnames=list(pairs[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(pairs)
        print(f"per-pair Jaccard written to {args.out}")


def choose_methods(text: str | None) -> list[Method]:
    """The methods --methods names (default: all), in the order given; an unknown or repeated one is refused."""
    if text is None:
        return list(METHODS)
    by_name = {method.name: method for method in METHODS}
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in by_name:
            raise unknown_choice("method", name, by_name)
    distinct("--methods", text, names)
    return [by_name[name] for name in names]


def check_memory(args: argparse.Namespace, policies, prompt: int, new_tokens: int) -> None:
    """Refuse a comparison whose kvscope side would need more memory than this machine has or --max-memory allows
    (the kvpress side runs after it, in its own process, with the same weights)."""
    from evictor.protocol import EvictionConfig
    from models.footprint import model_shape

    check_engine_memory(model_shape(args.model, "float32", "cpu"), ["full", *sorted(policies)],
                        EvictionConfig(budget=None, buffer=0, trigger="step"), prompt, new_tokens, 1, "cpu",
                        args.max_memory, remedy="lower --ctx or --new-tokens")


def speed_command(args: argparse.Namespace) -> None:
    from evictor.engine import EvictionEngine
    from evictor.protocol import EvictionConfig
    from models.loading import load_model, load_tokenizer

    if args.interval >= args.target:
        raise UsageError(f"--interval {args.interval} must be below --target {args.target}: kvscope keeps K = T - I")
    prompt = fixed_prompt(load_tokenizer(args.model))
    check_memory(args, {"keynorm"}, len(prompt), args.new_tokens)
    require_side()
    lm = load_model(args.model)
    assert lm.model.name_or_path is not None  # from_pretrained records where the weights were read from
    model_dir = Path(lm.model.name_or_path)
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
            [str(VENV_PYTHON), str(SIDE), "speed", "--model-dir", str(model_dir), "--prompt-ids", json.dumps(prompt),
             "--target", str(args.target), "--interval", str(args.interval), "--new-tokens", str(args.new_tokens),
             "--threads", str(args.threads)],
            capture_output=True, text=True, env=side_env,
        )
        if out.returncode != 0:
            raise UsageError(f"the kvpress side failed: {side_error(out)}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bench/kvpress_compare.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    kept = commands.add_parser("kept", help="Jaccard of the kept sets per (layer, KV head) after prefill")
    kept.add_argument("--model", default="smollm2-135m", choices=MODELS,
                      help="SmolLM2-135M (its converted directory) or the random-init tiny Llama (default: "
                      "smollm2-135m)")
    kept.add_argument("--ctx", type=positive_int, default=1024,
                      help="prompt tokens: the first geometry calibration text, cut to this length (default: 1024)")
    kept.add_argument("--ratio", type=open_unit_interval, default=0.75,
                      help="kvpress compression_ratio: the share of prompt tokens evicted, in (0, 1) (default: 0.75, "
                      "which keeps 256 of 1024, a multiple of the 128-token block)")
    kept.add_argument("--methods", default=None,
                      help=f"comma list of methods (default: all of {', '.join(m.name for m in METHODS)})")
    kept.add_argument("--out", default=None, help="CSV file for the per-pair Jaccard (default: none)")
    speed = commands.add_parser("speed", help="decode tokens/s and peak cache at the same cache target")
    speed.add_argument("--model", default="smollm2-135m", choices=MODELS[:1],
                       help="the model both sides decode with (default: smollm2-135m)")
    speed.add_argument("--target", type=positive_int, default=256, help="cache target T (default: 256)")
    speed.add_argument("--interval", type=positive_int, default=16, help="compression interval I (default: 16)")
    speed.add_argument("--new-tokens", type=positive_int, default=256, help="tokens generated per run (default: 256)")
    speed.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats (default: 3)")
    for sub in (kept, speed):
        sub.add_argument("--threads", type=thread_count, default=1, help="torch threads on each side (default: 1)")
        sub.add_argument("--max-memory", type=memory_size, default=None,
                         help="the memory the kvscope side may use, with its unit (e.g. 8GiB): a setting whose "
                         "estimated peak exceeds it is refused before it starts (default: this machine's memory)")
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    {"kept": kept_command, "speed": speed_command}[args.command](args)
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
