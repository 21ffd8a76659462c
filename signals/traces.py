"""Per-token signals of stored dense traces as `core.schemas.Signal` records: the library of ``python -m signals``.

Each dense trace (``prompt_ids + generated_ids`` of a `tasks.run` or `evictor.run --policy full` record) gets one
teacher-forced forward (`signals.extract.teacher_forced_signals`) and becomes one record, ``signals[signal][layer]``
one value per position (null where undefined: hidden_diff at position 0), smoothed per layer, causally
(`signals.hidden.smooth`). Records with a signal of the residual stream state the stream they read (``hidden_hook``:
EpiKV's h_l is the input of block l, ``hook_resid_pre``), so the band policy `validation.select` configures from them
reads the same one; windowed records state their window.

`trace_signals(lm, traces, SignalsConfig(...))` yields the records. The trace and output helpers are shared with the
stages that read dense traces or write one JSONL file of records (`evictor.replay`, `evictor.calibrate`, the study):
`read_dense_traces` refuses traces made under eviction, `traces_model` the model they name or one that cannot read
them, `claim_output` claims a JSONL file as a run directory of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UsageError, unknown_choice
from core.limits import Footprint
from core.rundir import RunDir
from core.schemas import Signal, Trace, read_records
from models.footprint import FP32, ModelShape, forward_footprint
from scoring.policy import DEFAULT_HIDDEN_HOOK
from signals import SIGNALS, check_signals, default_signals
from signals.extract import resolve_layers, teacher_forced_signals
from signals.hidden import DEFAULT_EPS, DEFAULT_WINDOW, SMOOTHINGS, band_score, smooth

BAND_SMOOTHINGS = ("mean", "z")
WINDOWED_SMOOTHINGS = ("mean", "z")  # the smoothings that read a trailing window of --window positions


@dataclass(frozen=True)
class SignalsConfig:
    """What each Signal record is computed with; the CLI flags of the same names document each field."""

    layers: str | tuple[int, ...] = "all"
    signals: tuple[str, ...] = field(default_factory=default_signals)
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

    def footprint(self, shape: ModelShape, tokens: int) -> Footprint:
        """The peak memory of computing one trace of `tokens` positions: its teacher-forced forward building its
        cache and, when a signal reads attention, one layer's recomputed maps at a time (logits, probabilities and
        the pattern handed to the signals, fp32; `models.footprint` says what the rest counts)."""
        attention = any(SIGNALS[name].reads == "attention" for name in check_signals(self.signals))
        maps = 3 * shape.q_heads * tokens * tokens * FP32 if attention else 0
        return forward_footprint(shape, 1, tokens) + Footprint((("attention maps", maps),))

    def record_settings(self) -> dict[str, Any]:
        """Every setting a record's values depend on, None where the smoothing does not use it (so changing an
        unused one never refuses a resume, and a used one always does)."""
        z_somewhere = self.smoothing == "z" or (self.bands is not None and self.band_smoothing == "z")
        reads = {SIGNALS[name].reads for name in check_signals(self.signals)}
        return {
            "layers": self.layers if isinstance(self.layers, str) else sorted(set(self.layers)),
            "signals": list(self.signals),
            "hidden_hook": DEFAULT_HIDDEN_HOOK if "hidden" in reads else None,
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
