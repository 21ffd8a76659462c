"""Exact multi-head expansion of a grouped-query-attention model: one KV head per query head, the same logits.

Under GQA, query head ``h`` attends with KV head ``h // groups`` (``groups = q_heads / kv_heads``). Duplicating each
KV head's rows of ``k_proj`` / ``v_proj`` (and their biases) once per query head of its group gives a model whose
KV head ``h`` is exactly the KV head query head ``h`` used before, so every attention output, and therefore every
logit, is unchanged. A QK-norm over ``head_dim`` (Qwen3, Gemma3) acts on each head alone and is shared as is.

What changes is the granularity of per-head KV-cache eviction: each query head now owns its own copy of the cache,
so a policy that keeps different tokens in different KV heads acts per query head. On SmolLM2-135M (9 query heads,
3 KV heads) this turns a 3-head cache into a 9-head one, which lets the planted-fact probe choose among more heads
than the paper's 8-KV-head model had.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.errors import UsageError
from models.lm import LoadedModel

if TYPE_CHECKING:  # transformers' model classes take seconds to import; they are only annotations here
    from transformers import PreTrainedModel


def expand_kv_heads(model: PreTrainedModel) -> PreTrainedModel:
    """Give `model` (a transformers causal LM) one KV head per query head, in place; returns `model`.

    Raises `UsageError` for attention layouts whose expansion would not be exact: query heads that are not a whole
    multiple of the KV heads, attention without separate ``k_proj`` / ``v_proj`` (fused QKV), or a key norm that
    spans several heads. A model that already has one KV head per query head is returned unchanged.
    """
    config = model.config
    n_query, n_kv = config.num_attention_heads, config.num_key_value_heads
    if n_query % n_kv:
        raise UsageError(f"cannot expand KV heads: {n_query} query heads are not a multiple of {n_kv} KV heads")
    groups = n_query // n_kv
    if groups == 1:
        return model
    attentions = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    if len(attentions) != config.num_hidden_layers or not all(_separate_kv(a) for a in attentions):
        raise UsageError(f"cannot expand KV heads of a {config.model_type} model: expected one attention module per "
                         "layer with separate k_proj and v_proj")
    for attention in attentions:
        norm = getattr(attention, "k_norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.numel() != attention.head_dim:
            raise UsageError(f"cannot expand KV heads of a {config.model_type} model: its key norm spans "
                             f"{norm.weight.numel()} features, not one head of {attention.head_dim}")
    for attention in attentions:
        for projection in (attention.k_proj, attention.v_proj):
            assert isinstance(projection, nn.Linear)  # `_separate_kv` held for every attention module
            # torch types a module's attributes as tensors or submodules; head_dim is a plain int
            _repeat_head_rows(projection, attention.head_dim, groups)  # type: ignore[arg-type]
        attention.num_key_value_groups = 1  # type: ignore[assignment]  # a plain int attribute, likewise
    config.num_key_value_heads = n_query
    return model


def _separate_kv(attention: nn.Module) -> bool:
    return all(isinstance(getattr(attention, name, None), nn.Linear) for name in ("k_proj", "v_proj"))


def _repeat_head_rows(projection: nn.Linear, head_dim: int, groups: int) -> None:
    """Rows ``[kv * head_dim, in]`` -> ``[kv * groups * head_dim, in]``, head ``j`` repeated as heads
    ``j * groups .. (j + 1) * groups - 1`` (the order in which GQA assigns query heads to KV heads)."""

    def repeated(tensor: torch.Tensor) -> nn.Parameter:
        heads = tensor.detach().unflatten(0, (-1, head_dim))
        return nn.Parameter(heads.repeat_interleave(groups, dim=0).flatten(0, 1).contiguous(),
                            requires_grad=tensor.requires_grad)

    projection.weight = repeated(projection.weight)
    if projection.bias is not None:
        projection.bias = repeated(projection.bias)
    projection.out_features = projection.weight.shape[0]


def with_expanded_kv_heads(lm: LoadedModel, name: str) -> LoadedModel:
    """`lm` expanded in place (`expand_kv_heads`), renamed `name`; its info records what it was expanded from."""
    start = time.perf_counter()
    kv_heads = lm.config.num_key_value_heads
    expand_kv_heads(lm.model)
    return dataclasses.replace(lm, name=name, load_seconds=lm.load_seconds + time.perf_counter() - start,
                               info={**lm.info, "expanded_from": lm.name, "kv_heads_before_expansion": kv_heads})
