"""Attention recomputed from a layer's queries and keys: the one implementation every kvscope stage uses.

The eager kernel of every supported family computes, for query head h reading KV head ``h // (q_head / kv_head)``
(grouped-query attention, as transformers' ``repeat_kv``)::

    logits = (q_rot . k_rot) * scaling
    logits = softcap * tanh(logits / softcap)        only where the family's kernel call passes a cap (Gemma2)
    probs  = softmax(logits over the keys the query may see)

where ``q_rot``, ``k_rot`` are the query and key after RoPE. `rotate` applies RoPE with the attention module's own
``apply_rotary_pos_emb`` and the ``(cos, sin)`` the module receives from the model's rotary embedding, so no
family's rotation is rewritten here. Which keys a query sees is a boolean ``visible`` mask, built either from
absolute positions (`visible_by_position`: causal, sliding window, -1 = padding) or from the mask the module itself
received (`visible_from_module_mask`).

Axis order: queries ``[batch, q_head, query, d_head]``, keys ``[batch, kv_head, key, d_head]``, logits and
probabilities ``[batch, q_head, query, key]`` (the layout of the eager kernel's ``attn_weights``). Computation is in
float32 (float64 inputs stay float64); a query that sees no key (padding) gets a row of zeros.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from core.errors import unknown_choice

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class AttentionRule:
    """How a family's attention module is configured, where transformers' attributes do not say it alone."""

    # The kernel call passes ``softcap=module.attn_logit_softcapping`` (Gemma2). Gemma3 keeps the attribute but never
    # passes it, so reading the attribute alone would cap logits the model does not cap.
    softcap: bool = False
    # Every layer slides over ``config.sliding_window`` through the mask alone; the module holds no window (Mistral).
    window_from_config: bool = False


ATTENTION_RULES: dict[str, AttentionRule] = {
    "llama": AttentionRule(),
    "mistral": AttentionRule(window_from_config=True),
    "qwen2": AttentionRule(),
    "qwen3": AttentionRule(),
    "gemma2": AttentionRule(softcap=True),
    "gemma3_text": AttentionRule(),
}


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's attention does, read from its attention module."""

    index: int
    kind: str  # config.layer_types entry ("full_attention", "sliding_attention")
    window: int | None  # a query at position p sees keys at p - window < s <= p; None = every earlier key
    scaling: float
    softcap: float | None


