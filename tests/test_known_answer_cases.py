"""The known-answer cases beyond "the needed note comes last" (tasks/known_answer.py traits: needed first, stated
twice, two hops, long) and their scoring per copy, per hop and for a decoy's name (validation/known_answer.py):
names, byte-identical old problems, spacing, lengths, and hand-derived scores."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from core.errors import UsageError
from core.schemas import Label
from models.tiny import tiny_tokenizer
from tasks import known_answer
from tasks.datasets import DATASETS, check_dataset, load_problems, resolve_source
from tasks.known_answer import (
    BOXES,
    COPY_GAP_WORDS,
    FILLER,
    KEYS,
    META,
    MIN_GAP_WORDS,
    NAMES,
    TOKENS_PER_WORD,
    KnownFactsConfig,
    answer_traces,
    generate,
    parse_name,
    problem_trace,
)
from validation.known_answer import FactSpans, Note, classify, fact_spans, label_scores, scorer_auc, window_class
from validation.signals import SignalSet, SignalTrace
from validation.stats import wilson_interval

TOKENIZER = tiny_tokenizer()  # one token per byte
CASES = ["known_facts@2+first", "known_facts@2+twice", "known_facts@1+first+twice", "known_facts@1+twohop",
         "known_facts@3+first+twohop", "known_facts@2+twice+twohop"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from models.loading import locate_weights

    return AutoTokenizer.from_pretrained(locate_weights("smollm2-135m")[0])


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


# --- names ---------------------------------------------------------------------------------------------------------
def test_the_name_grammar():
    assert parse_name("known_facts+first") == KnownFactsConfig(1, layout="first")
    assert parse_name("known_facts@3+twohop+first+2k", seed=4) == KnownFactsConfig(3, 4, "first", hops=2, length=2048)
    assert parse_name("known_facts@0+twice+7500") == KnownFactsConfig(0, copies=2, length=7500)
    # traits in any order; the canonical name in one
    assert parse_name("known_facts@2+7500+twohop+twice+first").name == "known_facts@2+first+twice+twohop+7500"
    assert parse_name("known_facts+2k").name == "known_facts@1+2048"
    assert parse_name("known_facts@1").name == "known_facts@1"  # the original task's name is unchanged
    assert parse_name("ruler_vt@4k") is None and parse_name("known_factsy+first") is None
    for name in NAMES:
        check_dataset(name)
        assert name in DATASETS
    assert resolve_source("known_facts+first") == f"generated:known_facts@1+first seed=0 {known_answer.GENERATOR}"


@pytest.mark.parametrize("name, message", [
    ("known_facts+frist", r"unknown trait in dataset 'known_facts\+frist': 'frist' \(did you mean 'first'\?\); "
                          r"valid choices: <tokens>, first, twice, twohop"),
    ("known_facts+first+first", r"dataset 'known_facts\+first\+first' sets its layout twice"),
    ("known_facts+2k+7500", r"sets its length twice"),
    ("known_facts@x+first", r"decoys 'x' is not a number"),
    ("known_facts@9+twohop", r"decoys must be an integer in 0\.\.8, got 9"),
    ("known_facts+100", r"dataset 'known_facts@1\+100': a length of 100 tokens cannot hold its notes and the filler "
                        r"between them; ask for at least \d+ tokens"),
    ("known_facts+", r"unknown trait in dataset 'known_facts\+': ''"),
    ("known_facts@0+twohop", r"dataset 'known_facts@0\+twohop': two hops need a decoy"),
])
def test_bad_names(name, message):
    with pytest.raises(UsageError, match=message):
        check_dataset(name)


def test_bad_configs():
    with pytest.raises(UsageError, match=r"unknown known_facts layout 'middle'"):
        KnownFactsConfig(layout="middle")
    with pytest.raises(UsageError, match=r"copies must be an integer in 1\.\.2, got 3"):
        KnownFactsConfig(copies=3)
    with pytest.raises(UsageError, match=r"hops must be an integer in 1\.\.2, got True"):
        KnownFactsConfig(hops=True)


def test_the_original_problems_are_byte_identical():
    """Hashes of what the generator made before the traits existed (every committed known_facts result was built
    from these): the problems of four decoy counts, and the first traces for a byte tokenizer."""
    assert _hash([generate(KnownFactsConfig(d), 6) for d in (0, 1, 3, 8)]) == \
        "4244bc7ef7fefea6365a2ff355d6028f927b750af7e4d206a35790cdc00c0c55"
    traces = [problem_trace(p, TOKENIZER, "tiny").to_json() for p in load_problems("known_facts@1", limit=6)]
    assert _hash(traces) == "79513e3582454dd789df3fb5e94b6516f1158d3ed6f222c7ef0f509d6c17e00b"
    assert known_answer.GENERATOR == "kvscope-known-facts-1"


def test_the_original_traces_are_byte_identical_for_smollm2(smollm2_tokenizer):
    traces = [problem_trace(p, smollm2_tokenizer, "smollm2-135m").to_json()
              for p in load_problems("known_facts@1", limit=6)]
    assert _hash(traces) == "e7ade22545d2b5de2484afe805a77ca39f3796e466c29974b6d276d680fd9666"


@pytest.mark.parametrize("name", CASES + ["known_facts+first+2k"])
def test_generation_is_deterministic(name):
    config = parse_name(name)
    first = generate(config, 4)
    assert first == generate(config, 4) and generate(config, 2) == first[:2]
    assert generate(parse_name(name, seed=1), 1)[0] != first[0]
    assert len({r[META]["text"] for r in first}) == 4
    json.dumps(first)


# --- where the facts are -------------------------------------------------------------------------------------------
def _notes(info) -> list[dict]:
    return sorted([*info["needed"], *info["decoys"]], key=lambda n: n["note"][0])


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("name", CASES)
def test_every_note_stands_apart_in_filler_that_says_nothing(name):
    for record in generate(parse_name(name), 6):
        info = record[META]
        text, notes = info["text"], _notes(info)
        ends = [n["note"][0] for n in notes[1:]] + [info["cue"]]
        for note, next_start in zip(notes, ends):
            gap = text[note["note"][1]:next_start]
            assert _words(gap) >= MIN_GAP_WORDS and not re.search(r"\d", gap)
            assert not any(word in gap.split() for word in (*KEYS, *BOXES)) and "code" not in gap and "box" not in gap
        lead = text[:notes[0]["note"][0]]
        assert not re.search(r"\d", lead) and not any(word in lead.split() for word in (*KEYS, *BOXES))


@pytest.mark.parametrize("name", CASES)
def test_needed_notes_come_first_or_last(name):
    config = parse_name(name)
    for record in generate(config, 6):
        info = record[META]
        needed = [n["note"][0] for n in info["needed"]]
        decoys = [n["note"][0] for n in info["decoys"]]
        assert len(needed) == config.copies * config.hops and len(decoys) == config.decoys * config.hops
        assert needed == sorted(needed)  # reading order
        if config.layout == "first":
            assert max(needed) < min(decoys)
        else:
            assert min(needed) > max(decoys)
        assert info.get("layout", "last") == config.layout  # written only where it is not the default


@pytest.mark.parametrize("name", ["known_facts@2+twice", "known_facts@1+first+twice", "known_facts@2+twice+twohop"])
def test_the_copies_say_the_same_at_least_three_windows_apart(name):
    config = parse_name(name)
    for record in generate(config, 6):
        info = record[META]
        text = info["text"]
        assert info["copies"] == 2
        for hop in range(1, config.hops + 1):
            first, second = [n for n in info["needed"] if n.get("hop", 1) == hop]
            assert (first["copy"], second["copy"]) == (1, 2)
            assert text[slice(*first["note"])] == text[slice(*second["note"])]
            assert _words(text[first["value"][1]:second["value"][0]]) >= COPY_GAP_WORDS
        if config.hops == 1:
            answer = record["answer"]
            assert [m.start() for m in re.finditer(answer, text)] == \
                [info["needed"][0]["value"][0], info["needed"][1]["value"][0], info["answer_char"]]


@pytest.mark.parametrize("decoys", [1, 2, 3, 8])
def test_two_hops_need_both_notes_and_give_no_shortcut(decoys):
    config = KnownFactsConfig(decoys, hops=2, layout="first")
    for record in generate(config, 6):
        info, answer = record[META], record["answer"]
        text, name = info["text"], info["key"]
        assert not re.search(r"\d", record["question"]) and name in record["question"]
        assert not any(box in record["question"].split() for box in BOXES)
        link, box = info["needed"]
        assert (link["hop"], box["hop"]) == (1, 2)
        colour = text[slice(*link["value"])]
        assert text[slice(*link["note"])] == f"{name}'s code is in the {colour} box."
        assert text[slice(*link["key"])] == name
        assert text[slice(*box["note"])] == f"The {colour} box holds {answer}."
        assert text[slice(*box["key"])] == colour and text[slice(*box["value"])] == answer
        # no single note has both the name and the code: the name only in the link, the code only in the box note
        reasoning = text[:info["cue"]]
        assert [m.start() for m in re.finditer(answer, reasoning)] == [box["value"][0]]
        assert [m.start() for m in re.finditer(rf"\b{name}\b", reasoning)] == [link["key"][0]]
        hop1 = [n for n in info["decoys"] if n["hop"] == 1]
        hop2 = [n for n in info["decoys"] if n["hop"] == 2]
        assert len(hop1) == len(hop2) == decoys
        owners = [text[slice(*n["key"])] for n in hop1]
        owned = [text[slice(*n["value"])] for n in hop1]
        held = [text[slice(*n["key"])] for n in hop2]
        assert name not in owners and colour not in owned + held
        assert len({*owned, colour}) == decoys + 1 and len(set(held)) == decoys
        # with the asked person's box occluded, at least two boxes hold a code that no note assigns
        assert len({colour, *held} - set(owned)) >= 2
        # from two decoys on, a decoy chain is as complete as the needed one
        assert (len(set(held) & set(owned)) >= 1) is (decoys >= 2)
        codes = [text[slice(*n["value"])] for n in hop2]
        assert len({c[0] for c in [answer, *codes]}) == decoys + 1


def test_the_filler_says_nothing_a_note_says():
    for sentence in FILLER:
        words = re.findall(r"\w+", sentence)
        assert not re.search(r"\d", sentence) and "code" not in words and "box" not in words
        assert not set(words) & {*KEYS, *BOXES}


def test_min_length_bounds_every_unlengthened_problem():
    for name in CASES + ["known_facts@8+twice+twohop"]:
        config = parse_name(name)
        for record in generate(config, 12):
            assert _words(record[META]["text"]) * TOKENS_PER_WORD <= config.min_length


# --- tokens --------------------------------------------------------------------------------------------------------
def _window_notes(trace) -> list[int]:
    """For every 32-token window at stride 16 over the reasoning span: how many notes it touches."""
    spans = trace.extra[META]
    notes = [n["note"] for n in spans["needed"] + spans["decoys"]]
    start, end = len(trace.prompt_ids), spans["answer_start"]
    return [sum(s < a + 32 and e > a for s, e in notes) for a in range(start, end - 31, 16)]


@pytest.mark.parametrize("name", CASES)
def test_smollm2_windows_touch_one_note_and_copies_lie_three_windows_apart(name, smollm2_tokenizer):
    for problem in load_problems(name, limit=4):
        trace = problem_trace(problem, smollm2_tokenizer, "smollm2-135m")
        assert max(_window_notes(trace)) == 1
        spans = trace.extra[META]
        for note in spans["needed"]:
            assert {k for k in note if k not in ("note", "key", "value")} <= {"hop", "copy"}
        copies = {}
        for note in spans["needed"]:
            copies.setdefault(note.get("hop", 1), []).append(note["value"])
        for values in copies.values():
            if len(values) == 2:
                assert values[1][0] - values[0][1] >= 96
        answer = spans["needed"][-1]["value"]
        assert smollm2_tokenizer.decode(trace.token_ids[slice(*answer)]) == problem.answer


@pytest.mark.parametrize("name, target", [("known_facts+first+2k", 2048), ("known_facts@2+first+twohop+7500", 7500),
                                          ("known_facts@1+twice+7500", 7500)])
def test_long_traces_have_about_their_length_and_fit_smollm2(name, target, smollm2_tokenizer):
    depths = []
    for problem in load_problems(name, limit=6):
        trace = problem_trace(problem, smollm2_tokenizer, "smollm2-135m")
        assert 0.97 * target <= len(trace.generated_ids) <= 1.03 * target
        assert trace.extra[META]["answer_token"] + 8 <= 8192  # prompt, trace and a forced answer of 8 tokens
        assert max(_window_notes(trace)) == 1
        depths.append(problem.meta[META]["depth"])
    assert max(depths) - min(depths) > 0.1  # the added filler moves the needed notes around


def test_answer_traces_refuses_a_trace_past_the_context(tiny_llama):
    long = problem_trace(load_problems("known_facts+first+2k", limit=1)[0], TOKENIZER, "tiny")  # ~10k bytes
    short = problem_trace(load_problems("known_facts", limit=1)[0], TOKENIZER, "tiny")
    with pytest.raises(UsageError, match=r"trace 'known_facts@1\+first\+2048-0' with its prompt and a forced answer "
                                         r"of 8 tokens exceeds tiny-llama's context of 4096 tokens"):
        answer_traces(tiny_llama, [short, long])


# --- validation: window classes, per copy, per hop -----------------------------------------------------------------
# Twice, needed first: copy 1 at 40..50, copy 2 at 200..210, then a decoy at 300..310; reasoning 0..400.
TWICE = FactSpans(needed=[Note((40, 50), (43, 45), (46, 50), copy=1), Note((200, 210), (203, 205), (206, 210), copy=2)],
                  decoys=[Note((300, 310), (303, 305), (306, 310))], reasoning=(0, 400))
# Two hops, needed first: link 40..52 (value 48), box 120..128 (value 124..128); decoys of hop 1 at 200, hop 2 at 260.
HOPS = FactSpans(needed=[Note((40, 52), (40, 42), (48, 49), hop=1), Note((120, 128), (121, 122), (124, 128), hop=2)],
                 decoys=[Note((200, 212), (200, 202), (208, 209), hop=1),
                         Note((260, 268), (261, 262), (264, 268), hop=2)], reasoning=(0, 320))


def test_a_decoys_name_after_the_needed_note_is_a_class_of_its_own():
    assert window_class(272, 304, TWICE) == "decoy_key"  # reaches the name (303..305), not the value
    assert window_class(280, 306, TWICE) == "decoy_key"  # ends just before the value
    assert window_class(290, 322, TWICE) == "decoy"  # the name and the value: nothing left to confuse
    assert window_class(306, 338, TWICE) == "decoy"  # the value only
    assert window_class(270, 302, TWICE) == "decoy"  # "The code for" only
    assert window_class(180, 201, HOPS) == "decoy_key" and window_class(230, 262, HOPS) == "decoy_key"
    # a decoy before every needed note: its name is an ordinary decoy window
    last = FactSpans(needed=[Note((300, 310), (303, 305), (306, 310))], decoys=[Note((40, 50), (43, 45), (46, 50))],
                     reasoning=(0, 400))
    assert window_class(12, 44, last) == "decoy"
    # a decoy of the other hop does not count: only a needed note of its own hop comes first
    other = FactSpans(needed=[Note((40, 52), (40, 42), (48, 49), hop=1),
                              Note((300, 308), (301, 302), (304, 308), hop=2)],
                      decoys=[Note((200, 208), (201, 202), (204, 208), hop=2)], reasoning=(0, 400))
    assert window_class(170, 202, other) == "decoy"
    assert classify(30, 62, TWICE) == ("planted", TWICE.needed[0])
    assert classify(190, 222, TWICE) == ("planted", TWICE.needed[1])
    assert classify(0, 32, TWICE) == ("filler", None)


def _label(trace_id: str, windows, answer_start: int = 400) -> Label:
    return Label(id=trace_id, dataset="known_facts", model="m", status="labelled", answer_start=answer_start,
                 windows=[{"start": s, "end": e, "flipped": f} for s, e, f in windows])


def test_label_scores_per_copy_and_both_copies_found():
    a = _label("a", [(30, 62, False), (190, 222, True), (200, 232, True), (272, 304, True), (0, 32, False),
                     (290, 322, False)])
    b = _label("b", [(30, 62, True), (190, 222, True), (100, 132, None)])
    c = _label("c", [(30, 62, True), (100, 132, False)])  # copy 2 untested: not in found_all's count
    scores = label_scores([a, b, c], {"a": TWICE, "b": TWICE, "c": TWICE})
    # planted: copy 1 a- b+ c+; copy 2 a+ a+ b+; decoy_key a+; decoy a-; filler a- c-; excluded b(100,132)
    assert scores.windows == {"planted": 6, "key": 0, "decoy_key": 1, "decoy": 1, "filler": 2, "flush": 0}
    assert scores.flipped == {"planted": 5, "key": 0, "decoy_key": 1, "decoy": 0, "filler": 0, "flush": 0}
    assert scores.excluded == 1
    assert (scores.flip_rate("planted", copy=1).k, scores.flip_rate("planted", copy=1).n) == (2, 3)
    assert (scores.flip_rate("planted", copy=2).k, scores.flip_rate("planted", copy=2).n) == (3, 3)
    assert scores.precision.value == 1.0  # the decoy's name flipped, yet counts neither way
    assert scores.found_all == (1, 2)  # b found both copies, a only copy 2; c never tested copy 2
    row = scores.to_json()
    assert (row["copy1_windows"], row["copy1_flipped"], row["copy2_windows"], row["copy2_flipped"]) == (3, 2, 3, 3)
    assert row["copy1_recall"] == pytest.approx(2 / 3)
    assert (row["copy1_recall_lo"], row["copy1_recall_hi"]) == wilson_interval(2, 3)
    assert (row["found_all"], row["found_all_traces"]) == (0.5, 2)
    assert (row["found_all_lo"], row["found_all_hi"]) == wilson_interval(1, 2)
    assert row["hop1_windows"] == 6 and row["hop2_windows"] == 0 and np.isnan(row["hop2_recall"])
    assert row["decoy_key_flipped"] == 1
    json.dumps(row)


def test_label_scores_per_hop():
    a = _label("a", [(20, 52, True), (100, 132, False), (116, 148, True), (180, 201, False), (190, 222, True),
                     (240, 272, False)], answer_start=320)
    scores = label_scores([a], {"a": HOPS})
    # hop 1 planted (20,52)+; hop 2 planted (100,132)- (116,148)+; decoy_key (180,201)-; decoy hop 1 (190,222)+;
    # decoy hop 2 (240,272)-
    assert scores.flip_rate("planted", hop=1).value == 1.0 and scores.flip_rate("planted", hop=2).value == 0.5
    row = scores.to_json()
    assert (row["hop2_windows"], row["hop2_flipped"], row["decoy_hop1_flipped"], row["decoy_hop2_windows"]) == \
        (2, 1, 1, 1)
    assert scores.precision.value == pytest.approx(2 / 3) and scores.windows["decoy_key"] == 1
    assert scores.found_all == (1, 1)


def test_old_rows_keep_their_values():
    """A one-hop, one-copy trace scores as before the per-note columns: the old columns' values are unchanged."""
    spans = FactSpans(needed=[Note((40, 50), (43, 45), (46, 50))], decoys=[Note((100, 110), (103, 105), (106, 110))],
                      reasoning=(0, 150))
    row = label_scores([_label("a", [(30, 62, True), (94, 126, False), (118, 150, True)], 150)], {"a": spans}).to_json()
    assert (row["recall"], row["precision"], row["planted_windows"], row["decoy_windows"]) == (1.0, 0.5, 1, 1)
    assert (row["hop1_recall"], row["copy1_recall"], row["found_all"]) == (1.0, 1.0, 1.0)


