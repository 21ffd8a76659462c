"""core: run directories (lock, identity, path checks), portable paths, resumable JSONL, record schemas, seeds, CLI
argument types."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import core.paths
from core.cli import device, positive_int, unit_interval
from core.errors import UsageError
from core.paths import portable, portable_path, roots
from core.records import JsonlStore
from core.rundir import RunDir
from core.schemas import Label, Signal, Trace, read_records
from core.seeds import derive_seed


def test_rundir_claims_saves_identity_and_resumes(tmp_path):
    out = tmp_path / "run"
    with RunDir(out, {"model": "m", "limit": 3}) as run:
        run.save_config(note="x")
        run.store("records.jsonl").append({"id": "a"})
    assert json.loads((out / "config.json").read_text()) == {"identity": {"model": "m", "limit": 3}, "note": "x"}
    assert not (out / ".kvscope.lock").exists()
    with RunDir(out, {"model": "m", "limit": 3}) as run:
        assert "a" in run.store("records.jsonl")


def test_rundir_names_every_differing_setting(tmp_path):
    with RunDir(tmp_path, {"model": "m", "max_new_tokens": 256, "seed": 0}) as run:
        run.save_config()
    with pytest.raises(UsageError, match=r"max_new_tokens 256 \(now 512\)") as err:
        RunDir(tmp_path, {"model": "m", "max_new_tokens": 512, "seed": 0}).claim()
    assert "seed" not in str(err.value) and "\n" not in str(err.value)


SPELLINGS = [("/home/ada/kvscope", ""), ("/home/ada/data", "$KVSCOPE_DATA_DIR"), ("/home/ada", "~")]


@pytest.mark.parametrize("path, spelled", [
    ("/home/ada/kvscope/runs/t.jsonl", "runs/t.jsonl"),  # the checkout: relative, as results/ writes them
    ("/home/ada/kvscope", "."),
    ("/home/ada/data/math500.jsonl", "$KVSCOPE_DATA_DIR/math500.jsonl"),  # under home, spelled from the data dir
    ("/home/ada/.cache/kvscope/gguf/m.gguf", "~/.cache/kvscope/gguf/m.gguf"),
    ("/home/adam/notes.txt", "/home/adam/notes.txt"),  # a name that starts like a root is not under it
    ("/mnt/home/ada/x", "/mnt/home/ada/x"),  # nor is a path that holds a root further down
    ("--out /home/ada/kvscope/runs/s --data-file=/home/ada/data/m.jsonl",  # a command line: each path in it
     "--out runs/s --data-file=$KVSCOPE_DATA_DIR/m.jsonl"),
    ("/srv/traces.jsonl", "/srv/traces.jsonl"),  # outside every root: absolute
    ("runs/t.jsonl", "runs/t.jsonl"),  # already portable: unchanged, so the spelling is idempotent
    ("hub:HuggingFaceH4/MATH-500", "hub:HuggingFaceH4/MATH-500"),
])
def test_a_path_is_spelled_from_the_most_specific_root_it_lies_under(path, spelled):
    assert portable_path(path, SPELLINGS) == spelled
    assert portable_path(spelled, SPELLINGS) == spelled


def test_portable_spells_every_string_of_nested_settings_and_keeps_the_rest():
    settings = {"file": "/home/ada/kvscope/runs/t.jsonl", "n": 3, "ok": True, "none": None,
                "generation": {"data_source": "/home/ada/data/m.jsonl", "ids": ("p1", "/home/ada/x")}}
    assert portable(settings, SPELLINGS) == {"file": "runs/t.jsonl", "n": 3, "ok": True, "none": None,
                                             "generation": {"data_source": "$KVSCOPE_DATA_DIR/m.jsonl",
                                                            "ids": ["p1", "~/x"]}}


def test_the_roots_are_this_checkout_the_data_directory_and_home_longest_first(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path / "data"))
    assert roots() == sorted([(str(core.paths.REPOSITORY), ""), (str(tmp_path / "data"), "$KVSCOPE_DATA_DIR"),
                              (str(tmp_path), "~")], key=lambda root: len(root[0]), reverse=True)
    assert portable_path(str(core.paths.REPOSITORY / "runs" / "t.jsonl")) == "runs/t.jsonl"
    monkeypatch.delenv("KVSCOPE_DATA_DIR")
    assert portable_path(str(tmp_path / "data" / "m.jsonl")) == "~/data/m.jsonl"


def test_a_run_stored_with_portable_paths_resumes_in_this_checkout_and_another_file_is_still_refused(
        tmp_path, monkeypatch):
    """A committed run's config spells its paths portably; here the same files have absolute paths."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"identity": {
        "reference": "runs/t.jsonl", "data_source": "$KVSCOPE_DATA_DIR/m.jsonl", "source": "~/.cache/m.gguf"}}))
    here = {"reference": str(core.paths.REPOSITORY / "runs" / "t.jsonl"), "data_source": str(tmp_path / "data/m.jsonl"),
            "source": str(tmp_path / "home/.cache/m.gguf")}
    RunDir(out, here).claim().release()
    with pytest.raises(UsageError, match=r"reference \"runs/t.jsonl\" \(now \".*/runs/u.jsonl\"\)"):
        RunDir(out, {**here, "reference": str(core.paths.REPOSITORY / "runs" / "u.jsonl")}).claim()


