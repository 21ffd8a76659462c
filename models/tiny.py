"""Random-init tiny models of every model family (`models.families`), built in-process for tests: no downloads, ever.

Each is built from its family's own transformers config class, with the shared small sizes below and the fields its
record sets, so each keeps the structural features kvscope must handle: grouped-query attention (more query than KV
heads) everywhere, QK-norm (Qwen3, Gemma3, OLMo2), sliding-window layers (Mistral, Gemma2, Gemma3, gpt-oss), a fused
QKV projection (Phi-3), learned attention sinks (gpt-oss), mixtures of experts (Qwen3-MoE, gpt-oss). The tokenizer
is a byte-level BPE with no merges plus chat special tokens, so any text round-trips and chat templates work.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from models.families import family_named
from models.lm import LoadedModel

if TYPE_CHECKING:  # transformers takes a second or more to import: only building a tiny model or tokenizer needs it
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<think>", "</think>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|eos|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    # sorted: alphabet() comes from a set, so its order (and every token id) would change with PYTHONHASHSEED
    byte_vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(family: str = "llama", **overrides):
    """A small config of `family` (a tiny name, `models.families.family_names`); `overrides` replace any field
    (e.g. num_hidden_layers=6; families whose config derives its layer types from the depth derive them again)."""
    record = family_named(family)
    vocab = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, pad_token_id=vocab - 7,
        bos_token_id=vocab - 6, eos_token_id=vocab - 5, tie_word_embeddings=True,
    )
    return record.config_type()(**{**common, **record.tiny, **overrides})


def tiny_model(
    family: str = "llama", *, seed: int = 0, attn_implementation: str | None = None, dtype=torch.float32, **overrides
) -> LoadedModel:
    """A random-init tiny model of `family`, deterministic for a given `seed`, on the CPU. Without
    `attn_implementation` it runs transformers' default kernel for its class: SDPA, or eager where the class has no
    SDPA path (Gemma2, gpt-oss)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    return LoadedModel(model, tiny_tokenizer(), f"tiny-{family}", f"random-init seed={seed}", 0.0, {"seed": seed})


def save_tiny_model(family: str, path: str | os.PathLike, *, seed: int = 0) -> str:
    """A tiny model of `family` saved as a local HuggingFace directory, so CLIs load it by path like any model."""
    lm = tiny_model(family, seed=seed)
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return str(path)