def test_fact_spans_reads_hops_and_copies():
    problem = load_problems("known_facts@1+twice+twohop", limit=1)[0]
    spans = fact_spans(problem_trace(problem, TOKENIZER, "tiny"))
    assert [(n.hop, n.copy) for n in spans.needed] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert sorted(n.hop for n in spans.decoys) == [1, 2] and all(n.copy == 1 for n in spans.decoys)
    old = fact_spans(problem_trace(load_problems("known_facts@1", limit=1)[0], TOKENIZER, "tiny"))
    assert [(n.hop, n.copy) for n in old.needed + old.decoys] == [(1, 1), (1, 1)]


def test_scorer_auc_per_hop():
    positions = np.arange(320)
    recency = positions.astype(float)
    box_value = np.where((positions >= 124) & (positions < 128), 1.0, 0.0)
    signals = SignalSet(["recency", "box"], [SignalTrace("a", positions, np.column_stack([recency, box_value]))])
    overall, box = scorer_auc(signals, {"a": HOPS}, n_boot=10)
    assert overall.auc == 0.0  # every needed value precedes every decoy value
    # needed values 48, 124..127 (scores 0, 1, 1, 1, 1) against decoy values 208, 264..267 (all 0): 22.5 of 25 pairs
    assert box.auc == pytest.approx(22.5 / 25)
    assert scorer_auc(signals, {"a": HOPS}, hop=2, n_boot=10)[1].auc == 1.0
    assert scorer_auc(signals, {"a": HOPS}, hop=1, n_boot=10)[1].auc == 0.5
    with pytest.raises(UsageError, match=r"hop must be in 1\.\.2, got 3"):
        scorer_auc(signals, {"a": HOPS}, hop=3)