def test_second_writer_is_refused_at_once_naming_the_first(tmp_path):
    with RunDir(tmp_path, {"a": 1}):
        with pytest.raises(UsageError, match=r"in use by another run \(pid \d+"):
            RunDir(tmp_path, {"a": 1}).claim()
    RunDir(tmp_path, {"a": 1}).claim().release()  # released: free again


def test_lock_is_held_across_processes(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from core.rundir import RunDir; r = RunDir(sys.argv[1], {}).claim(); "
         "print('held', flush=True); time.sleep(30)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match="in use by another run"):
            RunDir(tmp_path, {}).claim()
    finally:
        holder.kill()
        holder.wait()
    RunDir(tmp_path, {}).claim().release()  # the OS dropped the dead holder's lock


def test_out_that_is_a_file_or_cannot_be_made(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        RunDir(file, {}).claim()
    with pytest.raises(UsageError, match="cannot create it"):
        RunDir(file / "below", {}).claim()


def test_a_run_that_wrote_nothing_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "run"
    run = RunDir(out, {}).claim()
    run.release()
    assert not (tmp_path / "new").exists()


def test_torn_last_line_is_repaired_with_a_message(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "x"')
    store = JsonlStore(path, key=lambda r: r["id"])
    assert [r["id"] for r in store.records] == ["a"]
    assert "torn last line" in capsys.readouterr().err
    assert path.read_text() == '{"id": "a"}\n'


def _trace(**extra):
    return {"id": 7, "dataset": "gsm8k", "model": "m", "prompt_ids": [1], "generated_ids": [2, 3], **extra}


def test_schema_round_trip_keeps_unknown_fields(tmp_path):
    trace = Trace.from_json(_trace(future_field=1))
    assert trace.id == "7" and trace.token_ids == [1, 2, 3] and not trace.evicted
    assert trace.to_json()["future_field"] == 1 and trace.to_json()["kind"] == "trace"


def test_schema_refuses_another_kind_and_missing_fields(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(Trace.from_json(_trace()).to_json()) + "\n")
    with pytest.raises(UsageError, match="record 1 is a trace record, not a label record"):
        read_records(path, Label)
    path.write_text(json.dumps({"id": "a", "model": "m"}) + "\n")
    with pytest.raises(UsageError, match="has no dataset, prompt_ids, generated_ids: not a trace record"):
        read_records(path, Trace)


def test_schema_reads_the_older_trace_id_key(tmp_path):
    signal = Signal.from_json({"trace_id": "p1", "model": "m", "n_tokens": 2, "n_prompt": 1, "positions": [0, 1],
                               "signals": {}})
    assert signal.id == "p1" and "trace_id" not in signal.to_json()


def test_evicted_trace_is_not_dense():
    assert Trace.from_json(_trace(policy="random", eviction={"rounds": 3})).evicted
    assert not Trace.from_json(_trace(policy="random", eviction={"rounds": 0})).evicted


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("")
    with pytest.raises(UsageError, match="holds no trace records"):
        read_records(path, Trace)
    path.write_text((json.dumps(_trace()) + "\n") * 2)
    with pytest.raises(UsageError, match="appears twice"):
        read_records(path, Trace)


def test_derived_seeds_depend_on_the_seed_and_the_keys_only():
    assert derive_seed(0, ["a", "b"]) == derive_seed(0, ["a", "b"])
    assert len({derive_seed(0, ["a", "b"]), derive_seed(1, ["a", "b"]), derive_seed(0, ["b", "a"])}) == 3
    assert 0 <= derive_seed(10**30, ["x"]) < 2**63


def test_argument_types():
    assert positive_int("3") == 3 and unit_interval("1") == 1.0
    for bad, kind in (("0", positive_int), ("x", positive_int), ("1.5", unit_interval), ("nan", unit_interval)):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(bad)
    assert device("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match="not a device; valid choices: cpu"):
        device("bogus")


def test_cuda_without_cuda_is_a_one_line_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(argparse.ArgumentTypeError, match="CUDA is not available here; valid choices: cpu"):
        device("cuda")
