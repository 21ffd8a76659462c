"""Per-token, per-layer signals of a trace, streamed during decode or computed over a stored trace.

One `SignalStream` makes, for every requested signal (`signals.SIGNALS`) and layer, one instance of the signal
(`scoring.signal.TokenSignal`) and feeds it what it declared it reads from each forward: the residual stream, the
K/V the cache stores, or the attention probabilities (recomputed by `models.attention`, so any attention kernel
serves). Nothing names a signal here: a registered signal is computed like every other. The stream is fed either

- during generation (`stream_signals`): hooks installed for the whole decode loop, one pass, no second forward; or
- by one teacher-forced forward over ``prompt_ids + generated_ids`` (`teacher_forced_signals`).

Both feed the same code, so they differ only in floating-point summation order. Streaming covers the positions the
model forwarded: the prompt and every generated token but the last (which is sampled, never fed back).

Results are ``{signal: {layer: [batch, pos]}}``, the signals in the order of what they read (the residual stream,
the cache, the attention) and then as requested. The signals themselves are defined beside their score functions:
``hidden_diff`` in `signals.hidden`, the K/V statistics in `signals.kv`, ``h2o``, ``tova`` and
``attention_entropy`` in `signals.attention`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from core.errors import UsageError
from models.hooks import capture, hook_name
from scoring.policy import DEFAULT_HIDDEN_HOOK
from scoring.signal import READS, TokenSignal
from signals import SIGNALS, check_signals, default_signals

# The hook points each kind of signal reads (scoring.signal); the cache stores k then v for the same tokens.
POINTS = {"hidden": (DEFAULT_HIDDEN_HOOK,), "kv": ("attn.hook_cache_k", "attn.hook_cache_v"),
          "attention": ("attn.hook_pattern",)}


def resolve_layers(spec: str | Iterable[int], n_layers: int) -> list[int]:
    """``"all"``, ``"3,10,21"`` or an iterable of ints -> sorted layer indices, range-checked."""
    if isinstance(spec, str):
        if spec == "all":
            return list(range(n_layers))
        try:
            layers = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise UsageError(f"layers {spec!r}: give 'all' or comma-separated integers") from None
    else:
        layers = [int(layer) for layer in spec]
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad or not layers:
        raise UsageError(f"layers {bad or spec!r} out of range 0..{n_layers - 1}")
    return sorted(set(layers))


class SignalStream:
    """Per-token signals for `layers` (default signals: `signals.default_signals`), accumulated over any sequence of
    forwards (see the module docstring)."""

    def __init__(self, model, layers: Iterable[int], signals: Iterable[str] | None = None):
        self.model = model
        self.layers = resolve_layers(list(layers), model.config.num_hidden_layers)
        requested = check_signals(default_signals() if signals is None else signals)
        self.signals = sorted(requested, key=lambda name: READS.index(SIGNALS[name].reads))
        self._streams: dict[str, dict[int, TokenSignal]] = {
            name: {layer: SIGNALS.create(name) for layer in self.layers} for name in self.signals}
        self._readers: dict[tuple[str, int], list[TokenSignal]] = {}  # (kind read, layer) -> the signals reading it
        for name, per_layer in self._streams.items():
            for layer, stream in per_layer.items():
                self._readers.setdefault((SIGNALS[name].reads, layer), []).append(stream)
        kinds = [kind for kind in READS if any(kind == read for read, _ in self._readers)]
        self._by_name = {hook_name(layer, point): (kind, layer, point) for kind in kinds for layer in self.layers
                         for point in POINTS[kind]}
        self._pending_k: dict[int, torch.Tensor] = {}

    @property
    def hook_names(self) -> list[str]:
        return list(self._by_name)

    def _callback(self, name: str, tensor: torch.Tensor) -> None:
        kind, layer, point = self._by_name[name]
        if point == "attn.hook_cache_k":
            self._pending_k[layer] = tensor  # its values follow
            return
        tensors = (self._pending_k.pop(layer), tensor) if kind == "kv" else (tensor,)
        for stream in self._readers[kind, layer]:
            stream.add(*tensors)

    @contextlib.contextmanager
    def attached(self) -> Iterator[SignalStream]:
        """Hooks live for the duration of the context; run any number of forwards (or a generate call) inside."""
        with capture(self.model, self.hook_names, callback=self._callback):
            yield self

    def result(self) -> dict[str, dict[int, torch.Tensor]]:
        """``{signal: {layer: [batch, pos]}}`` over every position forwarded so far (float32, on the CPU)."""
        return {name: {layer: stream.result() for layer, stream in per_layer.items()}
                for name, per_layer in self._streams.items()}


@torch.no_grad()
def teacher_forced_signals(lm, ids: list[int], layers: Iterable[int] | str = "all",
                           signals: Iterable[str] | None = None) -> dict[str, dict[int, torch.Tensor]]:
    """Signals over a stored trace ``ids`` (prompt + generated) from one forward; arrays ``[1, len(ids)]``."""
    from transformers import DynamicCache  # transformers takes a second to import: the CLIs import this module first

    model = lm.model
    stream = SignalStream(model, resolve_layers(layers, model.config.num_hidden_layers), signals)
    device = next(model.parameters()).device
    with stream.attached():
        model(input_ids=torch.tensor([ids], device=device), cache=DynamicCache(config=model.config),
              use_cache=True, logits_to_keep=1)
    return stream.result()


def stream_signals(lm, prompt_ids: list[int], max_new_tokens: int, layers: Iterable[int] | str = "all",
                   signals: Iterable[str] | None = None):
    """Generate greedily with `tasks.generation.generate` while the signals stream out of the same forwards.

    Returns ``(GenerationResult, signals)``; signal arrays cover ``len(prompt_ids) + len(generated_ids) - 1``
    positions (the last generated token is never fed to the model).
    """
    from tasks.generation import generate

    model = lm.model
    stream = SignalStream(model, resolve_layers(layers, model.config.num_hidden_layers), signals)
    with stream.attached():
        result = generate(lm, prompt_ids, max_new_tokens)
    return result, stream.result()
