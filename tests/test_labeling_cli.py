"""`python -m labeling.occlusion` / `labeling.merge` on a tiny model: outputs, resume, shards, refusals, bad input,
and the Ray backend (two CPU workers): the same records as a serial run, and none lost or doubled when a worker dies.

A random-init model never states an answer, so most tests extract a toy answer (the first characters of the
regenerated text) to get real labels; `nothing_labelled` keeps the real extraction.
"""

from __future__ import annotations

import functools
import json
import re
import sys

import pytest
from conftest import tiny_traces  # tests/ is on sys.path under pytest
from test_backend import _die_once

import labeling.job
from core.rundir import RunDir
from labeling.merge import main as merge_main
from labeling.occlusion import main
from models.tiny import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def traces(tmp_path_factory, tiny_dir):
    """Three tiny-Llama traces (saved model directory), two marked correct."""
    rows = tiny_traces(str(tiny_dir))
    path = tmp_path_factory.mktemp("run") / "generations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _toy_answer(text: str, dataset: str | None = None) -> str:
    """The first two characters of a regeneration ("-" when it is only special tokens): every reference has one and
    windows can flip."""
    return text[:2] or "-"


def _same(a: str, b: str, **kw) -> bool:
    return a == b


def _use_toy_answers() -> None:
    """The toy answers in a Ray worker process (its set-up hook)."""
    import tasks.grading

    tasks.grading.extract_answer, tasks.grading.is_equivalent = _toy_answer, _same


@pytest.fixture
def toy_answers(monkeypatch):
    import tasks.grading

    monkeypatch.setattr(tasks.grading, "extract_answer", _toy_answer)
    monkeypatch.setattr(tasks.grading, "is_equivalent", _same)


def _args(traces, out, *extra):
    """Free regeneration (a random model never closes a forced box), so the toy answers can flip."""
    return ["--traces", str(traces), "--out", str(out), "--window", "8", "--stride", "4",
            "--max-answer-tokens", "4", "--no-force-answer", *extra]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""  # earlier lines: the weight-loading progress bar


