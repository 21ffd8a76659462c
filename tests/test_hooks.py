"""Canonical hooks (models/hooks.py) checked against independent computations, on every family and both real models.

Each capture runs a prefill of PROMPT tokens followed by DECODE single-token steps on a DynamicCache, so every check
covers both phases (the capture concatenates the calls along the position axis).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import DynamicCache

from core.errors import UsageError
from models.hooks import ATTN_HOOKS, RESID_HOOKS, all_hook_names, capture, decoder_layers, hook_name
from models.tiny import tiny_model

PROMPT, DECODE = 12, 3  # tiny Gemma3's sliding window (16) still holds all 15 positions
MODELS = ["tiny-llama", "tiny-qwen3", "tiny-gemma3", "smollm2", "gemma3_270m"]


@pytest.fixture(scope="module", params=MODELS)
def lm(request):
    if request.param.startswith("tiny-"):
        return tiny_model(request.param.removeprefix("tiny-"), seed=0)
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def traced(lm):
    """One prefill + decode run per model capturing every point the checks below read (real-model forwards are slow)."""
    model = lm.model
    names = [hook_name(layer, p) for layer in range(model.config.num_hidden_layers) for p in RESID_HOOKS]
    names += [hook_name(layer, p) for layer in _edge_layers(model) for p in ATTN_HOOKS]
    cap, cache, tokens, out = _run(model, names, hidden_states=True)
    return lm, cap, cache, tokens, out


def _atol(lm) -> float:
    # Real models have residual norms in the hundreds; fp32 reorderings differ by ~1e-6 relative.
    return 1e-5 if lm.name.startswith("tiny-") else 2e-4


def _run(model, names, *, hidden_states=False):
    """Prefill + greedy decode with `names` captured; returns (capture, cache, all token ids, prefill output)."""
    ids = torch.randint(5, 200, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), capture(model, names) as cap:
        out = model(ids, cache=cache, use_cache=True, output_hidden_states=hidden_states)
        tokens = [ids]
        nxt = out.logits[:, -1:].argmax(-1)
        for step in range(DECODE):
            tokens.append(nxt)
            step_out = model(nxt, cache=cache, use_cache=True, position_ids=torch.tensor([[PROMPT + step]]))
            nxt = step_out.logits[:, -1:].argmax(-1)
    return cap, cache, torch.cat(tokens, dim=1), out


def _edge_layers(model):
    last = model.config.num_hidden_layers - 1
    return (0, last // 2, last)


def test_resid_streams_equal_hidden_states(traced):
    """resid_pre[l] = hidden_states[l]; resid_post[l] = hidden_states[l+1], except the last, which HF final-norms."""
    lm, cap, _, _, out = traced
    model = lm.model
    n_layers = model.config.num_hidden_layers
    hidden = out.hidden_states
    assert len(hidden) == n_layers + 1
    atol = _atol(lm)
    for layer in range(n_layers):
        torch.testing.assert_close(cap[hook_name(layer, "hook_resid_pre")][:, :PROMPT], hidden[layer], rtol=1e-5, atol=atol)
        post = cap[hook_name(layer, "hook_resid_post")][:, :PROMPT]
        expected = hidden[layer + 1]
        if layer == n_layers - 1:
            post = model.model.norm(post)
        torch.testing.assert_close(post, expected, rtol=1e-5, atol=atol)
        # decode steps: layer l's output is layer l+1's input
        if layer + 1 < n_layers:
            torch.testing.assert_close(
                cap[hook_name(layer, "hook_resid_post")], cap[hook_name(layer + 1, "hook_resid_pre")], rtol=0, atol=0
            )


def test_decode_resid_without_hidden_states_matches_full_forward(lm):
    """Two layers' residual streams captured during decode (no output_hidden_states) equal a no-cache forward."""
    model = lm.model
    last = model.config.num_hidden_layers - 1
    names = [hook_name(1, "hook_resid_post"), hook_name(last, "hook_resid_pre")]
    cap, _, tokens, _ = _run(model, names)
    assert cap.keys() == names
    assert cap[names[0]].shape[1] == PROMPT + DECODE
    assert [t.shape[1] for t in cap.calls(names[0])] == [PROMPT] + [1] * DECODE
    with torch.no_grad(), capture(model, names) as full:
        model(tokens, use_cache=False)
    for name in names:
        torch.testing.assert_close(cap[name], full[name], rtol=1e-4, atol=_atol(lm) * 10)


def test_cache_hooks_equal_cache_contents(traced):
    """hook_cache_k|v (every forward, concatenated) are exactly what the DynamicCache holds afterwards."""
    lm, cap, cache, _, _ = traced
    model = lm.model
    layers = _edge_layers(model)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    for layer in layers:
        stored_k, stored_v = cache.layers[layer].keys, cache.layers[layer].values
        captured_k, captured_v = cap[hook_name(layer, "attn.hook_cache_k")], cap[hook_name(layer, "attn.hook_cache_v")]
        assert captured_k.shape[2] == PROMPT + DECODE
        if types[layer] == "full_attention":
            assert stored_k.shape[2] == PROMPT + DECODE
        kept = stored_k.shape[2]  # a sliding-window layer keeps only the most recent positions
        torch.testing.assert_close(captured_k[:, :, -kept:], stored_k, rtol=0, atol=0)
        torch.testing.assert_close(captured_v[:, :, -kept:], stored_v, rtol=0, atol=0)


