"""Per-token, per-layer signals of a trace, streamed during decode or computed over a stored trace.

One `SignalStream` consumes what each forward exposes (the residual stream, the K/V the cache stores and the
attention probabilities) and turns it into per-position scalars, keeping only running state.
It is fed either

- during generation (`stream_signals`): hooks installed for the whole decode loop, one pass, no second forward; or
- by one teacher-forced forward over ``prompt_ids + generated_ids`` (`teacher_forced_signals`).

Both feed the same code, so they differ only in floating-point summation order. Streaming covers the positions the
model forwarded: the prompt and every generated token but the last (which is sampled, never fed back).

Signals (``[batch, pos]`` per layer; every K/V and attention signal is the mean over heads):

- ``hidden_diff``: g_l(t) = ||h_l(t) - h_l(t-1)||_2, h_l = ``blocks.{l}.hook_resid_pre`` (EpiKV §3.2: the input of
  block l, ``output_hidden_states[l]``; `probes.signals.hidden.DEFAULT_HIDDEN_HOOK`); position 0 is NaN.
- ``key_norm``: ||k_t||_2 of the cached (post-RoPE) key.
- ``key_variance`` / ``value_variance``: variance of k_t / v_t across the head dimension (EpiKV KV-key / KV-val
  before their rolling mean; smooth them with `probes.signals.hidden.smooth`).
- ``lag_key_variance`` / ``lag_value_variance``: the same after causal lag normalisation (EpiKV Lag-KV).
- ``key_cosine_to_mean`` (KeyDiff): 1 - cos(k_t, mean of the keys at positions <= t).
- ``value_distance_to_mean`` (ValueDiff): ||v_t - mean of the values at positions <= t||_2.
  The mean is causal (the cache as it is when t enters it), so the score is fixed when the token is produced.
- attention signals, from ``blocks.{l}.attn.hook_pattern`` (recomputed by `models.attention`, so any attention
  kernel serves; averaged over query heads):
  ``h2o``: attention each position received, summed over every query forwarded so far (at the end of a
  teacher-forced pass: every later position of the trace, the H2O accumulator without eviction);
  ``tova``: the attention the last forwarded query gives each position (0 for none, i.e. a position not yet
  forwarded); ``attention_entropy``: the entropy (nats) of position t's own query distribution.
  ``h2o`` and ``tova`` read later queries by definition, so they are not causal per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from core.errors import UsageError, unknown_choice
from models.hooks import capture, hook_name
from probes.signals import attention as attn_scores
from probes.signals import kv as kv_scores
from probes.signals.hidden import HiddenDiffStream

KV_SIGNALS = ("key_norm", "key_variance", "value_variance", "lag_key_variance", "lag_value_variance",
              "key_cosine_to_mean", "value_distance_to_mean")
ATTENTION_SIGNALS = ("h2o", "tova", "attention_entropy")
SIGNALS = ("hidden_diff", *KV_SIGNALS, *ATTENTION_SIGNALS)
DEFAULT_SIGNALS = ("hidden_diff", *KV_SIGNALS)


def check_signals(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    for name in names:
        if name not in SIGNALS:
            raise unknown_choice("signal", name, SIGNALS)
    if not names:
        raise UsageError("no signal requested")
    return names


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


class _RunningMean:
    """The mean of all vectors seen so far, per position: ``add(x[b, h, new, d]) -> [b, h, new, d]``."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # [b, h, d] float64 sum
        self.count = 0

    def add(self, x: torch.Tensor) -> torch.Tensor:
        sums = x.double().cumsum(-2)
        if self.total is not None:
            sums = sums + self.total[..., None, :]
        counts = torch.arange(self.count + 1, self.count + x.shape[-2] + 1, device=x.device, dtype=torch.float64)
        self.total, self.count = sums[..., -1, :], self.count + x.shape[-2]
        return (sums / counts[:, None]).to(torch.float32)


@dataclass
class _LayerKV:
    lag_k: kv_scores.LagNormaliser
    lag_v: kv_scores.LagNormaliser
    mean_k: _RunningMean = field(default_factory=_RunningMean)
    mean_v: _RunningMean = field(default_factory=_RunningMean)


class _LayerAttention:
    """H2O accumulator, the last query's row, and per-query entropies of one layer, keyed by absolute position."""

    def __init__(self) -> None:
        self.seen = 0  # positions forwarded so far
        self.received: torch.Tensor | None = None  # [batch, seen]
        self.last_row: torch.Tensor | None = None  # [batch, seen]
        self.entropy: list[torch.Tensor] = []

    def add(self, probs: torch.Tensor) -> None:
        """``probs [batch, q_head, new, keys]``: the keys are the last `keys` positions (sliding layers keep fewer)."""
        probs = probs.float().mean(1)  # [batch, new, keys]
        batch, new, keys = probs.shape
        self.seen += new
        offset = self.seen - keys
        padded = probs.new_zeros(batch, new, self.seen)
        padded[..., offset:] = probs
        received = attn_scores.cumulative_attention(padded)
        if self.received is not None:
            received[:, : self.received.shape[1]] += self.received
        self.received = received
        self.last_row = attn_scores.last_query_attention(padded)
        self.entropy.append(attn_scores.attention_entropy(probs))


