"""Passcode probe: policy parsing, the CLI on tiny models (files, resume, adding a policy, bad input), the library
entry point, a SmolLM2 smoke run in which a recency window must lose the passcode that the dense run retrieves. The
output-directory contract both probe CLIs share is tested in test_planted_fact.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import UsageError
from core.schemas import ProbeRow, as_json
from evictor.policies import policy_names
from probes.passcode import PasscodeConfig, main, parse_condition, parse_policies, run_passcode

REPO = Path(__file__).resolve().parents[1]


def test_parse_policies():
    names = policy_names()
    assert parse_policies("random, h2o", names) == ["random", "h2o"]
    with pytest.raises(UsageError, match="random twice"):  # a policy named twice would be run twice
        parse_policies("random, h2o,random", names)
    with pytest.raises(UsageError, match="did you mean 'random'"):
        parse_policies("random,randon", names)
    with pytest.raises(UsageError, match="at least one"):
        parse_policies(" , ", names)


def test_a_condition_gives_its_policy_parameters():
    names = policy_names()
    assert parse_condition("r_kv:lam=0.5:pooling=avg") == ("r_kv", {"lam": 0.5, "pooling": "avg"})
    assert parse_condition("h2o") == ("h2o", {})
    # the same policy at two settings is two conditions, each named by its entry
    assert parse_policies("r_kv,r_kv:lam=0.5", names) == ["r_kv", "r_kv:lam=0.5"]
    with pytest.raises(UsageError, match="key=value"):
        parse_policies("r_kv:lam", names)
    with pytest.raises(UsageError, match="lam must be in"):
        parse_policies("r_kv:lam=2", names)
    with pytest.raises(UsageError, match="unexpected keyword"):
        parse_policies("r_kv:alpha=1", names)


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
    rows = [ProbeRow.from_json(r) for r in json.loads((out / "summary.json").read_text())["rows"]]
    assert [r.condition for r in rows] == ["full", "random", "h2o", "recency"]
    assert all(r.probe == "passcode" and r.id == r.condition and r.n == 2 and r.R is None for r in rows)
    assert [r.extra["protection"] for r in rows] == ["-", "prompt", "sinks", "prompt"]
    assert all(r.retrieval_lo <= r.retrieval <= r.retrieval_hi for r in rows)
    assert main(_cli(tmp_path, data_dir, "--policy", "random", "--rounds", "3")) == 2  # other settings: refused
    assert "rounds 2 (now 3)" in capsys.readouterr().err


def test_library_returns_probe_rows(tmp_path, data_dir):
    config = PasscodeConfig(model="tiny-llama", policies=("recency",), n=2, budget=128,
                            protocol_settings={"buffer": 8}, lead=8, box=24,
                            rounds=2, n_boot=100, data_file=os.path.join(data_dir, "math500.jsonl"))
    result = run_passcode(config, tmp_path / "lib", progress=False)
    assert [r.condition for r in result.rows] == ["full", "recency"] and result.rows[0].held == 1.0
    assert json.loads((tmp_path / "lib" / "summary.json").read_text())["rows"] == as_json(result.rows)
    with pytest.raises(UsageError, match="did you mean 'recency'"):
        run_passcode(PasscodeConfig(policies=("recenc",)), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("extra, message", [
    (["--policy", "h2o0"], "did you mean 'h2o'"),
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


def test_protocol_preset_is_recorded_with_the_peak_cache_and_sampling_is_refused(tmp_path, data_dir, capsys):
    """--protocol epikv: a step trigger, no buffer, K counting only scored tokens, a recency window min(128, K/4) =
    32 at K = 128; the rows state the resolved protocol (explicit flags marked) and the peak cache slots per head."""
    argv = _cli(tmp_path, data_dir, "--model", "tiny-llama", "--policy", "recency", "--protocol", "epikv", "--protect",
                "sinks")
    del argv[argv.index("--buffer"):argv.index("--buffer") + 2]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = {r["condition"]: r for r in summary["rows"]}
    protocol = rows["recency"]["protocol"]
    assert (protocol["protocol"], protocol["trigger"], protocol["buffer"], protocol["budget_scope"]) == (
        "epikv", "step", 0, "trace")
    assert (protocol["recency"], protocol["recency_share"], protocol["explicit"]) == (128, 0.25, ["protect"])
    assert "temperature" not in protocol and summary["protocol"] == protocol and rows["full"]["protocol"] is None
    # K_eff = 128 scored + 4 sinks + a window of 32; the step trigger evicts as soon as one more token arrives
    assert rows["recency"]["peak_slots"] == 128 + 4 + 32 + 1
    assert rows["full"]["peak_slots"] == summary["layout"]["end"] - 1  # dense: the whole context but the last digit
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["identity"]["protocol"] == protocol
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "other"), "--temperature", "0.6"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--temperature: the probes teacher-force every token" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "other").exists()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance with two CPUs for the module (as in tests/test_backend.py)."""
    ray = pytest.importorskip("ray", reason="the Ray backend needs pip install 'kvscope[ray]'")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


def test_two_ray_workers_write_the_serial_records_and_rows(local_ray, tmp_path, data_dir):
    argv = _cli(tmp_path, data_dir, "--model", "tiny-llama", "--policy", "random,recency", "--n", "4",
                "--batch-size", "2")
    assert main([*argv, "--out", str(tmp_path / "serial")]) == 0
    assert main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    records = {name: (tmp_path / name / "instances.jsonl").read_text().splitlines() for name in ("serial", "ray")}
    assert len(records["ray"]) == 12 and records["ray"] == records["serial"]  # 3 runs x 4 instances, same order
    rows = {name: json.loads((tmp_path / name / "summary.json").read_text())["rows"] for name in ("serial", "ray")}
    assert rows["ray"] == rows["serial"]
    assert json.loads((tmp_path / "ray" / "config.json").read_text())["backend"]["workers"] == 2


def test_the_planted_fact_probe_on_two_ray_workers_writes_the_serial_records(local_ray, tmp_path, data_dir):
    from probes.planted_fact import main as planted_main

    argv = ["--model", "tiny-llama", "--heads", "0;all", "--n", "2", "--batch-size", "1", "--budget", "128",
            "--buffer", "8", "--lead", "8", "--distance", "2", "--n-boot", "200", "--threads", "1",
            "--data-file", os.path.join(data_dir, "math500.jsonl")]
    assert planted_main([*argv, "--out", str(tmp_path / "serial")]) == 0
    assert planted_main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    for name in ("instances.jsonl", "summary.csv"):
        assert (tmp_path / "ray" / name).read_text() == (tmp_path / "serial" / name).read_text()
