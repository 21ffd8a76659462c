"""nnsight and TransformerLens see the same tensors as kvscope's canonical hooks (models/interop.py), on the tiny model
of every family."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from core.errors import UsageError
from models.families import family_of
from models.hooks import ATTN_HOOKS, RESID_HOOKS, capture, hook_name, parse_hook_name
from models.interop import nnsight_capture, nnsight_model, transformer_lens_bridge, transformer_lens_read

pytest.importorskip("nnsight")
pytest.importorskip("transformer_lens")

POINTS = RESID_HOOKS + ATTN_HOOKS


def _kvscope(model, names, input_ids, **kwargs):
    with torch.no_grad(), capture(model, names) as cap:
        model(input_ids, **kwargs)
    return cap


def _names(model):
    last = model.config.num_hidden_layers - 1
    return [hook_name(layer, point) for layer in (0, last) for point in POINTS]


def test_nnsight_prefill_matches_capture(family_lm):
    model = family_lm.model
    ids = torch.randint(0, 250, (1, 11), generator=torch.Generator().manual_seed(1))
    names = _names(model)
    ours = _kvscope(model, names, ids, cache=DynamicCache(config=model.config), use_cache=True)
    theirs_all = nnsight_capture(nnsight_model(family_lm), names, ids, cache=DynamicCache(config=model.config),
                                 use_cache=True)
    for name in names:
        theirs = theirs_all[name]
        assert theirs.shape == ours[name].shape, name
        torch.testing.assert_close(theirs, ours[name], rtol=0, atol=1e-6, msg=name)


def test_nnsight_decode_step_matches_capture(tiny_gemma3):
    """A decode step after a prefill: nnsight reads the same single-position tensors (cache copied per trace)."""
    model = tiny_gemma3.model
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(2))  # > sliding window 16
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    token, position = torch.tensor([[42]]), torch.tensor([[20]])
    names = [hook_name(0, "attn.hook_cache_k"), hook_name(3, "attn.hook_cache_v"), hook_name(3, "hook_resid_post")]
    ours = _kvscope(model, names, token, cache=copy.deepcopy(cache), position_ids=position, use_cache=True)
    theirs_all = nnsight_capture(nnsight_model(tiny_gemma3), names, token, cache=cache, position_ids=position,
                                 use_cache=True)
    for name in names:
        theirs = theirs_all[name]
        assert theirs.shape[-2] == 1, name  # one new position, in both [b, pos, d] and [b, head, pos, d]
        torch.testing.assert_close(theirs, ours[name], rtol=0, atol=1e-6, msg=name)


def test_nnsight_leaves_model_unchanged(tiny_llama):
    model = tiny_llama.model
    before = [type(m) for m in model.modules()]
    nnsight_capture(nnsight_model(tiny_llama), ["blocks.1.attn.hook_k"], torch.tensor([[5, 6, 7]]))
    assert [type(m) for m in model.modules()] == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.realmodel
def test_nnsight_on_smollm2(smollm2):
    model = smollm2.model
    ids = smollm2.tokenizer("The cache keeps keys and values.", return_tensors="pt").input_ids
    names = [hook_name(29, "hook_resid_post"), hook_name(7, "attn.hook_k"), hook_name(7, "attn.hook_cache_k")]
    ours = _kvscope(model, names, ids, cache=DynamicCache(config=model.config), use_cache=True)
    theirs = nnsight_capture(nnsight_model(smollm2), names, ids, cache=DynamicCache(config=model.config),
                             use_cache=True)
    for name in names:
        torch.testing.assert_close(theirs[name], ours[name], rtol=0, atol=1e-5, msg=name)


def _tl_check(lm, ids, atol):
    model = lm.model
    kernel_before = model.config._attn_implementation
    bridge = transformer_lens_bridge(lm)
    assert model.config._attn_implementation == kernel_before  # the bridge wrapped a copy, not lm.model
    assert bridge.original_model is not model
    with torch.no_grad():
        logits, activations = bridge.run_with_cache(ids)
    names = _names(model)
    ours = _kvscope(model, names, ids, cache=DynamicCache(config=model.config), use_cache=True)
    with torch.no_grad():
        ref_logits = model(ids).logits
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=atol * 10)
    exposed = family_of(model.config).interop_points()
    for name in names:
        if exposed[parse_hook_name(model, name)[1]] is None:  # a point this family's bridge has no hook for
            with pytest.raises(UsageError, match="exposes no hook"):
                transformer_lens_read(activations, name, model)
            continue
        theirs = transformer_lens_read(activations, name, model)
        assert theirs.shape == ours[name].shape, name
        scale = ours[name].abs().max().item()
        torch.testing.assert_close(theirs, ours[name], rtol=0, atol=atol * max(1.0, scale), msg=name)


def test_transformer_lens_bridge_matches_capture(family_lm):
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    _tl_check(family_lm, ids, atol=1e-5)


@pytest.mark.slow  # deep-copies the model and boots the bridge: 10-35 s on a shared 2-core machine
@pytest.mark.realmodel
def test_transformer_lens_bridge_on_smollm2(smollm2):
    # The bridge runs eager attention; the fixture runs SDPA, which reorders float ops (~1e-5 relative in fp32).
    ids = smollm2.tokenizer("Keys, values and the residual stream.", return_tensors="pt").input_ids
    _tl_check(smollm2, ids, atol=1e-4)
