"""Model-driven measurements: one forward per calibration sequence, reduced layer by layer to KV-geometry statistics.

A forward records each layer's post-RoPE queries and keys (``attn.hook_rot_q|rot_k``: rotated by the attention
module's own RoPE), pre-RoPE keys and values through the canonical hooks. Each layer's attention is recomputed
from those (`models.attention`) in chunks of query rows (`geometry.attention`), reduced to the statistics and
discarded before the next layer, so no ``[layers, heads, T, T]`` tensor ever exists.

Keys are the post-RoPE keys the KV cache stores (what KeyDiff-style eviction scores see) unless
``key_space="pre_rope"``. The leading token is position 0, whatever the tokenizer put there (a BOS token for
Gemma3; the first text token for SmolLM2, whose tokenizer adds no BOS).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from geometry.attention import layer_attention
from geometry.stats import (
    FIRST_KEPT_FRACTIONS,
    bos_cosine,
    dispersion,
    distances_to_mean,
    first_token_kept,
    jaccard_stability,
    leading_token_attention,
    query_positions,
    top_singular_value,
)
from models.attention import LayerSpec
from models.hooks import capture, decoder_layers, hook_name, layer_specs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KEY_SPACES = ("post_rope", "pre_rope")
# ValueDiff keeps the leading token at a budget of f of the context (1.0 / 0.0 per sequence), per fraction f
FIRST_FIELDS = tuple(f"valuediff_first_k{round(100 * f)}" for f in FIRST_KEPT_FRACTIONS)
KV_FIELDS = ("sigma_k", "sigma_v", "bos_cos", "sigma1_k", "sigma1_v", *FIRST_FIELDS)  # per (layer, KV head)
Q_FIELDS = ("alpha_bos", "jaccard")  # per (layer, query head)


@dataclass(frozen=True)
class MeasureSettings:
    topk: int = 256
    n_queries: int = 128
    key_space: str = "post_rope"
    chunk: int = 256


def weight_norms(model: PreTrainedModel) -> dict[str, list]:
    """Data-free spectral norms of each layer's k_proj / v_proj weights, whole and per KV-head block of rows.

    Returns ``w_k``, ``w_v`` (``[layer]``) and ``w_k_head``, ``w_v_head`` (``[layer][kv_head]``). QK-norm scales
    applied after k_proj (Qwen3, Gemma3) are not part of these matrices.
    """
    n_kv = model.config.num_key_value_heads
    norms: dict[str, list] = {"w_k": [], "w_v": [], "w_k_head": [], "w_v_head": []}
    for layer in decoder_layers(model):
        for name in ("k", "v"):
            # [kv_head * d_head, d_model]
            weight = layer.get_parameter(f"self_attn.{name}_proj.weight").detach().double()
            norms[f"w_{name}"].append(top_singular_value(weight).item())
            blocks = weight.view(n_kv, -1, weight.shape[-1])  # [kv_head, d_head, d_model]
            norms[f"w_{name}_head"].append(top_singular_value(blocks).tolist())
    return norms


def attention_inputs(model: PreTrainedModel, input_ids: torch.Tensor) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Run one forward on ``input_ids`` ``[1, T]`` and yield, layer by layer, the tensors attention used.

    Each item is ``(layer, {"q": [q_head, T, d] post-RoPE, "k": [kv_head, T, d] post-RoPE,
    "k_pre": [kv_head, T, d] pre-RoPE, "v": [kv_head, T, d]})``. A layer's tensors are dropped once the next is
    requested.
    """
    n_layers = model.config.num_hidden_layers
    points = {"q": "attn.hook_rot_q", "k": "attn.hook_rot_k", "k_pre": "attn.hook_k", "v": "attn.hook_v"}
    names = [hook_name(layer, point) for layer in range(n_layers) for point in points.values()]
    with torch.no_grad(), capture(model, names) as captured:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    for layer in range(n_layers):
        tensors = {key: captured[hook_name(layer, point)][0] for key, point in points.items()}
        for point in points.values():
            captured.calls(hook_name(layer, point)).clear()
        yield layer, tensors


def measure_sequence(model: PreTrainedModel, input_ids: torch.Tensor, settings: MeasureSettings) -> dict[str, list]:
    """All per-head statistics of one calibration sequence ``[1, T]``.

    Returns lists indexed ``[layer][kv_head]`` for `KV_FIELDS` and ``[layer][q_head]`` for `Q_FIELDS`
    (``jaccard`` is the mean positional stability over the sampled queries; None where no pair is defined, e.g.
    a sliding window shorter than k).
    """
    n_tokens = input_ids.shape[-1]
    sampled = query_positions(n_tokens, settings.topk, settings.n_queries)
    specs: list[LayerSpec] = layer_specs(model)
    result: dict[str, list] = {name: [] for name in KV_FIELDS + Q_FIELDS}
    for layer, tensors in attention_inputs(model, input_ids):
        spec = specs[layer]
        keys = (tensors["k"] if settings.key_space == "post_rope" else tensors["k_pre"]).float()
        values = tensors["v"].float()
        result["sigma_k"].append(dispersion(keys).tolist())
        result["sigma_v"].append(dispersion(values).tolist())
        result["bos_cos"].append(bos_cosine(keys).tolist())
        result["sigma1_k"].append(top_singular_value(keys).tolist())
        result["sigma1_v"].append(top_singular_value(values).tolist())
        scores = distances_to_mean(values)
        for name, fraction in zip(FIRST_FIELDS, FIRST_KEPT_FRACTIONS):
            result[name].append(first_token_kept(scores, fraction).float().tolist())
        attention = layer_attention(
            tensors["q"], tensors["k"], scaling=spec.scaling, sampled=sampled, window=spec.window,
            softcap=spec.softcap, chunk=settings.chunk,
        )
        result["alpha_bos"].append(leading_token_attention(attention.first_column, spec.window).tolist())
        stability = jaccard_stability(attention.sampled_logits, sampled, settings.topk, spec.window)
        per_head = stability.nanmean(dim=-1)
        result["jaccard"].append([None if value != value else value for value in per_head.tolist()])
    return result