def layer_spec(module: nn.Module, config, index: int) -> LayerSpec:
    """The `LayerSpec` of attention module `module`, layer `index` of a model with `config`."""
    if config.model_type not in ATTENTION_RULES:
        raise unknown_choice("model family for attention", config.model_type, ATTENTION_RULES)
    rule = ATTENTION_RULES[config.model_type]
    window = getattr(config if rule.window_from_config else module, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    kind = kinds[index] if kinds else (SLIDING_ATTENTION if window is not None else FULL_ATTENTION)
    return LayerSpec(
        index=index,
        kind=kind,
        window=window,
        scaling=float(module.scaling),
        softcap=getattr(module, "attn_logit_softcapping", None) if rule.softcap else None,
    )


def rotary_function(module: nn.Module) -> Callable:
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` of the modeling file that defines `module`'s class."""
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def rotate(
    module: nn.Module, queries: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE queries ``[b, q_head, pos, d]`` and keys ``[b, kv_head, pos, d]`` rotated as `module` rotates them,
    with the ``(cos, sin)`` it receives as ``position_embeddings`` (``[b, pos, d]`` each)."""
    return rotary_function(module)(queries, keys, cos, sin)


def visible_by_position(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Which keys each query sees, from absolute positions (-1 = padding, for queries and keys alike).

    `query_positions` ``[b, Q]``; `key_positions` ``[b, S]`` (every head alike) or ``[b, kv_head, S]`` (per-head
    caches, as after per-head eviction). A query at p sees a key at s iff both are real, ``s <= p`` and, with a
    `window`, ``p - s < window`` (transformers' ``kv_idx > q_idx - sliding_window``, in positions). Returns bool
    ``[b, 1, Q, S]`` or ``[b, kv_head, Q, S]``.
    """
    if key_positions.dim() == 2:
        key_positions = key_positions[:, None]
    keys = key_positions[:, :, None, :]
    queries = query_positions[:, None, :, None]
    visible = (keys >= 0) & (queries >= 0) & (keys <= queries)
    if window is not None:
        visible &= (queries - keys) < window
    return visible


def visible_from_module_mask(
    mask: torch.Tensor | None,
    n_queries: int,
    n_keys: int,
    window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Which keys each query sees, from the ``attention_mask`` an attention module received.

    A 4D mask (eager: additive float, 0 or the dtype's minimum; sdpa: bool, True = attend) is what the kernel
    applied and is used as is. A 2D key-padding mask ``[b, S]`` (flash attention) or None (sdpa when the pattern is
    plainly causal) means transformers relies on the kernel's own causal rule, aligned at the last query: query i of
    Q sees key j of S iff ``j <= S - Q + i`` (and, with a `window`, within it), padding keys excluded.
    """
    if mask is not None and mask.dim() == 4:
        return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    device = mask.device if mask is not None else device
    key_positions = torch.arange(n_keys, device=device)[None]
    if mask is not None:
        key_positions = key_positions.masked_fill(mask[:, -n_keys:] == 0, -1)
    query_positions = torch.arange(n_keys - n_queries, n_keys, device=device)[None]
    return visible_by_position(query_positions, key_positions, window)


def _grouped(visible: torch.Tensor, n_kv: int, group: int) -> torch.Tensor:
    """A ``[b, 1 | kv_head | q_head, Q, S]`` mask as ``[b, kv_head | 1, group | 1, Q, S]``."""
    b, heads, n_queries, n_keys = visible.shape
    if heads == n_kv * group and group > 1:
        return visible.reshape(b, n_kv, group, n_queries, n_keys)
    return visible[:, :, None]


def attention_logits(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled (and soft-capped) logits ``[b, q_head, Q, S]`` of post-RoPE `queries` over post-RoPE `keys`, -inf
    where `visible` (broadcastable to ``[b, 1 | kv_head | q_head, Q, S]``) is False."""
    b, n_q, n_queries, d_head = queries.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    group = n_q // n_kv
    dtype = torch.promote_types(queries.dtype, torch.float32)
    # Each KV head's query group as group * Q rows of one matmul (a broadcast 5D matmul is many times slower).
    grouped = queries.to(dtype).reshape(b, n_kv, group * n_queries, d_head)
    logits = (grouped @ keys.to(dtype).mT * scaling).view(b, n_kv, group, n_queries, n_keys)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if visible is not None:
        logits = logits.masked_fill(~_grouped(visible, n_kv, group), float("-inf"))
    return logits.reshape(b, n_q, n_queries, n_keys)


def attention_probabilities(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[b, q_head, Q, S]`` (see `attention_logits`); rows that see no key are zero."""
    probs = torch.softmax(attention_logits(queries, keys, scaling=scaling, softcap=softcap, visible=visible), dim=-1)
    if visible is None:
        return probs
    b, n_q, n_queries, n_keys = probs.shape
    n_kv = keys.shape[1]
    sees = _grouped(visible, n_kv, n_q // n_kv).any(-1, keepdim=True)  # a row of -inf logits softmaxes to NaN
    return probs.view(b, n_kv, n_q // n_kv, n_queries, n_keys).masked_fill(~sees, 0.0).view(probs.shape)


def group_mean(probs: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[b, q_head, Q, S]`` -> ``[b, kv_head, Q, S]``: the mean over each KV head's query group."""
    b, n_q, n_queries, n_keys = probs.shape
    return probs.view(b, n_kv, n_q // n_kv, n_queries, n_keys).mean(2)
