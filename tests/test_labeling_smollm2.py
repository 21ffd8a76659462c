"""Occlusion labels on the real SmolLM2: the fast engine gives exactly the naive engine's labels."""

from __future__ import annotations

import json

import pytest

from labeling.occlusion import OcclusionLabeler, main
from tasks.datasets import Problem, load_problems
from tasks.generation import generate, stop_token_ids
from tasks.grading import extract_answer, is_equivalent
from tasks.prompts import build_prompt_ids

pytestmark = pytest.mark.realmodel


pytestmark = pytest.mark.usefixtures("one_thread")


def _labeler(lm, method, **kw):
    return OcclusionLabeler(model=lm.model, tokenizer=lm.tokenizer,
                            answer_of=lambda text: extract_answer(text, "gsm8k"),
                            same=is_equivalent, stop_ids=stop_token_ids(lm.tokenizer, lm.model),
                            replacement=lm.tokenizer.pad_token_id, method=method, **kw)


def test_cli_fast_and_naive_agree_on_a_short_smollm2_trace(tmp_path, smollm2):
    """A hand-written trace; from the context before its box the model writes " 5, which is the answer..."."""
    tok = smollm2.tokenizer
    prompt = build_prompt_ids(tok, Problem("sum", "What is 2 + 3?", "5", "gsm8k"))
    generated = tok.encode("We add the two numbers: 2 + 3 = 5. Adding 2 and 3 gives 5, so the sum is 5.\n\n"
                           "The sum of 2 and 3 is \\boxed{5}", add_special_tokens=False)
    trace = {"id": "sum", "dataset": "gsm8k", "model": "smollm2-135m", "prompt_ids": prompt,
             "generated_ids": generated, "answer": "5", "gold": "5", "correct": True}
    traces = tmp_path / "generations.jsonl"
    traces.write_text(json.dumps(trace) + "\n")
    outputs = {}
    for method in ("fast", "naive"):
        out = tmp_path / method
        assert main(["--traces", str(traces), "--out", str(out), "--window", "8", "--stride", "6",
                     "--max-answer-tokens", "8", "--method", method, "--batch-size", "4"]) == 0
        (record,) = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
        outputs[method] = record
    fast, naive = outputs["fast"], outputs["naive"]
    assert fast["status"] == "labelled" and fast["boundary"] == "boxed"
    assert fast["reference_answer"] == "5"
    assert fast["labels"] == naive["labels"]
    assert [w["answer_after"] for w in fast["windows"]] == [w["answer_after"] for w in naive["windows"]]
    assert len(fast["windows"]) >= 4
    assert {w["flipped"] for w in fast["windows"]} == {True, False}  # some occlusions change the answer, some not


@pytest.mark.slow
def test_fast_equals_naive_on_generated_smollm2_traces(smollm2):
    """Three real greedy GSM8K traces (96 tokens, tail boundary), default window 32 / stride 16, labelled against
    the model's own answers: the fast method labels them together, the naive one each alone; records identical."""
    traces = []
    for problem in load_problems("gsm8k", limit=3):
        prompt = build_prompt_ids(smollm2.tokenizer, problem)
        traces.append((prompt, generate(smollm2, prompt, 96).generated_ids))
    fast = _labeler(smollm2, "fast", max_answer_tokens=48, batch_size=16).label_many(traces)
    naive = [_labeler(smollm2, "naive", max_answer_tokens=48).label(*trace) for trace in traces]
    assert sum(record["status"] == "labelled" for record in naive) >= 2
    assert fast == naive
