"""The generation CLI (tasks/run.py): outputs, resume without duplicates, bad input -> exit 2 and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tasks.generation
from tasks.generation import GenerationResult
from tasks.run import format_table, main, summarize

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"id", "dataset", "model", "prompt_ids", "generated_ids", "text", "answer", "gold", "correct", "finish_reason",
          "empty_output", "no_answer", "timings"}


@pytest.fixture
def problems_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [{"id": f"q{i}", "question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"} for i in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_run_writes_records_summary_and_config(tiny_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--limit", "3",
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    records = _read(out / "generations.jsonl")
    assert [r["id"] for r in records] == ["q1", "q2", "q3"]
    for r in records:
        assert FIELDS <= set(r)
        assert r["gold"] == str(2 * int(r["id"][1:])) and r["dataset"] == "gsm8k" and r["model"] == tiny_dir
        assert 1 <= len(r["generated_ids"]) <= 4 and r["finish_reason"] in ("eos", "length")
        assert set(r["timings"]) == {"prefill_s", "decode_s", "tokens_per_s"}
        assert r["empty_output"] == (not r["text"].strip())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 3 and summary["accuracy"] == summary["correct"] / 3
    config = json.loads((out / "config.json").read_text())
    assert config["max_new_tokens"] == 4 and config["data_source"] == str(Path(problems_file).resolve())
    assert config["prompt_format"] == "chat_template" and config["loaded_model"]["layers"] == 4
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "q3" in printed


def test_resume_adds_only_missing_problems_and_repairs_a_torn_line(tiny_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--max-new-tokens", "3",
            "--out", str(out), "--quiet"]
    assert main(args + ["--limit", "2"]) == 0
    first = _read(out / "generations.jsonl")
    with open(out / "generations.jsonl", "a") as handle:  # a crash in the middle of writing record 3
        handle.write('{"id": "q3", "dataset": "gs')
    assert main(args) == 0
    records = _read(out / "generations.jsonl")
    assert [r["id"] for r in records] == ["q1", "q2", "q3", "q4"]
    assert records[:2] == first
    assert "resuming: 2 of 4" in capsys.readouterr().out
    assert main(args) == 0  # everything done: nothing appended
    assert len(_read(out / "generations.jsonl")) == 4
    assert json.loads((out / "summary.json").read_text())["problems"] == 4


def test_different_settings_in_the_same_out_dir_are_refused(tiny_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--limit", "1", "--out", str(out)]
    assert main(base + ["--max-new-tokens", "2"]) == 0
    assert main(base + ["--max-new-tokens", "5"]) == 2
    assert "max_new_tokens 2 vs 5" in capsys.readouterr().err


def test_accuracy_summary_and_table_with_a_scripted_model(tiny_dir, problems_file, tmp_path, monkeypatch, capsys):
    """Replace the model's text with known answers to check grading, counts and the printed table end to end."""
    scripted = iter(["so \\boxed{2}", "I think it is 5", "", "#### 8"])  # correct, wrong, empty, correct

    def fake_generate(lm, prompt_ids, max_new_tokens, *, temperature=0.0, seed=0):
        text = next(scripted)
        return GenerationResult([1, 2] if text else [3], text, "eos" if text else "length", 0.01, 0.02)

    monkeypatch.setattr(tasks.generation, "generate", fake_generate)
    out = tmp_path / "run"
    assert main(["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["correct"], summary["accuracy"], summary["no_answer"], summary["empty_output"], summary["truncated"]) == (
        2, 0.5, 1, 1, 1)
    records = _read(out / "generations.jsonl")
    assert [r["answer"] for r in records] == ["2", "5", None, "8"]
    assert [r["correct"] for r in records] == [True, False, False, True]
    printed = capsys.readouterr().out
    assert "accuracy 50.0% (2/4)" in printed
    table = format_table(records).splitlines()
    assert table[0].split()[:4] == ["#", "id", "gold", "answer"] and len(table) == 2 + 4
    assert summarize([])["accuracy"] == 0.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "math5000"], "unknown dataset 'math5000' (did you mean 'math500'?)"),
        (["--dataset", "math500", "--limit", "0"], "--limit: must be a positive integer, got 0"),
        (["--dataset", "math500", "--limit", "-3"], "--limit: must be a positive integer, got -3"),
        (["--dataset", "math500", "--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer"),
        (["--dataset", "math500", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["--dataset", "gsm8k", "--data-file", "/nonexistent/problems.jsonl"], "does not exist"),
        (["--dataset", "math500", "--model", "smolm2-135m"], "did you mean 'smollm2-135m'?"),
        (["--model", "smollm2-135m"], "the following arguments are required: --dataset"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_output(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists()


def test_malformed_data_file_line_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n')
    out = tmp_path / "never"
    assert main(["--dataset", "math500", "--data-file", str(bad), "--out", str(out)]) == 2
    assert "line 2 is not valid JSON" in capsys.readouterr().err
    assert not out.exists()


# In-process runs above cover every case; these check the real entry point (an unknown model is checked there too,
# but needs torch imported first: slow in a subprocess, so it stays in-process).
@pytest.mark.parametrize("argv", [["--dataset", "gsm9k"], ["--dataset", "math500", "--limit", "0"]])
def test_cli_subprocess_exit_code(argv, tmp_path):
    out = tmp_path / "never"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tasks.run", *argv, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_help_explains_every_flag():
    proc = subprocess.run([sys.executable, "-m", "tasks.run", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for flag in ("--model", "--dataset", "--limit", "--max-new-tokens", "--temperature", "--seed", "--data-file",
                 "--out", "--device", "--dtype", "--quiet"):
        assert flag in proc.stdout


@pytest.mark.realmodel
def test_smollm2_demo_run(smollm2, tmp_path, data_dir, monkeypatch, capsys):
    """The README demo, shortened: SmolLM2 on the first MATH-500 problem with a small token budget."""
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)
    out = tmp_path / "demo"
    assert main(["--model", "smollm2-135m", "--dataset", "math500", "--limit", "1", "--max-new-tokens", "12",
                 "--out", str(out)]) == 0
    (record,) = _read(out / "generations.jsonl")
    assert record["id"] == "test/precalculus/807.json" and len(record["generated_ids"]) <= 12
    assert record["prompt_ids"][0] == smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert record["text"].strip()
    assert "accuracy" in capsys.readouterr().out
