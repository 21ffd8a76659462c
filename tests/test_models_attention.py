"""The one attention recomputation (models/attention.py) on hand-made tensors whose answers are worked out in the
comments, and the per-family facts it reads off a model. Equality with the eager kernel on real forwards of every
family is checked through ``attn.hook_pattern`` in tests/test_hooks.py."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from core.errors import UsageError
from models.attention import (
    attention_logits,
    attention_probabilities,
    group_mean,
    layer_kinds,
    layer_spec,
    visible_by_position,
    visible_from_module_mask,
)
from models.hooks import decoder_layers, layer_specs
from models.lm import LoadedModel
from models.tiny import tiny_model

LOW = torch.finfo(torch.float32).min


@contextlib.contextmanager
def using_kernel(model, name: str):
    """Run `model` on attention kernel `name` inside the context (transformers reads it at every call)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def tiny_gemma2(softcap: float | None = 50.0, seed: int = 0) -> LoadedModel:
    """The tiny Gemma2 (soft-capped logits, alternating sliding / full layers) with logit cap `softcap`; it runs on
    the eager kernel, the only one transformers runs Gemma2 with."""
    return tiny_model("gemma2", seed=seed, attn_logit_softcapping=softcap)


# --- the recomputation by hand -----------------------------------------------------------------------------------
def test_grouped_query_attention_by_hand():
    # d = 1, scaling 1, one KV head read by two query heads: keys 0 and ln 3; head 0 (q = 1) gives [1/4, 3/4], head 1
    # (q = 0) gives [1/2, 1/2]; their group mean is [3/8, 5/8].
    keys = torch.tensor([[[[0.0], [math.log(3)]]]])  # [b, kv_head=1, S=2, d=1]
    queries = torch.tensor([[[[1.0]], [[0.0]]]])  # [b, q_head=2, Q=1, d=1]
    probs = attention_probabilities(queries, keys, scaling=1.0)
    assert probs.shape == (1, 2, 1, 2)
    torch.testing.assert_close(probs[0, :, 0], torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    torch.testing.assert_close(group_mean(probs, 1)[0, 0, 0], torch.tensor([3 / 8, 5 / 8]))
    # query head j reads KV head j // 2: with two KV heads the second pair of query heads reads the second key set
    two = torch.cat([keys, keys.flip(2)], dim=1)  # KV head 1 holds ln 3 first
    probs = attention_probabilities(torch.cat([queries, queries], dim=1), two, scaling=1.0)
    torch.testing.assert_close(probs[0, 2, 0], torch.tensor([0.75, 0.25]))
    # scaling multiplies the logits: q = 1 at scaling 2 sees logits 0, 2 ln 3 -> [1/10, 9/10]
    torch.testing.assert_close(attention_probabilities(queries, keys, scaling=2.0)[0, 0, 0], torch.tensor([0.1, 0.9]))


def test_softcap_and_masks_by_hand():
    keys = torch.tensor([[[[0.0], [100.0]]]])
    queries = torch.tensor([[[[1.0]]]])
    # logits 0 and 100 capped at 1: 0 and tanh(100) ~ 1 -> [1, e] / (1 + e)
    capped = attention_probabilities(queries, keys, scaling=1.0, softcap=1.0)
    assert capped[0, 0, 0, 1].item() == pytest.approx(math.e / (1 + math.e), abs=1e-6)
    logits = attention_logits(queries, keys, scaling=1.0, visible=torch.tensor([[[[True, False]]]]))
    assert logits[0, 0, 0].tolist() == [0.0, float("-inf")]
    # a query that sees nothing (padding) has a zero row, not NaN
    probs = attention_probabilities(queries, keys, scaling=1.0, visible=torch.zeros(1, 1, 1, 2, dtype=torch.bool))
    assert probs.abs().sum() == 0


def test_learned_sinks_by_hand():
    # keys 0 and ln 3 under q = 1, scaling 1, and a sink logit ln 4: the softmax over e^0, e^ln3, e^ln4 = 1, 3, 4 gives
    # the keys 1/8 and 3/8 (the sink's 4/8 is dropped); a second head with sink -inf is the plain softmax [1/4, 3/4]
    keys = torch.tensor([[[[0.0], [math.log(3)]]]])
    queries = torch.tensor([[[[1.0]], [[1.0]]]])  # two query heads read the one KV head
    sinks = torch.tensor([math.log(4), float("-inf")])
    probs = attention_probabilities(queries, keys, scaling=1.0, sinks=sinks)
    torch.testing.assert_close(probs[0, :, 0], torch.tensor([[1 / 8, 3 / 8], [1 / 4, 3 / 4]]))
    # a query that sees no key still reads zeros, the sink taking the whole row
    blind = attention_probabilities(queries, keys, scaling=1.0, sinks=sinks, visible=torch.zeros(1, 1, 1, 2).bool())
    assert blind.abs().sum() == 0


def test_visible_by_position_by_hand():
    # keys at 0, 3, padding, 5; a query at 5 with window 3 sees 3 and 5 (5 - 0 >= 3); a padding query sees nothing
    visible = visible_by_position(torch.tensor([[5, -1]]), torch.tensor([[0, 3, -1, 5]]), window=3)
    assert visible.shape == (1, 1, 2, 4)
    assert visible[0, 0].tolist() == [[False, True, False, True], [False, False, False, False]]
    # causal without a window; per-head key positions keep their head axis
    per_head = visible_by_position(torch.tensor([[2]]), torch.tensor([[[0, 1, 2], [1, 2, 3]]]))
    assert per_head.shape == (1, 2, 1, 3)
    assert per_head[0, :, 0].tolist() == [[True, True, True], [True, True, False]]


def test_visible_from_module_mask_by_hand():
    # no 4D mask: causal aligned at the last query. 2 queries over 4 keys: rows see keys 0..2 and 0..3
    assert visible_from_module_mask(None, 2, 4)[0, 0].tolist() == [[True, True, True, False], [True] * 4]
    # a window of 2 keeps keys 1..2 and 2..3; a 2D padding mask drops key 0
    assert visible_from_module_mask(None, 2, 4, window=2)[0, 0].tolist() == [[False, True, True, False],
                                                                             [False, False, True, True]]
    padding = torch.tensor([[0, 1, 1, 1]])
    assert visible_from_module_mask(padding, 1, 4)[0, 0, 0].tolist() == [False, True, True, True]
    # a 4D mask is what the kernel applied: additive (0 / dtype minimum) or boolean
    additive = torch.tensor([[[[0.0, LOW, 0.0]]]])
    assert visible_from_module_mask(additive, 1, 3)[0, 0, 0].tolist() == [True, False, True]
    boolean = torch.tensor([[[[False, True, True]]]])
    assert visible_from_module_mask(boolean, 1, 3) is boolean


# --- per-family facts -------------------------------------------------------------------------------------------------
def test_layer_specs_read_scaling_windows_and_only_the_caps_the_kernel_applies():
    specs = layer_specs(tiny_model("gemma3", seed=3, attn_logit_softcapping=50.0).model)
    assert [s.window for s in specs] == [16, 16, 16, None]
    assert [s.kind for s in specs] == ["sliding_attention"] * 3 + ["full_attention"]
    assert specs[0].scaling == pytest.approx(16**-0.5)
    # transformers' Gemma3 keeps attn_logit_softcapping on the module but never passes it to the kernel
    assert [s.softcap for s in specs] == [None] * 4
    gemma2 = layer_specs(tiny_gemma2(softcap=50.0).model)
    assert [s.softcap for s in gemma2] == [50.0] * 4 and [s.window for s in gemma2] == [16, None, 16, None]
    assert [s.window for s in layer_specs(tiny_model("llama").model)] == [None] * 4


def test_layer_kinds_follow_the_config_as_transformers_does():
    assert layer_kinds(LlamaConfig(num_hidden_layers=2)) == ["full_attention"] * 2
    assert layer_kinds(MistralConfig(num_hidden_layers=2, sliding_window=8)) == ["sliding_attention"] * 2
    assert layer_kinds(MistralConfig(num_hidden_layers=2, sliding_window=None)) == ["full_attention"] * 2
    gemma2 = tiny_gemma2().config
    assert layer_kinds(gemma2) == gemma2.layer_types == ["sliding_attention", "full_attention"] * 2


def test_windows_from_the_config_are_those_of_the_modules_that_hold_one(family_lm):
    """A layer's window is read from the config, as the mask builders read it; the attention modules that keep their
    own (Gemma, gpt-oss, Qwen3) hold the same one, and a full layer has none."""
    model = family_lm.model
    specs = layer_specs(model)
    assert [spec.kind for spec in specs] == list(getattr(model.config, "layer_types", None) or [s.kind for s in specs])
    for spec, block in zip(specs, decoder_layers(model)):
        own = getattr(block.self_attn, "sliding_window", spec.window)
        assert spec.window == own and (spec.window is None) == (spec.kind == "full_attention")


def test_mistral_window_comes_from_its_config_and_unknown_families_raise():
    config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           sliding_window=32)
    module = torch.nn.Module()
    module.scaling = 0.25
    spec = layer_spec(module, config, 0)
    assert (spec.window, spec.kind, spec.softcap) == (32, "sliding_attention", None)
    config.model_type = "falcon"
    with pytest.raises(UsageError, match="unknown model family 'falcon'; valid choices: gemma2, gemma3_text, gpt_oss"):
        layer_spec(module, config, 0)
