"""What a request is checked against before it starts (`core.limits`, `core.backend`, `core.cli`), and a damaged
resume that must leave its output as it found it (`core.rundir`): each on hand-made inputs."""

from __future__ import annotations

import json
import os

import pytest

from core.backend import WORKERS_PER_CPU, BackendConfig
from core.cli import ArgumentParser, distinct
from core.errors import UsageError
from core.limits import Footprint, MemoryLimit, ModelLimits, format_bytes, machine_memory, parse_bytes
from core.rundir import RunDir
from core.schemas import Trace


# ---------------------------------------------------------------------------------------------------- amounts
@pytest.mark.parametrize("text, nbytes", [("24GiB", 24 * 2**30), ("24G", 24 * 2**30), ("24GB", 24 * 10**9),
                                          ("1.5 MiB", 3 * 2**19), ("512k", 512 * 2**10), ("2TiB", 2 * 2**40),
                                          ("100B", 100)])
def test_an_amount_of_memory_reads_binary_and_decimal_units(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text, says", [("24", "no unit"), ("abcGiB", "not an amount"), ("0GiB", "positive"),
                                        ("-1GiB", "positive"), ("nanGiB", "positive"), ("1PiB", "unknown unit"),
                                        ("1e30TiB", "more memory than any machine")])
def test_an_amount_without_a_unit_or_a_size_is_refused(text, says):
    with pytest.raises(ValueError, match=says):
        parse_bytes(text)


def test_bytes_read_in_the_largest_unit_with_three_digits():
    assert [format_bytes(n) for n in (512, 2**20, 1.5 * 2**30, 1.34 * 2**40)] == ["512B", "1MiB", "1.5GiB", "1.34TiB"]


# ---------------------------------------------------------------------------------------------------- the limit
def test_the_limit_is_the_machine_unless_lowered_and_never_raised():
    assert MemoryLimit.of("cpu").nbytes == machine_memory()
    assert MemoryLimit.of("cpu", 2**30) == MemoryLimit(2**30, "--max-memory 1GiB")
    with pytest.raises(UsageError, match="more than this machine has"):
        MemoryLimit.of("cpu", machine_memory() + 1)


def test_a_footprint_is_its_parts_summed_and_copies_are_named():
    a = Footprint((("weights", 100), ("KV cache", 50)))
    both = a + Footprint((("KV cache", 25),))
    assert both.total == 175 and dict(both.parts)["KV cache"] == 75
    assert a.times(3).parts == (("3 x weights", 300), ("3 x KV cache", 150))


def test_a_request_beyond_the_limit_names_the_estimate_the_limit_and_the_remedy():
    request = Footprint((("weights", 100), ("runtime", 100), ("KV cache", 3 * 2**30)))
    request.check("a request", MemoryLimit(4 * 2**30, "--max-memory 4GiB"), "lower --batch-size")  # fits
    with pytest.raises(UsageError) as refused:
        request.check("a request", MemoryLimit(2**30, "--max-memory 1GiB"), "lower --batch-size")
    assert str(refused.value) == ("a request needs about 3GiB (KV cache 3GiB) of memory, more than --max-memory 1GiB; "
                                  "lower --batch-size")


def test_a_model_that_alone_does_not_fit_says_no_setting_helps():
    model = Footprint((("weights", 2 * 2**30), ("runtime", 0), ("KV cache", 1)))
    with pytest.raises(UsageError, match="the model alone does not fit"):
        model.check("a request", MemoryLimit(2**30, "--max-memory 1GiB"), "lower --batch-size")


def test_a_trace_without_tokens_is_refused():
    empty = Trace(id="t", dataset="gsm8k", model="m", prompt_ids=[], generated_ids=[])
    with pytest.raises(UsageError, match="'t' holds no tokens"):
        ModelLimits("m", context=100, vocab_size=10).check_traces([empty], "--traces f")


# ---------------------------------------------------------------------------------------------------- lists
def test_a_list_naming_an_item_twice_is_refused():
    distinct("--layers", "1,2", [1, 2])
    with pytest.raises(UsageError, match=r"--layers '1,2,1' gives 1 twice"):
        distinct("--layers", "1,2,1", [1, 2, 1])
    parser = ArgumentParser(prog="p")
    parser.add_argument("--ctx", type=int, nargs="+")
    parser.add_argument("--file", action="append")
    assert parser.parse_args(["--ctx", "1", "2"]).ctx == [1, 2]
    for argv in (["--ctx", "1", "1"], ["--file", "a", "--file", "a"]):
        with pytest.raises(UsageError, match="twice"):
            parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- workers
