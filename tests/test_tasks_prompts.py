"""Prompt formatting (tasks/prompts.py): chat template when the tokenizer has one, the plain format otherwise."""

from __future__ import annotations

import copy

import pytest

from tasks.problem import Problem
from tasks.prompts import INSTRUCTION, build_prompt_ids, build_prompt_text, uses_chat_template

PROBLEM = Problem(id="t1", question="What is $1+1$?", answer="2", dataset="math500")


def test_instruction_asks_for_steps_and_a_boxed_answer():
    assert "step by step" in INSTRUCTION and "\\boxed{}" in INSTRUCTION


def test_chat_template_prompt(tiny_llama):
    tok = tiny_llama.tokenizer
    text = build_prompt_text(tok, PROBLEM)
    assert text == f"<|bos|><|user|>What is $1+1$?\n\n{INSTRUCTION}<|eos|><|assistant|>"
    ids = build_prompt_ids(tok, PROBLEM)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # no second BOS from the tokenizer
    assert tok.decode(ids) == text


def test_plain_fallback_without_chat_template(tiny_llama):
    tok = copy.deepcopy(tiny_llama.tokenizer)
    tok.chat_template = None
    assert not uses_chat_template(tok)
    text = build_prompt_text(tok, PROBLEM)
    assert text == f"Problem: What is $1+1$?\n\n{INSTRUCTION}\n\nSolution:"
    assert tok.decode(build_prompt_ids(tok, PROBLEM)).endswith("Solution:")


@pytest.mark.realmodel
def test_smollm2_uses_its_chat_template(smollm2):
    tok = smollm2.tokenizer
    ids = build_prompt_ids(tok, PROBLEM)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and tok.decode(ids[:3]).startswith("<|im_start|>system")
    text = build_prompt_text(tok, PROBLEM)
    assert "<|im_start|>user\nWhat is $1+1$?" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(ids) == text


@pytest.mark.realmodel
def test_gemma3_base_gets_the_plain_prompt_with_one_bos(gemma3_270m):
    tok = gemma3_270m.tokenizer
    assert not uses_chat_template(tok)
    ids = build_prompt_ids(tok, PROBLEM)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == build_prompt_text(tok, PROBLEM)
