"""KV-head expansion: the expanded model has one KV head per query head and computes the same logits and greedy
tokens, on the tiny models of every family whose attention it can expand exactly (fast; the others are refused) and
on the registered SmolLM2 expansion (a real prompt)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core.errors import UsageError
from models.expand import expand_kv_heads
from models.hooks import decoder_layers
from models.loading import load_model
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def _greedy(model: nn.Module, ids: torch.Tensor, tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_tiny_expansion_keeps_logits_and_greedy_tokens_or_is_refused(family_lm):
    """A fused QKV projection (Phi-3) or a key norm over every KV head at once (OLMo2) cannot be split per head:
    refused, with the reason, and nothing changed; every other family expands exactly."""
    original = family_lm.model
    attention = decoder_layers(original)[0].self_attn
    k_norm = getattr(attention, "k_norm", None)
    refusal = ("separate k_proj and v_proj" if not hasattr(attention, "k_proj") else
               "key norm spans 32 features" if k_norm is not None and k_norm.weight.numel() != attention.head_dim
               else None)
    if refusal is not None:
        with pytest.raises(UsageError, match=refusal):
            expand_kv_heads(original)
        assert original.config.num_key_value_heads == 2
        return
    expanded = expand_kv_heads(copy.deepcopy(original))
    cfg = expanded.config
    assert original.config.num_key_value_heads == 2 and cfg.num_key_value_heads == cfg.num_attention_heads == 4
    attention = decoder_layers(expanded)[0].self_attn
    assert attention.k_proj.weight.shape == (4 * attention.head_dim, cfg.hidden_size)
    # key head j of the original is now heads 2j and 2j + 1 (the query heads of its group)
    kv_rows = decoder_layers(original)[0].self_attn.k_proj.weight.unflatten(0, (2, -1))
    assert torch.equal(attention.k_proj.weight.unflatten(0, (4, -1)), kv_rows.repeat_interleave(2, dim=0))
    # 40 tokens: past the tiny models' 16-token sliding windows, so both kinds of layer are exercised
    ids = torch.randint(0, cfg.vocab_size - 10, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(expanded, ids), _logits(original, ids), rtol=0, atol=1e-5)
    with torch.inference_mode():
        cache = expanded(input_ids=ids[:1], use_cache=True).cache
    assert cache.layers[0].keys.shape[1] == 4  # the cache holds one KV head per query head
    assert _greedy(expanded, ids[:1], 12) == _greedy(original, ids[:1], 12)


def test_expansion_is_idempotent_and_survives_save_and_load(tmp_path, tiny_llama):
    expanded = expand_kv_heads(copy.deepcopy(tiny_llama.model))
    weights = expanded.model.layers[1].self_attn.v_proj.weight.clone()
    assert expand_kv_heads(expanded) is expanded  # already one KV head per query head: unchanged
    assert torch.equal(expanded.model.layers[1].self_attn.v_proj.weight, weights)
    expanded.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert reloaded.config.num_key_value_heads == 4 and reloaded.describe()["kv_heads"] == 4
    ids = torch.arange(3, 30)[None]
    torch.testing.assert_close(_logits(reloaded.model, ids), _logits(tiny_llama.model, ids), rtol=0, atol=1e-5)


def test_qkv_biases_are_duplicated_with_their_heads():
    lm = tiny_model("llama", seed=1, attention_bias=True)
    original = copy.deepcopy(lm.model)
    with torch.no_grad():  # random-init biases are zero; give each head its own
        for layer in original.model.layers:
            layer.self_attn.k_proj.bias.normal_()
            layer.self_attn.v_proj.bias.normal_()
    expanded = expand_kv_heads(copy.deepcopy(original))
    bias = expanded.model.layers[2].self_attn.v_proj.bias.unflatten(0, (4, -1))
    assert torch.equal(bias[2], bias[3]) and not torch.equal(bias[1], bias[2])
    ids = torch.arange(5, 25)[None]
    torch.testing.assert_close(_logits(expanded, ids), _logits(original, ids), rtol=0, atol=1e-5)


def test_a_key_norm_across_heads_is_refused():
    lm = tiny_model("qwen3", seed=0)
    attention = lm.model.model.layers[0].self_attn
    attention.k_norm = nn.RMSNorm(2 * attention.head_dim)  # a norm over all KV heads at once: not per head
    with pytest.raises(UsageError, match="key norm spans 32 features, not one head of 16"):
        expand_kv_heads(lm.model)
    assert lm.config.num_key_value_heads == 2  # refused before anything changed


@pytest.mark.realmodel
def test_registered_smollm2_expansion_matches_smollm2_on_a_real_prompt(smollm2):
    expanded = load_model("smollm2-135m-mha", device="cpu", dtype="float32")
    assert expanded.name == "smollm2-135m-mha" and expanded.describe()["kv_heads"] == 9
    assert smollm2.describe()["kv_heads"] == 3 and expanded.info["expanded_from"] == "smollm2-135m"
    messages = [{"role": "user", "content": "What is 12 times 7? Answer with the number."}]
    text = smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = smollm2.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.testing.assert_close(_logits(expanded.model, ids), _logits(smollm2.model, ids), rtol=0, atol=1e-4)
    assert _greedy(expanded.model, ids, 16) == _greedy(smollm2.model, ids, 16)