@pytest.fixture
def two_cores(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setattr("core.backend.cpu_count", lambda: 2)


def test_ray_workers_beyond_the_cores_are_refused_before_ray_starts(two_cores):
    BackendConfig("ray", workers=2 * WORKERS_PER_CPU, cpus_per_worker=0.25)  # as many as two cores take
    with pytest.raises(UsageError, match=f"--workers {2 * WORKERS_PER_CPU + 1} is more than a local Ray instance"):
        BackendConfig("ray", workers=2 * WORKERS_PER_CPU + 1, cpus_per_worker=0.0004)


@pytest.mark.parametrize("fraction", [0.00004, 0.00015])
def test_a_reservation_ray_cannot_make_is_refused(two_cores, fraction):
    with pytest.raises(UsageError, match="steps of 0.0001"):
        BackendConfig("ray", workers=1, cpus_per_worker=fraction)


def test_local_workers_each_hold_the_work_and_the_driver_its_model(two_cores):
    driver, worker = Footprint((("weights", 10),)), Footprint((("weights", 10), ("KV cache", 5)))
    assert BackendConfig().footprint(driver, worker) == worker
    assert BackendConfig("ray", workers=2, cpus_per_worker=1).footprint(driver, worker).total == 10 + 2 * 15
    assert BackendConfig("ray", address="head:6379").footprint(driver, worker) == driver


# ---------------------------------------------------------------------------------------------------- resume
def _finished_run(out) -> bytes:
    with RunDir(out, {"model": "m"}) as run:
        run.save_config(note="first")
        run.store("records.jsonl").append({"id": "a"})
    return (out / "config.json").read_bytes()


def test_the_configuration_is_written_with_the_first_record_not_before(tmp_path):
    out = tmp_path / "run"
    with RunDir(out, {"model": "m"}) as run:
        run.save_config(note="held")
        store = run.store("records.jsonl")
        assert not (out / "config.json").exists()
        store.append({"id": "a"})
        assert json.loads((out / "config.json").read_text())["note"] == "held"
        run.save_config(note="later")  # once records exist, written at once
        assert json.loads((out / "config.json").read_text())["note"] == "later"


def test_a_run_failing_before_its_first_record_writes_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), RunDir(out, {"model": "m"}) as run:
        run.save_config(note="held")
        raise RuntimeError("the model did not load")
    assert not out.exists()


@pytest.mark.parametrize("damage", [b'{"kind": "record"}\n', b"[1, 2, 3]\n", b'{"id": "b", "ki\n{"id": "c"}\n'])
def test_a_resume_over_a_damaged_output_opens_no_file_for_writing(tmp_path, damage):
    out = tmp_path / "run"
    config = _finished_run(out)
    records = out / "records.jsonl"
    records.write_bytes(records.read_bytes() + damage)
    before = {path.name: (path.read_bytes(), os.stat(path).st_mtime_ns, os.stat(path).st_ino)
              for path in out.iterdir()}
    with pytest.raises(UsageError, match="refusing to resume"), RunDir(out, {"model": "m"}) as run:
        run.save_config(note="second")
        run.store("records.jsonl")
    after = {path.name: (path.read_bytes(), os.stat(path).st_mtime_ns, os.stat(path).st_ino)
             for path in out.iterdir()}
    assert after == before and (out / "config.json").read_bytes() == config


# ---------------------------------------------------------------------------------------------------- at the limit
def test_a_generation_just_under_the_limit_runs_and_just_over_it_is_refused(tiny_dir, tmp_path, capsys):
    """tasks.run on the tiny model: --max-memory at its estimate (rounded up to the KiB) runs and writes its traces;
    one KiB below the estimate is refused in one line naming it, with nothing written."""
    from conftest import write_arithmetic_problems

    from models.loading import load_tokenizer
    from tasks.prompts import build_prompt_ids
    from tasks.run import GenerationConfig, main

    data = write_arithmetic_problems(tmp_path / "problems.jsonl", 2)
    config = GenerationConfig(dataset="gsm8k", model=str(tiny_dir), data_file=data, max_new_tokens=4)
    tokenizer = load_tokenizer(str(tiny_dir))
    prompts = {p.id: build_prompt_ids(tokenizer, p) for p in config.problems()}
    estimate = config.footprint([len(ids) for ids in prompts.values()]).total  # serial: the driver is the worker
    kib = -(-estimate // 1024)
    argv = ["--model", str(tiny_dir), "--dataset", "gsm8k", "--data-file", data, "--max-new-tokens", "4", "--quiet"]
    below = tmp_path / "below"
    assert main([*argv, "--max-memory", f"{kib - 1}KiB", "--out", str(below)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than --max-memory" in err[0] and not below.exists()
    at = tmp_path / "at"
    assert main([*argv, "--max-memory", f"{kib}KiB", "--out", str(at)]) == 0
    assert len((at / "generations.jsonl").read_text().splitlines()) == 2
