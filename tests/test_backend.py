"""`core.backend`: the serial and Ray backends of every stage. The Ray tests share one local instance with two CPUs:
results come back in unit order, each worker is built once, a worker killed mid-unit loses nothing and duplicates
nothing, and `tasks.run` / `evictor.run` write the same records with ``--backend ray --workers 2`` as serially."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core.backend import BackendConfig, WorkerLost, add_backend_arguments, run_units
from core.cli import ArgumentParser
from core.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
RAY = BackendConfig(backend="ray", workers=2)
# Fields that measure time or memory; everything else in a record must match the serial run's.
TIMING_FIELDS = ("timings",)
EVICTION_COST_FIELDS = ("round_ms_mean", "round_ms_median", "round_share", "score_s", "compact_s", "observe_s",
                        "peak_memory_bytes", "cache_allocated_peak_bytes")


# --- configuration (no Ray needed) ------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"backend": "spark"}, "unknown backend 'spark'; valid choices: ray, serial"),
    ({"workers": 2}, "--workers 2 needs --backend ray"),
    ({"address": "head:6379"}, "--address head:6379 needs --backend ray"),
    ({"gpus_per_worker": 1.0}, "--gpus-per-worker 1.0 needs --backend ray"),
    ({"backend": "ray", "workers": 0}, "--workers must be a positive integer, got 0"),
    ({"backend": "ray", "max_retries": -1}, "max_retries must be an integer >= 0"),
])
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        BackendConfig(**settings)


def test_flags_parse_into_a_config():
    parser = ArgumentParser()
    add_backend_arguments(parser)
    # a cluster address: a local instance would be checked against this machine's cores and GPUs
    flags = vars(parser.parse_args(["--backend", "ray", "--address", "head:6379", "--workers", "3",
                                    "--gpus-per-worker", "0.5"]))
    assert BackendConfig.from_flags(flags) == BackendConfig(backend="ray", address="head:6379", workers=3,
                                                            gpus_per_worker=0.5)
    assert BackendConfig.from_flags(vars(parser.parse_args([]))) == BackendConfig()
    with pytest.raises(UsageError, match="--workers: must be a positive integer"):
        parser.parse_args(["--workers", "0"])


def test_serial_runs_in_order_with_the_local_worker():
    made, seen = [], []
    results = []
    run_units([1, 2, 3], lambda: made.append(1) or 10, _add, BackendConfig(),
              on_result=lambda unit, result: results.append((unit, result)),
              progress=lambda unit, result: seen.append(unit))
    assert results == [(1, 11), (2, 12), (3, 13)] and seen == [1, 2, 3] and made == [1]
    run_units([1], _never_called, _add, BackendConfig(), on_result=lambda u, r: results.append(r), local_worker=100)
    assert results[-1] == 101
    run_units([], _never_called, _add, RAY, on_result=results.append)  # nothing to do: no worker, no Ray


def test_the_serial_path_does_not_import_ray(tiny_dir, tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"id": "q1", "question": "What is 1+1?", "answer": "#### 2"}) + "\n")
    code = ("import sys; from tasks.run import main; "
            f"code = main(['--model', {tiny_dir!r}, '--dataset', 'gsm8k', '--data-file', {str(problems)!r}, "
            f"'--max-new-tokens', '2', '--quiet', '--out', {str(tmp_path / 'out')!r}]); "
            "print('ray imported' if 'ray' in sys.modules else 'no ray', code)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.stdout.strip().splitlines()[-1] == "no ray 0", proc.stderr[-2000:]


# --- the Ray backend --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (starting one costs seconds): two CPUs, no dashboard, a small object
    store. `core.backend.connected` uses it as it is."""
    ray = pytest.importorskip("ray", reason="the Ray backend needs pip install 'kvscope[ray]'")
    # Ray's workers cannot import this test module by name: its worker functions travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


# Worker functions run in Ray's worker processes, which import them from this module by name.
def _add(worker: int, unit: int) -> int:
    return worker + unit


def _never_called():
    raise AssertionError("the serial backend was given a worker")


def _record_build(marks: str) -> int:
    Path(marks, f"worker-{os.getpid()}").touch()
    return os.getpid()


