"""Reach kvscope's canonical hook points through nnsight and TransformerLens, over an already-loaded model.

Both libraries wrap the model in memory (no download; keep ``HF_HUB_OFFLINE=1``), and tests/test_interop.py checks
that what they save equals what `models.hooks.capture` records:

- nnsight (`nnsight_model`, `nnsight_read`): `TransformersModel` wraps ``lm.model`` itself and leaves it unchanged
  outside a trace. Layer inputs/outputs and projection outputs are module envoys; the cache hooks are the arguments
  of the ``cache.update`` call inside the attention forward, reached through nnsight's ``.source`` view. nnsight
  requires a trace to request values in execution order, so `nnsight_read` runs one trace per hook name (a forward
  each): simple and order-proof, fine for cross-checks, not for bulk capture.
- TransformerLens (`transformer_lens_bridge`, `transformer_lens_read`): the v3 `TransformerBridge` over a *copy* of
  the model, because booting it replaces the model's submodules in place and switches it to eager attention.
  `TL_POINTS` maps each canonical point to the bridge's hook and layout (QK-norm families expose the normed
  projections as ``hook_q_normed`` / ``hook_k_normed``; the post-RoPE key is ``hook_rot_k``).
"""

from __future__ import annotations

import copy
import functools
import tempfile

import torch

from models.hooks import BHPD, BPHD, HOOK_TABLES, _to_heads, HookPoint, parse_hook_name
from models.loading import LoadedModel

QK_NORM_FAMILIES = ("qwen3", "gemma3_text")


def nnsight_model(lm: LoadedModel):
    """An nnsight `TransformersModel` over ``lm.model`` (the same module object, no reload)."""
    from nnsight.modeling.transformers import TransformersModel

    return TransformersModel(lm.model, tokenizer=lm.tokenizer)


def _envoy(root, path: str):
    return functools.reduce(lambda envoy, attr: envoy[int(attr)] if attr.isdigit() else getattr(envoy, attr),
                            path.split("."), root)


def nnsight_read(nn_model, name: str, input_ids: torch.Tensor, **forward_kwargs) -> torch.Tensor:
    """The tensor at canonical hook `name` for one forward of `input_ids`, saved by nnsight, in kvscope's layout.

    nnsight builds an all-ones attention mask covering `input_ids` only; on a decode step (a non-empty ``cache``)
    that mask is too short and silently changes the result, so one spanning cache + new tokens is supplied here.
    """
    model = nn_model._module
    cache = forward_kwargs.get("cache")
    if cache is not None and "attention_mask" not in forward_kwargs and cache.get_seq_length() > 0:
        batch, new = input_ids.shape
        forward_kwargs["attention_mask"] = torch.ones(
            batch, cache.get_seq_length() + new, dtype=torch.long, device=input_ids.device
        )
    layer, point = parse_hook_name(model, name)
    layers_path, table = HOOK_TABLES[model.config.model_type]
    with torch.no_grad(), nn_model.trace(input_ids, **forward_kwargs):
        block = _envoy(nn_model, layers_path)[layer]
        if point == "hook_resid_pre":
            saved = block.input.save()
        elif point == "hook_resid_post":
            saved = block.output.save()
        elif point in ("attn.hook_cache_k", "attn.hook_cache_v"):
            saved = block.self_attn.source.cache_update_0.inputs.save()
        else:
            saved = _envoy(block, table[point].module).output.save()
    if point == "hook_resid_post":
        return saved[0] if isinstance(saved, tuple) else saved
    if point == "hook_resid_pre":
        return saved
    if point in ("attn.hook_cache_k", "attn.hook_cache_v"):
        args, _ = saved
        return args[0] if point.endswith("k") else args[1]
    spec = table[point]
    config = model.config
    return _to_heads(saved, spec, config.num_attention_heads if spec.heads == "q" else config.num_key_value_heads)


def tl_points(model_type: str) -> dict[str, HookPoint]:
    """Canonical point -> (TransformerLens bridge hook, its layout); the bridge names live under ``blocks.{l}.``."""
    qk_norm = model_type in QK_NORM_FAMILIES
    return {
        "hook_resid_pre": HookPoint("hook_resid_pre"),
        "hook_resid_post": HookPoint("hook_resid_post"),
        "attn.hook_q": HookPoint("attn.hook_q_normed", BHPD, "q") if qk_norm else HookPoint("attn.hook_q", BPHD, "q"),
        "attn.hook_k": HookPoint("attn.hook_k_normed", BHPD) if qk_norm else HookPoint("attn.hook_k", BPHD),
        "attn.hook_v": HookPoint("attn.hook_v", BPHD),
        "attn.hook_cache_k": HookPoint("attn.hook_rot_k", BPHD),
        "attn.hook_cache_v": HookPoint("attn.hook_v", BPHD),
    }


def transformer_lens_bridge(lm: LoadedModel):
    """A TransformerLens v3 `TransformerBridge` over a deep copy of ``lm.model`` (``lm`` itself stays untouched).

    The bridge reads the model's config and tokenizer by path, so both are written to a temporary directory for
    the duration of the boot; the weights are the in-memory copy.
    """
    from transformers import AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    model = copy.deepcopy(lm.model)
    model.config.architectures = [type(model).__name__]  # the bridge picks its adapter from this field
    with tempfile.TemporaryDirectory(prefix="kvscope-tl-") as tmp:
        model.config.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        return TransformerBridge.boot_transformers(
            tmp, hf_model=model, tokenizer=tokenizer, device=str(lm.device), dtype=lm.model.dtype
        )


def transformer_lens_read(activations, name: str, model) -> torch.Tensor:
    """Canonical hook `name` of `model` read from a bridge `ActivationCache` (``bridge.run_with_cache``), kvscope layout."""
    layer, point = parse_hook_name(model, name)
    config = model.config
    spec = tl_points(config.model_type)[point]
    tensor = activations[f"blocks.{layer}.{spec.module}"]
    if "resid" in point:
        return tensor
    return _to_heads(tensor, spec, config.num_attention_heads if spec.heads == "q" else config.num_key_value_heads)
