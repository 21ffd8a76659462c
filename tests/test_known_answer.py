"""Known-answer tasks (tasks/known_answer.py) and the labeller / scorer measurements against them
(validation/known_answer.py): names, determinism, where the facts are, token spans, and hand-derived scores."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from core.errors import UsageError
from core.schemas import Label
from labeling.windows import find_answer_boundary
from models.tiny import tiny_tokenizer
from tasks import known_answer
from tasks.datasets import DATASETS, check_dataset, load_problems, resolve_source
from tasks.known_answer import (
    CUE,
    FILLER,
    KEYS,
    META,
    MIN_GAP_WORDS,
    TAIL_EXTRA_WORDS,
    THINK_END,
    KnownFactsConfig,
    answer_traces,
    generate,
    parse_name,
    problem_trace,
)
from tasks.problem import Problem
from validation.known_answer import (
    FactSpans,
    Note,
    fact_spans,
    label_scores,
    scorer_auc,
    trace_auc,
    window_class,
)
from validation.signals import SignalSet, SignalTrace
from validation.stats import wilson_interval

# Byte-level with no merges: one token per byte, so a character span is a token span shifted by the prompt.
TOKENIZER = tiny_tokenizer()


def test_names_and_bad_input():
    assert "known_facts" in DATASETS
    assert parse_name("known_facts") == KnownFactsConfig(1)
    assert parse_name("known_facts@3") == KnownFactsConfig(3)
    assert parse_name("known_facts@3").name == "known_facts@3"
    assert parse_name("gsm8k") is None
    with pytest.raises(UsageError, match=r"decoys 'x' is not a number; write e\.g\. known_facts@2"):
        parse_name("known_facts@x")
    with pytest.raises(UsageError, match=r"decoys must be an integer in 0\.\.8, got 9"):
        parse_name("known_facts@9")
    with pytest.raises(UsageError, match="seed must be an integer, got '1'"):
        KnownFactsConfig(seed="1")
    with pytest.raises(UsageError, match=r"unknown dataset 'known_fact' \(did you mean 'known_facts'"):
        check_dataset("known_fact")
    check_dataset("known_facts@0")
    assert resolve_source("known_facts@2") == f"generated:known_facts@2 seed=0 {known_answer.GENERATOR}"


def test_generation_is_deterministic_and_independent_of_the_count():
    first = generate(KnownFactsConfig(2), 4)
    assert first == generate(KnownFactsConfig(2), 4)
    assert generate(KnownFactsConfig(2), 2) == first[:2]
    assert generate(KnownFactsConfig(2, seed=1), 1)[0] != first[0]
    assert len({r["question"] + r[META]["text"] for r in first}) == 4
    json.dumps(first)  # records go into JSONL files as they are


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("decoys", [0, 1, 3])
def test_facts_are_where_the_record_says_and_only_there(decoys):
    for index, record in enumerate(generate(KnownFactsConfig(decoys), 6)):
        info, answer = record[META], record["answer"]
        text = info["text"]
        assert not re.search(r"\d", record["question"])  # the prompt never states a value
        assert info["key"] in record["question"]
        needed, = info["needed"]
        assert text[slice(*needed["value"])] == answer
        assert text[slice(*needed["key"])] == info["key"]
        assert text[slice(*needed["note"])] == f"The code for {info['key']} is {answer}."
        assert len(info["decoys"]) == decoys
        values = [text[slice(*d["value"])] for d in info["decoys"]]
        names = [text[slice(*d["key"])] for d in info["decoys"]]
        assert info["key"] not in names and len(set(names)) == decoys
        assert len({v[0] for v in [answer, *values]}) == decoys + 1  # first digits all differ
        # The value's only other copy is the boxed answer, after the cue.
        assert [m.start() for m in re.finditer(answer, text)] == [needed["value"][0], info["answer_char"]]
        # The answer boundary </think>, then the statement, which the cue runs through up to the answer.
        statement = f"So the code for {info['key']} is {CUE}"
        assert text[info["cue"]:info["answer_char"]] == f"{THINK_END} {statement}"
        assert text[slice(*info["statement"])] == f"{statement}{answer}}}." and text.endswith(f"{answer}}}.")
        # The needed note comes after every decoy; at least MIN_GAP_WORDS filler words after each note, and the
        # extra words of the cycle after the needed one.
        notes = sorted([needed, *info["decoys"]], key=lambda n: n["note"][0])
        assert notes[-1] is needed
        ends = [n["note"][0] for n in notes[1:]] + [info["cue"]]
        for note, next_start in zip(notes, ends):
            gap = text[note["note"][1]:next_start]
            extra = TAIL_EXTRA_WORDS[index % len(TAIL_EXTRA_WORDS)] if note is needed else 0
            assert _words(gap) >= MIN_GAP_WORDS + extra and not re.search(r"\d", gap)
            assert not any(name in gap for name in KEYS) and "code" not in gap
        assert 0 <= info["depth"] < 1


def test_filler_says_nothing_a_note_says():
    for sentence in FILLER:
        assert not re.search(r"\d", sentence) and "code" not in sentence
        assert not any(name in sentence for name in KEYS)


def test_load_problems_gives_known_answer_problems():
    problems = load_problems("known_facts@2", limit=3)
    assert [p.id for p in problems] == ["known_facts@2-0", "known_facts@2-1", "known_facts@2-2"]
    assert all(p.dataset == "known_facts@2" and p.answer == p.meta[META]["answer"] for p in problems)
    assert len(load_problems("known_facts")) == known_answer.DEFAULT_COUNT


def test_problem_trace_maps_the_spans_to_tokens():
    problem = load_problems("known_facts@2", limit=2)[1]
    trace = problem_trace(problem, TOKENIZER, "tiny")
    info, spans = problem.meta[META], trace.extra[META]
    base = len(trace.prompt_ids)
    assert TOKENIZER.decode(trace.generated_ids[:-1]) == info["text"]
    assert trace.generated_ids[-1] == TOKENIZER.eos_token_id and trace.finish_reason == "eos"
    assert trace.gold == problem.answer and trace.answer is None and trace.correct is None
    for char_note, token_note in zip(info["needed"] + info["decoys"], spans["needed"] + spans["decoys"]):
        assert {part: [s + base, e + base] for part, (s, e) in char_note.items()} == token_note
    ids = trace.token_ids
    assert TOKENIZER.decode(ids[slice(*spans["needed"][0]["value"])]) == problem.answer
    boundary = find_answer_boundary(TOKENIZER, base, trace.generated_ids)
    assert (boundary.kind, boundary.answer_start) == ("think", spans["answer_start"])
    cue = TOKENIZER.decode(ids[spans["answer_start"]:spans["answer_token"]])
    assert cue == info["text"][info["cue"]:info["answer_char"]] and cue.endswith(CUE)
    json.dumps(trace.to_json())
    with pytest.raises(UsageError, match="problem 'p1' of gsm8k is not a known-answer problem"):
        problem_trace(Problem("p1", "What is 1 + 1?", "2", "gsm8k"), TOKENIZER, "tiny")


def test_scripted_ids_stop_where_the_answer_starts_and_grading_reads_only_the_statement():
    problem = load_problems("known_facts@2", limit=1)[0]
    trace = problem_trace(problem, TOKENIZER, "tiny")
    script = known_answer.scripted_ids(problem, TOKENIZER)
    assert script == trace.generated_ids[:trace.extra[META]["answer_token"] - len(trace.prompt_ids)]
    assert TOKENIZER.decode(script).endswith(CUE)  # the model's first free token is the answer's
    assert known_answer.scripted_ids(Problem("p1", "What is 1 + 1?", "2", "gsm8k"), TOKENIZER) is None
    decoy = problem.meta[META]["decoys"][0]
    decoy_value = problem.meta[META]["text"][slice(*decoy["value"])]
    prefix = problem.meta[META]["text"][:problem.meta[META]["answer_char"]]  # the reasoning and the cue
    right = known_answer.grade(prefix + problem.answer + "}.", problem)
    assert right["correct"] and right["answer"] == problem.answer
    # a box left open: the reasoning's notes hold every code, yet no answer was stated
    unanswered = known_answer.grade(prefix, problem)
    assert unanswered["no_answer"] and not unanswered["correct"]
    assert known_answer.grade(prefix + decoy_value + "}", problem)["correct"] is False


def test_answer_traces_reads_the_answer_after_the_forced_cue(tiny_llama):
    problem = load_problems("known_facts", limit=1)[0]
    trace = problem_trace(problem, tiny_llama.tokenizer, "tiny")
    (answered,) = answer_traces(tiny_llama, [trace], max_new_tokens=6)
    forced = answered.extra[META]["forced"]
    # The random model's continuation of "\boxed{": whatever it is, the answer is read from the cue plus it.
    from tasks.grading import extract_answer

    assert answered.answer == extract_answer(CUE + forced)
    assert answered.correct is (answered.answer == problem.answer)
    assert answered.no_answer is (answered.answer is None)
    assert trace.extra[META].get("forced") is None  # the input trace is not changed


def test_smollm2_tokens_and_forced_answer(smollm2):
    """On the real tokenizer the value tokens are its digits and notes stay two windows apart; the first trace of
    known_facts is answered correctly under the forced cue (measured: all of the first 24)."""
    tok = smollm2.tokenizer
    problems = load_problems("known_facts@2", limit=3)
    for problem in problems:
        trace = problem_trace(problem, tok, "smollm2-135m")
        spans, ids = trace.extra[META], trace.token_ids
        assert tok.decode(ids[slice(*spans["needed"][0]["value"])]) == problem.answer
        cue = tok.decode(ids[spans["answer_start"]:spans["answer_token"]]).strip()
        assert cue == f"{THINK_END} So the code for {problem.meta[META]['key']} is {CUE}"
        boundary = find_answer_boundary(tok, len(trace.prompt_ids), trace.generated_ids)
        assert boundary.answer_start == spans["answer_start"]
        notes = sorted(spans["needed"] + spans["decoys"], key=lambda n: n["note"][0])
        starts = [n["note"][0] for n in notes[1:]] + [spans["answer_start"]]
        assert all(start - note["note"][1] >= 64 for note, start in zip(notes, starts))
    (answered,) = answer_traces(smollm2, [problem_trace(load_problems("known_facts", limit=1)[0], tok, "smollm2")])
    assert answered.correct is True and answered.extra[META]["forced"].startswith(answered.gold + "}")


# --- validation.known_answer -----------------------------------------------------------------------------------------
SPANS = FactSpans(needed=[Note((40, 50), (43, 45), (46, 50))], decoys=[Note((100, 110), (103, 105), (106, 110))],
                  reasoning=(0, 150))


def test_window_classes():
    assert window_class(30, 47, SPANS) == "planted"  # reaches the value's first token
    assert window_class(49, 81, SPANS) == "planted"  # starts on its last
    assert window_class(14, 46, SPANS) == "key"  # the name, not the value
    assert window_class(10, 40, SPANS) == "filler"  # ends just before the note
    assert window_class(50, 82, SPANS) == "filler"  # starts just after
    assert window_class(90, 101, SPANS) == "decoy"
    assert window_class(110, 142, SPANS) == "filler"


def _label(trace_id: str, windows: list[tuple[int, int, bool | None]], answer_start: int = 150,
           status: str = "labelled") -> Label:
    return Label(id=trace_id, dataset="known_facts", model="m", status=status, answer_start=answer_start,
                 windows=[{"start": s, "end": e, "flipped": f} for s, e, f in windows])


def test_label_scores_by_hand():
    a = _label("a", [(30, 62, True), (46, 78, True), (14, 46, True), (90, 122, False), (118, 150, True),
                     (0, 32, False)])
    b = _label("b", [(30, 62, False), (94, 126, True), (60, 92, None), (0, 32, False)])
    skipped = _label("c", [], status="skipped")
    scores = label_scores([a, b, skipped], {"a": SPANS, "b": SPANS})
    # planted: a(30,62)+ a(46,78)+ b(30,62)- -> 2 of 3; key: a(14,46)+; decoy: a(90,122)- b(94,126)+;
    # filler: a(118,150)+ a(0,32)- b(0,32)-; b(60,92) excluded; flush: a(118,150)+.
    assert scores.traces == 2 and scores.excluded == 1
    assert scores.windows == {"planted": 3, "key": 1, "decoy_key": 0, "decoy": 2, "filler": 3, "flush": 1}
    assert scores.flipped == {"planted": 2, "key": 1, "decoy_key": 0, "decoy": 1, "filler": 1, "flush": 1}
    assert scores.recall.value == pytest.approx(2 / 3)
    assert scores.recall.interval == wilson_interval(2, 3)
    assert scores.precision.value == pytest.approx(2 / 4)  # the key flip counts neither way
    assert scores.kept("decoy").value == pytest.approx(1 / 2)
    row = scores.to_json()
    assert (row["precision_lo"], row["precision_hi"]) == wilson_interval(2, 4)
    assert row["filler_kept"] == pytest.approx(2 / 3) and row["key_flipped"] == 1
    json.dumps(row)


def test_label_scores_refuses_what_it_cannot_score():
    with pytest.raises(UsageError, match="label 'x' has no known-answer trace"):
        label_scores([_label("x", [(0, 32, True)])], {"a": SPANS})
    with pytest.raises(UsageError, match="no labelled known-answer trace"):
        label_scores([_label("a", [], status="skipped")], {"a": SPANS})
    nothing = label_scores([_label("a", [(0, 32, False)])], {"a": SPANS})
    assert np.isnan(nothing.precision.value) and nothing.precision.interval == (None, None)


def test_fact_spans_reads_a_trace_and_refuses_others():
    problem = load_problems("known_facts@1", limit=1)[0]
    trace = problem_trace(problem, TOKENIZER, "tiny")
    spans = fact_spans(trace)
    assert spans.needed[0].value == tuple(trace.extra[META]["needed"][0]["value"])
    assert len(spans.decoys) == 1
    assert spans.reasoning == (len(trace.prompt_ids), trace.extra[META]["answer_start"])
    trace.extra = {}
    with pytest.raises(UsageError, match="is not a known-answer trace"):
        fact_spans(trace)


def test_trace_auc_by_hand():
    positions = np.arange(6)
    # needed tokens 0, 1 score 3 and 1; decoy tokens 4, 5 score 2 and 1: pairs 3>2, 3>1, 1<2, 1=1 -> 2.5 / 4.
    scores = np.array([3.0, 1.0, 9.0, 9.0, 2.0, 1.0])
    assert trace_auc(positions, scores, np.array([0, 1]), np.array([4, 5])) == pytest.approx(0.625)
    scores[1] = np.nan  # left out: 3 beats both decoys
    assert trace_auc(positions, scores, np.array([0, 1]), np.array([4, 5])) == 1.0
    assert np.isnan(trace_auc(positions, scores, np.array([1]), np.array([4, 5])))


def test_scorer_auc_means_over_traces_with_a_bootstrap():
    # Token positions 40..49 are the needed note, 100..109 the decoy (SPANS); signals on 0..149.
    positions = np.arange(150)
    recency = positions.astype(float)  # needed before the decoy: AUC 0
    flat = np.zeros(150)  # all ties: 0.5
    trace_a = SignalTrace("a", positions, np.column_stack([recency, flat]))
    late = FactSpans(needed=[Note((100, 110), (103, 105), (106, 110))], decoys=[Note((40, 50), (43, 45), (46, 50))],
                     reasoning=(0, 150))
    trace_b = SignalTrace("b", positions, np.column_stack([recency, flat]))
    stray = SignalTrace("z", positions, np.column_stack([recency, flat]))  # no spans: left out
    signals = SignalSet(["recency", "flat"], [trace_a, trace_b, stray])
    recency_auc, flat_auc = scorer_auc(signals, {"a": SPANS, "b": late}, n_boot=200)
    assert (recency_auc.name, recency_auc.auc, recency_auc.traces) == ("recency", 0.5, 2)
    assert recency_auc.per_trace == {"a": 0.0, "b": 1.0}
    assert recency_auc.auc_lo == 0.0 and recency_auc.auc_hi == 1.0  # resampling two traces reaches both ends
    assert (flat_auc.auc, flat_auc.auc_lo, flat_auc.auc_hi) == (0.5, 0.5, 0.5)
    assert scorer_auc(signals, {"a": SPANS}, part="note", n_boot=10)[0].auc == 0.0
    # Against the filler of trace a: 130 positions outside the notes, 40 of them (0..39) before the needed value
    # 46..49 and 90 (50..99, 110..149) after it, so recency wins 40 of 130 pairs for every needed token.
    by_filler = scorer_auc(signals, {"a": SPANS}, against="filler", n_boot=10)
    assert by_filler[0].auc == pytest.approx(40 / 130) and by_filler[1].auc == 0.5
    with pytest.raises(UsageError, match="unknown fact part 'digits'"):
        scorer_auc(signals, {"a": SPANS}, part="digits")
    with pytest.raises(UsageError, match="unknown AUC comparison 'prompt'"):
        scorer_auc(signals, {"a": SPANS}, against="prompt")
    with pytest.raises(UsageError, match="no signal trace has known-answer fact spans"):
        scorer_auc(signals, {"q": SPANS})
