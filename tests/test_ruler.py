"""RULER-style tasks (tasks/ruler.py): names, determinism, length in tokens, task structure, exact-match grading."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from core.errors import UsageError
from models.tiny import tiny_tokenizer
from tasks import ruler
from tasks.datasets import DATASETS, load_problems, resolve_source
from tasks.problem import Problem
from tasks.ruler import RulerConfig, answer_items, generate, grade, parse_name
from tasks.ruler_words import ADJECTIVES, NOUNS, VERBS

# Byte-level with no merges: one token per byte, so lengths can be checked with len(text.encode()).
TOKENIZER = tiny_tokenizer()


def byte_tokens(text: str) -> int:
    return len(text.encode())


def problem(task: str, tokens: int = 1024, index: int = 0, seed: int = 0) -> Problem:
    records = generate(RulerConfig(task, tokens, seed), index + 1, TOKENIZER)
    record = records[index]
    return Problem(record["id"], record["question"], record["answer"], f"ruler_{task}@{tokens}",
                   {"ruler": record["ruler"]})


def list_counts(question: str) -> Counter:
    return Counter(re.findall(r"^\d+\. ([a-z]+)$", question, flags=re.MULTILINE))


def test_names_and_lengths():
    assert set(ruler.NAMES) <= set(DATASETS)
    assert parse_name("ruler_niah_single") == RulerConfig("niah_single", 2048)
    assert parse_name("ruler_vt@4k") == RulerConfig("vt", 4096)
    assert parse_name("ruler_cwe@1000").name == "ruler_cwe@1000"
    assert parse_name("gsm8k") is None
    with pytest.raises(UsageError, match=r"unknown dataset 'ruler_niah_singel' \(did you mean 'ruler_niah_single'"):
        parse_name("ruler_niah_singel@4k")
    with pytest.raises(UsageError, match=r"context length '4 k' is not a number of tokens; write e.g\. "
                                         r"ruler_vt@4096 or ruler_vt@4k"):
        parse_name("ruler_vt@4 k")
    with pytest.raises(UsageError, match=">= 256 tokens, got 100"):
        parse_name("ruler_vt@100")
    with pytest.raises(UsageError, match="unknown RULER task 'qa'"):
        RulerConfig("qa")


def test_words_are_distinct_lowercase_letters():
    words = ADJECTIVES + NOUNS + VERBS
    assert len(set(words)) == len(words)
    assert all(re.fullmatch(r"[a-z]+", word) for word in words)


@pytest.mark.parametrize("task", ruler.TASKS)
def test_generation_is_deterministic_and_fits_the_length(task):
    first = generate(RulerConfig(task, 1024), 3, TOKENIZER)
    assert first == generate(RulerConfig(task, 1024), 3, TOKENIZER)
    assert generate(RulerConfig(task, 1024), 2, TOKENIZER) == first[:2]  # problem i does not depend on the count
    assert generate(RulerConfig(task, 1024, seed=1), 1, TOKENIZER)[0]["question"] != first[0]["question"]
    assert len({r["question"] for r in first}) == 3
    for record in first:
        length = byte_tokens(record["question"])
        assert record["ruler"]["tokens"] == length
        # as long as fits: within one filler unit (a sentence, a noise sentence, a list entry) of the target
        assert 1024 - 100 < length <= 1024
        assert record["ruler"]["tokenizer"] == ruler.tokenizer_name(TOKENIZER)
        json.dumps(record)  # records go into JSONL files as they are


def test_niah_single_has_one_number_the_needle():
    p = problem("niah_single")
    info = p.meta["ruler"]
    key, value = info["query"], p.answer
    assert re.findall(r"\d+", p.question) == [value]
    assert f"The special number for {key} is {value}." in p.question
    assert p.question.endswith(f"What is the special number for {key}? Answer with the number only.")
    assert 0 <= info["depths"][0] <= 1


def test_needle_depth_places_the_needle():
    for index in range(6):
        p = problem("niah_single", tokens=2048, index=index)
        depth = p.meta["ruler"]["depths"][0]
        body = p.question.split("\n\n")[1]
        at = body.index("The special number for") / len(body)
        assert at == pytest.approx(depth, abs=0.08)


def test_niah_multikey_asks_for_one_of_four_keys():
    p = problem("niah_multikey")
    info = p.meta["ruler"]
    assert len(set(info["keys"])) == 4 and info["query"] == info["keys"][0]
    numbers = re.findall(r"\d{7}", p.question)
    assert len(set(numbers)) == 4 and p.answer in numbers
    assert f"The special number for {info['query']} is {p.answer}." in p.question


def test_niah_multivalue_asks_for_all_four_values():
    p = problem("niah_multivalue")
    values = p.meta["ruler"]["values"]
    assert len(set(values)) == 4 and p.answer == ", ".join(values)
    for value in values:
        assert f"One of the special numbers for {p.meta['ruler']['query']} is {value}." in p.question


def test_variable_tracking_chain_is_in_order_with_a_distractor_chain():
    p = problem("vt")
    info = p.meta["ruler"]
    chain, other = info["values"], info["distractor_chain"]
    assert len(chain) == 5 and len(other) == 5 and not set(chain) & set(other)
    value = info["query"]
    positions = [p.question.index(f"VAR {chain[0]} = {value}.")]
    positions += [p.question.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
    assert positions == sorted(positions)  # each variable is defined before it is copied
    assert set(info["candidates"]) == set(chain) | set(other)


@pytest.mark.parametrize("tokens", [1024, 4096, 16384])
def test_common_words_are_the_most_frequent(tokens):
    p = problem("cwe", tokens=tokens)
    counts = list_counts(p.question)
    gold = p.meta["ruler"]["values"]
    repeats = p.meta["ruler"]["common_repeats"]
    assert 4 <= repeats <= 30
    if 4 < repeats < 30:  # unclamped: the common words fill about 40% of the list
        assert 0.3 < 10 * repeats / sum(counts.values()) < 0.5
    assert all(counts[word] == repeats for word in gold)
    assert max(count for word, count in counts.items() if word not in gold) <= 3
    assert set(counts) <= set(p.meta["ruler"]["candidates"])


def test_a_context_too_short_for_the_task_text_is_a_usage_error():
    with pytest.raises(UsageError, match=r"'ruler_niah_multivalue@256': 256 tokens cannot hold the task's own text"):
        generate(RulerConfig("niah_multivalue", 256), 1, TOKENIZER)  # four needles and the instructions: ~400 bytes


# --- grading -------------------------------------------------------------------------------------------------------
def test_grade_niah_by_exact_match():
    p = problem("niah_multikey")
    gold = p.answer
    distractor = next(n for n in re.findall(r"\d{7}", p.question) if n != gold)
    assert grade(f"The special number is {gold}.", p) == {
        "answer": gold, "correct": True, "no_answer": False, "extracted_by": "text", "score": 1.0}
    listed = grade(f"It is {gold} or maybe {distractor}.", p)
    assert not listed["correct"] and listed["score"] == 1.0  # a distractor too: not an exact match
    boxed = grade(f"I saw {distractor} and {gold}. So \\boxed{{{gold}}}", p)
    assert boxed["correct"] and boxed["extracted_by"] == "boxed"  # the box is the answer
    assert grade("I do not know.", p) == {"answer": None, "correct": False, "no_answer": True, "extracted_by": None,
                                          "score": 0.0}
    assert not grade(f"{gold}1", p)["correct"]  # an 8-digit number is not the 7-digit value


def test_grade_multivalue_needs_every_value_in_any_order():
    p = problem("niah_multivalue")
    values = p.meta["ruler"]["values"]
    assert grade(", ".join(reversed(values)), p)["correct"]
    partial = grade(", ".join(values[:2]), p)
    assert not partial["correct"] and partial["score"] == 0.5


def test_grade_variable_tracking_and_common_words_against_the_context_vocabulary():
    vt = problem("vt")
    chain = vt.meta["ruler"]["values"]
    assert grade("VAR " + ", VAR ".join(chain) + ". DONE.", vt)["correct"]  # DONE is not a variable of the text
    extra = grade(", ".join(chain + vt.meta["ruler"]["distractor_chain"][:1]), vt)
    assert not extra["correct"] and extra["score"] == 1.0
    cwe = problem("cwe")
    words = cwe.meta["ruler"]["values"]
    assert grade("The ten words are: " + ", ".join(w.upper() for w in words) + ".", cwe)["correct"]
    assert not grade(", ".join(words[:9]), cwe)["correct"]
    assert answer_items("apple Apple pear", "cwe", ["apple"]) == ["apple", "apple"]


# --- as a tasks dataset --------------------------------------------------------------------------------------------
def test_load_problems_generates_ruler_datasets():
    problems = load_problems("ruler_niah_single@512", limit=2, tokenizer=TOKENIZER)
    assert [p.id for p in problems] == ["ruler_niah_single@512-0", "ruler_niah_single@512-1"]
    assert all(p.dataset == "ruler_niah_single@512" for p in problems)
    expected = f"generated:ruler_niah_single@512 seed=0 tokenizer={ruler.tokenizer_name(TOKENIZER)} {ruler.GENERATOR}"
    assert problems[0].meta["source"] == expected
    assert resolve_source("ruler_niah_single@512", tokenizer=TOKENIZER) == expected
    assert resolve_source("ruler_vt") == f"generated:ruler_vt@2048 seed=0 tokenizer=smollm2-135m {ruler.GENERATOR}"
    assert grade(problems[0].answer, problems[0])["correct"]


def test_a_ruler_data_file_round_trips(tmp_path):
    records = generate(RulerConfig("vt", 1024), 2, TOKENIZER)
    path = tmp_path / "vt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    problems = load_problems("ruler_vt@1024", data_file=path)
    assert [p.question for p in problems] == [r["question"] for r in records]
    assert grade(problems[1].answer, problems[1])["correct"]


@pytest.mark.realmodel
def test_smollm2_tokens_measure_the_default_length():
    from models.loading import load_model

    problems = load_problems("ruler_niah_single@1024", limit=1)
    tokenizer = load_model("smollm2-135m", device="cpu").tokenizer
    tokens = len(tokenizer(problems[0].question, add_special_tokens=False)["input_ids"])
    assert tokens == problems[0].meta["ruler"]["tokens"] and 1024 - 30 < tokens <= 1024


@pytest.mark.realmodel
def test_tasks_run_gives_identical_prompts_on_two_runs(tmp_path):
    from tasks.run import main

    prompts = []
    for run in ("a", "b"):
        out = tmp_path / run
        argv = ["--model", "tiny-llama", "--dataset", "ruler_niah_single@512", "--limit", "2",
                "--max-new-tokens", "2", "--device", "cpu", "--quiet", "--out", str(out)]
        assert main(argv) == 0
        records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
        assert [r["id"] for r in records] == ["ruler_niah_single@512-0", "ruler_niah_single@512-1"]
        prompts.append([r["prompt_ids"] for r in records])
    assert prompts[0] == prompts[1]
