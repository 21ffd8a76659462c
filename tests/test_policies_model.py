"""Frozen-score policies fed the way the engine feeds them (a prefill block, then one decode token per forward) from a
real forward pass, against the same signal computed offline on the whole captured sequence."""

from __future__ import annotations

import torch

from evictor.policies import get_policy
from models.hooks import capture, hook_name
from scoring.policy import ObserveInputs, ScoreInputs
from signals.hidden import RollingStats, band_score, hidden_diffs
from signals.kv import head_dim_variance, lag_normalised_variance

PROMPT = "Let x = 3. Then 2x + 1 = "
DECODE_STEPS = 3


def generate_with_capture(loaded, names: list[str]):
    """Greedy prefill + decode; returns the per-forward captured tensors."""
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad(), capture(model, names) as cap:
        out = model(input_ids=ids, use_cache=True)
        for _ in range(DECODE_STEPS):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
    return cap


def check_streaming_matches_offline(loaded):
    n_layers = loaded.config.num_hidden_layers
    epikv, raw = get_policy("epikv").for_depth(n_layers), get_policy("epikv_raw").for_depth(n_layers)
    kv_key, lag_kv = get_policy("kv_key"), get_policy("lag_kv")
    layers = epikv.needs.hidden_layers
    names = [hook_name(layer, "hook_resid_post") for layer in layers]
    names += [hook_name(0, "attn.hook_cache_k"), hook_name(0, "attn.hook_cache_v")]
    cap = generate_with_capture(loaded, names)
    calls = len(cap.calls(names[0]))
    assert calls == 1 + DECODE_STEPS

    states = {policy.name: {} for policy in (epikv, raw, kv_key, lag_kv)}
    streamed = {name: [] for name in states}
    start = 0
    for i in range(calls):
        hidden = {layer: cap.calls(hook_name(layer, "hook_resid_post"))[i] for layer in layers}
        keys, values = cap.calls(names[-2])[i], cap.calls(names[-1])[i]  # [batch, kv_head, new, d_head]
        new = keys.shape[2]
        positions = torch.arange(start, start + new)[None]
        for policy in (epikv, raw, kv_key, lag_kv):
            inputs = ObserveInputs(0, positions, keys, values, hidden, states[policy.name])
            streamed[policy.name].append(policy.observe(inputs))
        start += new
    streamed = {name: torch.cat(parts, dim=-1) for name, parts in streamed.items()}

    positive, negative = epikv.bands
    g = {layer: hidden_diffs(cap[hook_name(layer, "hook_resid_post")]) for layer in layers}
    bands = [g[layer] for layer in positive], [g[layer] for layer in negative]
    expected_z = torch.nan_to_num(band_score(*bands, smoothing="z", window=64))[:, None]
    expected_raw = torch.nan_to_num(band_score(*bands, smoothing="mean", window=64))[:, None]
    torch.testing.assert_close(streamed["epikv"], expected_z, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(streamed["epikv_raw"], expected_raw, rtol=1e-4, atol=1e-4)
    assert streamed["epikv"].abs().sum() > 0  # the signal is not trivially zero on a real model

    keys, values = cap[names[-2]], cap[names[-1]]
    kv_rolling = RollingStats(64).add(head_dim_variance(keys).flatten(0, 1))[0].reshape(keys.shape[:3])
    torch.testing.assert_close(streamed["kv_key"], kv_rolling)
    torch.testing.assert_close(streamed["lag_kv"], lag_normalised_variance(keys) + lag_normalised_variance(values))

    # the frozen scores come back through ScoreInputs and broadcast over KV heads
    n = keys.shape[2]
    inputs = ScoreInputs(
        layer=0,
        step=DECODE_STEPS,
        positions=torch.arange(n).expand(1, keys.shape[1], n),
        candidate_mask=torch.ones(1, keys.shape[1], n, dtype=torch.bool),
        frozen=streamed["epikv"].expand(1, keys.shape[1], n),
    )
    assert epikv.score(inputs).shape == (1, keys.shape[1], n)


def test_streaming_observe_matches_offline_signals_tiny(tiny):
    check_streaming_matches_offline(tiny)


def test_streaming_observe_matches_offline_signals_smollm2(smollm2):
    assert get_policy("epikv").for_depth(smollm2.config.num_hidden_layers).needs.hidden_layers == (9, 20)
    check_streaming_matches_offline(smollm2)
