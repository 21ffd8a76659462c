"""The generation CLI (tasks/run.py): trace records, resume without duplicates, the library under it, batched
generation reproducing one-at-a-time records, and bad input -> exit 2, one line and nothing written (including --out
and --device problems, a missing vLLM and a second run on one --out)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tasks.generation
from core.rundir import RunDir
from core.schemas import Trace, read_records
from models.loading import load_model
from tasks.datasets import load_problems
from tasks.generation import GenerationResult
from tasks.run import GenerationConfig, Generator, format_table, generate_chunk, generate_traces, main, summarize

REPO = Path(__file__).resolve().parents[1]
FIELDS = set(
    "kind id dataset model prompt_ids generated_ids text answer gold correct finish_reason empty_output no_answer "
    "timings sampling policy engine".split()
)


@pytest.fixture
def problems_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [{"id": f"q{i}", "question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"} for i in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def generate(model, problems_file, out, *extra):
    """`tasks.run` on the gsm8k-style problems file."""
    return main(["--model", model, "--dataset", "gsm8k", "--data-file", problems_file, "--out", str(out), *extra])


def test_run_writes_records_summary_and_config(tiny_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert generate(tiny_dir, problems_file, out, "--limit", "3", "--max-new-tokens", "4") == 0
    records = _read(out / "generations.jsonl")
    assert [r["id"] for r in records] == ["q1", "q2", "q3"]
    for r in records:
        assert FIELDS <= set(r)
        assert r["gold"] == str(2 * int(r["id"][1:])) and r["dataset"] == "gsm8k" and r["model"] == tiny_dir
        assert 1 <= len(r["generated_ids"]) <= 4 and r["finish_reason"] in ("eos", "length")
        assert set(r["timings"]) == {"prefill_s", "decode_s", "tokens_per_s"}
        assert r["empty_output"] == (not r["text"].strip())
        assert r["kind"] == "trace" and r["policy"] == "full" and r["eviction"] is None
        assert r["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": 0}
        assert r["engine"] == {"name": "hf", "version": transformers.__version__, "batch_size": 1}
    assert [t.id for t in read_records(out / "generations.jsonl", Trace)] == ["q1", "q2", "q3"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 3 and summary["accuracy"] == summary["correct"] / 3
    config = json.loads((out / "config.json").read_text())
    assert config["max_new_tokens"] == 4 and config["identity"]["data_source"] == str(Path(problems_file).resolve())
    assert config["identity"]["top_p"] == 1.0 and "limit" not in config["identity"]
    assert config["prompt_format"] == "chat_template" and config["loaded_model"]["layers"] == 4
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "q3" in printed


def test_resume_adds_only_missing_problems_and_repairs_a_torn_line(tiny_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--out", str(out), "--quiet"]
    args += ["--max-new-tokens", "3"]
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
    assert "max_new_tokens 2 (now 5)" in capsys.readouterr().err
    assert main(base + ["--max-new-tokens", "2", "--temperature", "0.6", "--top-p", "0.95"]) == 2
    err = capsys.readouterr().err.strip()
    assert "temperature 0.0 (now 0.6)" in err and "top_p 1.0 (now 0.95)" in err and "\n" not in err
    assert len(_read(out / "generations.jsonl")) == 1


def test_a_second_run_on_the_same_out_exits_2_at_once(tiny_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "run"
    with RunDir(out, {"held": "by another run"}):
        assert generate(tiny_dir, problems_file, out) == 2
        err = capsys.readouterr().err.strip()
        assert "is in use by another run" in err and "\n" not in err
        assert sorted(p.name for p in out.iterdir()) == [".kvscope.lock"]


def test_nucleus_sampling_is_recorded_and_reproduced(tiny_dir, problems_file, tmp_path):
    argv = [
        "--model",
        tiny_dir,
        "--dataset",
        "gsm8k",
        "--data-file",
        problems_file,
        "--limit",
        "2",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.6",
        "--top-p",
        "0.95",
        "--seed",
        "3",
        "--quiet",
    ]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert main(argv + ["--out", str(tmp_path / "b")]) == 0
    a, b = _read(tmp_path / "a" / "generations.jsonl"), _read(tmp_path / "b" / "generations.jsonl")
    assert [r["generated_ids"] for r in a] == [r["generated_ids"] for r in b]
    assert all(r["sampling"] == {"temperature": 0.6, "top_p": 0.95, "seed": 3} for r in a)


def test_library_yields_traces_without_a_cli(tiny_dir, problems_file):
    config = GenerationConfig(
        dataset="gsm8k", model=tiny_dir, data_file=problems_file, limit=2, max_new_tokens=3, device="cpu"
    )
    lm = load_model(tiny_dir, device="cpu")
    traces = list(generate_traces(lm, config.problems(), config))
    assert [t.id for t in traces] == ["q1", "q2"] and all(isinstance(t, Trace) for t in traces)
    assert all(t.policy == "full" and not t.evicted and 1 <= len(t.generated_ids) <= 3 for t in traces)
    # each problem draws from its own seed: generating it alone gives the same trace
    (alone,) = generate_traces(lm, load_problems("gsm8k", data_file=problems_file)[1:2], config)
    assert alone.generated_ids == traces[1].generated_ids


def test_accuracy_summary_and_table_with_a_scripted_model(tiny_dir, problems_file, tmp_path, monkeypatch, capsys):
    """Replace the model's text with known answers to check grading, counts and the printed table end to end."""
    scripted = iter(["so \\boxed{2}", "I think it is 5", "", "#### 8"])  # correct, wrong, empty, correct

    def fake_generate(lm, prompt_ids, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=0, stop_ids=None):
        text = next(scripted)
        return GenerationResult([1, 2] if text else [3], text, "eos" if text else "length", 0.01, 0.02)

    monkeypatch.setattr(tasks.generation, "generate", fake_generate)
    out = tmp_path / "run"
    assert generate(tiny_dir, problems_file, out) == 0
    summary = json.loads((out / "summary.json").read_text())
    counts = ("correct", "accuracy", "no_answer", "empty_output", "truncated")
    assert tuple(summary[key] for key in counts) == (2, 0.5, 1, 1, 1)
    records = _read(out / "generations.jsonl")
    assert [r["answer"] for r in records] == ["2", "5", None, "8"]
    assert [r["correct"] for r in records] == [True, False, False, True]
    printed = capsys.readouterr().out
    assert "accuracy 50.0% (2/4)" in printed
    traces = [Trace.from_json(r) for r in records]
    table = format_table(traces).splitlines()
    assert table[0].split()[:4] == ["#", "id", "gold", "answer"] and len(table) == 2 + 4
    assert summarize(traces)["mean_generated"] == (2 + 2 + 1 + 2) / 4
    assert summarize([])["accuracy"] == 0.0


