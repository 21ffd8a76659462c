"""TriAttention's per-model calibration: the pre-RoPE query centre of every query head, and each layer's RoPE.

TriAttention (Mao et al. 2026) observes that pre-RoPE queries concentrate around a fixed non-zero centre, so the
attention a future query pays a key is predictable from the key and its distance alone. Per layer l and query head
h, over every position of the calibration traces, with the head dimension split into ``F = d/2`` rotate-half pairs
``q_f = q[f] + i q[f + F]``::

    q_mean[l, h, f]     = mean_t q_f(t)          (complex: the centre)
    q_abs_mean[l, h, f] = mean_t |q_f(t)|        (its "mean length", the norm term's weight)

Both follow the released calibration (scripts/calibrate.py of WeianMao/triattention: one forward over plain text,
queries captured per attention layer, RoPE inverted, the two means per head). Here the forwards are teacher-forced
dense traces and the query is read before RoPE (``blocks.{l}.attn.hook_q``, after QK-norm where the family has
one), so nothing needs inverting. The file also stores each layer's RoPE angular frequencies ``omega_f`` and
amplitude ``s_f`` (transformers' ``inv_freq`` and ``attention_scaling``; Gemma3's sliding and full layers differ),
checked against the ``(cos, sin)`` the attention modules actually receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.errors import UsageError
from core.schemas import Trace
from evictor.calibration import (
    attention_module_hooks,
    base_record,
    read_calibration,
    teacher_forced,
    trace_token_ids,
)
from models.hooks import capture, hook_name

METHOD = "triattention"


@dataclass(frozen=True)
class TriAttentionStats:
    """A loaded TriAttention calibration, as tensors (F = head_dim / 2 frequencies)."""

    path: str
    model: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    omega: torch.Tensor  # [layer, F] radians per position
    rope_scale: torch.Tensor  # [layer, F]
    q_mean: torch.Tensor  # [layer, q_head, F] complex
    q_abs_mean: torch.Tensor  # [layer, q_head, F]

    def check_keys(self, keys: torch.Tensor) -> None:
        if keys.shape[1] != self.n_kv_heads or keys.shape[-1] != self.head_dim:
            raise UsageError(
                f"calibration file {self.path!r} was made for {self.model} ({self.n_kv_heads} KV heads of dimension "
                f"{self.head_dim}); this model's keys have {keys.shape[1]} heads of dimension {keys.shape[-1]}"
            )


def load_triattention(path: str, policy: str) -> TriAttentionStats:
    data = read_calibration(path, METHOD, policy)
    rope = data["rope"]
    return TriAttentionStats(
        path=path,
        model=data["model"],
        n_layers=data["n_layers"],
        n_heads=data["n_heads"],
        n_kv_heads=data["n_kv_heads"],
        head_dim=data["head_dim"],
        omega=torch.tensor(rope["omega"], dtype=torch.float64),
        rope_scale=torch.tensor(rope["scale"], dtype=torch.float64),
        q_mean=torch.complex(torch.tensor(data["q_mean_real"], dtype=torch.float64),
                             torch.tensor(data["q_mean_imag"], dtype=torch.float64)),
        q_abs_mean=torch.tensor(data["q_abs_mean"], dtype=torch.float64),
    )


def rope_frequencies(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(omega [F], scale [F])`` of the rotary embedding `layer` uses (per layer type where the model has several)."""
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise UsageError(f"{type(model).__name__} has no rotary embedding: TriAttention needs a RoPE model")
    layer_types = getattr(model.config, "layer_types", None)
    prefix = f"{layer_types[layer]}_" if layer_types and hasattr(rotary, f"{layer_types[layer]}_inv_freq") else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq").detach().double().cpu()
    scale = float(getattr(rotary, f"{prefix}attention_scaling", 1.0) or 1.0)
    return inv_freq, torch.full_like(inv_freq, scale)


def _check_rope(layer: int, cos: torch.Tensor, sin: torch.Tensor, omega: torch.Tensor, scale: torch.Tensor) -> None:
    """The (cos, sin) the module received must be rotate-half RoPE with these frequencies (checked at positions 0
    and 1, to the precision of the model's dtype)."""
    n_freq = omega.numel()
    cos, sin = cos[0, :2].double().cpu(), sin[0, :2].double().cpu()  # [2 positions, head_dim]
    if cos.shape[-1] != 2 * n_freq or not torch.allclose(cos[:, :n_freq], cos[:, n_freq:], atol=1e-2):
        raise UsageError(f"layer {layer}: RoPE is not rotate-half over the whole head dimension; TriAttention's "
                         "calibration supports rotate-half RoPE only")
    expected = scale * torch.cos(omega), scale * torch.sin(omega)
    if not (torch.allclose(cos[1, :n_freq], expected[0], atol=2e-2)
            and torch.allclose(sin[1, :n_freq], expected[1], atol=2e-2)):
        raise UsageError(f"layer {layer}: the rotary embedding's inv_freq does not match the (cos, sin) the "
                         "attention module receives (a dynamic RoPE scaling?); cannot calibrate TriAttention")


def calibrate_triattention(lm, traces: list[Trace], *, max_tokens: int | None = None,
                           progress: Callable[[Any], Any] = iter) -> dict[str, Any]:
    """The calibration record (JSON-ready) of `lm` from teacher-forced forwards over `traces`."""
    model = lm.model
    config = model.config
    n_layers = config.num_hidden_layers
    token_lists = trace_token_ids(traces, config.vocab_size, max_tokens)
    centre: dict[int, torch.Tensor] = {}  # layer -> [q_head, F] complex128 sum over positions
    length: dict[int, torch.Tensor] = {}  # layer -> [q_head, F] float64 sum of |q_f|
    received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_queries(name: str, query: torch.Tensor) -> None:  # [1, q_head, pos, d] before RoPE
        layer = int(name.split(".")[1])
        if query.shape[-1] % 2:
            raise UsageError(f"head dimension {query.shape[-1]} is odd: RoPE pairs need an even one")
        half = query.shape[-1] // 2
        pairs = torch.complex(query[0, ..., :half].double(), query[0, ..., half:].double()).cpu()
        centre[layer] = centre.get(layer, 0) + pairs.sum(1)
        length[layer] = length.get(layer, 0) + pairs.abs().sum(1)

    def rope_hook(layer: int):
        def hook(module, args, kwargs):
            received.setdefault(layer, kwargs["position_embeddings"])

        return hook

    names = [hook_name(layer, "attn.hook_q") for layer in range(n_layers)]
    with torch.inference_mode(), attention_module_hooks(model, rope_hook, pre=True), \
            capture(model, names, callback=add_queries):
        for ids in progress(token_lists):
            teacher_forced(lm, ids)
    head_dim = 2 * centre[0].shape[-1]
    tokens = sum(len(ids) for ids in token_lists)
    rope = [rope_frequencies(model, layer) for layer in range(n_layers)]
    for layer, (omega, scale) in enumerate(rope):
        _check_rope(layer, *received[layer], omega, scale)
    q_mean = [centre[layer] / tokens for layer in range(n_layers)]
    return {
        **base_record(METHOD, lm, traces, token_lists),
        "head_dim": head_dim,
        "rope": {"omega": [omega.tolist() for omega, _ in rope], "scale": [scale.tolist() for _, scale in rope]},
        "q_mean_real": [mean.real.tolist() for mean in q_mean],
        "q_mean_imag": [mean.imag.tolist() for mean in q_mean],
        "q_abs_mean": [(length[layer] / tokens).tolist() for layer in range(n_layers)],
    }
