"""Model-driven geometry checked against independent computations: eager attention maps and cache-captured K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_geometry_stats import _brute_force_stability  # tests/ is on sys.path under pytest
from test_models_attention import tiny_gemma2
from transformers import DynamicCache

from geometry.measure import MeasureSettings, attention_inputs, measure_sequence, weight_norms
from geometry.stats import query_positions
from models.hooks import capture, hook_name, layer_specs


def _ids(n_tokens: int, seed: int = 0, low: int = 5, high: int = 250) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (1, n_tokens), generator=generator)


def _eager_maps(model, input_ids):
    """Every layer's attention probabilities from transformers' own eager kernel."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, output_attentions=True, use_cache=False, logits_to_keep=1)
    finally:
        model.config._attn_implementation = previous
    return [a[0].double().numpy() for a in out.attentions]  # [layer] of [q_head, T, T]


def _cache_kv(model, input_ids):
    """What each layer hands its KV cache (post-RoPE keys, values), [layer] of [kv_head, T, d]."""
    n_layers = model.config.num_hidden_layers
    names = [hook_name(l, p) for l in range(n_layers) for p in ("attn.hook_cache_k", "attn.hook_cache_v")]
    with torch.no_grad(), capture(model, names) as cap:
        model(input_ids=input_ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return [(cap[hook_name(l, "attn.hook_cache_k")][0].double().numpy(),
             cap[hook_name(l, "attn.hook_cache_v")][0].double().numpy()) for l in range(n_layers)]


def _independent_stats(model, input_ids, settings):
    """The survey statistics recomputed with numpy from eager maps and cache-captured K/V."""
    maps, kv = _eager_maps(model, input_ids), _cache_kv(model, input_ids)
    n_tokens = input_ids.shape[-1]
    sampled = query_positions(n_tokens, settings.topk, settings.n_queries)
    out = {name: [] for name in ("sigma_k", "sigma_v", "bos_cos", "alpha_bos", "jaccard")}
    for spec, probs, (keys, values) in zip(layer_specs(model), maps, kv):
        def sigma(x):
            return np.linalg.norm(x - x.mean(axis=1, keepdims=True), axis=-1).std(axis=1)

        out["sigma_k"].append(sigma(keys))
        out["sigma_v"].append(sigma(values))
        content = keys[:, 1:].mean(axis=1)
        out["bos_cos"].append((keys[:, 0] * content).sum(-1) / np.linalg.norm(keys[:, 0], axis=-1)
                              / np.linalg.norm(content, axis=-1))
        reach = n_tokens if spec.window is None else min(spec.window, n_tokens)
        out["alpha_bos"].append(probs[:, 1:reach, 0].mean(axis=1))
        rows = torch.from_numpy(probs[:, sampled.numpy()])
        out["jaccard"].append(np.nanmean(_brute_force_stability(rows, sampled, settings.topk, spec.window), axis=1))
    return {name: np.array(value) for name, value in out.items()}


def _check_against_independent(lm, input_ids, settings, tau=0.3):
    got = measure_sequence(lm.model, input_ids, settings)
    ref = _independent_stats(lm.model, input_ids, settings)
    for name in ("sigma_k", "sigma_v", "bos_cos", "alpha_bos"):
        np.testing.assert_allclose(np.array(got[name]), ref[name], rtol=2e-4, atol=2e-5, err_msg=name)
    jaccard = np.array([[np.nan if v is None else v for v in row] for row in got["jaccard"]], dtype=float)
    np.testing.assert_allclose(jaccard, ref["jaccard"], rtol=1e-5, err_msg="jaccard")
    sink_rate = (np.array(got["alpha_bos"]) > tau).mean()
    assert sink_rate == pytest.approx((ref["alpha_bos"] > tau).mean())
    return got, ref


def test_post_rope_queries_and_keys_are_what_the_cache_stores(tiny):
    model = tiny.model
    ids = _ids(40)
    kv = _cache_kv(model, ids)
    for layer, tensors in attention_inputs(model, ids):
        np.testing.assert_allclose(tensors["k"].double().numpy(), kv[layer][0], atol=1e-5)
        np.testing.assert_allclose(tensors["v"].double().numpy(), kv[layer][1], atol=1e-6)
        assert tensors["q"].shape == (model.config.num_attention_heads, 40, model.config.head_dim)
        assert not torch.allclose(tensors["k"], tensors["k_pre"])  # RoPE did rotate the keys


def test_measure_sequence_matches_eager_maps_and_captured_kv(tiny):
    # tiny gemma3 has a 16-token sliding window on 3 of its 4 layers: both Jaccard paths and the alpha rule run
    settings = MeasureSettings(topk=4, n_queries=12, chunk=16)
    got, _ = _check_against_independent(tiny, _ids(90), settings)
    n_layers, n_kv = tiny.config.num_hidden_layers, tiny.config.num_key_value_heads
    assert np.array(got["sigma_k"]).shape == (n_layers, n_kv)
    assert np.array(got["alpha_bos"]).shape == (n_layers, tiny.config.num_attention_heads)


def test_soft_capped_gemma2_matches_eager_maps():
    # a cap small enough to change a random-init model's attention: the survey must apply it as the kernel does
    lm = tiny_gemma2(softcap=0.02)
    _check_against_independent(lm, _ids(40), MeasureSettings(topk=4, n_queries=8, chunk=16))
    assert [spec.softcap for spec in layer_specs(lm.model)] == [0.02] * 4


def test_pre_rope_key_space_uses_the_projection_keys(tiny_llama):
    ids = _ids(50)
    pre = measure_sequence(tiny_llama.model, ids, MeasureSettings(topk=4, n_queries=6, key_space="pre_rope"))
    with torch.no_grad(), capture(tiny_llama.model, [hook_name(1, "attn.hook_k")]) as cap:
        tiny_llama.model(input_ids=ids, use_cache=False)
    keys = cap[hook_name(1, "attn.hook_k")][0].double().numpy()
    expected = np.linalg.norm(keys - keys.mean(axis=1, keepdims=True), axis=-1).std(axis=1)
    np.testing.assert_allclose(pre["sigma_k"][1], expected, rtol=1e-4)


def test_weight_norms_are_spectral_norms_of_the_projections(tiny):
    norms = weight_norms(tiny.model)
    attn = tiny.model.model.layers[2].self_attn
    n_kv = tiny.config.num_key_value_heads
    for name, proj in (("k", attn.k_proj), ("v", attn.v_proj)):
        weight = proj.weight.detach().double().numpy()
        assert norms[f"w_{name}"][2] == pytest.approx(np.linalg.svd(weight, compute_uv=False)[0])
        blocks = np.split(weight, n_kv, axis=0)
        assert norms[f"w_{name}_head"][2] == pytest.approx([np.linalg.svd(b, compute_uv=False)[0] for b in blocks])


def test_smollm2_matches_eager_maps_and_captured_kv(smollm2):
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = torch.tensor([smollm2.tokenizer(text).input_ids[:72]])
    got, ref = _check_against_independent(smollm2, ids, MeasureSettings(topk=8, n_queries=8, chunk=32))
    assert len(got["sigma_k"]) == 30 and len(got["alpha_bos"][0]) == 9


@pytest.mark.slow
def test_gemma3_270m_matches_eager_maps_beyond_its_sliding_window(gemma3_270m):
    # 560 tokens > the 512-token window: sliding layers drop position 0 for the last queries
    ids = torch.tensor([[gemma3_270m.tokenizer.bos_token_id] + _ids(559, low=300, high=5000)[0].tolist()])
    _check_against_independent(gemma3_270m, ids, MeasureSettings(topk=32, n_queries=8, chunk=128))
