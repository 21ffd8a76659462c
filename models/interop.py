"""Reach kvscope's canonical hook points through nnsight and TransformerLens, over an already-loaded model.

Both libraries wrap the model in memory (no download; keep ``HF_HUB_OFFLINE=1``), and tests/test_interop.py checks
that what they save equals what `models.hooks.capture` records:

- nnsight (`nnsight_model`, `nnsight_capture`): `TransformersModel` wraps ``lm.model`` itself and leaves it
  unchanged outside a trace. Layer inputs/outputs and projection outputs are module envoys; the cache hooks are the
  arguments of the ``cache.update`` call inside the attention forward, reached through nnsight's ``.source`` view.
  nnsight requires a trace to request values in execution order, which the family's record gives
  (`models.families.Family.interop_order`). A module that several hooks read (a fused ``qkv_proj``) is saved once.
- TransformerLens (`transformer_lens_bridge`, `transformer_lens_read`): the v3 `TransformerBridge` over a *copy* of
  the model, because booting it replaces the model's submodules in place and switches it to eager attention.
  `Family.interop_points` maps each canonical point to the bridge's hook and layout (QK-norm families expose the
  normed projections as ``hook_q_normed`` / ``hook_k_normed``; the post-RoPE key is ``hook_rot_k``).
"""

from __future__ import annotations

import copy
import functools
import tempfile

import torch

from core.errors import UsageError
from models.families import family_of
from models.hooks import parse_hook_name
from models.lm import LoadedModel


def nnsight_model(lm: LoadedModel):
    """An nnsight `TransformersModel` over ``lm.model`` (the same module object, no reload)."""
    from nnsight.modeling.transformers import TransformersModel

    return TransformersModel(lm.model, tokenizer=lm.tokenizer)


def _envoy(root, path: str):
    return functools.reduce(lambda envoy, attr: envoy[int(attr)] if attr.isdigit() else getattr(envoy, attr),
                            path.split("."), root)


def nnsight_capture(nn_model, names, input_ids: torch.Tensor, **forward_kwargs) -> dict[str, torch.Tensor]:
    """The tensors at canonical hooks `names` for one forward of `input_ids`, saved by nnsight, in kvscope's layout.

    nnsight builds an all-ones attention mask covering `input_ids` only; on a decode step (a non-empty ``cache``)
    that mask is too short and silently changes the result, so one spanning cache + new tokens is supplied here.
    """
    model = nn_model._module
    config = model.config
    family = family_of(config)
    table = family.hook_table()
    stage = family.interop_order()
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
        blocks = _envoy(nn_model, family.layers)
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
                # one call site serves both: cache.update(key_states, value_states, ...)
                key: tuple[str | int, ...] = ("cache_update", layer)
                if key not in saved:
                    saved[key] = cache_calls[layer].inputs.save()
            else:
                key = ("module", layer, table[point].module)  # a fused projection serves several points
                if key not in saved:
                    saved[key] = _envoy(blocks[layer], table[point].module).output.save()
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
            result[name] = table[point].read(saved[("module", layer, table[point].module)], config)
    return result


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
    spec = family_of(model.config).interop_points()[point]
    if spec is None:
        raise UsageError(f"the TransformerLens bridge of a {model.config.model_type} model exposes no hook for {point}")
    tensor = activations[f"blocks.{layer}.{spec.module}"]
    if "resid" in point:
        return tensor
    return spec.read(tensor, model.config)
