"""Occlusion labels on the real SmolLM2: the fast engine gives exactly the naive engine's labels."""

from __future__ import annotations

import json

import pytest

from core.schemas import Trace
from labeling.labeler import OcclusionConfig, OcclusionLabeler, make_units
from labeling.occlusion import main
from labeling.replacement import resolve_replacement
from tasks.datasets import load_problems
from tasks.generation import generate, stop_token_ids
from tasks.problem import Problem
from tasks.prompts import build_prompt_ids

pytestmark = [pytest.mark.realmodel, pytest.mark.usefixtures("one_thread")]


def _labeler(lm, method, **kw):
    return OcclusionLabeler.for_model(lm, OcclusionConfig(replacement="pad", method=method, **kw), "gsm8k")


def test_auto_replacement_is_a_space_because_the_pad_token_ends_the_turn(smollm2):
    tok = smollm2.tokenizer
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    auto = resolve_replacement(tok, "auto", stop_token_ids(tok, smollm2.model))
    assert (auto.chosen, auto.text, [auto.token_id]) == ("space", " ", tok.encode(" ", add_special_tokens=False))
    assert "'<|im_end|>' is the end-of-sequence token" in auto.note
    assert resolve_replacement(tok, "pad").token_id == tok.eos_token_id  # EpiKV's literal protocol stays selectable


@pytest.mark.parametrize("replacement", ["pad", "auto"])
def test_cli_fast_and_naive_agree_on_a_short_smollm2_trace(tmp_path, smollm2, replacement):
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
                     "--max-answer-tokens", "8", "--method", method, "--batch-size", "4",
                     "--replacement", replacement]) == 0
        (record,) = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
        outputs[method] = record
    fast, naive = outputs["fast"], outputs["naive"]
    assert fast["status"] == "labelled" and fast["boundary"] == "boxed"
    assert fast["reference_answer"] == "5"
    assert fast["replacement"]["chosen"] == ("pad" if replacement == "pad" else "space")
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
        traces.append(Trace(id=problem.id, dataset="gsm8k", model="smollm2-135m", prompt_ids=prompt,
                            generated_ids=generate(smollm2, prompt, 96).generated_ids))
    fast = _labeler(smollm2, "fast", max_answer_tokens=48, batch_size=16, traces_per_batch=3)
    naive = _labeler(smollm2, "naive", max_answer_tokens=48)
    together = fast.label_unit(make_units(traces, 3)[0])
    alone = [naive.label(trace) for trace in traces]
    assert sum(record.labelled for record in alone) >= 2
    assert together == alone
