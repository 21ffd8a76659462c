"""The offline calibration set: deterministic, exactly `ctx` tokens, five categories, answerable retrieval prompts."""

from __future__ import annotations

import importlib
import inspect

import pytest

from core.errors import UsageError
from geometry.calibration import CATEGORIES, calibration_digest, calibration_prompts
from models.tiny import tiny_tokenizer


@pytest.fixture(autouse=True)
def _offline_data(data_dir, monkeypatch):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)


def test_prompts_are_deterministic_exact_length_and_cycle_categories():
    tokenizer = tiny_tokenizer()
    first = calibration_prompts(tokenizer, n_prompts=7, ctx=300)
    again = calibration_prompts(tokenizer, n_prompts=7, ctx=300)
    assert [p.input_ids for p in first] == [p.input_ids for p in again]
    assert calibration_digest(first) == calibration_digest(again)
    assert [p.category for p in first] == list(CATEGORIES) + ["narrative", "qa"]
    assert [p.id for p in first][5:] == ["narrative-1", "qa-1"]
    assert all(len(p.input_ids) == 300 for p in first)
    assert len({p.input_ids for p in first}) == 7  # variants of a category start at different sources
    assert calibration_digest(first[:6]) != calibration_digest(first)


def test_category_contents(smollm2):
    tokenizer = smollm2.tokenizer
    prompts = {p.category: p for p in calibration_prompts(tokenizer, n_prompts=5, ctx=256)}
    text = {category: tokenizer.decode(p.input_ids) for category, p in prompts.items()}
    assert "Python" in text["narrative"]
    assert text["qa"].startswith("Question:") and "Answer:" in text["qa"]
    module = prompts["code"].sources[0].removeprefix("source of ")
    assert inspect.getsource(importlib.import_module(module)).startswith(text["code"][:200])
    assert text["math"].startswith("Problem:") and "Solution:" in text["math"]
    # SmolLM2's tokenizer adds no BOS: position 0 is the first text token
    assert prompts["qa"].input_ids[0] != tokenizer.bos_token_id


def test_retrieval_prompt_asks_about_a_key_in_its_table():
    tokenizer = tiny_tokenizer()
    for variant in range(4):  # the four table styles
        prompt = calibration_prompts(tokenizer, n_prompts=5 * variant + 5, ctx=400)[-1]
        assert prompt.category == "retrieval"
        text = tokenizer.decode(prompt.input_ids)
        table, question = text.rsplit("\n\nQuestion: what is the value recorded for the key ", 1)
        key = question.removesuffix("?\nAnswer:")
        assert question.endswith("?\nAnswer:") and f"\n{key}: " in table


def test_context_too_short_for_a_retrieval_question():
    with pytest.raises(UsageError, match="too short"):
        calibration_prompts(tiny_tokenizer(), n_prompts=5, ctx=40)