def test_labels_every_selected_trace_and_resumes(tmp_path, traces, capsys, toy_answers):
    out = tmp_path / "labels"
    assert main(_args(traces, out)) == 0
    records = _records(out / "labels.jsonl")
    assert [r["id"] for r in records] == ["t0", "t2"]  # only the correct traces by default
    assert all("trace_id" not in r and r["kind"] == "label" for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["window"] == 8 and config["identity"]["replacement"] == "auto"
    assert config["n_traces"] == 2 and config["trace_ids"] == ["t0", "t2"]
    tok = tiny_tokenizer()  # its pad <|pad|> is a dedicated filler: auto keeps it
    used = {"spec": "auto", "chosen": "pad", "token_id": tok.pad_token_id, "text": "<|pad|>"}
    assert config["replacement"] == used
    for record in records:
        assert record["status"] == "labelled" and record["answer_start"] > record["reasoning_start"]
        assert record["replacement"] == used and len(record["labels"]) == record["answer_start"]
    capsys.readouterr()
    assert main(_args(traces, out)) == 0
    assert "resuming: 2 of 2" in capsys.readouterr().out
    assert len(_records(out / "labels.jsonl")) == 2
    assert main(_args(traces, out, "--stride", "8")) == 2  # a different labelling into the same directory
    assert "stride 4 (now 8)" in _last_error(capsys)
    assert main(_args(traces, out, "--batch-size", "2", "--traces-per-batch", "1")) == 0  # speed only: resumes


def test_nothing_labelled_exits_non_zero(tmp_path, traces, capsys):
    """The real answer extraction finds nothing in a random model's text: every trace is skipped."""
    out = tmp_path / "labels"
    assert main(_args(traces, out)) == 1
    err = capsys.readouterr().err
    assert "nothing labelled: all 2 traces were skipped (2x no answer extracted" in err
    assert all(r["status"] == "skipped" for r in _records(out / "labels.jsonl"))


def test_replacement_is_recorded(tmp_path, traces, toy_answers, capsys):
    tok = tiny_tokenizer()
    for spec, chosen, token in [("space", "space", tok.encode(" ", add_special_tokens=False)[0]),
                                ("delete", "delete", None)]:
        out = tmp_path / spec
        assert main(_args(traces, out, "--replacement", spec, "--traces-per-batch", "1")) == 0
        assert re.search(r"1 traces \(\d+ regenerations\) in .* for the remaining \d+ regenerations",
                         capsys.readouterr().err)  # measured on the first unit
        assert {(r["replacement"]["chosen"], r["replacement"]["token_id"]) for r in _records(out / "labels.jsonl")} \
            == {(chosen, token)}
        assert json.loads((out / "config.json").read_text())["identity"]["replacement"] == spec


def test_shards_merge_into_the_unsharded_result(tmp_path, traces, toy_answers, capsys):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert main(_args(traces, whole, "--include-incorrect")) == 0
    assert merge_main([str(sharded)]) == 2  # nothing there yet
    # shards of one job run side by side: shard 0 holding its lock does not stop shard 1
    with RunDir(sharded, {}, config_name="config.shard-0-of-2.json", lock_name=".kvscope.lock.shard-0-of-2"):
        assert main(_args(traces, sharded, "--include-incorrect", "--shard", "1/2")) == 0
        assert main(_args(traces, sharded, "--include-incorrect", "--shard", "0/2")) == 2  # that shard is running
        assert "in use by another run" in _last_error(capsys)
    assert merge_main([str(sharded)]) == 2 and not (sharded / "labels.jsonl").exists()  # shard 0 missing
    assert "shards [0] of 2 are missing" in _last_error(capsys)
    assert main(_args(traces, sharded, "--include-incorrect", "--shard", "0/2", "--traces-per-batch", "1")) == 0
    assert merge_main([str(sharded)]) == 0
    merged = _records(sharded / "labels.jsonl")
    assert merged == _records(whole / "labels.jsonl")  # same records, same order
    assert [r["id"] for r in merged] == ["t0", "t1", "t2"]
    merged_config = json.loads((sharded / "config.json").read_text())
    assert merged_config["identity"] == json.loads((whole / "config.json").read_text())["identity"]
    assert main(_args(traces, sharded, "--include-incorrect")) == 0  # an unsharded rerun finds everything done
    assert "resuming: 3 of 3" in capsys.readouterr().out


def test_merge_refuses_shards_made_differently(tmp_path, traces, toy_answers, capsys):
    out = tmp_path / "mixed"
    assert main(_args(traces, out, "--include-incorrect", "--shard", "0/2")) == 0
    assert main(_args(traces, out, "--include-incorrect", "--shard", "1/2", "--stride", "8")) == 0
    assert merge_main([str(out)]) == 2
    assert "shard 1 was made with other settings than shard 0: stride 4 (now 8)" in _last_error(capsys)
    assert not (out / "labels.jsonl").exists()


@pytest.mark.parametrize("extra, message", [
    (["--shard", "2/2"], "0 <= I < N"),
    (["--shard", "one/2"], "I/N"),
    (["--shard", "0/3"], "only 2 traces to label; use at most 2 shards"),
    (["--dataset", "math5000"], "math500"),
    (["--window", "400"], "larger than every trace"),
    (["--stride", "9"], "untested"),
    (["--replacement", "blank"], "valid choices"),
    (["--replacement", "100000"], "out of range"),
    (["--device", "bogus"], "'bogus' is not a device"),
    (["--device", "cuda:7"], "cuda:7"),
    (["--workers", "2"], "--workers 2 needs --backend ray"),
    (["--backend", "spark"], "invalid choice: 'spark'"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, traces, capsys, extra, message):
    out = tmp_path / "never"
    assert main(_args(traces, out, *extra)) == 2
    last = _last_error(capsys)
    assert "error:" in last and message in last
    assert not out.exists()


@pytest.mark.parametrize("extra, message", [
    (["--intervention", "prune"], "invalid choice: 'prune'"),
    (["--intervention", "joint", "--budget", "0"], "--budget: must be in (0, 1], got 0"),
    (["--intervention", "joint", "--budget", "1.5"], "--budget: must be in (0, 1], got 1.5"),
    (["--intervention", "joint", "--draws", "0"], "--draws"),
    (["--intervention", "joint", "--window", "400"], "larger than every trace"),
    (["--intervention", "cache", "--no-force-answer"], "forces the answer from a pruned cache"),
    (["--intervention", "cache", "--method", "naive"], "runs on kvscope's own cache"),
])
def test_label_kinds_refuse_what_cannot_run_in_one_line(tmp_path, traces, capsys, extra, message):
    out = tmp_path / "never"
    assert main(["--traces", str(traces), "--out", str(out), "--window", "8", "--stride", "4", *extra]) == 2
    last = _last_error(capsys)
    assert "error:" in last and message in last
    assert not out.exists()


def test_graded_labels_of_traces_without_a_cue_need_the_generic_cue(tmp_path, traces, capsys):
    rows = [{**r, "generated_ids": r["generated_ids"][:12]} for r in _records(traces)]  # no box, no phrase
    uncued = _write(tmp_path / "uncued.jsonl", rows)
    out = tmp_path / "never"
    assert main(["--traces", str(uncued), "--out", str(out), "--window", "4", "--stride", "4",
                 "--no-generic-cue"]) == 2
    assert "has an answer cue" in _last_error(capsys) and not out.exists()


def test_out_that_is_a_file_or_below_a_file(tmp_path, traces, capsys):
    file = tmp_path / "file"
    file.write_text("keep me")
    for out, message in [(file, "is a file"), (file / "below", "cannot create it")]:
        assert main(_args(traces, out)) == 2
        assert message in _last_error(capsys)
    assert file.read_text() == "keep me"


def test_a_second_run_on_the_same_out_exits_at_once(tmp_path, traces, capsys):
    out = tmp_path / "busy"
    with RunDir(out, {}):
        assert main(_args(traces, out)) == 2
        assert "in use by another run" in _last_error(capsys)
        assert not (out / "labels.jsonl").exists()


def test_traces_from_an_evicting_policy_are_refused(tmp_path, traces, capsys, toy_answers):
    rows = _records(traces)
    rows[2] = {**rows[2], "policy": "h2o", "budget": 64, "eviction": {"rounds": 3}}
    evicted = _write(tmp_path / "evicted.jsonl", rows)
    out = tmp_path / "labels"
    assert main(_args(evicted, out)) == 2
    assert "1 of 3 traces were generated under eviction (policy h2o (1))" in _last_error(capsys)
    assert not out.exists()
    assert main(_args(evicted, out, "--allow-evicted")) == 0
    assert json.loads((out / "config.json").read_text())["identity"]["allow_evicted"] is True
    by_id = {r["id"]: r for r in _records(out / "labels.jsonl")}
    assert by_id["t2"]["trace_policy"] == "h2o" and "trace_policy" not in by_id["t0"]


def test_other_refusals(tmp_path, traces, capsys):
    out = tmp_path / "never"
    assert main(["--dataset", "gsm8k", "--shard", "0/2", "--out", str(out)]) == 2  # shards need stored traces
    assert main(["--out", str(out)]) == 2  # neither --dataset nor --traces
    wrong = _write(tmp_path / "wrong.jsonl", [{**r, "correct": False} for r in _records(traces)])
    assert main(_args(wrong, out)) == 2  # no correct trace, no --include-incorrect
    assert "--include-incorrect" in capsys.readouterr().err
    assert main(_args(tmp_path / "missing.jsonl", out)) == 2
    labels = _write(tmp_path / "labels.jsonl", [{"kind": "label", "id": "t0", "dataset": "gsm8k", "model": "m",
                                                 "status": "skipped"}])
    assert main(_args(labels, out)) == 2  # a file of another kind
    assert "is a label record, not a trace record" in _last_error(capsys)
    assert not out.exists()


def test_generation_mode_prints_its_plan_then_generates_and_labels(tmp_path, traces, data_dir, monkeypatch, capsys,
                                                                   toy_answers):
    """Without --traces: problems are generated with tasks.run into OUT/traces/, then labelled."""
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)
    model_dir = _records(traces)[0]["model"]
    out = tmp_path / "generated"
    assert main(["--dataset", "gsm8k", "--model", model_dir, "--limit", "2", "--max-new-tokens", "80",
                 "--include-incorrect", "--window", "8", "--stride", "4", "--max-answer-tokens", "4",
                 "--no-force-answer", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "plan: generate 2 gsm8k traces of at most 80 new tokens" in err
    assert "up to 3 windows per trace" in err  # span 80 - 64 = 16: windows at 0, 4, 8
    assert "estimate at" in err and "generation up to" in err
    assert "first trace: 80 tokens in" in err and "for the other 1 if they are as long" in err
    assert "labelling 2 of the 2 generated traces: about" in err
    generated = _records(out / "traces" / "generations.jsonl")
    assert [len(r["generated_ids"]) for r in generated] == [80, 80]
    records = _records(out / "labels.jsonl")
    assert [r["id"] for r in records] == [r["id"] for r in generated]
    assert all(r["boundary"] == "tail" and r["answer_start"] == r["n_tokens"] - 64 for r in records)
    identity = json.loads((out / "config.json").read_text())["identity"]
    assert identity["traces"] == "generated" and identity["generation"]["max_new_tokens"] == 80
    # the trace directory is a tasks.run output: tasks.run with the same settings resumes it
    from tasks.run import main as generate_main

    capsys.readouterr()
    assert generate_main(["--dataset", "gsm8k", "--model", model_dir, "--limit", "2", "--max-new-tokens", "80",
                          "--dtype", "float32", "--out", str(out / "traces")]) == 0
    assert "resuming: 2 of 2" in capsys.readouterr().out


def test_generation_mode_without_a_correct_trace_fails_and_claims_no_labels(tmp_path, traces, data_dir, monkeypatch,
                                                                          capsys):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)
    out = tmp_path / "generated"
    assert main(["--dataset", "gsm8k", "--model", _records(traces)[0]["model"], "--limit", "2",
                 "--max-new-tokens", "8", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "no correctly answered trace among the 2 generated" in err and "--include-incorrect" in err
    assert "written" not in err and "wrote" not in err
    assert not (out / "labels.jsonl").exists() and not (out / "config.json").exists()


# --- the Ray backend -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance with two CPUs whose workers use the toy answers too."""
    ray = pytest.importorskip("ray", reason="the Ray backend needs pip install 'kvscope[ray]'")
    # Ray's workers cannot import the test modules by name: their functions travel by value.
    for module in (__name__, _die_once.__module__):
        ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=False, logging_level="WARNING", runtime_env={"worker_process_setup_hook": _use_toy_answers})
    yield
    ray.shutdown()


def test_two_ray_workers_write_the_serial_records_and_resume_serially(local_ray, tmp_path, traces, toy_answers,
                                                                      capsys):
    serial, parallel = tmp_path / "serial", tmp_path / "ray"
    argv = ["--include-incorrect", "--traces-per-batch", "1"]  # three units for two workers
    assert main(_args(traces, serial, *argv)) == 0
    assert main(_args(traces, parallel, *argv, "--backend", "ray", "--workers", "2")) == 0
    records = _records(parallel / "labels.jsonl")
    assert [r["id"] for r in records] == ["t0", "t1", "t2"] and records == _records(serial / "labels.jsonl")
    assert {r["status"] for r in records} == {"labelled"}
    config = json.loads((parallel / "config.json").read_text())
    assert config["backend"]["backend"] == "ray" and config["backend"]["workers"] == 2
    assert config["identity"] == json.loads((serial / "config.json").read_text())["identity"]
    capsys.readouterr()
    assert main(_args(traces, parallel, "--include-incorrect")) == 0  # the backend is not part of the identity
    assert "resuming: 3 of 3" in capsys.readouterr().out


def test_a_ray_worker_killed_mid_run_loses_no_label_and_doubles_none(local_ray, tmp_path, traces, toy_answers,
                                                                     monkeypatch):
    serial, parallel = tmp_path / "serial", tmp_path / "ray"
    argv = ["--include-incorrect", "--traces-per-batch", "1"]
    assert main(_args(traces, serial, *argv)) == 0
    marker = tmp_path / "killed"
    monkeypatch.setattr(labeling.job, "labelled_unit",
                        functools.partial(_die_once, str(marker), labeling.job.labelled_unit))
    assert main(_args(traces, parallel, *argv, "--backend", "ray", "--workers", "2")) == 0
    assert marker.exists()  # a worker did die mid-unit
    assert _records(parallel / "labels.jsonl") == _records(serial / "labels.jsonl")  # every record once, in order
