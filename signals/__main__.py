"""Per-token signals of stored traces: ``python -m signals --traces DIR/generations.jsonl --out signals.jsonl``.

Each dense trace (``prompt_ids + generated_ids`` of a `tasks.run` or `evictor.run --policy full` record) gets one
teacher-forced forward and becomes one `core.schemas.Signal` record, ``signals[signal][layer]`` one value per
position (null where undefined: hidden_diff at position 0), appended to --out as it finishes; rerunning the same
command resumes. Records with hidden_diff state the residual stream it read (``hidden_hook``: EpiKV's h_l is the input
of block l, ``hook_resid_pre``), so the band policy `validation.select` configures from them reads the same one.
Signal definitions: `signals` (the registry) and `signals.extract`; smoothings: `signals.hidden`.

--out is a JSONL file. Several signal files may share a directory (one per smoothing, say): each has its own
resolved configuration ``<stem>.config.json`` and lock ``.<stem>.lock`` beside it. A rerun into an existing --out with
a setting that changes the records (traces, model, layers, signals, smoothing and its parameters, bands, dtype) is
refused naming the setting, so records made differently never share a file.

Library: `signals.traces.trace_signals(lm, traces, SignalsConfig(...))` yields the records; this CLI is a thin
adapter over it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.cli import ArgumentParser, add_device_arguments, distinct, main_guard, positive_int
from core.errors import UsageError
from core.limits import MemoryLimit
from core.schemas import Signal
from signals import SIGNALS, check_signals, default_signals
from signals.hidden import DEFAULT_EPS, DEFAULT_WINDOW, SMOOTHINGS
from signals.traces import SignalsConfig, claim_output, read_dense_traces, trace_signals, traces_model


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m signals",
                            description="Compute per-token, per-layer signals (hidden-state change, K/V statistics, "
                            "attention scores) of stored dense traces with one teacher-forced forward each.")
    parser.add_argument("--traces", required=True,
                        help="dense trace records (tasks.run or evictor.run --policy full generations.jsonl)")
    parser.add_argument("--out", required=True,
                        help="output JSONL file (resumable; <stem>.config.json and a lock are kept beside it)")
    parser.add_argument("--model", default=None,
                        help="model to run (registry name, directory, .gguf or hub id); default: the traces' model")
    parser.add_argument("--layers", default="all", help="'all' (default) or comma-separated layer indices")
    attention = [name for name in SIGNALS if SIGNALS[name].reads == "attention"]
    parser.add_argument("--signals", default=",".join(default_signals()),
                        help=f"comma-separated signals from {', '.join(SIGNALS)} (default: all but the attention "
                        f"ones, {', '.join(attention)}, which recompute every query's attention row)")
    parser.add_argument("--smoothing", default="raw",
                        help=f"applied to every signal per layer, causally: {', '.join(SMOOTHINGS)} (default raw); "
                        "validation.layers configures the epikv policies from a mean file and a z file")
    parser.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW,
                        help=f"rolling window for mean / z smoothing and the band score (default {DEFAULT_WINDOW})")
    parser.add_argument("--alpha", type=float, default=0.9, help="EMA weight on the past, in [0, 1) (default 0.9)")
    parser.add_argument("--eps", type=float, default=DEFAULT_EPS, help="z-score denominator epsilon (default 1e-6)")
    parser.add_argument("--bands", default=None,
                        help="A,B: also write EpiKV's band_score from hidden_diff at layers A and B (eq. 1, or its "
                        "z version with --band-smoothing z); the two layers are added to --layers")
    parser.add_argument("--band-smoothing", default="z", help="mean (eq. 1) or z (EpiKV; default)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N traces")
    add_device_arguments(parser, dtype_default="float32")
    return parser


def _bands(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        bands = tuple(int(part) for part in text.split(","))
    except ValueError:
        bands = ()
    if len(bands) != 2:
        raise UsageError(f"--bands {text!r}: give two layers A,B")
    distinct("--bands", text, bands)
    return bands


def _layers(text: str) -> str | tuple[int, ...]:
    if text == "all":
        return text
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--layers {text!r}: give 'all' or comma-separated integers") from None
    distinct("--layers", text, layers)
    return tuple(sorted(layers))


def _run(argv: list[str] | None) -> int:
    from models.footprint import model_shape
    from models.loading import model_limits

    args = build_parser().parse_args(argv)
    bands = _bands(args.bands)
    names = [s.strip() for s in args.signals.split(",") if s.strip()]
    distinct("--signals", args.signals, names)
    signals = tuple(check_signals(names))
    if bands is not None and "hidden_diff" not in signals:
        signals = ("hidden_diff", *signals)
    config = SignalsConfig(layers=_layers(args.layers), signals=signals, smoothing=args.smoothing,
                           window=args.window, alpha=args.alpha, eps=args.eps, bands=bands,
                           band_smoothing=args.band_smoothing)
    config.check()
    traces = read_dense_traces(args.traces, args.limit)
    model_name = traces_model(traces, args.model, f"--traces {args.traces}")
    limits = model_limits(model_name)
    limits.check_flags({"--window": args.window})
    if limits.layers is not None:
        config.layer_indices(limits.layers)  # a layer the model lacks is refused before it loads
    longest = max(len(trace.token_ids) for trace in traces)
    config.footprint(model_shape(model_name, args.dtype, args.device), longest).check(
        f"{model_name} reading traces of up to {longest} tokens (--traces {args.traces})",
        MemoryLimit.of(args.device, args.max_memory), "use shorter traces or leave out the attention --signals")
    out = Path(args.out)
    identity = {"traces": str(Path(args.traces).resolve()), "model": model_name, "dtype": args.dtype,
                **config.record_settings()}
    with claim_output(out, identity) as run:
        from models.loading import load_model

        lm = load_model(model_name, device=args.device, dtype=args.dtype)
        layers = config.layer_indices(lm.config.num_hidden_layers)
        run.save_config(layers_measured=layers, limit=args.limit, device=str(lm.device),
                        loaded_model=lm.describe())
        store = run.store(out.name, key=lambda record: Signal.from_json(record, str(out)).id)
        todo = [t for t in traces if t.id not in store]

        from tqdm import tqdm

        for record in tqdm(trace_signals(lm, todo, config), total=len(todo), desc="traces", unit="trace",
                           file=sys.stderr):
            store.append(record.to_json())
    print(f"{len(store.records)} signal records in {out}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
