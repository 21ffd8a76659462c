"""Passcode probe: policy parsing, the CLI on tiny models (files, resume, adding a policy, bad input), a SmolLM2 smoke
run in which a recency window must lose the passcode that the dense run retrieves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evictor.policy import policy_names
from core.errors import UsageError
from probes.passcode import main, parse_policies

REPO = Path(__file__).resolve().parents[1]


def test_parse_policies():
    names = policy_names()
    assert parse_policies("random, h2o,random", names) == ["random", "h2o"]
    with pytest.raises(UsageError, match="did you mean 'random'"):
        parse_policies("random,randon", names)
    with pytest.raises(UsageError, match="at least one"):
        parse_policies(" , ", names)


@pytest.fixture(autouse=True)
def _restore_threads():
    """The CLI runs below pass --threads 1 (oversubscribed threads crawl on a shared CPU); restore torch's setting."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _cli(tmp_path, data_dir, *extra):
    return ["--model", "tiny-gemma3", "--n", "2", "--budget", "128", "--buffer", "8", "--lead", "8", "--box", "24",
            "--rounds", "2", "--n-boot", "200", "--threads", "1",
            "--data-file", os.path.join(data_dir, "math500.jsonl"), "--out", str(tmp_path / "run"), *extra]


def test_cli_runs_policies_and_adds_one_on_resume(tmp_path, data_dir, capsys):
    # h2o needs attention: under SDPA the engine recomputes it for a window of recent queries
    assert main(_cli(tmp_path, data_dir, "--policy", "random,h2o")) == 0
    out = tmp_path / "run"
    printed = capsys.readouterr().out
    assert "\nfull " in printed and "\nrandom " in printed and "\nh2o " in printed
    records = [json.loads(line) for line in (out / "instances.jsonl").read_text().splitlines()]
    assert sorted((r["policy"], r["id"]) for r in records) == sorted(
        (p, i) for p in ("full", "random", "h2o") for i in ("i00000", "i00001"))
    assert all(r["fact_rounds"] >= 2 for r in records if r["policy"] != "full")
    # the passcode is far outside the tiny Gemma3's 16-token windows: only the global layer (1 of 4) can hold it
    assert all(r["resident"] <= 0.25 for r in records)
    assert all(r["resident"] == 0.25 for r in records if r["policy"] == "full")
    assert main(_cli(tmp_path, data_dir, "--policy", "random,h2o,recency")) == 0  # same run, one more policy
    records = (out / "instances.jsonl").read_text().splitlines()
    assert len(records) == 8
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["condition"] for r in rows] == ["full", "random", "h2o", "recency"]
    assert main(_cli(tmp_path, data_dir, "--policy", "random", "--rounds", "3")) == 2  # other settings: refused
    assert "different settings" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--policy", "h2o0"], "did you mean 'h2o'"),
    (["--policy", "h2o", "--attention-source", "eager"], "--kernel eager"),
    (["--box", "8"], "--box 8 is too small"),
    (["--level", "1.5"], "--level"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, data_dir, capsys, extra, message):
    assert main(_cli(tmp_path, data_dir, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_cli_exit_code_in_a_real_process(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "probes.passcode", "--policy", "randm", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "unknown policy 'randm'" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_smollm2_smoke_recency_loses_what_dense_retrieves(tmp_path, data_dir):
    argv = ["--policy", "recency", "--n", "2", "--budget", "80", "--buffer", "8", "--lead", "8", "--rounds", "2",
            "--threads", "1", "--n-boot", "200", "--data-file", os.path.join(data_dir, "math500.jsonl"),
            "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    rows = {r["condition"]: r for r in json.loads((tmp_path / "s" / "summary.json").read_text())["rows"]}
    # a recency window drops the oldest trace tokens first: two rounds after the passcode no head holds it
    assert rows["recency"]["held"] == 0.0 and rows["full"]["held"] == 1.0
    assert rows["full"]["retrieval"] == 1.0
    assert rows["recency"]["mean_lp"] < rows["full"]["mean_lp"] - 2.0
