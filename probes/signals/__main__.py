"""Per-token signals of stored traces: ``python -m probes.signals --traces DIR/generations.jsonl --out signals.jsonl``.

Each trace (``prompt_ids + generated_ids`` of a `tasks.run` or `evictor.run --policy full` record) gets one
teacher-forced forward; the output holds one JSONL record per trace, appended as it finishes (rerun to resume):
``{trace_id, model, dataset, n_tokens, n_prompt, positions, layers, smoothing, signals: {signal: {layer: [...]}},
band_score?}`` with NaN (hidden_diff at position 0) written as null. The resolved configuration is saved beside the
output as ``<stem>.config.json``. Signal definitions: `probes.signals.extract`; smoothings: `probes.signals.hidden`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from core.cli import ArgumentParser, main_guard, positive_int, save_config
from core.errors import UsageError, unknown_choice
from probes.signals.extract import ATTENTION_SIGNALS, DEFAULT_SIGNALS, SIGNALS, check_signals, resolve_layers
from probes.signals.hidden import DEFAULT_EPS, DEFAULT_WINDOW, SMOOTHINGS, band_score, smooth

BAND_SMOOTHINGS = ("mean", "z")



def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m probes.signals",
                     description="Compute per-token, per-layer signals (hidden-state change, K/V statistics, "
                     "attention scores) of stored traces with one teacher-forced forward each.")
    parser.add_argument("--traces", required=True, help="trace records (JSONL with id, prompt_ids, generated_ids)")
    parser.add_argument("--out", required=True, help="output JSONL file (resumable; config saved beside it)")
    parser.add_argument("--model", default=None,
                        help="model to run (registry name, directory, .gguf or hub id); default: the traces' model")
    parser.add_argument("--layers", default="all", help="'all' (default) or comma-separated layer indices")
    parser.add_argument("--signals", default=",".join(DEFAULT_SIGNALS),
                        help=f"comma-separated signals from {', '.join(SIGNALS)} (default: all but the attention "
                        f"ones; {', '.join(ATTENTION_SIGNALS)} load the model with the eager kernel)")
    parser.add_argument("--smoothing", default="raw",
                        help=f"applied to every signal per layer, causally: {', '.join(SMOOTHINGS)} (default raw)")
    parser.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW,
                        help=f"rolling window for mean / z smoothing and the band score (default {DEFAULT_WINDOW})")
    parser.add_argument("--alpha", type=float, default=0.9, help="EMA weight on the past (default 0.9)")
    parser.add_argument("--eps", type=float, default=DEFAULT_EPS, help="z-score denominator epsilon (default 1e-6)")
    parser.add_argument("--bands", default=None,
                        help="A,B: also write EpiKV's band_score from hidden_diff at layers A and B (eq. 1, or its "
                        "z version with --band-smoothing z); the two layers are added to --layers")
    parser.add_argument("--band-smoothing", default="z", help="mean (eq. 1) or z (EpiKV; default)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N traces")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights dtype (default float32)")
    return parser


def _json_values(tensor) -> list[float | None]:
    return [None if math.isnan(x) else x for x in tensor.tolist()]


def _run(argv: list[str] | None) -> int:
    from core.records import read_jsonl

    args = build_parser().parse_args(argv)
    signals = check_signals(s.strip() for s in args.signals.split(",") if s.strip())
    if args.smoothing not in SMOOTHINGS:
        raise unknown_choice("smoothing", args.smoothing, SMOOTHINGS)
    if args.band_smoothing not in BAND_SMOOTHINGS:
        raise unknown_choice("band smoothing", args.band_smoothing, BAND_SMOOTHINGS)
    bands = None
    if args.bands is not None:
        try:
            bands = tuple(int(part) for part in args.bands.split(","))
        except ValueError:
            bands = ()
        if len(bands) != 2:
            raise UsageError(f"--bands {args.bands!r}: give two layers A,B")
        if "hidden_diff" not in signals:
            signals = ["hidden_diff", *signals]
    traces_path = Path(args.traces)
    if not traces_path.is_file():
        raise UsageError(f"--traces {args.traces!r} does not exist")
    traces = []
    for number, record in enumerate(read_jsonl(traces_path), start=1):
        if not {"id", "prompt_ids", "generated_ids"} <= set(record):
            raise UsageError(f"{traces_path}: record {number} lacks id / prompt_ids / generated_ids")
        traces.append(record)
        if args.limit is not None and len(traces) >= args.limit:
            break
    models = {t.get("model") for t in traces}
    model_name = args.model or (models.pop() if len(models) == 1 and None not in models else None)
    if model_name is None:
        raise UsageError(f"cannot tell the traces' model (found {sorted(map(str, models))}); pass --model")

    from models.loading import load_model

    wants_attention = any(s in ATTENTION_SIGNALS for s in signals)
    lm = load_model(model_name, device=args.device, dtype=args.dtype,
                    attn_implementation="eager" if wants_attention else None)
    n_layers = lm.config.num_hidden_layers
    layers = resolve_layers(args.layers, n_layers)
    if bands is not None:
        layers = sorted(set(layers) | set(resolve_layers(list(bands), n_layers)))

    from tqdm import tqdm

    from core.records import JsonlStore
    from probes.signals.extract import teacher_forced_signals

    out = Path(args.out)
    save_config(out.parent, {"traces": str(traces_path.resolve()), "model": model_name, "layers": layers,
                             "signals": signals, "smoothing": args.smoothing, "window": args.window,
                             "alpha": args.alpha, "eps": args.eps, "bands": bands,
                             "band_smoothing": args.band_smoothing, "limit": args.limit, "dtype": args.dtype,
                             "loaded_model": lm.describe(),
                             "h_l": "blocks.{l}.hook_resid_post; hidden_diff at position 0 is null"},
                name=f"{out.stem}.config.json")
    store = JsonlStore(out, key=lambda r: r["trace_id"])
    todo = [t for t in traces if str(t["id"]) not in store]
    for trace in tqdm(todo, desc="traces", unit="trace", file=sys.stderr):
        ids = list(trace["prompt_ids"]) + list(trace["generated_ids"])
        raw = teacher_forced_signals(lm, ids, layers, signals)
        record = {"trace_id": str(trace["id"]), "model": model_name, "dataset": trace.get("dataset"),
                  "n_tokens": len(ids), "n_prompt": len(trace["prompt_ids"]), "positions": list(range(len(ids))),
                  "layers": layers, "smoothing": args.smoothing,
                  "signals": {signal: {str(layer): _json_values(smooth(values[0], args.smoothing, args.window,
                                                                         args.alpha, args.eps))
                                       for layer, values in per_layer.items()}
                              for signal, per_layer in raw.items()}}
        if bands is not None:
            g = raw["hidden_diff"]
            record["band_score"] = _json_values(band_score(g[bands[0]][0], g[bands[1]][0], args.band_smoothing,
                                                           args.window, args.alpha, args.eps))
        store.append(record)
    print(f"{len(store.records)} trace records in {out}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