def test_batched_run_writes_the_records_of_a_one_at_a_time_run(tiny_dir, problems_file, tmp_path):
    """--batch-size 3 over 4 problems: the same tokens, text and grades, in problem order, with the batch size
    recorded; and a batched run resumes a one-at-a-time run (the batch size is not part of the identity)."""
    base = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--max-new-tokens", "8", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    assert main([*base, "--out", str(tmp_path / "three"), "--batch-size", "3"]) == 0
    one, three = _read(tmp_path / "one" / "generations.jsonl"), _read(tmp_path / "three" / "generations.jsonl")
    fields = ("id", "generated_ids", "text", "answer", "correct", "finish_reason")
    assert [[r[f] for f in fields] for r in three] == [[r[f] for f in fields] for r in one]
    assert [r["id"] for r in three] == ["q1", "q2", "q3", "q4"]
    assert {r["engine"]["batch_size"] for r in three} == {3}
    config = json.loads((tmp_path / "three" / "config.json").read_text())
    assert config["batch_size"] == 3 and config["loaded_engine"]["batch_size"] == 3
    assert "engine" not in config["identity"] and "batch_size" not in config["identity"]
    assert main([*base, "--out", str(tmp_path / "mixed"), "--limit", "2"]) == 0
    assert main([*base, "--out", str(tmp_path / "mixed"), "--batch-size", "2"]) == 0
    assert [r["generated_ids"] for r in _read(tmp_path / "mixed" / "generations.jsonl")] == [
        r["generated_ids"] for r in one]


def test_a_chunk_is_the_traces_of_its_problems(tiny_dir, problems_file):
    """The Ray unit of work: a batch of problems decoded together gives their one-at-a-time traces, in order."""
    config = GenerationConfig(dataset="gsm8k", model=tiny_dir, data_file=problems_file, max_new_tokens=5,
                              device="cpu", batch_size=3)
    lm = load_model(tiny_dir, device="cpu")
    chunk = generate_chunk(Generator(lm, config), config.problems())
    alone = list(generate_traces(lm, config.problems(), dataclasses.replace(config, batch_size=1)))
    assert [t.generated_ids for t in chunk] == [t.generated_ids for t in alone] and len(chunk) == 4
    assert [t.extra["engine"]["batch_size"] for t in chunk] == [3] * 4


