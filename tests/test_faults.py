"""Every long job survives faults: killed mid-run, its last line torn, and rerun, it ends with the records of a run
that was never interrupted (CONTRIBUTING.md: long jobs append results as they finish and resume when rerun with the
same command; a torn last line is repaired, finished units are skipped).

Each job runs as a real process (`python -m <module>`) on the saved tiny model. It is sent SIGKILL as soon as its
incremental output holds a complete record, a few bytes are cut off that output so its last JSON line is incomplete
(a crash in the middle of a write), and the same command is rerun to completion. The rerun must exit as the
uninterrupted run does, and every JSONL file of the output must hold the uninterrupted run's records, in its order:
each id once, nothing lost, nothing doubled, equal once the wall-clock measurements are dropped. The sweep is also
interrupted with SIGINT (Ctrl-C), which must exit 130 keeping whole lines; the study is killed in two different
stages and its report's stage table, stage records and deliverables must equal those of an uninterrupted study.

Greedy decoding makes every job deterministic, so the tiny model's wrong answers are fine: what is compared is that
the same command gives the same records, however often it was cut short.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import write_arithmetic_problems  # tests/ is on sys.path under pytest

from study.pipeline import STAGES

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "KVSCOPE_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}
TIMEOUT = 300  # seconds any one process may take; far above what a job here needs
TEAR = 7  # bytes cut off the end: the newline and the record's closing characters
# Measurements of the clock and of process memory, which differ between any two runs.
VOLATILE = re.compile(r"timings|seconds|.*_s|.*round_ms.*|.*round_share|.*memory_bytes")


@dataclass(frozen=True)
class Job:
    """A long job: its command line ({model}, {problems}, {filler}, {traces} and {out} filled in), and the faults it
    gets, in order: (the glob under --out of the file that must hold a complete record, the signal then sent)."""

    module: str
    args: tuple[str, ...]
    faults: tuple[tuple[str, signal.Signals], ...]
    status: int = 0  # the exit status of an uninterrupted run


GREEDY = ("--model", "{model}", "--dataset", "gsm8k", "--data-file", "{problems}")
PROBE = ("--model", "{model}", "--n", "4", "--batch-size", "2", "--budget", "128", "--buffer", "8", "--lead", "8",
         "--n-boot", "50", "--threads", "1", "--data-file", "{filler}", "--out", "{out}")
JOBS = {
    # 80 tokens: the traces are long enough for the labelling job below to slide windows over
    "tasks.run": Job("tasks.run", (*GREEDY, "--max-new-tokens", "80", "--out", "{out}", "--quiet"),
                     (("generations.jsonl", signal.SIGKILL),)),
    # SIGKILLed in its first cell; the next run finishes that cell and is interrupted (Ctrl-C) in the second, with a
    # third cell still to come, so the signal cannot arrive after the job is done
    "evictor.run": Job("evictor.run", (*GREEDY, "--max-new-tokens", "24", "--buffer", "4", "--block", "32", "--policy",
                                       "recency", "--budget", "40,48,56", "--protect", "sinks", "--out", "{out}",
                                       "--quiet"),
                       (("recency-K40/generations.jsonl", signal.SIGKILL),
                        ("recency-K48/generations.jsonl", signal.SIGINT))),
    # The random-init model states no answer, so every trace is skipped and the job exits 1 ("nothing labelled"),
    # having written a record per trace all the same; one trace per unit writes them one at a time.
    "labeling.occlusion": Job("labeling.occlusion", ("--traces", "{traces}", "--include-incorrect", "--window", "8",
                                                     "--stride", "4", "--max-answer-tokens", "32",
                                                     "--traces-per-batch", "1", "--threads", "1", "--out", "{out}"),
                              (("labels.jsonl", signal.SIGKILL),), status=1),
    "probes.passcode": Job("probes.passcode", ("--policy", "random,recency", "--box", "24", "--rounds", "2", *PROBE),
                           (("instances.jsonl", signal.SIGKILL),)),
    "probes.planted_fact": Job("probes.planted_fact", ("--heads", "0;all", "--distance", "2", *PROBE),
                               (("instances.jsonl", signal.SIGKILL),)),
    # Eight problems: the labels stage labels them in two units of four, so it is still running once it has written
    # a record; no label is ever made (see labeling.occlusion above), so agreement and signals are off.
    "study": Job("study", (*GREEDY, "--max-new-tokens", "16", "--include-incorrect", "--budget", "0.5", "--window",
                           "8", "--stride", "4", "--max-answer-tokens", "32", "--tail", "6", "--no-force-answer",
                           "--n-boot", "100", "--compare-n-boot", "100", "--quiet", "--out", "{out}"),
                 (("stages/labels-*/labels.jsonl", signal.SIGKILL),
                  ("stages/evictor-*/*/*/generations.jsonl", signal.SIGKILL))),
}


# ---------------------------------------------------------------------------------------------------- processes
class Process:
    """A job's process, in a session of its own so a signal reaches what it started too (as Ctrl-C reaches the
    foreground group); its output goes to a log file, not a pipe that could fill up."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        with open(log, "w") as handle:
            # A suite started in the background inherits SIGINT ignored, and Python keeps an inherited SIG_IGN: restore
            # the default so the job sees Ctrl-C as a user's terminal would deliver it.
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=handle, stderr=subprocess.STDOUT,
                                          start_new_session=True,
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def wait(self) -> int:
        try:
            return self.popen.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            pytest.fail(f"{self.log.stem} ran past {TIMEOUT} s:\n{self.tail()}")

    def kill(self, sig: signal.Signals) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def complete_records(path: Path) -> bool:
    return b"\n" in path.read_bytes()


