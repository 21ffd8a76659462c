"""Reach kvscope's canonical hook points through nnsight and TransformerLens, over an already-loaded model.

Both libraries wrap the model in memory (no download; keep ``HF_HUB_OFFLINE=1``), and tests/test_interop.py checks
that what they save equals what `models.hooks.capture` records:

- nnsight (`nnsight_model`, `nnsight_capture`): `TransformersModel` wraps ``lm.model`` itself and leaves it
  unchanged outside a trace. Layer inputs/outputs and projection outputs are module envoys; the cache hooks are the
  arguments of the ``cache.update`` call inside the attention forward, reached through nnsight's ``.source`` view.
  nnsight requires a trace to request values in execution order, which `_STAGE` spells out per family.
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

from models.hooks import BHPD, BPHD, HOOK_TABLES, HookPoint, _to_heads, parse_hook_name
from models.loading import LoadedModel

QK_NORM_FAMILIES = ("qwen3", "gemma3_text")


def nnsight_model(lm: LoadedModel):
    """An nnsight `TransformersModel` over ``lm.model`` (the same module object, no reload)."""
    from nnsight.modeling.transformers import TransformersModel

    return TransformersModel(lm.model, tokenizer=lm.tokenizer)


def _envoy(root, path: str):
    return functools.reduce(lambda envoy, attr: envoy[int(attr)] if attr.isdigit() else getattr(envoy, attr),
                            path.split("."), root)


# Where each point falls in a decoder layer's forward; nnsight must be asked for values in this order.
_STAGE = {"hook_resid_pre": 0, "attn.hook_q": 1, "attn.hook_k": 2, "attn.hook_v": 3, "attn.hook_cache_k": 4,
          "attn.hook_cache_v": 4, "hook_resid_post": 5}
_STAGE_OVERRIDES = {"gemma3_text": {"attn.hook_v": 0.5}}  # v_proj runs before q_norm / k_norm


def nnsight_capture(nn_model, names, input_ids: torch.Tensor, **forward_kwargs) -> dict[str, torch.Tensor]:
    """The tensors at canonical hooks `names` for one forward of `input_ids`, saved by nnsight, in kvscope's layout.

    nnsight builds an all-ones attention mask covering `input_ids` only; on a decode step (a non-empty ``cache``)
    that mask is too short and silently changes the result, so one spanning cache + new tokens is supplied here.
    """
    model = nn_model._module
    config = model.config
    layers_path, table = HOOK_TABLES[config.model_type]
    stage = {**_STAGE, **_STAGE_OVERRIDES.get(config.model_type, {})}
    requests = sorted(((*parse_hook_name(model, name), name) for name in dict.fromkeys(names)),
                      key=lambda r: (r[0], stage[r[1]]))
    cache = forward_kwargs.get("cache")
    if cache is not None and "attention_mask" not in forward_kwargs and cache.get_seq_length() > 0:
        batch, new = input_ids.shape
        forward_kwargs["attention_mask"] = torch.ones(
            batch, cache.get_seq_length() + new, dtype=torch.long, device=input_ids.device
        )
    saved = {}
    with torch.no_grad(), nn_model.trace(input_ids, **forward_kwargs):
        blocks = _envoy(nn_model, layers_path)
        # Source-level call sites are looked up before the forward reaches them (a lookup made while the attention
        # forward is already paused at a later projection raises OutOfOrderError).
        cache_calls = {layer: blocks[layer].self_attn.source.cache_update_0
                       for layer, point, _ in requests if point in ("attn.hook_cache_k", "attn.hook_cache_v")}
        for layer, point, name in requests:
            if point == "hook_resid_pre":
                saved[name] = blocks[layer].input.save()
            elif point == "hook_resid_post":
                saved[name] = blocks[layer].output.save()
            elif point in ("attn.hook_cache_k", "attn.hook_cache_v"):
                key = ("cache_update", layer)  # one call site serves both: cache.update(key_states, value_states, ...)
                if key not in saved:
                    saved[key] = cache_calls[layer].inputs.save()
            else:
                saved[name] = _envoy(blocks[layer], table[point].module).output.save()
    result = {}
    for layer, point, name in requests:
        if point == "hook_resid_post":
            output = saved[name]
            result[name] = output[0] if isinstance(output, tuple) else output
        elif point == "hook_resid_pre":
            result[name] = saved[name]
        elif point in ("attn.hook_cache_k", "attn.hook_cache_v"):
            args, _ = saved[("cache_update", layer)]
            result[name] = args[0] if point.endswith("k") else args[1]
        else:
            spec = table[point]
            heads = config.num_attention_heads if spec.heads == "q" else config.num_key_value_heads
            result[name] = _to_heads(saved[name], spec, heads)
    return result


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
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

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
    """Canonical hook `name` of `model` read from a bridge `ActivationCache` (``bridge.run_with_cache``), in kvscope's
    layout."""
    layer, point = parse_hook_name(model, name)
    config = model.config
    spec = tl_points(config.model_type)[point]
    tensor = activations[f"blocks.{layer}.{spec.module}"]
    if "resid" in point:
        return tensor
    return _to_heads(tensor, spec, config.num_attention_heads if spec.heads == "q" else config.num_key_value_heads)