def _cannot_build() -> int:
    raise UsageError("model 'x' is missing on that worker's machine")


def _last_first(marks: str, worker: int, unit: int) -> tuple[int, int]:
    """Unit 0 finishes only after every other unit has: the worst order for committing in unit order."""
    if unit == 0:
        deadline = time.monotonic() + 120
        while not Path(marks, "done-5").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    Path(marks, f"done-{unit}").touch()
    return unit, worker


def _first_never_ends(worker, unit: int) -> int:
    """Unit 0 runs until its worker is killed; the others return at once."""
    while unit == 0:
        time.sleep(0.05)
    return unit


def _refuse(worker, unit: int) -> int:
    if unit == 2:
        raise UsageError(f"unit {unit} is bad input")
    return unit


def _die_always(worker, unit: int) -> int:
    if unit == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return unit


def _die_once(marker: str, work, worker, unit):
    """`work`, except that the first worker to reach a unit with `marker` absent kills its own process there."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return work(worker, unit)


def test_results_are_committed_in_unit_order_and_each_worker_is_built_once(local_ray, tmp_path):
    builds, marks = tmp_path / "builds", tmp_path / "marks"
    builds.mkdir(), marks.mkdir()
    committed, arrived = [], []
    run_units(list(range(6)), functools.partial(_record_build, str(builds)), functools.partial(_last_first, str(marks)),
              RAY, on_result=lambda unit, result: committed.append(result),
              progress=lambda unit, result: arrived.append(unit))
    assert [unit for unit, _ in committed] == list(range(6))
    assert arrived[-1] == 0 and sorted(arrived) == list(range(6))  # unit 0 finished last, yet was committed first
    builders = {pid for _, pid in committed}
    assert len(builders) == 2 and len(list(builds.iterdir())) == 2  # two workers, each built once


def test_a_run_stopped_early_saves_the_units_that_finished_ahead_of_an_earlier_one(local_ray, tmp_path):
    """SIGTERM reaches a Ray driver as SystemExit: units 1 and 2 have finished while unit 0 still runs, so none is
    committed in unit order yet; stopping saves both (in unit order among themselves) and not the unfinished one."""
    committed, arrived = [], []

    def stop_after_two(unit, result):
        arrived.append(unit)
        if len(arrived) == 2:
            raise SystemExit(15)

    with pytest.raises(SystemExit):
        run_units(list(range(5)), functools.partial(_record_build, str(tmp_path)), _first_never_ends, RAY,
                  on_result=lambda unit, result: committed.append(result), progress=stop_after_two)
    assert arrived == [1, 2] and committed == [1, 2]


def test_a_worker_error_is_raised_in_the_driver_not_retried(local_ray, tmp_path):
    committed = []
    with pytest.raises(UsageError, match="^unit 2 is bad input$"):
        run_units(list(range(4)), functools.partial(_record_build, str(tmp_path)), _refuse,
                  dataclasses.replace(RAY, workers=1), on_result=lambda unit, result: committed.append(result))
    assert committed == [0, 1] and len(list(tmp_path.iterdir())) == 1


def test_a_worker_that_cannot_be_built_is_one_line_not_retried(local_ray):
    with pytest.raises(UsageError, match="^model 'x' is missing on that worker's machine$"):
        run_units([0, 1], _cannot_build, _add, RAY, on_result=print)


def test_a_unit_that_keeps_killing_its_worker_stops_the_run_with_one_line(local_ray, tmp_path):
    committed = []
    config = BackendConfig(backend="ray", workers=1, max_retries=1)
    with pytest.raises(WorkerLost) as caught:
        run_units([0, 1, 2], functools.partial(_record_build, str(tmp_path)), _die_always, config,
                  on_result=lambda unit, result: committed.append(result))
    message = str(caught.value)
    assert message.startswith("unit 2 of 3 lost its Ray worker 2 times") and "rerun the same command" in message
    assert "\n" not in message and committed == [0]
    assert len(list(tmp_path.iterdir())) == 2  # the first worker and its one replacement


def test_more_workers_than_the_cluster_holds_is_refused(local_ray):
    with pytest.raises(UsageError, match="--workers 3 with --cpus-per-worker 1 needs 3 CPUs; a local Ray instance "
                                         "has 2; lower --workers or --cpus-per-worker"):
        run_units([1], _never_called, _add, BackendConfig(backend="ray", workers=3), on_result=print)
    with pytest.raises(UsageError, match="needs 1 GPUs; a local Ray instance has 0"):
        run_units([1], _never_called, _add, BackendConfig(backend="ray", gpus_per_worker=1.0), on_result=print)


# --- stages on the tiny model -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def problems_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    rows = [{"id": f"p{i}", "question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _records(path: Path) -> list[dict]:
    """The records of a JSONL file without what measures time or memory."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        for name in TIMING_FIELDS:
            record.pop(name)
        for name in EVICTION_COST_FIELDS:
            (record.get("eviction") or {}).pop(name, None)
    return records


