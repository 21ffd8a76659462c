"""Canonical hooks (models/hooks.py) checked against independent computations, on the tiny model of every family
(`models.families`) and both real models.

Each capture runs a prefill of PROMPT tokens followed by DECODE single-token steps on a DynamicCache, so every check
covers both phases (the capture concatenates the calls along the position axis).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from test_models_attention import tiny_gemma2, using_kernel  # tests/ is on sys.path under pytest
from transformers import DynamicCache

from core.errors import UsageError
from models.attention import attention_probabilities
from models.families import family_names
from models.hooks import (
    ATTN_HOOKS,
    DERIVED_HOOKS,
    RESID_HOOKS,
    all_hook_names,
    capture,
    decoder_layers,
    hook_name,
    layer_specs,
)
from models.tiny import tiny_model

PROMPT, DECODE = 12, 3  # the tiny models' sliding windows (16) still hold all 15 positions
MODELS = [f"tiny-{family}" for family in family_names()] + ["smollm2", "gemma3_270m"]


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
    names += [hook_name(layer, p) for layer in _edge_layers(model) for p in ATTN_HOOKS + DERIVED_HOOKS]
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
        pre = cap[hook_name(layer, "hook_resid_pre")][:, :PROMPT]
        torch.testing.assert_close(pre, hidden[layer], rtol=1e-5, atol=atol)
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
        # Decode and one full forward sum in different orders: fp32 error scales with the stream's largest entries
        # (Gemma3's reach the thousands), so the absolute tolerance does too.
        scale = full[name].abs().max().item()
        torch.testing.assert_close(cap[name], full[name], rtol=1e-4, atol=max(_atol(lm) * 10, 2e-6 * scale))


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
    """hook_k rotated by the model's own RoPE at each position equals hook_cache_k and hook_rot_k (hook_q: hook_rot_q);
    hook_v is hook_cache_v."""
    lm, cap, _, _, _ = traced
    model = lm.model
    layers = _edge_layers(model)
    modeling = importlib.import_module(type(model).__module__)
    positions = torch.arange(PROMPT + DECODE)[None]
    for layer in layers:
        keys = cap[hook_name(layer, "attn.hook_k")]  # [batch, kv_head, pos, d_head]
        assert keys.shape == (1, model.config.num_key_value_heads, PROMPT + DECODE, keys.shape[-1])
        by_type = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters  # one RoPE per kind
        kind = (model.config.layer_types[layer],) if by_type else ()
        cos, sin = model.model.rotary_emb(keys, positions, *kind)
        queries, rotated = modeling.apply_rotary_pos_emb(cap[hook_name(layer, "attn.hook_q")], keys, cos, sin)
        torch.testing.assert_close(rotated, cap[hook_name(layer, "attn.hook_cache_k")], rtol=0, atol=_atol(lm))
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_rot_k")], cap[hook_name(layer, "attn.hook_cache_k")],
                                   rtol=0, atol=0)  # the same rotation of the same projection, bit for bit
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_rot_q")], queries, rtol=0, atol=_atol(lm))
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_v")], cap[hook_name(layer, "attn.hook_cache_v")],
                                   rtol=0, atol=0)
        assert (rotated[:, :, 1:] - keys[:, :, 1:]).abs().max() > 1e-3  # RoPE did rotate: the check can fail


def test_projections_recomputed_from_resid_pre(traced):
    """hook_q|k|v equal the layer's own projections (and QK-norms) applied to its normed input, prefill and decode,
    recomputed from the modules the layer has: a pre-attention norm or none (OLMo2 normalises after attention), separate
    or fused (Phi-3) projections, a QK-norm over one head's features or over the whole projection (OLMo2)."""
    lm, cap, _, _, _ = traced
    model = lm.model
    config = model.config
    layer = _edge_layers(model)[1]
    names = [hook_name(layer, p) for p in ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v")]
    block = decoder_layers(model)[layer]
    attn = block.self_attn
    n_q, n_kv, d_head = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
    with torch.no_grad():
        x = block.input_layernorm(cap[names[0]]) if hasattr(block, "input_layernorm") else cap[names[0]]
        if hasattr(attn, "qkv_proj"):
            q, k, v = attn.qkv_proj(x).split([n_q * d_head, n_kv * d_head, n_kv * d_head], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        whole = hasattr(attn, "q_norm") and attn.q_norm.weight.numel() == n_q * d_head
        if whole:
            q, k = attn.q_norm(q), attn.k_norm(k)
        b, pos, _ = x.shape
        q, k, v = (t.view(b, pos, heads, d_head).transpose(1, 2) for t, heads in ((q, n_q), (k, n_kv), (v, n_kv)))
        if hasattr(attn, "q_norm") and not whole:
            q, k = attn.q_norm(q), attn.k_norm(k)
    for name, expected in zip(names[1:], (q, k, v)):
        assert cap[name].shape == expected.shape, name
        torch.testing.assert_close(cap[name], expected, rtol=0, atol=_atol(lm), msg=name)


def _eager_weights(model, forwards: list[dict]) -> list[tuple[torch.Tensor, ...]]:
    """The eager kernel's own attention weights of each forward (one DynamicCache across them), per layer."""
    cache = DynamicCache(config=model.config)
    with using_kernel(model, "eager"), torch.no_grad():
        return [model(**inputs, cache=cache, use_cache=True, output_attentions=True).attentions for inputs in forwards]


def _patterns(model, names: list[str], forwards: list[dict], kernel: str):
    cache = DynamicCache(config=model.config)
    with using_kernel(model, kernel), torch.no_grad(), capture(model, names) as cap:
        for inputs in forwards:
            model(**inputs, cache=cache, use_cache=True)
    return cap


def _needs_kernel(model, kernel: str) -> None:
    if kernel == "sdpa" and not type(model)._supports_sdpa:
        pytest.skip(f"transformers runs {type(model).__name__} on no SDPA kernel")


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_pattern_equals_the_eager_kernels_weights(lm, kernel):
    """hook_pattern, recomputed under either kernel, equals the weights the eager kernel returns, in the prefill and
    in decode steps; 20 prompt tokens take the tiny models past their 16-token windows, so sliding layers drop keys."""
    model = lm.model
    _needs_kernel(model, kernel)
    ids = torch.randint(5, 200, (1, 20), generator=torch.Generator().manual_seed(1))
    forwards = [{"input_ids": ids}] + [{"input_ids": torch.tensor([[token]])} for token in (7, 11, 13)]
    layers = range(model.config.num_hidden_layers) if lm.name.startswith("tiny-") else _edge_layers(model)
    names = [hook_name(layer, "attn.hook_pattern") for layer in layers]
    reference = _eager_weights(model, forwards)
    cap = _patterns(model, names, forwards, kernel)
    key_counts = set()
    for layer, name in zip(layers, names):
        for call, weights in zip(cap.calls(name), reference, strict=True):
            assert call.shape == weights[layer].shape and call.dtype == torch.float32
            torch.testing.assert_close(call, weights[layer], rtol=1e-5, atol=_atol(lm) / 10)
        key_counts.add(cap.calls(name)[-1].shape[-1])
    if lm.name.startswith("tiny-"):  # sliding layers: the last 15 keys and the query's own; full layers: all 23
        assert key_counts == {23 if spec.window is None else spec.window for spec in layer_specs(model)}


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_pattern_of_a_left_padded_batch_equals_the_eager_weights(family_lm, kernel):
    """Two prompts, the shorter left-padded, then one decode step: the pattern follows the padding mask the layer
    received; the rows of real queries equal the eager weights and rows of padding queries are zero."""
    model = family_lm.model
    _needs_kernel(model, kernel)
    mask = torch.tensor([[1] * 20, [0] * 7 + [1] * 13])
    ids = torch.randint(5, 200, (2, 20), generator=torch.Generator().manual_seed(2)).masked_fill(mask == 0, 0)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    forwards = [
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        {"input_ids": torch.tensor([[5], [6]]), "attention_mask": torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
         "position_ids": torch.tensor([[20], [13]])},
    ]
    names = [hook_name(layer, "attn.hook_pattern") for layer in range(model.config.num_hidden_layers)]
    reference = _eager_weights(model, forwards)
    cap = _patterns(model, names, forwards, kernel)
    real = [mask.bool(), torch.ones(2, 1, dtype=torch.bool)]  # [batch, query] per forward
    for layer, name in enumerate(names):
        for call, weights, rows in zip(cap.calls(name), reference, real, strict=True):
            expected = weights[layer]
            torch.testing.assert_close(call.transpose(1, 2)[rows], expected.transpose(1, 2)[rows], rtol=1e-5,
                                       atol=1e-6)
            if kernel == "eager":
                assert call.transpose(1, 2)[~rows].abs().sum() == 0
        assert (cap.calls(name)[0][1, :, 7:, :7] == 0).all()  # padding keys get nothing


def test_pattern_applies_gemma2s_logit_softcap():
    """Gemma2's kernel caps logits (a tiny cap, so that it matters at random init): the pattern equals its weights,
    and the same recomputation without the cap does not."""
    lm = tiny_gemma2(softcap=0.02)
    model = lm.model
    ids = torch.randint(5, 200, (1, 20), generator=torch.Generator().manual_seed(3))
    names = [hook_name(layer, point) for layer in range(4) for point in ("attn.hook_pattern", "attn.hook_rot_q")]
    names += [hook_name(1, "attn.hook_rot_k")]
    with torch.no_grad(), capture(model, names) as cap:
        weights = model(ids, use_cache=False, output_attentions=True).attentions
    for layer in range(4):
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_pattern")], weights[layer], rtol=1e-5, atol=1e-6)
    spec = layer_specs(model)[1]
    assert spec.softcap == 0.02 and spec.window is None
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    uncapped = attention_probabilities(cap[hook_name(1, "attn.hook_rot_q")], cap[hook_name(1, "attn.hook_rot_k")],
                                       scaling=spec.scaling, visible=causal)
    assert (uncapped - weights[1]).abs().max() > 1e-3


def test_pattern_adds_gpt_oss_learned_sinks():
    """gpt-oss's kernel gives each query head's learned sink logit its share of every softmax: the pattern equals its
    weights, its rows sum to less than 1, and the same recomputation without the sinks does not equal them."""
    model = tiny_model("gpt_oss", seed=0).model
    ids = torch.randint(5, 200, (1, 20), generator=torch.Generator().manual_seed(3))
    names = [hook_name(1, point) for point in ("attn.hook_pattern", "attn.hook_rot_q", "attn.hook_rot_k")]
    with torch.no_grad(), capture(model, names) as cap:
        weights = model(ids, use_cache=False, output_attentions=True).attentions[1]
    torch.testing.assert_close(cap[names[0]], weights, rtol=1e-5, atol=1e-6)
    assert (cap[names[0]].sum(-1) < 1 - 1e-3).all()
    spec = layer_specs(model)[1]
    assert spec.sinks is not None and spec.sinks.shape == (model.config.num_attention_heads,)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    unsunk = attention_probabilities(cap[names[1]], cap[names[2]], scaling=spec.scaling, visible=causal)
    assert (unsunk - weights).abs().max() > 1e-3


def test_capture_shapes_for_all_points(family_lm):
    model = family_lm.model
    config = model.config
    cap, _, _, _ = _run(model, all_hook_names(model))
    total = PROMPT + DECODE
    d_head = config.head_dim
    for layer in range(config.num_hidden_layers):
        assert cap[hook_name(layer, "hook_resid_pre")].shape == (1, total, config.hidden_size)
        assert cap[hook_name(layer, "attn.hook_q")].shape == (1, config.num_attention_heads, total, d_head)
        assert cap[hook_name(layer, "attn.hook_rot_q")].shape == (1, config.num_attention_heads, total, d_head)
        for point in ("attn.hook_k", "attn.hook_v", "attn.hook_cache_k", "attn.hook_cache_v", "attn.hook_rot_k"):
            assert cap[hook_name(layer, point)].shape == (1, config.num_key_value_heads, total, d_head)
        # one pattern per forward, over every key the layer attended to (a tiny model's window holds all 15)
        patterns = cap.calls(hook_name(layer, "attn.hook_pattern"))
        assert [p.shape for p in patterns] == [(1, config.num_attention_heads, PROMPT, PROMPT)] + [
            (1, config.num_attention_heads, 1, PROMPT + step + 1) for step in range(DECODE)]
        with pytest.raises(ValueError, match="calls"):
            cap[hook_name(layer, "attn.hook_pattern")]


def test_callback_streams_instead_of_storing(tiny_llama):
    seen = []
    record = lambda n, t: seen.append((n, t.shape))
    with torch.no_grad(), capture(tiny_llama.model, ["blocks.2.attn.hook_v"], callback=record) as cap:
        tiny_llama.model(torch.tensor([[3, 4, 5]]))
    assert seen == [("blocks.2.attn.hook_v", torch.Size([1, 2, 3, 16]))]
    assert cap.keys() == []


def _hook_counts(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_removed_after_context(family_lm):
    model = family_lm.model
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
        ("blocks.0.attn.hook_rot_v", "does not resolve"),
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


@pytest.mark.parametrize("family", family_names())
def test_tiny_models_deterministic_per_seed(family):
    rng_before = torch.random.get_rng_state()
    a, b, c = (tiny_model(family, seed=s).model.state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # building does not consume the global RNG
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
