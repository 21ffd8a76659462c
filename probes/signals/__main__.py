"""Per-token signals of stored traces: ``python -m probes.signals --traces DIR/generations.jsonl --out signals.jsonl``.

Each dense trace (``prompt_ids + generated_ids`` of a `tasks.run` or `evictor.run --policy full` record) gets one
teacher-forced forward and becomes one `core.schemas.Signal` record, ``signals[signal][layer]`` one value per
position (null where undefined: hidden_diff at position 0), appended to --out as it finishes; rerunning the same
command resumes. Records with hidden_diff state the residual stream it read (``hidden_hook``: EpiKV's h_l is the input
of block l, ``hook_resid_pre``), so the band policy `validation.select` configures from them reads the same one.
Signal definitions: `probes.signals.extract`; smoothings: `probes.signals.hidden`.

--out is a JSONL file. Several signal files may share a directory (one per smoothing, say): each has its own
resolved configuration ``<stem>.config.json`` and lock ``.<stem>.lock`` beside it. A rerun into an existing --out with
a setting that changes the records (traces, model, layers, signals, smoothing and its parameters, bands, dtype) is
refused naming the setting, so records made differently never share a file.

Library: `trace_signals(lm, traces, SignalsConfig(...))` yields the records; the CLI is a thin adapter over it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.cli import ArgumentParser, add_device_arguments, main_guard, positive_int
from core.errors import UsageError, unknown_choice
from core.rundir import RunDir
from core.schemas import Signal, Trace, read_records
from probes.signals.extract import ATTENTION_SIGNALS, DEFAULT_SIGNALS, SIGNALS, check_signals, resolve_layers
from probes.signals.hidden import DEFAULT_EPS, DEFAULT_HIDDEN_HOOK, DEFAULT_WINDOW, SMOOTHINGS, band_score, smooth

BAND_SMOOTHINGS = ("mean", "z")
WINDOWED_SMOOTHINGS = ("mean", "z")  # the smoothings that read a trailing window of --window positions


@dataclass(frozen=True)
class SignalsConfig:
    """What each Signal record is computed with; the CLI flags of the same names document each field."""

    layers: str | tuple[int, ...] = "all"
    signals: tuple[str, ...] = DEFAULT_SIGNALS
    smoothing: str = "raw"
    window: int = DEFAULT_WINDOW
    alpha: float = 0.9
    eps: float = DEFAULT_EPS
    bands: tuple[int, int] | None = None  # EpiKV's Band A and Band B layers for `band_score`
    band_smoothing: str = "z"

    def check(self) -> None:
        """Refuse settings no record can be computed with, before anything is loaded or written."""
        check_signals(self.signals)
        if self.smoothing not in SMOOTHINGS:
            raise unknown_choice("smoothing", self.smoothing, SMOOTHINGS)
        if self.band_smoothing not in BAND_SMOOTHINGS:
            raise unknown_choice("band smoothing", self.band_smoothing, BAND_SMOOTHINGS)
        if self.bands is not None and "hidden_diff" not in self.signals:
            raise UsageError("a band score is computed from hidden_diff; add it to the signals")
        if not 0.0 <= self.alpha < 1.0:
            raise UsageError(f"--alpha must be in [0, 1), got {self.alpha}")
        if not self.eps > 0:
            raise UsageError(f"--eps must be > 0, got {self.eps}")

    def layer_indices(self, n_layers: int) -> list[int]:
        """The layers measured: --layers plus the band layers, range-checked against the model."""
        layers = resolve_layers(self.layers, n_layers)
        if self.bands is not None:
            layers = sorted(set(layers) | set(resolve_layers(list(self.bands), n_layers)))
        return layers

    def record_settings(self) -> dict[str, Any]:
        """Every setting a record's values depend on, None where the smoothing does not use it (so changing an
        unused one never refuses a resume, and a used one always does)."""
        z_somewhere = self.smoothing == "z" or (self.bands is not None and self.band_smoothing == "z")
        return {
            "layers": self.layers if isinstance(self.layers, str) else sorted(set(self.layers)),
            "signals": list(self.signals),
            "hidden_hook": DEFAULT_HIDDEN_HOOK if "hidden_diff" in self.signals else None,
            "smoothing": self.smoothing,
            "window": self.window if self.smoothing in WINDOWED_SMOOTHINGS or self.bands is not None else None,
            "alpha": self.alpha if self.smoothing == "ema" else None,
            "eps": self.eps if z_somewhere else None,
            "bands": None if self.bands is None else list(self.bands),
            "band_smoothing": self.band_smoothing if self.bands is not None else None,
        }


def _json_values(tensor) -> list[float | None]:
    return [None if math.isnan(x) else x for x in tensor.tolist()]


def trace_signals(lm, traces: Iterable[Trace], config: SignalsConfig) -> Iterator[Signal]:
    """One Signal record per trace, in order: one teacher-forced forward each, smoothed per layer, causally."""
    from probes.signals.extract import teacher_forced_signals

    config.check()
    layers = config.layer_indices(lm.config.num_hidden_layers)
    # The window travels with windowed records: validation names their columns e.g. "z64", and the policy it
    # configures smooths over the same window. The hook does too: a band policy configured from these records reads
    # h_l where hidden_diff read it.
    extra = {"window": config.window} if config.smoothing in WINDOWED_SMOOTHINGS else {}
    hook = config.record_settings()["hidden_hook"]
    if hook is not None:
        extra["hidden_hook"] = hook
    for trace in traces:
        ids = trace.token_ids
        raw = teacher_forced_signals(lm, ids, layers, config.signals)
        values = {signal: {str(layer): _json_values(smooth(per_layer[layer][0], config.smoothing, config.window,
                                                           config.alpha, config.eps))
                           for layer in layers}
                  for signal, per_layer in raw.items()}
        band = None
        if config.bands is not None:
            g = raw["hidden_diff"]
            band = _json_values(band_score(g[config.bands[0]][0], g[config.bands[1]][0], config.band_smoothing,
                                           config.window, config.alpha, config.eps))
        yield Signal(id=trace.id, model=lm.name, dataset=trace.dataset, n_tokens=len(ids),
                     n_prompt=len(trace.prompt_ids), positions=list(range(len(ids))), signals=values, layers=layers,
                     smoothing=config.smoothing, band_score=band, extra=dict(extra))


def read_dense_traces(path: str, limit: int | None = None) -> list[Trace]:
    """The first `limit` traces of `path`; a trace generated under eviction is refused (its tokens are not what the
    model produces with a full cache, so its signals would describe another generation)."""
    traces = read_records(path, Trace)[:limit]
    evicted = [trace for trace in traces if trace.evicted]
    if evicted:
        raise UsageError(f"--traces {path}: {len(evicted)} trace(s) were generated under eviction (first "
                         f"{evicted[0].id!r}, policy {evicted[0].policy}); give dense traces (tasks.run, or "
                         "evictor.run --policy full)")
    return traces


def traces_model(traces: Sequence[Trace], model: str | None, where: str = "--traces") -> str:
    """The model to run on `traces` (read from `where`, e.g. ``--traces FILE``, which errors name): `model` when
    given, else the one model they were generated with; traces it cannot read (a token id outside its vocabulary,
    more tokens than its context) are refused before it loads."""
    from models.loading import model_limits

    models = {t.model for t in traces}
    if model is None and len(models) != 1:
        raise UsageError(f"the traces come from several models ({', '.join(sorted(models))}); pass --model")
    name = model if model is not None else models.pop()
    model_limits(name).check_traces(traces, where)
    return name


def claim_output(out: Path, identity: dict[str, Any]) -> RunDir:
    """The run directory of the JSONL file `out`: its parent, with a config and a lock named after the file."""
    if out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a directory; give the path of a .jsonl file")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--out {str(out)!r}: {str(parent)!r} is a file, so nothing can be written below it")
            break
    return RunDir(out.parent, identity, config_name=f"{out.stem}.config.json", lock_name=f".{out.stem}.lock",
                  flag=f"--out {out.name!r} in")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m probes.signals",
                            description="Compute per-token, per-layer signals (hidden-state change, K/V statistics, "
                            "attention scores) of stored dense traces with one teacher-forced forward each.")
    parser.add_argument("--traces", required=True,
                        help="dense trace records (tasks.run or evictor.run --policy full generations.jsonl)")
    parser.add_argument("--out", required=True,
                        help="output JSONL file (resumable; <stem>.config.json and a lock are kept beside it)")
    parser.add_argument("--model", default=None,
                        help="model to run (registry name, directory, .gguf or hub id); default: the traces' model")
    parser.add_argument("--layers", default="all", help="'all' (default) or comma-separated layer indices")
    parser.add_argument("--signals", default=",".join(DEFAULT_SIGNALS),
                        help=f"comma-separated signals from {', '.join(SIGNALS)} (default: all but the attention "
                        f"ones, {', '.join(ATTENTION_SIGNALS)}, which recompute every query's attention row)")
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
    return bands


def _layers(text: str) -> str | tuple[int, ...]:
    if text == "all":
        return text
    try:
        return tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise UsageError(f"--layers {text!r}: give 'all' or comma-separated integers") from None


def _run(argv: list[str] | None) -> int:
    from models.loading import model_limits

    args = build_parser().parse_args(argv)
    bands = _bands(args.bands)
    signals = tuple(check_signals(s.strip() for s in args.signals.split(",") if s.strip()))
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