def test_engine_vllm_without_vllm_exits_2_before_loading_anything(tiny_dir, problems_file, tmp_path, monkeypatch,
                                                                    capsys):
    import tasks.engines

    monkeypatch.setattr(tasks.engines, "VLLM_VENV", tmp_path / "no-venv")
    monkeypatch.delenv("KVSCOPE_VLLM_PYTHON", raising=False)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")

    def no_load(*_, **__):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("models.loading.load_model", no_load)
    monkeypatch.setattr("tasks.datasets.load_problems", no_load)
    out = tmp_path / "never"
    assert generate(tiny_dir, problems_file, out, "--engine", "vllm") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tasks.run: error:") or "error:" in err
    assert "needs vLLM" in err and "KVSCOPE_VLLM=1 bash scripts/setup.sh" in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "math5000"], "unknown dataset 'math5000' (did you mean 'math500'?)"),
        (["--dataset", "math500", "--limit", "0"], "--limit: must be a positive integer, got 0"),
        (["--dataset", "math500", "--limit", "-3"], "--limit: must be a positive integer, got -3"),
        (["--dataset", "math500", "--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer"),
        (["--dataset", "math500", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["--dataset", "math500", "--top-p", "0"], "--top-p: must be in (0, 1], got 0"),
        (["--dataset", "math500", "--top-p", "1.5"], "--top-p: must be in (0, 1], got 1.5"),
        (["--dataset", "math500", "--device", "bogus"], "--device: 'bogus' is not a device; valid choices: cpu"),
        pytest.param(
            ["--dataset", "math500", "--device", "cuda"],
            "--device: 'cuda': CUDA is not available here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),
        ),
        (["--dataset", "gsm8k", "--data-file", "/nonexistent/problems.jsonl"], "does not exist"),
        (["--dataset", "math500", "--model", "smolm2-135m"], "did you mean 'smollm2-135m'?"),
        (["--model", "smollm2-135m"], "the following arguments are required: --dataset"),
        (["--dataset", "math500", "--backend", "spark"], "--backend: invalid choice: 'spark'"),
        (["--dataset", "math500", "--engine", "vlm"], "unknown engine 'vlm' (did you mean 'vllm'?)"),
        (["--dataset", "math500", "--batch-size", "0"], "--batch-size: must be a positive integer, got 0"),
        (["--dataset", "math500", "--workers", "2"], "--workers 2 needs --backend ray"),
        (["--dataset", "math500", "--backend", "ray", "--workers", "0"], "--workers: must be a positive integer"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_output(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists()


def test_out_that_is_a_file_or_cannot_be_created_exits_2(tiny_dir, problems_file, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    assert generate(tiny_dir, problems_file, blocker) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert generate(tiny_dir, problems_file, blocker / "below") == 2
    err = capsys.readouterr().err.strip()
    assert "cannot create it" in err and "\n" not in err
    assert blocker.read_text() == "not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["problems.jsonl", "taken"]


def test_empty_data_file_exits_2(tiny_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "never"
    assert generate(tiny_dir, str(empty), out) == 2
    err = capsys.readouterr().err.strip()
    assert "empty.jsonl" in err and "\n" not in err
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
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.run", *argv, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_help_explains_every_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.run", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    flags = "--model --dataset --limit --max-new-tokens --temperature --top-p --seed --data-file --out --device --dtype"
    flags += " --engine --batch-size"
    backend = "--backend --address --workers --gpus-per-worker --cpus-per-worker"
    for flag in [*flags.split(), *backend.split(), "--quiet"]:
        assert flag in proc.stdout


@pytest.mark.realmodel
def test_smollm2_demo_run(smollm2, tmp_path, data_dir, monkeypatch, capsys):
    """The README demo, shortened: SmolLM2 on the first MATH-500 problem with a small token budget."""
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)
    out = tmp_path / "demo"
    argv = ["--model", "smollm2-135m", "--dataset", "math500", "--limit", "1", "--max-new-tokens", "12"]
    assert main([*argv, "--out", str(out)]) == 0
    (record,) = _read(out / "generations.jsonl")
    assert record["id"] == "test/precalculus/807.json" and len(record["generated_ids"]) <= 12
    assert record["prompt_ids"][0] == smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert record["text"].strip()
    assert "accuracy" in capsys.readouterr().out
