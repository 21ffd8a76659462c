"""Survey a model's KV geometry and attention-sink statistics over a calibration set (ValueDiff Tables 4-8).

    python -m geometry.survey --model smollm2-135m --prompts 20 --ctx 2048 --out runs/geometry/smollm2-135m

Writes into --out: ``config.json`` (resolved settings, calibration hash, what position 0 is), ``records.jsonl``
(one record of per-head statistics per calibration sequence; a rerun resumes after the last finished one),
and the tables ``heads_kv``, ``heads_q``, ``layers``, ``model`` as ``.csv`` and ``.json``. Prints the model-level
rows. Definitions: `geometry.stats`, `geometry.measure`, aggregation rules: `geometry.summary`.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from geometry.calibration import CATEGORIES, calibration_digest, calibration_prompts
from geometry.measure import KEY_SPACES, MeasureSettings, layer_specs, measure_sequence, weight_norms
from geometry.stats import JACCARD_MARGIN
from geometry.summary import MODEL_COLUMNS, GeometryAccumulator, build_tables
from core.cli import ArgumentParser, atomic_write, main_guard, positive_int, save_config
from core.errors import UsageError
from models.loading import load_model
from core.records import JsonlStore
from models.registry import DEFAULT_MODEL

TABLES = ("heads_kv", "heads_q", "layers", "model")
# Settings a resumed run must share with the records already on disk (tau only enters the aggregation).
RUN_KEYS = ("ctx", "topk", "queries", "key_space")
MEASUREMENT_KEYS = ("model", "weights", "dtype", *RUN_KEYS)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m geometry.survey", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="registry name (smollm2-135m, gemma3-270m, ...), local HF directory, .gguf file or hub id "
                             f"(default {DEFAULT_MODEL})")
    parser.add_argument("--prompts", type=positive_int, default=20,
                        help=f"number of calibration sequences, cycling through {', '.join(CATEGORIES)} (default 20)")
    parser.add_argument("--ctx", type=positive_int, default=2048,
                        help="tokens per calibration sequence; at least topk + 34 so the Jaccard statistic has two "
                             f"query positions in [topk+{JACCARD_MARGIN}, ctx-1] (default 2048)")
    parser.add_argument("--out", default=None, help="output directory (default runs/geometry/<model>)")
    parser.add_argument("--tau", type=float, default=0.3,
                        help="sink threshold: a head is a sink in a sequence when its mean attention to position 0 "
                             "over queries t>=1 exceeds tau; must be in (0, 1) (default 0.3)")
    parser.add_argument("--topk", type=positive_int, default=256, help="k of the top-k attention Jaccard (default 256)")
    parser.add_argument("--queries", type=int, default=128,
                        help="query positions sampled for the Jaccard statistic, >= 2 (default 128)")
    parser.add_argument("--key-space", choices=KEY_SPACES, default="post_rope",
                        help="keys used for sigma_K, BOS cosine and sigma_1(K): post_rope = what the KV cache stores "
                             "(default), pre_rope = the k projection before rotary embedding")
    parser.add_argument("--chunk", type=positive_int, default=256,
                        help="query rows per attention block; peak memory ~ q_heads x chunk x ctx floats (default 256)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32",
                        help="model dtype: float32, bfloat16 or float16 (default float32)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is fastest on a CPU shared with "
                             "other jobs, where extra threads mostly wait on each other")
    return parser


def _validate(args: argparse.Namespace) -> None:
    if not 0 < args.tau < 1:
        raise UsageError(f"--tau must be in (0, 1), got {args.tau}")
    if args.queries < 2:
        raise UsageError(f"--queries must be at least 2, got {args.queries}")
    minimum = args.topk + JACCARD_MARGIN + 2
    if args.ctx < minimum:
        raise UsageError(
            f"--ctx {args.ctx} is too small for --topk {args.topk}: the Jaccard statistic samples queries in "
            f"[topk+{JACCARD_MARGIN}, ctx-1] and needs two of them, so --ctx must be at least {minimum}"
        )


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    out = Path(args.out) if args.out else Path("runs") / "geometry" / Path(args.model).name.replace(".gguf", "")
    # Settings known before loading are checked first, so a refused resume does not wait for the model.
    _check_resumable(out / "config.json", {"model": args.model, **{k: getattr(args, k) for k in RUN_KEYS}})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    limit = getattr(lm.config, "max_position_embeddings", None)
    if limit is not None and args.ctx > limit:
        raise UsageError(f"--ctx {args.ctx} exceeds the model's max_position_embeddings {limit}")
    prompts = calibration_prompts(lm.tokenizer, args.prompts, args.ctx)
    config = _resolved_config(args, lm, prompts)
    store_path = out / "records.jsonl"
    _check_resumable(out / "config.json", config)
    if store_path.exists():
        _check_records(store_path, {p.id: p.sha256 for p in prompts})

    out.mkdir(parents=True, exist_ok=True)
    save_config(out, config)
    store = JsonlStore(store_path, key=lambda record: record["prompt"])
    settings = MeasureSettings(topk=args.topk, n_queries=args.queries, key_space=args.key_space, chunk=args.chunk)
    todo = [p for p in prompts if p.id not in store]
    for prompt in tqdm(todo, desc=f"geometry {lm.name}", unit="seq", file=sys.stderr):
        input_ids = torch.tensor([prompt.input_ids], device=lm.device)
        record = measure_sequence(lm.model, input_ids, settings)
        store.append({"prompt": prompt.id, "category": prompt.category, "sha256": prompt.sha256,
                      "leading_token": prompt.input_ids[0], **record})

    accumulator = GeometryAccumulator(args.tau)
    wanted = {p.id for p in prompts}
    for record in store.records:
        if record["prompt"] in wanted:
            accumulator.add(record)
    tables = build_tables(accumulator.means(), layer_specs(lm.model), weight_norms(lm.model), lm.name)
    for name in TABLES:
        write_table(out / name, tables[name])
    print(format_model_rows(tables["model"]))
    print(f"tables written to {out}/", file=sys.stderr)
    return 0


def _resolved_config(args: argparse.Namespace, lm, prompts) -> dict[str, Any]:
    tokenizer = lm.tokenizer
    leading = sorted({p.input_ids[0] for p in prompts})
    return {
        "model": lm.name,
        "weights": lm.info.get("gguf_sha256", lm.source),
        "dtype": str(lm.model.dtype),
        "device": str(lm.device),
        "ctx": args.ctx,
        "prompts": args.prompts,
        "topk": args.topk,
        "queries": args.queries,
        "key_space": args.key_space,
        "tau": args.tau,
        "chunk": args.chunk,
        "describe": lm.describe(),
        "layer_types": [spec.kind for spec in layer_specs(lm.model)],
        "calibration_sha256": calibration_digest(prompts),
        "calibration": [{"id": p.id, "sha256": p.sha256, "sources": list(p.sources)} for p in prompts],
        # The leading token is position 0 whatever it is; record whether that is the tokenizer's BOS.
        "leading_token_ids": leading,
        "leading_tokens": tokenizer.convert_ids_to_tokens(leading),
        "leading_token_is_bos": all(t == tokenizer.bos_token_id for t in leading),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }


def _check_resumable(config_path: Path, config: dict[str, Any]) -> None:
    if not config_path.exists():
        return
    try:
        previous = json.loads(config_path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{config_path} is not valid JSON; use another --out") from None
    changed = [key for key in MEASUREMENT_KEYS if key in config and previous.get(key) != config[key]]
    if changed:
        detail = ", ".join(f"{key}: {previous.get(key)!r} -> {config[key]!r}" for key in changed)
        raise UsageError(f"{config_path.parent} holds a survey with different settings ({detail}); use another --out")


def _check_records(path: Path, expected: dict[str, str]) -> None:
    for record in JsonlStore(path, key=lambda r: r["prompt"]).records:
        if record["prompt"] in expected and record.get("sha256") != expected[record["prompt"]]:
            raise UsageError(
                f"{path}: prompt {record['prompt']!r} was measured on different text (the calibration sources "
                "changed); use another --out"
            )


def write_table(stem: Path, rows: list[dict[str, Any]]) -> None:
    """``stem.csv`` and ``stem.json`` holding the same records (JSON null / empty CSV cell = undefined)."""
    with atomic_write(stem.with_suffix(".json")) as handle:
        json.dump(rows, handle, indent=1)
        handle.write("\n")
    with atomic_write(stem.with_suffix(".csv"), mode="w") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def format_model_rows(rows: list[dict[str, Any]]) -> str:
    """The model-level rows as an aligned text table (ValueDiff Tables 4-8 columns)."""
    def cell(value: Any) -> str:
        if value is None:
            return "n/a"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    table = [list(MODEL_COLUMNS)] + [[cell(row[c]) for c in MODEL_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(MODEL_COLUMNS))]
    return "\n".join("  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in table)


if __name__ == "__main__":
    raise SystemExit(main())