def kill_when(process: Process, out: Path, pattern: str, sig: signal.Signals) -> Path:
    """Send `sig` as soon as a file matching `pattern` under `out` holds a complete record, and wait for the process
    to end; the newest such file (the one being written). A job that ends first fails the test: make it larger."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        finished = process.popen.poll() is not None
        written = [path for path in out.glob(pattern) if complete_records(path)]
        if written and not finished:
            process.kill(sig)
            status = process.wait()
            expected = 130 if sig == signal.SIGINT else -sig
            assert status == expected, (f"{process.log.stem} ended with {status}, not {expected} (one that finished "
                                        f"before the signal must be made larger):\n{process.tail()}")
            return max(written, key=lambda path: path.stat().st_mtime_ns)
        if finished:
            pytest.fail(f"{process.log.stem} exited with {process.popen.returncode} before {pattern} held a record "
                        f"it could be {sig.name}ed after; make the job larger:\n{process.tail()}")
        time.sleep(0.005)  # a poll: the next record can come within milliseconds
    process.kill(signal.SIGKILL)
    pytest.fail(f"{process.log.stem}: {pattern} held no record after {TIMEOUT} s:\n{process.tail()}")


def tear(path: Path) -> None:
    """Cut the last line short, as a crash in the middle of writing it would."""
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - TEAR)


class Runs:
    """Each job's uninterrupted run and its faulted runs, made once for the module. A process spends most of its
    ~10 s importing torch and transformers on one core, so the faulted runs of two jobs go at once, each job's
    beside its uninterrupted run."""

    def __init__(self, root: Path, fields: dict[str, str], names: list[str]):
        self.root, self.fields = root, fields
        self.lock = threading.RLock()
        self.processes: list[Process] = []
        self.references: dict[str, Process] = {}
        self.closed = False
        self.pool = ThreadPoolExecutor(2)
        self.chains = {name: self.pool.submit(self.fault, name) for name in names}

    def start(self, argv: list[str], log: str) -> Process:
        with self.lock:
            if self.closed:
                raise RuntimeError("the module's runs are being torn down")
            self.processes.append(Process(argv, self.root / log))
            return self.processes[-1]

    def command(self, name: str, out: Path) -> list[str]:
        job = JOBS[name]
        fields = {**self.fields, "out": str(out)}
        if any("{traces}" in arg for arg in job.args):  # the labelling job labels the generation job's traces
            fields["traces"] = str(self.reference("tasks.run") / "generations.jsonl")
        return [sys.executable, "-m", job.module, *(arg.format(**fields) for arg in job.args)]

    def start_reference(self, name: str) -> Process:
        command = self.command(name, self.root / f"{name}-reference")
        with self.lock:
            if name not in self.references:
                self.references[name] = self.start(command, f"{name}-reference.log")
            return self.references[name]

    def reference(self, name: str) -> Path:
        """--out of the uninterrupted run, once it has finished."""
        process = self.start_reference(name)
        status = process.wait()
        assert status == JOBS[name].status, f"uninterrupted {name} exited with {status}:\n{process.tail()}"
        return self.root / f"{name}-reference"

    def faulted(self, name: str) -> Path:
        """--out of the run that got every fault of its job, then a rerun of the same command to completion."""
        return self.chains[name].result()

    def fault(self, name: str) -> Path:
        """Start `name`'s uninterrupted run, then run it into another --out with each of its faults in turn (every
        SIGKILL followed by a torn last line) and rerun it to completion."""
        self.start_reference(name)
        out = self.root / f"{name}-faulted"
        command = self.command(name, out)
        for number, (pattern, sig) in enumerate(JOBS[name].faults, start=1):
            process = self.start(command, f"{name}-fault-{number}.log")
            written = kill_when(process, out, pattern, sig)
            assert unfinished_stage(written, out), f"{name}: the stage of {written} had finished before the kill"
            if sig == signal.SIGKILL:
                tear(written)
            else:  # an interrupt saves what is finished and stops cleanly: whole lines only
                assert written.read_bytes().endswith(b"\n") and "Traceback" not in process.tail()
                assert "interrupted" in process.tail()
        rerun = self.start(command, f"{name}-rerun.log")
        status = rerun.wait()
        assert status == JOBS[name].status, f"the rerun of {name} exited with {status}:\n{rerun.tail()}"
        assert "Traceback" not in rerun.tail()
        return out

    def close(self) -> None:
        """Stop what still runs (after a failure): the chains not started, then every process."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self.closed = True
        for process in self.processes:
            process.kill(signal.SIGKILL)
        self.pool.shutdown(wait=True)


