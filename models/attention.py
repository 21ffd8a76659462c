"""Attention recomputed from a layer's queries and keys: the one implementation every kvscope stage uses.

The eager kernel of every supported family computes, for query head h reading KV head ``h // (q_head / kv_head)``
(grouped-query attention, as transformers' ``repeat_kv``)::

    logits = (q_rot . k_rot) * scaling
    logits = softcap * tanh(logits / softcap)        only where the family's kernel call passes a cap (Gemma2)
    probs  = softmax(logits over the keys the query may see)
    probs  = softmax([logits, sink[h]])[:-1]          instead, where the kernel call passes learned sinks (gpt-oss)

where ``q_rot``, ``k_rot`` are the query and key after RoPE; a sink is one more logit per query head that takes its
share of the softmax and adds no value, so a row sums to less than 1 (`models.families.Family` says which families'
kernels cap or sink). `rotate` applies RoPE with the attention module's own ``apply_rotary_pos_emb`` and the
``(cos, sin)`` the module receives from the model's rotary embedding, so no family's rotation is rewritten here.
Which keys a query sees is a boolean ``visible`` mask, built either from absolute positions (`visible_by_position`:
causal, sliding window, -1 = padding) or from the mask the module itself received (`visible_from_module_mask`); which
layers slide, and over how many keys, follows the config (`layer_kinds`) as transformers' mask builders do.

Axis order: queries ``[batch, q_head, query, d_head]``, keys ``[batch, kv_head, key, d_head]``, logits and
probabilities ``[batch, q_head, query, key]`` (the layout of the eager kernel's ``attn_weights``). Computation is in
float32 (float64 inputs stay float64); a query that sees no key (padding) gets a row of zeros.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from models.families import family_of

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's attention does, read from its attention module and the model's config."""

    index: int
    kind: str  # "full_attention" or "sliding_attention" (`layer_kinds`)
    window: int | None  # a query at position p sees keys at p - window < s <= p; None = every earlier key
    scaling: float
    softcap: float | None
    # learned per-query-head logits ``[q_head]`` that join every softmax as a key without a value (gpt-oss)
    sinks: torch.Tensor | None = field(default=None, compare=False)


def layer_kinds(config) -> list[str]:
    """Each layer's attention kind, as transformers builds its masks and caches: ``config.layer_types`` where the
    config lists them, else every layer slides when the config has a ``sliding_window`` (Mistral, Phi-3) and none
    does otherwise."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    sliding = getattr(config, "sliding_window", None) is not None
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * config.num_hidden_layers


def layer_spec(module: nn.Module, config, index: int) -> LayerSpec:
    """The `LayerSpec` of attention module `module`, layer `index` of a model with `config`; a model family
    kvscope has no record of (`models.families`) is a `UsageError` naming the known ones."""
    family = family_of(config)
    kind = layer_kinds(config)[index]
    return LayerSpec(
        index=index,
        kind=kind,
        window=config.sliding_window if kind == SLIDING_ATTENTION else None,
        # torch types a module's attributes as tensors or submodules; `scaling` is a plain float
        scaling=float(module.scaling),  # type: ignore[arg-type]
        softcap=getattr(module, "attn_logit_softcapping", None) if family.softcap else None,
        sinks=module.get_parameter("sinks").detach() if family.sinks else None,
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
    sinks: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[b, q_head, Q, S]`` (see `attention_logits`); rows that see no key are zero. With
    `sinks` ``[q_head]``, each head's sink logit joins the softmax of its every row and its share is dropped."""
    logits = attention_logits(queries, keys, scaling=scaling, softcap=softcap, visible=visible)
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
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
