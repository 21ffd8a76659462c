"""`python -m evictor.run` end to end on a saved tiny model and a three-problem data file: records, summaries,
sweeps, keep-logs, resuming, fractional budgets, policy-config files, and bad input (exit 2, nothing written)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from evictor.instrument import kept_positions
from evictor.run import main

TASKS_RUN_FIELDS = {"id", "dataset", "model", "prompt_ids", "generated_ids", "text", "answer", "gold", "correct",
                    "finish_reason", "empty_output", "no_answer", "timings"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    rows = [{"id": f"p{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(tiny_dir, data_file, out, *extra):
    argv = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", data_file, "--max-new-tokens", "12",
            "--buffer", "4", "--block", "32", "--out", str(out), "--quiet", *extra]
    return main(argv)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_single_cell_records_summary_keep_logs_and_resume(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ("--policy", "random", "--budget", "48", "--protect", "sinks", "--keep-log", "--batch-size", "2")
    assert run(tiny_dir, data_file, out, *args) == 0
    records = lines(out / "generations.jsonl")
    assert [r["id"] for r in records] == ["p1", "p2", "p3"]
    for record in records:
        assert TASKS_RUN_FIELDS <= set(record)
        assert 1 <= len(record["generated_ids"]) <= 12
        assert record["budget_tokens"] == 48 and record["protocol"]["protection"] == "sinks"
        assert record["eviction"]["rounds"] > 0 and record["eviction"]["peak_slots"] <= 48 + 4 + 32
        assert record["eviction"]["attention_requests"] == 0
        blocks = math.ceil(len(record["prompt_ids"]) / 32)
        assert len(record["cache_sizes"]) == blocks + len(record["generated_ids"]) - 1  # one entry per forward
        log = dict(np.load(out / record["keep_log"]))
        assert str(log["problem_id"]) == record["id"]
        last = len(log["round_step"]) - 1
        kept = kept_positions(log, last, 0, 0)
        assert len(kept) == 48 + 4 and set(range(4)) <= set(kept.tolist())  # K + r, sinks kept
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert len(rows) == 1 and rows[0]["cell"] == "random-K48" and rows[0]["problems"] == "3"
    assert json.loads((out / "summary.json").read_text())[0]["problems"] == 3
    assert "random-K48" in capsys.readouterr().out

    # a torn last line (crash mid-write) is repaired and only the missing problem is rerun
    text = (out / "generations.jsonl").read_text().splitlines(keepends=True)
    (out / "generations.jsonl").write_text("".join(text[:2]) + text[2][:40])
    assert run(tiny_dir, data_file, out, *args) == 0
    again = lines(out / "generations.jsonl")
    assert [r["id"] for r in again] == ["p1", "p2", "p3"]
    assert again[0] == records[0]

    # a different budget in the same directory is refused, not mixed in
    assert run(tiny_dir, data_file, out, "--policy", "random", "--budget", "40", "--protect", "sinks") == 2
    assert "different" in capsys.readouterr().err


def test_sweep_policies_by_budgets_into_one_table(tiny_dir, data_file, tmp_path):
    out = tmp_path / "sweep"
    assert run(tiny_dir, data_file, out, "--policy", "full,recency,keynorm", "--budget", "40,48",
               "--protect", "sinks", "--limit", "2") == 0
    cells = [row["cell"] for row in csv.DictReader((out / "summary.csv").open())]
    assert cells == ["full", "recency-K40", "recency-K48", "keynorm-K40", "keynorm-K48"]
    for cell in cells:
        assert len(lines(out / cell / "generations.jsonl")) == 2
    full = lines(out / "full" / "generations.jsonl")
    assert all(r["eviction"]["rounds"] == 0 and r["budget_tokens"] is None for r in full)


def test_fractional_budget_from_a_dense_reference_and_policy_config(tiny_dir, data_file, tmp_path):
    dense = tmp_path / "dense"
    assert run(tiny_dir, data_file, dense, "--policy", "full") == 0
    config = tmp_path / "rkv.json"
    config.write_text(json.dumps({"policy": "r_kv", "params": {"lam": 0.5}}))
    out = tmp_path / "frac"
    assert run(tiny_dir, data_file, out, "--policy-config", str(config), "--budget", "0.5", "--reference", str(dense),
               "--protect", "sinks", "--on-long-prompt", "sinks") == 0
    references = {r["id"]: len(r["generated_ids"]) for r in lines(dense / "generations.jsonl")}
    for record in lines(out / "generations.jsonl"):
        assert record["budget"] == 0.5
        assert record["budget_tokens"] == math.ceil(0.5 * references[record["id"]])
        assert record["policy_config"]["lam"] == 0.5
        assert record["eviction"]["attention_source"] == "window" and record["eviction"]["attention_requests"] > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--policy", "randon"), "did you mean 'random'"),
        (("--policy", "random", "--budget", "0"), "--budget '0'"),
        (("--policy", "random", "--budget", "-3"), "--budget '-3'"),
        (("--policy", "random", "--budget", "2.5"), "--budget '2.5'"),
        (("--policy", "random", "--block", "0"), "--block"),
        (("--policy", "random", "--buffer", "-1"), "--buffer"),
        (("--policy", "random", "--budget", "16"), "exceed the budget 16"),
        (("--policy", "snapkv", "--attention-source", "eager"), "eager kernel"),
        (("--policy", "random", "--trigger", "interval", "--buffer", "0"), "buffer >= 1"),
        (("--policy-config", "/nonexistent.json"), "does not exist"),
        (("--policy", "random", "--kernel", "flash_attention_2"), "flash_attention_2"),
        (("--policy", "random", "--budget", "0.5", "--reference", "/nonexistent"), "no generations.jsonl"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tiny_dir, data_file, tmp_path, capsys, extra, message):
    out = tmp_path / "never"
    assert run(tiny_dir, data_file, out, *extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # not load progress bars
    assert len(errors) == 1 and message in errors[0]
    assert not out.exists()


def test_bad_policy_config_params_exit_2(tiny_dir, data_file, tmp_path, capsys):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"policy": "r_kv", "params": {"lam": 3.0}}))
    out = tmp_path / "never"
    assert run(tiny_dir, data_file, out, "--policy-config", str(config)) == 2
    assert "lam" in capsys.readouterr().err and not out.exists()