class SignalStream:
    """Per-token signals for `layers`, accumulated over any sequence of forwards (see the module docstring)."""

    def __init__(self, model, layers: Iterable[int], signals: Iterable[str] = DEFAULT_SIGNALS, lag_chunk: int = 64):
        self.model = model
        self.layers = resolve_layers(list(layers), model.config.num_hidden_layers)
        self.signals = check_signals(signals)
        self._hidden = HiddenDiffStream(self.layers) if "hidden_diff" in self.signals else None
        self._kv_wanted = [s for s in self.signals if s in KV_SIGNALS]
        self._attn_wanted = [s for s in self.signals if s in ATTENTION_SIGNALS]
        self._kv_state = {layer: _LayerKV(kv_scores.LagNormaliser(lag_chunk), kv_scores.LagNormaliser(lag_chunk))
                          for layer in self.layers}
        self._pending_k: dict[int, torch.Tensor] = {}
        self._kv_parts: dict[str, dict[int, list[torch.Tensor]]] = {s: {l: [] for l in self.layers}
                                                                    for s in self._kv_wanted}
        self._attention = {layer: _LayerAttention() for layer in self.layers}
        kv_points = ("attn.hook_cache_k", "attn.hook_cache_v") if self._kv_wanted else ()
        attention_points = ("attn.hook_pattern",) if self._attn_wanted else ()
        self._by_name = {hook_name(layer, point): (layer, point) for layer in self.layers
                         for point in kv_points + attention_points}

    @property
    def hook_names(self) -> list[str]:
        names = list(self._hidden.names) if self._hidden else []
        return names + list(self._by_name)

    def _callback(self, name: str, tensor: torch.Tensor) -> None:
        if self._hidden is not None and name in self._hidden.names:
            self._hidden.callback(name, tensor)
            return
        layer, point = self._by_name[name]
        if point == "attn.hook_pattern":
            self._attention[layer].add(tensor)
            return
        if point == "attn.hook_cache_k":
            self._pending_k[layer] = tensor  # the cache stores k then v for the same tokens
            return
        self._add_kv(layer, self._pending_k.pop(layer), tensor)

    def _add_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k, v [batch, kv_head, new, d_head]`` -> one value per new position and signal, averaged over heads."""
        state = self._kv_state[layer]
        per_head = {}
        want = set(self._kv_wanted)
        if "key_norm" in want:
            per_head["key_norm"] = kv_scores.vector_norm(k)
        if "key_variance" in want:
            per_head["key_variance"] = kv_scores.head_dim_variance(k)
        if "value_variance" in want:
            per_head["value_variance"] = kv_scores.head_dim_variance(v)
        if "lag_key_variance" in want:
            per_head["lag_key_variance"] = kv_scores.head_dim_variance(state.lag_k.add(k))
        if "lag_value_variance" in want:
            per_head["lag_value_variance"] = kv_scores.head_dim_variance(state.lag_v.add(v))
        if "key_cosine_to_mean" in want:  # each position vs its own causal mean: [.., new, 1, d] twice
            anchor = state.mean_k.add(k)
            per_head["key_cosine_to_mean"] = kv_scores.cosine_distance_to_mean(
                k.float()[..., None, :], ref=anchor[..., None, :])[..., 0]
        if "value_distance_to_mean" in want:
            anchor = state.mean_v.add(v)
            per_head["value_distance_to_mean"] = kv_scores.distance_to_mean(
                v.float()[..., None, :], ref=anchor[..., None, :])[..., 0]
        for signal, values in per_head.items():
            self._kv_parts[signal][layer].append(values.mean(1).cpu())  # [batch, kv_head, new] -> [batch, new]

    @contextlib.contextmanager
    def attached(self) -> Iterator[SignalStream]:
        """Hooks live for the duration of the context; run any number of forwards (or a generate call) inside."""
        with capture(self.model, self.hook_names, callback=self._callback):
            yield self

    def result(self) -> dict[str, dict[int, torch.Tensor]]:
        """``{signal: {layer: [batch, pos]}}`` over every position forwarded so far (float32, on the CPU)."""
        out: dict[str, dict[int, torch.Tensor]] = {}
        if self._hidden is not None:
            out["hidden_diff"] = {layer: self._hidden.diffs(layer) for layer in self.layers}
        for signal in self._kv_wanted:
            out[signal] = {layer: torch.cat(parts, dim=1) for layer, parts in self._kv_parts[signal].items()}
        for signal in self._attn_wanted:
            per_layer = {}
            for layer, acc in self._attention.items():
                if signal == "h2o":
                    per_layer[layer] = acc.received.cpu()
                elif signal == "tova":
                    per_layer[layer] = acc.last_row.cpu()
                else:
                    per_layer[layer] = torch.cat(acc.entropy, dim=1).cpu()
            out[signal] = per_layer
        return out


@torch.no_grad()
def teacher_forced_signals(lm, ids: list[int], layers: Iterable[int] | str = "all",
                           signals: Iterable[str] = DEFAULT_SIGNALS) -> dict[str, dict[int, torch.Tensor]]:
    """Signals over a stored trace ``ids`` (prompt + generated) from one forward; arrays ``[1, len(ids)]``."""
    model = lm.model
    stream = SignalStream(model, resolve_layers(layers, model.config.num_hidden_layers), signals)
    device = next(model.parameters()).device
    with stream.attached():
        model(input_ids=torch.tensor([ids], device=device), cache=DynamicCache(config=model.config),
              use_cache=True, logits_to_keep=1)
    return stream.result()


def stream_signals(lm, prompt_ids: list[int], max_new_tokens: int, layers: Iterable[int] | str = "all",
                   signals: Iterable[str] = DEFAULT_SIGNALS):
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