def test_pre_rope_keys_rotated_equal_cache_keys(traced):
    """hook_k rotated by the model's own RoPE at each position equals hook_cache_k; hook_v is hook_cache_v."""
    lm, cap, _, _, _ = traced
    model = lm.model
    layers = _edge_layers(model)
    modeling = importlib.import_module(type(model).__module__)
    positions = torch.arange(PROMPT + DECODE)[None]
    for layer in layers:
        keys = cap[hook_name(layer, "attn.hook_k")]  # [batch, kv_head, pos, d_head]
        assert keys.shape == (1, model.config.num_key_value_heads, PROMPT + DECODE, keys.shape[-1])
        if model.config.model_type == "gemma3_text":
            cos, sin = model.model.rotary_emb(keys, positions, model.config.layer_types[layer])
        else:
            cos, sin = model.model.rotary_emb(keys, positions)
        _, rotated = modeling.apply_rotary_pos_emb(keys, keys, cos, sin)
        torch.testing.assert_close(rotated, cap[hook_name(layer, "attn.hook_cache_k")], rtol=0, atol=_atol(lm))
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_v")], cap[hook_name(layer, "attn.hook_cache_v")],
                                   rtol=0, atol=0)
        assert (rotated[:, :, 1:] - keys[:, :, 1:]).abs().max() > 1e-3  # RoPE did rotate: the check can fail


def test_projections_recomputed_from_resid_pre(traced):
    """hook_q|k|v equal the layer's own projections (and QK-norms) applied to its normed input, prefill and decode."""
    lm, cap, _, _, _ = traced
    model = lm.model
    config = model.config
    layer = _edge_layers(model)[1]
    names = [hook_name(layer, p) for p in ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v")]
    block = decoder_layers(model)[layer]
    attn = block.self_attn
    with torch.no_grad():
        x = block.input_layernorm(cap[names[0]])
        b, pos, _ = x.shape
        q = attn.q_proj(x).view(b, pos, config.num_attention_heads, -1).transpose(1, 2)
        k = attn.k_proj(x).view(b, pos, config.num_key_value_heads, -1).transpose(1, 2)
        v = attn.v_proj(x).view(b, pos, config.num_key_value_heads, -1).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
    for name, expected in zip(names[1:], (q, k, v)):
        assert cap[name].shape == expected.shape, name
        torch.testing.assert_close(cap[name], expected, rtol=0, atol=_atol(lm), msg=name)


def test_capture_shapes_for_all_points(tiny):
    model = tiny.model
    config = model.config
    cap, _, _, _ = _run(model, all_hook_names(model))
    total = PROMPT + DECODE
    d_head = config.head_dim
    for layer in range(config.num_hidden_layers):
        assert cap[hook_name(layer, "hook_resid_pre")].shape == (1, total, config.hidden_size)
        assert cap[hook_name(layer, "attn.hook_q")].shape == (1, config.num_attention_heads, total, d_head)
        for point in ("attn.hook_k", "attn.hook_v", "attn.hook_cache_k", "attn.hook_cache_v"):
            assert cap[hook_name(layer, point)].shape == (1, config.num_key_value_heads, total, d_head)


def test_callback_streams_instead_of_storing(tiny_llama):
    seen = []
    with torch.no_grad(), capture(tiny_llama.model, ["blocks.2.attn.hook_v"], callback=lambda n, t: seen.append((n, t.shape))) as cap:
        tiny_llama.model(torch.tensor([[3, 4, 5]]))
    assert seen == [("blocks.2.attn.hook_v", torch.Size([1, 2, 3, 16]))]
    assert cap.keys() == []


def _hook_counts(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_removed_after_context(tiny):
    model = tiny.model
    before = _hook_counts(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), capture(model, all_hook_names(model)):
        assert _hook_counts(model) > before
        model(torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
        assert "update" in vars(cache)  # the cache instance's update is wrapped while inside
    assert _hook_counts(model) == before
    assert "update" not in vars(cache)
    with torch.no_grad(), capture(model, ["blocks.0.hook_resid_post"]) as cap:
        pass
    model(torch.tensor([[1, 2, 3]]))
    assert "blocks.0.hook_resid_post" not in cap  # nothing recorded after exit


def test_hooks_removed_when_body_raises(tiny_llama):
    model = tiny_llama.model
    before = _hook_counts(model)
    cache = DynamicCache(config=model.config)
    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad(), capture(model, ["blocks.1.attn.hook_k", "blocks.1.attn.hook_cache_k"]):
            model(torch.tensor([[1, 2]]), cache=cache, use_cache=True)
            raise RuntimeError("boom")
    assert _hook_counts(model) == before
    assert "update" not in vars(cache)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("blocks.0.attn.hook_z", "does not resolve"),
        ("block.0.hook_resid_pre", "does not resolve"),
        ("blocks.x.hook_resid_pre", "does not resolve"),
        ("blocks.4.hook_resid_post", "layer 4 out of range 0..3"),
        ("blocks.99.attn.hook_k", "out of range"),
    ],
)
def test_bad_hook_names_raise_usage_error(tiny_llama, name, fragment):
    before = _hook_counts(tiny_llama.model)
    with pytest.raises(UsageError, match=fragment):
        with capture(tiny_llama.model, ["blocks.0.hook_resid_pre", name]):
            pass
    assert _hook_counts(tiny_llama.model) == before


def test_empty_name_list_and_missing_cache_raise_usage_error(tiny_llama):
    before = _hook_counts(tiny_llama.model)
    with pytest.raises(UsageError, match="at least one"):
        with capture(tiny_llama.model, []):
            pass
    with pytest.raises(UsageError, match="use_cache"):
        with torch.no_grad(), capture(tiny_llama.model, ["blocks.0.attn.hook_cache_k"]):
            tiny_llama.model(torch.tensor([[1, 2]]), use_cache=False)
    assert _hook_counts(tiny_llama.model) == before


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_tiny_models_deterministic_per_seed(family):
    rng_before = torch.random.get_rng_state()
    a, b, c = (tiny_model(family, seed=s).model.state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # building does not consume the global RNG
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