def unfinished_stage(path: Path, out: Path) -> bool:
    """Whether the study stage holding `path` had not finished (its stage.json is written last); true outside a
    study."""
    return not any((parent / "stage.json").exists() for parent in path.parents if out in parent.parents)


def selected_jobs(session: pytest.Session) -> list[str]:
    """The jobs this module's selected tests need, in the order of `JOBS`."""
    needed = {item.callspec.params["name"] if hasattr(item, "callspec") else "study"
              for item in session.items if item.module.__name__ == __name__}
    return [name for name in JOBS if name in needed]


@pytest.fixture(scope="module")
def runs(request, tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    data = Path(os.environ.get("KVSCOPE_DATA_DIR") or ROOT.parent / "shared" / "data")  # as conftest's data_dir
    fields = {"model": str(tiny_dir), "problems": write_arithmetic_problems(root / "problems.jsonl", 8),
              "filler": str(data / "math500.jsonl")}
    made = Runs(root, fields, selected_jobs(request.session))
    yield made
    made.close()


# ---------------------------------------------------------------------------------------------------- comparing
def stable(value, out: Path):
    """A record without its measurements of the clock and of memory, its --out spelled OUT."""
    if isinstance(value, dict):
        return {k: stable(v, out) for k, v in value.items() if not VOLATILE.fullmatch(k)}
    if isinstance(value, list):
        return [stable(v, out) for v in value]
    return value.replace(str(out), "OUT") if isinstance(value, str) else value


def jsonl_files(out: Path) -> dict[str, list]:
    """Every JSONL file under `out` (by its path relative to it) as its records, in file order."""
    return {str(path.relative_to(out)): [stable(json.loads(line), out) for line in path.read_text().splitlines()]
            for path in sorted(out.rglob("*.jsonl"))}


def record_key(record: dict):
    return record.get("policy"), record["id"]  # the passcode probe keeps one record per (policy, instance)


@pytest.mark.parametrize("name", list(JOBS))
def test_a_killed_torn_and_rerun_job_ends_with_the_records_of_an_uninterrupted_run(runs, name):
    faulted = jsonl_files(runs.faulted(name))
    reference = jsonl_files(runs.reference(name))
    assert list(faulted) == list(reference)
    for file, records in faulted.items():
        keys = [record_key(r) for r in records]
        assert len(keys) == len(set(keys)), f"{file}: a record written twice"
        assert keys == [record_key(r) for r in reference[file]], f"{file}: records lost or out of order"
        assert records == reference[file], f"{file}: the records differ from an uninterrupted run's"


def stage_table(report: str) -> list[list[str]]:
    """The rows (stage, status, key, directory) of the report's stage table, without the wall time."""
    section = report.split("## Stages", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")][:4] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| stage |")]


def test_a_study_killed_in_two_stages_reports_the_stages_of_an_uninterrupted_one(runs):
    faulted, reference = runs.faulted("study"), runs.reference("study")
    rows = stage_table((faulted / "report.md").read_text())
    expected = stage_table((reference / "report.md").read_text())
    assert [row[0] for row in expected] == list(STAGES) and {row[1] for row in expected} == {"computed", "off"}
    # The last run found every stage before the evictor finished (stage.json written), resumed the evictor from its
    # records and computed what follows; stages that were off stay off.
    for row, (name, status, key, directory) in zip(rows, expected, strict=True):
        after = STAGES.index(name) - STAGES.index("evictor")
        now = status if status == "off" else "reused" if after < 0 else "resumed" if after == 0 else "computed"
        assert row == [name, now, key, directory]
    stages = sorted(path.name for path in (reference / "stages").iterdir())
    assert sorted(path.name for path in (faulted / "stages").iterdir()) == stages
    for stage in stages:
        marker = stable(json.loads((reference / "stages" / stage / "stage.json").read_text()), reference)
        resumed = stable(json.loads((faulted / "stages" / stage / "stage.json").read_text()), faulted)
        for record in (marker, resumed):
            del record["status"]  # "resumed" where a faulted run resumed the stage
        assert resumed == marker, f"{stage}: stage.json differs"
    assert stable(json.loads((faulted / "selection.json").read_text()), faulted) == stable(
        json.loads((reference / "selection.json").read_text()), reference)
    for table in ("compare.csv", "accuracy.csv"):
        assert list(csv.reader((faulted / table).open())) == list(csv.reader((reference / table).open()))