def test_tasks_run_on_two_ray_workers_equals_the_serial_run(local_ray, one_thread, tiny_dir, problems_file, tmp_path):
    from tasks.run import main

    argv = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--max-new-tokens", "6", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "serial")]) == 0
    assert main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    serial = _records(tmp_path / "serial" / "generations.jsonl")
    parallel = _records(tmp_path / "ray" / "generations.jsonl")
    assert [r["id"] for r in parallel] == ["p1", "p2", "p3", "p4", "p5"] and parallel == serial
    config = json.loads((tmp_path / "ray" / "config.json").read_text())
    assert config["backend"]["workers"] == 2
    assert config["identity"] == json.loads((tmp_path / "serial" / "config.json").read_text())["identity"]
    # a resume with the other backend is the same run: the identity does not name the backend
    assert main([*argv, "--out", str(tmp_path / "ray"), "--limit", "2"]) == 0


def test_evictor_sweep_on_two_ray_workers_equals_the_serial_run(local_ray, one_thread, tiny_dir, problems_file,
                                                                 tmp_path):
    from evictor.run import main

    argv = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems_file, "--max-new-tokens", "12",
            "--buffer", "4", "--block", "32", "--policy", "recency,random", "--budget", "40", "--protect", "sinks",
            "--batch-size", "2", "--keep-log", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "serial")]) == 0
    assert main([*argv, "--out", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    assert json.loads((tmp_path / "ray" / "config.json").read_text())["backend"]["backend"] == "ray"
    for cell in ("recency-K40", "random-K40"):
        serial = _records(tmp_path / "serial" / cell / "generations.jsonl")
        parallel = _records(tmp_path / "ray" / cell / "generations.jsonl")
        assert [r["id"] for r in parallel] == ["p1", "p2", "p3", "p4", "p5"] and parallel == serial
        for record in parallel:  # the driver wrote each keep-log the worker sent back
            a = np.load(tmp_path / "serial" / cell / record["keep_log"])
            b = np.load(tmp_path / "ray" / cell / record["keep_log"])
            assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def test_a_worker_killed_mid_run_loses_nothing_and_duplicates_nothing(local_ray, one_thread, tiny_dir,
                                                                       problems_file, tmp_path):
    from models.loading import load_model
    from tasks.run import GenerationConfig, Generator, generate_one, load_generator

    config = GenerationConfig(dataset="gsm8k", model=tiny_dir, data_file=problems_file, max_new_tokens=6)
    problems = config.problems()
    serial = []
    run_units(problems, _never_called, generate_one, BackendConfig(), on_result=lambda _, t: serial.append(t),
              local_worker=Generator(load_model(tiny_dir, device="cpu"), config))
    marker = tmp_path / "killed"
    committed = []
    run_units(problems, functools.partial(load_generator, config),
              functools.partial(_die_once, str(marker), generate_one), RAY,
              on_result=lambda _, trace: committed.append(trace))
    assert marker.exists()  # a worker did die mid-unit
    assert [t.id for t in committed] == [p.id for p in problems]  # every record once, in order
    strip = lambda trace: {**trace.to_json(), "timings": None}
    assert [strip(t) for t in committed] == [strip(t) for t in serial]
