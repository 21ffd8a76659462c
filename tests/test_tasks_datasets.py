"""Benchmark loaders (tasks/datasets.py): data file > $KVSCOPE_DATA_DIR > hub, field mapping, bad input."""

from __future__ import annotations

import json
import os

import pytest

from core.errors import UsageError
from tasks import datasets as tasks_datasets
from tasks.datasets import DATASETS, gsm8k_gold, load_problems, resolve_source
from tasks.problem import Problem


@pytest.fixture
def shared_data(data_dir, monkeypatch):
    if not os.path.isfile(os.path.join(data_dir, "math500.jsonl")):
        pytest.skip(f"benchmark data not found in {data_dir}")
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)
    return data_dir


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_dataset_names():
    assert DATASETS == ("math500", "aime24", "gsm8k", "ruler_niah_single", "ruler_niah_multikey",
                        "ruler_niah_multivalue", "ruler_vt", "ruler_cwe", "known_facts", "known_facts+first",
                        "known_facts+twice", "known_facts+twohop", "known_facts+2k")


@pytest.mark.parametrize("name, count", [("math500", 500), ("aime24", 30), ("gsm8k", 1319)])
def test_full_local_copies(shared_data, name, count):
    problems = load_problems(name)
    assert len(problems) == count
    assert len({p.id for p in problems}) == count
    assert all(isinstance(p, Problem) and p.dataset == name and p.question and p.answer for p in problems)


def test_local_fields_and_limit(shared_data):
    math = load_problems("math500", limit=3)
    assert [p.id for p in math] == ["test/precalculus/807.json", "test/intermediate_algebra/1994.json",
                                    "test/algebra/2584.json"]
    assert math[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math[0].question.startswith("Convert the point $(0,3)$")
    assert math[0].meta["subject"] == "Precalculus" and "solution" in math[0].meta
    aime = load_problems("aime24", limit=2)
    assert [(p.id, p.answer) for p in aime] == [("60", "204"), ("61", "113")]
    gsm = load_problems("gsm8k", limit=2)
    assert [(p.id, p.answer) for p in gsm] == [("gsm8k-0", "18"), ("gsm8k-1", "3")]
    assert gsm[0].meta["solution"].endswith("#### 18")
    assert gsm[0].question.startswith("Janet")
    assert resolve_source("gsm8k") == os.path.join(shared_data, "gsm8k_test.jsonl")


def test_gsm8k_gold():
    assert gsm8k_gold("so 5 + 5 = 10\n#### 1,250") == "1250"
    with pytest.raises(ValueError):
        gsm8k_gold("no marker")


def test_data_file_takes_precedence_and_maps_other_field_names(tmp_path, shared_data):
    path = _write_jsonl(tmp_path / "aime_like.jsonl", [
        {"ID": "2024-I-1", "Problem": "What is 1+1?", "Answer": 2},
        {"ID": "2024-I-2", "Problem": "What is 2+2?", "Answer": 4, "Solution": "add"},
    ])
    problems = load_problems("aime24", data_file=path)
    assert [(p.id, p.question, p.answer) for p in problems] == [("2024-I-1", "What is 1+1?", "2"),
                                                                 ("2024-I-2", "What is 2+2?", "4")]
    assert problems[1].meta["Solution"] == "add" and problems[1].meta["source"] == str(path)
    assert resolve_source("aime24", path) == str(path.resolve())


def test_data_file_without_ids_numbers_records(tmp_path):
    path = _write_jsonl(tmp_path / "g.jsonl", [{"question": "q1", "answer": "x\n#### 7"},
                                               {"question": "q2", "answer": "#### 8"}])
    assert [(p.id, p.answer) for p in load_problems("gsm8k", data_file=path)] == [("gsm8k-0", "7"), ("gsm8k-1", "8")]


def test_bad_inputs(tmp_path, shared_data):
    with pytest.raises(UsageError, match=r"unknown dataset 'math50' \(did you mean 'math500'\?\)"):
        load_problems("math50")
    for limit in (0, -1, True, 2.5):
        with pytest.raises(UsageError, match="limit must be a positive integer"):
            load_problems("math500", limit=limit)
    with pytest.raises(UsageError, match="does not exist"):
        load_problems("math500", data_file=tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", answer: 2}\n')
    with pytest.raises(UsageError, match="line 3 is not valid JSON"):
        load_problems("math500", data_file=bad)
    no_answer = _write_jsonl(tmp_path / "na.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b"}])
    with pytest.raises(UsageError, match="record 2 has no answer field"):
        load_problems("math500", data_file=no_answer)
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "problem": "a", "answer": "1"},
                                                {"id": 1, "problem": "b", "answer": "2"}])
    with pytest.raises(UsageError, match="'1' appears more than once"):
        load_problems("math500", data_file=dup)


def test_a_file_without_problems_is_a_usage_error_naming_it(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UsageError, match=f"^data file '{empty}' holds no problems$"):
        load_problems("gsm8k", data_file=empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(UsageError, match="blank.jsonl' holds no problems"):
        load_problems("ruler_vt", data_file=blank, limit=3)
    (tmp_path / "math500.jsonl").write_text("")
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path))
    with pytest.raises(UsageError, match=f"^{tmp_path / 'math500.jsonl'} holds no problems$"):
        load_problems("math500")


def test_empty_data_file_exits_2_with_one_line_and_no_output(tmp_path, capsys):
    from tasks.run import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "run"
    assert main(["--dataset", "gsm8k", "--data-file", str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"error: data file '{empty}' holds no problems") and "\n" not in err
    assert not out.exists()


def test_hub_is_tried_in_order_when_there_is_no_local_copy(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.delenv("KVSCOPE_DATA_DIR", raising=False)
    calls = []

    def fake_load_dataset(path, config, split):
        calls.append((path, config, split))
        if path == "HuggingFaceH4/aime_2024":
            raise ConnectionError("no route to host")
        return [{"ID": "2024-II-4", "Problem": "p", "Answer": 33}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    problems = load_problems("aime24", limit=1)
    assert calls == [("HuggingFaceH4/aime_2024", None, "train[:1]"), ("Maxwell-Jia/AIME_2024", None, "train[:1]")]
    assert problems == [Problem(id="2024-II-4", question="p", answer="33", dataset="aime24")]
    assert problems[0].meta["source"] == "hub:Maxwell-Jia/AIME_2024"


def test_hub_failure_offline_is_one_clear_usage_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.delenv("KVSCOPE_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def offline(path, config, split):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)\nlong traceback text")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UsageError) as err:
        load_problems("gsm8k")
    message = str(err.value)
    assert "set KVSCOPE_DATA_DIR" in message and "--data-file" in message and "HF_HUB_OFFLINE=1" in message
    assert "openai/gsm8k" in message and "\n" not in message


def test_real_hub_call_offline_fails_cleanly(monkeypatch):
    """No monkeypatched client: the installed `datasets` in offline mode gives a UsageError, not a traceback."""
    datasets = pytest.importorskip("datasets")
    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("datasets was imported without HF_HUB_OFFLINE=1")
    monkeypatch.delenv("KVSCOPE_DATA_DIR", raising=False)
    missing = tasks_datasets.HubSource("kvscope-tests/no-such-dataset", None, "test")
    monkeypatch.setattr(tasks_datasets, "SOURCES", {
        "math500": tasks_datasets.DatasetSpec("math500", "math500.jsonl", (missing,)),
    })
    with pytest.raises(UsageError, match="hub could not be read"):
        load_problems("math500", limit=1)
