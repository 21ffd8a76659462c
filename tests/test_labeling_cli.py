"""`python -m labeling.occlusion` / `labeling.merge` on a tiny model: outputs, resume, shards, bad input."""

from __future__ import annotations

import json

import pytest

from labeling.merge import main as merge_main
from labeling.occlusion import main
from models.tiny import tiny_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def traces(tmp_path_factory, tiny_dir):
    """Three tiny-Llama traces (saved model directory), two marked correct."""
    model_dir = tiny_dir
    tok = tiny_tokenizer()
    prompt = tok.encode("<|bos|><|user|>What is 6*7?<|eos|><|assistant|>")
    rows = []
    for i, correct in enumerate([True, False, True]):
        generated = tok.encode(f"Step {i}: six sevens make forty-two, so we get 42. \\boxed{{42}}<|eos|>",
                               add_special_tokens=False)
        rows.append({"id": f"t{i}", "dataset": "gsm8k", "model": str(model_dir), "prompt_ids": prompt,
                     "generated_ids": generated, "answer": "42", "gold": "42", "correct": correct})
    path = tmp_path_factory.mktemp("run") / "generations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(traces, out, *extra):
    return ["--traces", str(traces), "--out", str(out), "--window", "8", "--stride", "4",
            "--max-answer-tokens", "4", *extra]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_labels_every_selected_trace_and_resumes(tmp_path, traces, capsys):
    out = tmp_path / "labels"
    assert main(_args(traces, out)) == 0
    records = _records(out / "labels.jsonl")
    assert [r["trace_id"] for r in records] == ["t0", "t2"]  # only the correct traces by default
    config = json.loads((out / "config.json").read_text())
    assert config["window"] == 8 and config["replacement"] == "pad" and config["n_traces"] == 2
    for record in records:  # the random tiny model never writes an answer, so its references have none
        assert record["status"] == "skipped" and record["answer_start"] > record["reasoning_start"]
    capsys.readouterr()
    assert main(_args(traces, out)) == 0
    assert "resuming: 2 of 2" in capsys.readouterr().out
    assert len(_records(out / "labels.jsonl")) == 2
    assert main(_args(traces, out, "--stride", "8")) == 2  # a different labelling into the same directory


def test_shards_merge_into_the_unsharded_result(tmp_path, traces):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert main(_args(traces, whole, "--include-incorrect")) == 0
    assert merge_main([str(sharded)]) == 2  # nothing there yet
    assert main(_args(traces, sharded, "--include-incorrect", "--shard", "1/2")) == 0
    assert merge_main([str(sharded)]) == 2 and not (sharded / "labels.jsonl").exists()  # shard 0 missing
    assert main(_args(traces, sharded, "--include-incorrect", "--shard", "0/2")) == 0
    assert merge_main([str(sharded)]) == 0

    def by_id(records):
        return sorted(records, key=lambda r: r["trace_id"])

    assert by_id(_records(sharded / "labels.jsonl")) == by_id(_records(whole / "labels.jsonl"))
    assert len(_records(sharded / "labels.jsonl")) == 3


@pytest.mark.parametrize("extra, message", [
    (["--shard", "2/2"], "0 <= I < N"),
    (["--shard", "one/2"], "I/N"),
    (["--dataset", "math5000"], "math500"),
    (["--window", "400"], "larger than every trace"),
    (["--stride", "9"], "untested"),
    (["--replacement", "blank"], "valid choices"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, traces, capsys, extra, message):
    out = tmp_path / "never"
    assert main(_args(traces, out, *extra)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: the weight-loading progress bar
    assert "error:" in last and message in last
    assert not out.exists()


def test_other_refusals(tmp_path, traces, capsys):
    out = tmp_path / "never"
    assert main(["--dataset", "gsm8k", "--shard", "0/2", "--out", str(out)]) == 2  # shards need stored traces
    assert main(["--out", str(out)]) == 2  # neither --dataset nor --traces
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({**r, "correct": False}) + "\n" for r in _records(traces)))
    assert main(_args(wrong, out)) == 2  # no correct trace, no --include-incorrect
    assert "--include-incorrect" in capsys.readouterr().err
    assert main(_args(tmp_path / "missing.jsonl", out)) == 2
    assert not out.exists()


def test_generation_mode_runs_tasks_run_then_labels(tmp_path, traces, data_dir, monkeypatch):
    """Without --traces: problems are generated with tasks.run into OUT/traces/, then labelled."""
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)
    model_dir = _records(traces)[0]["model"]
    out = tmp_path / "generated"
    assert main(["--dataset", "gsm8k", "--model", model_dir, "--limit", "2", "--max-new-tokens", "80",
                 "--include-incorrect", "--window", "8", "--stride", "4", "--max-answer-tokens", "4",
                 "--out", str(out)]) == 0
    generated = _records(out / "traces" / "generations.jsonl")
    assert [len(r["generated_ids"]) for r in generated] == [80, 80]
    records = _records(out / "labels.jsonl")
    assert [r["trace_id"] for r in records] == [r["id"] for r in generated]
    assert all(r["boundary"] == "tail" and r["answer_start"] == r["n_tokens"] - 64 for r in records)
    assert json.loads((out / "config.json").read_text())["traces"] == "generated"
