"""Graded labels and the forced answer: where it ends and what it says by hand, its teacher-forced score on hand-made
logits, and the shared-prefix scoring of the fast labeller against teacher forcing from scratch."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from core.schemas import Trace
from labeling.answer import AnswerScore, answer_end, forced_answer_text, score_answer, teacher_forced_scores
from labeling.labeler import OcclusionConfig, OcclusionLabeler
from labeling.regenerate import PrefixCache, Row, regenerate_naive, regenerate_rows
from labeling.speculative import speculative_greedy
from labeling.windows import GENERIC, GENERIC_CUE, generic_cue, occlude, occlusion_windows
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "<|bos|><|user|>What is 6*7?<|eos|><|assistant|>"
REASONING = "Let us think. Six times seven: six sevens are forty-two, check 7*6=42 again. So"


def test_answer_end_counts_braces_from_the_forced_box_or_ends_the_first_line():
    assert answer_end("42}.", box=True) == 3
    assert answer_end("\\frac{1}{2}} and \\boxed{3}", box=True) == 12  # nested braces close inside the box
    assert answer_end("42", box=True) is None  # still open
    assert answer_end(" 18 apples.\nThen", box=False) == 11
    assert answer_end("\n\n 18\n", box=False) == 5  # leading blank lines hold no text yet
    assert answer_end(" 18", box=False) is None
    assert forced_answer_text(" 42 }. Then \\boxed{7}", box=True) == "42"  # never a later box
    assert forced_answer_text("}", box=True) is None  # an empty box states nothing
    assert forced_answer_text("7", box=True) is None
    assert forced_answer_text(" 18.\n", box=False) == "18."
    # a tokenizer that merges the box's brace into the answer's first token ("{(") leaves the cue at "\\boxed"
    assert answer_end("{(3, \\frac{1}{2})} \\]", box=True, opened=False) == 18
    assert forced_answer_text(" {(3, \\frac{1}{2})} \\]", box=True, opened=False) == "(3, \\frac{1}{2})"
    assert answer_end("{(3", box=True, opened=False) is None and answer_end("7}", box=True, opened=False) is None


def test_score_answer_by_hand():
    # vocabulary of 3; the reference is [2, 0]
    logits = torch.tensor([[0.0, 1.0, 2.0],    # predicts 2 (argmax): log p(2) = 2 - lse(0, 1, 2)
                           [0.0, 3.0, 0.0]])   # predicts 1, the reference says 0
    lse0, lse1 = math.log(1 + math.e + math.e ** 2), math.log(2 + math.e ** 3)
    score = score_answer(logits, [2, 0])
    assert score.logp == pytest.approx((2 - lse0) + (0 - lse1), abs=1e-6)
    assert score.margin == pytest.approx(2 - 1, abs=1e-6)  # log p(2) - log p(1): the logits' difference
    assert (score.greedy, score.diverges_at) == (False, 1)
    alone = score_answer(logits[:1], [2])
    assert (alone.greedy, alone.diverges_at) == (True, None) and alone.margin == pytest.approx(1.0, abs=1e-6)
    assert score_answer(logits[:1], [1]).margin == pytest.approx(-1.0, abs=1e-6)
    with pytest.raises(ValueError, match="logits"):
        score_answer(logits, [2])


def test_teacher_forced_scores_equal_one_forward_per_context(tiny_llama):
    tok = tiny_llama.tokenizer
    contexts = [tok.encode(PROMPT + REASONING), tok.encode(PROMPT + "So")]
    answer = tok.encode(" 42}", add_special_tokens=False)
    scores = teacher_forced_scores(tiny_llama.model, contexts, [answer] * 2, batch_size=2)
    for context, score in zip(contexts, scores):
        ids = torch.tensor([context + answer])
        with torch.no_grad():
            logits = tiny_llama.model(input_ids=ids).logits[0, len(context) - 1:-1]
        expected = score_answer(logits, answer)
        assert score.logp == pytest.approx(expected.logp, abs=1e-4)
        assert score.greedy == expected.greedy


def _rows(lm, filler):
    tok = lm.tokenizer
    ids = tok.encode(PROMPT + REASONING)
    windows = occlusion_windows(16, len(ids), 8, 4)
    return ids, [(s, occlude(ids, s, e, filler)[s:]) for s, e in windows]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_regeneration_stops_where_the_answer_completes_on_every_path(family):
    """A completion predicate (here: a row's third token) cuts naive, speculative and chunked continuations alike."""
    lm = tiny_model(family, seed=0, initializer_range=0.1)
    ids, rows = _rows(lm, lm.tokenizer.pad_token_id)
    stops = [lm.tokenizer.eos_token_id]
    complete = lambda row, tokens: len(tokens) >= 3  # noqa: E731
    naive = regenerate_naive(lm.model, [ids[:s] + t for s, t in rows], 10, stops, complete=complete)
    assert all(len(tokens) <= 3 for tokens in naive) and any(len(tokens) == 3 for tokens in naive)
    reference = regenerate_naive(lm.model, [ids], 10, stops)[0]
    prefix = PrefixCache(lm.model, ids)
    fast = regenerate_rows([Row(prefix, s, tuple(t), tuple(reference)) for s, t in rows], 10, stops, batch_size=3,
                           complete=complete)
    assert fast == naive


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_verifying_forward_scores_the_reference_as_teacher_forcing_does(family):
    """The logits the fast engines hand to `reference_logits` give the teacher-forced score of the reference after
    each occluded context (speculative engine for Llama/Qwen3, chunked verification for Gemma3's sliding layers)."""
    lm = tiny_model(family, seed=0, initializer_range=0.1)
    ids, rows = _rows(lm, lm.tokenizer.pad_token_id)
    stops = [lm.tokenizer.eos_token_id]
    reference = regenerate_naive(lm.model, [ids], 6, stops)[0]
    prefix = PrefixCache(lm.model, ids)
    got: dict[int, AnswerScore] = {}
    regenerate_rows([Row(prefix, s, tuple(t), tuple(reference)) for s, t in rows], 6, stops, batch_size=3,
                    reference_logits=lambda row, logits: got.__setitem__(row, score_answer(logits, reference)))
    expected = teacher_forced_scores(lm.model, [ids[:s] + t for s, t in rows], [reference] * len(rows))
    assert sorted(got) == list(range(len(rows)))
    for row, score in got.items():
        assert score.logp == pytest.approx(expected[row].logp, abs=1e-4)
        assert score.greedy == expected[row].greedy


def test_rows_prefilled_together_equal_rows_prefilled_alone(tiny_llama):
    """Joining rows of different tail lengths share one prefill (tails right-aligned); the continuations are those
    of rows that join one at a time."""
    ids, rows = _rows(tiny_llama, tiny_llama.tokenizer.pad_token_id)
    stops = [tiny_llama.tokenizer.eos_token_id]
    prefix = PrefixCache(tiny_llama.model, ids)
    start = rows[0][0]
    args = ([partial(prefix.copy_at, start, 1)] * len(rows), [ids[start:s] + list(t) for s, t in rows],
            [ids[:s] + list(t) for s, t in rows], 8, stops)
    together = speculative_greedy(tiny_llama.model, *args, batch_size=len(rows))
    one_by_one = speculative_greedy(tiny_llama.model, *args, batch_size=1)
    assert together == one_by_one


def test_a_cue_knows_whether_it_opened_the_box():
    from labeling.windows import Boundary, Cue

    assert Cue(Boundary(0, "boxed"), 3, "(\\boxed{").box_open
    assert not Cue(Boundary(0, "boxed"), 3, " \\boxed").box_open
    assert not Cue(Boundary(0, "phrase"), 3, "The answer is", box=False).box_open


def test_generic_cue_follows_the_trace_text_without_its_stop_tokens(tiny_llama):
    tok = tiny_llama.tokenizer
    generated = tok.encode("So he has 21 apples.", add_special_tokens=False) + [tok.eos_token_id]
    cue = generic_cue(tok, 5, generated, [tok.eos_token_id])
    assert cue.boundary.kind == GENERIC and cue.box and cue.text == GENERIC_CUE
    assert cue.boundary.answer_start == cue.end == 5 + len(generated) - 1
    assert tok.decode(list(cue.ids)) == GENERIC_CUE
    assert cue.to_json()["ids"] == list(cue.ids)


# --- the labeller on the default real model ------------------------------------------------------------------------
TRACE = ("Tom has 3 bags. Each bag holds 7 apples. So the total is 3 times 7, which is 21 apples. Let me double "
         "check: 7 + 7 + 7 = 21.")


def _trace(smollm2, text: str) -> Trace:
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

    tok = smollm2.tokenizer
    problem = Problem(id="p", dataset="gsm8k", question="Tom has 3 bags with 7 apples each. How many apples?",
                      answer="21")
    generated = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return Trace(id="t", dataset="gsm8k", model="smollm2-135m", prompt_ids=build_prompt_ids(tok, problem),
                 generated_ids=generated, gold="21", answer="21", correct=True)


def test_graded_labels_on_smollm2_fast_equal_naive(smollm2):
    """Every window carries the reference answer's teacher-forced score and its effect; the forced answer is read
    from the box and its regeneration stops there; the fast labeller's scores equal teacher forcing from scratch."""
    trace = _trace(smollm2, TRACE + " The answer is \\boxed{21}.")
    labels = {method: OcclusionLabeler.for_model(smollm2, OcclusionConfig(window=16, stride=16, method=method),
                                                 "gsm8k").label(trace) for method in ("fast", "naive")}
    fast, naive = labels["fast"], labels["naive"]
    assert fast.status == "labelled" and fast.reference_answer == "21" and fast.reference_matches_gold is True
    assert smollm2.tokenizer.decode(fast.graded["answer_ids"]).startswith("21}")
    assert [w["outcome"] for w in fast.windows] == [w["outcome"] for w in naive.windows]
    for a, b in zip(fast.windows, naive.windows):
        assert a["effect"] == pytest.approx(b["effect"], abs=1e-3)
        assert a["logp"] == pytest.approx(fast.graded["reference_logp"] + a["effect"], abs=1e-5)
        assert a["greedy"] == b["greedy"]
        if a["greedy"]:  # the forward alone decided it: greedy decoding reproduces the reference answer
            assert a["outcome"] == "same"
        assert len(a["continuation"]) <= len(fast.graded["answer_ids"]) + 1  # stopped once the box closed
    assert fast.graded["reference_logp"] == pytest.approx(naive.graded["reference_logp"], abs=1e-4)


def test_a_trace_without_a_cue_is_labelled_after_the_generic_cue(smollm2):
    trace = _trace(smollm2, TRACE + " So Tom has 21 apples.")
    label = OcclusionLabeler.for_model(smollm2, OcclusionConfig(window=16, stride=16), "gsm8k").label(trace)
    assert label.status == "labelled" and label.boundary == GENERIC
    assert label.forced_cue["kind"] == GENERIC and label.answer_start == len(trace.token_ids) - 1
    assert label.reference_answer is not None and label.windows
    skipped = OcclusionLabeler.for_model(smollm2, OcclusionConfig(window=16, stride=16, generic_cue=False),
                                         "gsm8k").label(trace)
    assert skipped.status == "skipped" and "no answer cue" in skipped.reason
