"""`python -m evictor.run` end to end on a saved tiny model and a three-problem data file: trace records, cell
summaries, sweeps, keep-logs, resuming, fractional budgets, policy-config files, the never-evicted warning, and bad
input (exit 2, one line, nothing written), including --out and --device problems and a second run on one --out."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import write_arithmetic_problems  # tests/ is on sys.path under pytest

from core.errors import UsageError
from core.rundir import RunDir
from core.schemas import Cell, Trace, read_records
from evictor.instrument import kept_positions
from evictor.run import build_parser, main

TRACE_FIELDS = set(
    "kind id dataset model prompt_ids generated_ids text answer gold correct finish_reason empty_output no_answer "
    "timings sampling policy policy_config budget budget_tokens protocol eviction".split()
)
CELL_COLUMNS = ["kind"] + [f.name for f in dataclasses.fields(Cell) if f.name != "extra"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_arithmetic_problems(tmp_path_factory.mktemp("data") / "problems.jsonl", 3)


def run(tiny_dir, data_file, out, *extra):
    argv = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", data_file, "--out", str(out), "--quiet"]
    return main([*argv, "--max-new-tokens", "12", "--buffer", "4", "--block", "32", *extra])


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_single_cell_records_summary_keep_logs_and_resume(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ("--policy", "random", "--budget", "48", "--protect", "sinks", "--keep-log", "--batch-size", "2")
    assert run(tiny_dir, data_file, out, *args) == 0
    records = lines(out / "generations.jsonl")
    assert [r["id"] for r in records] == ["p1", "p2", "p3"]
    assert [t.id for t in read_records(out / "generations.jsonl", Trace)] == ["p1", "p2", "p3"]
    for record in records:
        assert TRACE_FIELDS <= set(record) and record["kind"] == "trace"
        assert record["policy"] == "random" and record["budget"] == 48
        assert record["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": 0}
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
    assert len(rows) == 1 and rows[0]["id"] == "random-K48" and rows[0]["problems"] == "3"
    assert list(rows[0]) == CELL_COLUMNS
    (cell,) = [Cell.from_json(row) for row in json.loads((out / "summary.json").read_text())]
    assert cell.problems == 3 and cell.accuracy == cell.correct / 3 and cell.policy == "random"
    assert 0 <= cell.ci_lo <= cell.accuracy <= cell.ci_hi <= 1 and cell.ci_hi - cell.ci_lo > 0.3  # 3 problems: wide
    assert cell.max_peak_slots == max(r["eviction"]["peak_slots"] for r in records)
    assert cell.mean_rounds == pytest.approx(sum(r["eviction"]["rounds"] for r in records) / 3)
    assert cell.evicted == sum(r["eviction"]["rounds"] > 0 for r in records) == 3
    printed = capsys.readouterr()
    assert "random-K48" in printed.out and "equals dense" not in printed.err

    # a torn last line (crash mid-write) is repaired and only the missing problem is rerun
    text = (out / "generations.jsonl").read_text().splitlines(keepends=True)
    (out / "generations.jsonl").write_text("".join(text[:2]) + text[2][:40])
    assert run(tiny_dir, data_file, out, *args) == 0
    again = lines(out / "generations.jsonl")
    assert [r["id"] for r in again] == ["p1", "p2", "p3"]
    assert again[0] == records[0]

    # a different budget in the same directory is refused, naming it, not mixed in
    assert run(tiny_dir, data_file, out, "--policy", "random", "--budget", "40", "--protect", "sinks") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "budget 48 (now 40)" in err[0]
    assert len(lines(out / "generations.jsonl")) == 3


def test_sweep_policies_by_budgets_into_one_table(tiny_dir, data_file, tmp_path):
    out = tmp_path / "sweep"
    sweep = ("--policy", "full,recency,keynorm", "--budget", "40,48", "--protect", "sinks", "--limit", "2")
    assert run(tiny_dir, data_file, out, *sweep) == 0
    cells = [row["id"] for row in csv.DictReader((out / "summary.csv").open())]
    assert cells == ["full", "recency-K40", "recency-K48", "keynorm-K40", "keynorm-K48"]
    for cell in cells:
        assert len(lines(out / cell / "generations.jsonl")) == 2
        assert json.loads((out / cell / "config.json").read_text())["identity"]["budget"] == (
            None if cell == "full" else int(cell[-2:])
        )
    full = lines(out / "full" / "generations.jsonl")
    assert all(r["eviction"]["rounds"] == 0 and r["budget_tokens"] is None and r["policy"] == "full" for r in full)

    # a rerun may add a cell; the cells it shares with the first run are resumed, not redone
    before = lines(out / "recency-K40" / "generations.jsonl")
    more = ("--policy", "recency", "--budget", "40,56", "--protect", "sinks", "--limit", "2")
    assert run(tiny_dir, data_file, out, *more) == 0
    assert lines(out / "recency-K40" / "generations.jsonl") == before
    assert len(lines(out / "recency-K56" / "generations.jsonl")) == 2
    assert [row["id"] for row in csv.DictReader((out / "summary.csv").open())] == ["recency-K40", "recency-K56"]


def test_sweep_with_other_shared_settings_is_refused_naming_them(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ("--policy", "recency", "--budget", "40,48", "--protect", "sinks", "--limit", "1")
    assert run(tiny_dir, data_file, out, *args) == 0
    capsys.readouterr()
    assert run(tiny_dir, data_file, out, *args, "--temperature", "0.6", "--top-p", "0.95") == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "temperature 0.0 (now 0.6)" in err and "top_p 1.0 (now 0.95)" in err
    # the protocol flags are shared settings too; a new cell would not escape the check
    new_cell = ("--policy", "recency", "--budget", "56", "--protect", "sinks", "--limit", "1", "--buffer", "8")
    assert run(tiny_dir, data_file, out, *new_cell) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "buffer 4 (now 8)" in err and not (out / "recency-K56").exists()


def test_sampling_with_top_p_is_recorded_and_reproduced(tiny_dir, data_file, tmp_path):
    args = ("--policy", "recency", "--budget", "40", "--protect", "sinks", "--limit", "2", "--batch-size", "2")
    args += ("--temperature", "0.6", "--top-p", "0.95", "--seed", "5")
    assert run(tiny_dir, data_file, tmp_path / "a", *args) == 0
    assert run(tiny_dir, data_file, tmp_path / "b", *args) == 0
    a, b = lines(tmp_path / "a" / "generations.jsonl"), lines(tmp_path / "b" / "generations.jsonl")
    assert [r["generated_ids"] for r in a] == [r["generated_ids"] for r in b]
    assert all(r["sampling"] == {"temperature": 0.6, "top_p": 0.95, "seed": 5} for r in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["identity"]["top_p"] == 0.95


def test_a_cell_that_never_evicts_warns_that_it_equals_dense(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "big"
    sweep = ("--policy", "random,recency", "--budget", "40,4096", "--protect", "sinks", "--limit", "2")
    assert run(tiny_dir, data_file, out, *sweep) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and all("equals dense decoding" in w for w in warnings)
    assert warnings[0].startswith("warning: random-K4096 ") and warnings[1].startswith("warning: recency-K4096 ")
    assert "K=4096" in warnings[0] and "buffer 4" in warnings[0]
    longest = max(
        len(r["prompt_ids"]) + len(r["generated_ids"]) for r in lines(out / "random-K4096" / "generations.jsonl")
    )
    assert f"longest context ({longest} tokens" in warnings[0]


def test_fractional_budget_from_a_dense_reference_and_policy_config(tiny_dir, data_file, tmp_path):
    dense = tmp_path / "dense"
    assert run(tiny_dir, data_file, dense, "--policy", "full") == 0
    config = tmp_path / "rkv.json"
    config.write_text(json.dumps({"policy": "r_kv", "params": {"lam": 0.5, "window": 2}}))  # its window fits K
    out = tmp_path / "frac"
    fraction = ("--budget", "0.5", "--reference", str(dense), "--protect", "sinks", "--on-long-prompt", "sinks")
    assert run(tiny_dir, data_file, out, "--policy-config", str(config), *fraction) == 0
    references = {r["id"]: len(r["generated_ids"]) for r in lines(dense / "generations.jsonl")}
    for record in lines(out / "generations.jsonl"):
        assert record["budget"] == 0.5
        assert record["budget_tokens"] == math.ceil(0.5 * references[record["id"]])
        assert record["policy_config"]["lam"] == 0.5
        assert record["eviction"]["attention_requests"] > 0


def test_batches_group_problems_of_like_dense_length(tiny_dir, data_file, tmp_path):
    """A batch decodes until its longest row stops, so with a reference the problems are batched shortest first."""
    dense = tmp_path / "dense"
    assert run(tiny_dir, data_file, dense, "--policy", "full") == 0
    records = lines(dense / "generations.jsonl")
    for record, length in zip(records, (12, 4, 8)):  # distinct dense lengths, not in problem order
        record["generated_ids"] = (record["generated_ids"] * 12)[:length]
    (dense / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "sorted"
    assert run(tiny_dir, data_file, out, "--policy", "random", "--budget", "1", "--reference", str(dense),
               "--protect", "sinks", "--on-long-prompt", "sinks", "--batch-size", "2") == 0
    by_length = [records[1]["id"], records[2]["id"], records[0]["id"]]
    stored = lines(out / "generations.jsonl")
    assert [r["id"] for r in stored] == by_length
    assert [r["batch"]["ids"] for r in stored] == [by_length[:2], by_length[:2], by_length[2:]]


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
        (("--policy", "random", "--trigger", "interval", "--buffer", "0"), "buffer >= 1"),
        (("--policy-config", "/nonexistent.json"), "does not exist"),
        (("--policy", "random", "--kernel", "flash_attention_2"), "flash_attention_2"),
        (("--policy", "random", "--budget", "0.5", "--reference", "/nonexistent"), "no generations.jsonl"),
        (("--policy", "random", "--top-p", "0"), "--top-p: must be in (0, 1], got 0"),
        (("--policy", "random", "--temperature", "-0.5"), "--temperature: must be a finite number >= 0"),
        (("--policy", "random", "--device", "bogus"), "--device: 'bogus' is not a device; valid choices: cpu"),
        (("--policy", "random", "--workers", "2"), "--workers 2 needs --backend ray"),
        (("--policy", "random", "--backend", "ray", "--gpus-per-worker", "-1"), "--gpus-per-worker: must be"),
        (("--policy", "random", "--backend", "ray", "--address", "127.0.0.1:1"), "cannot reach a Ray head there"),
        pytest.param(
            ("--policy", "random", "--device", "cuda"),
            "CUDA is not available here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),
        ),
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


def test_out_that_is_a_file_or_cannot_be_created_exits_2(tiny_dir, data_file, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    assert run(tiny_dir, data_file, blocker, "--policy", "random") == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert run(tiny_dir, data_file, blocker / "below", "--policy", "random") == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "cannot create it" in err
    assert blocker.read_text() == "not a directory\n" and [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_a_second_run_on_the_same_out_exits_2_at_once(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    with RunDir(out, {"held": "by another run"}):
        assert run(tiny_dir, data_file, out, "--policy", "random,recency", "--budget", "48", "--protect", "sinks") == 2
        (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert "is in use by another run" in err
        assert sorted(p.name for p in out.iterdir()) == [".kvscope.lock"]


def test_empty_data_file_exits_2(tiny_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "never"
    assert run(tiny_dir, str(empty), out, "--policy", "random") == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "empty.jsonl" in err and not out.exists()


def test_reference_of_another_kind_or_under_eviction_is_one_line(tiny_dir, data_file, tmp_path, capsys):
    labels = tmp_path / "labels.jsonl"
    labels.write_text(
        json.dumps({"kind": "label", "id": "p1", "dataset": "gsm8k", "model": "m", "status": "labelled"}) + "\n"
    )
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text(json.dumps({"trace_id": "p1", "labels": [0, 1]}) + "\n")
    out = tmp_path / "never"
    for reference, message in (
        (labels, "record 1 is a label record, not a trace record"),
        (legacy, "not a trace record"),
    ):
        assert (
            run(tiny_dir, data_file, out, "--policy", "random", "--budget", "0.5", "--reference", str(reference)) == 2
        )
        (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert "--reference" in err and message in err and "Traceback" not in err
    evicted = tmp_path / "evicted"
    assert run(tiny_dir, data_file, evicted, "--policy", "random", "--budget", "40", "--protect", "sinks") == 0
    capsys.readouterr()
    assert run(tiny_dir, data_file, out, "--policy", "random", "--budget", "0.5", "--reference", str(evicted)) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "generated under eviction" in err
    assert not out.exists()


def test_help_explains_the_backend_flags():
    text = build_parser().format_help()
    for flag in ("--backend", "--address", "--workers", "--gpus-per-worker", "--cpus-per-worker"):
        assert flag in text
    assert "serial" in text and "ray" in text


def test_protocol_flags_of_a_teacher_forcing_cli_leave_sampling_out_of_the_help():
    from core.cli import ArgumentParser
    from evictor.protocol import add_protocol_arguments, protocol_overrides

    sampled, forced = ArgumentParser(prog="sampled"), ArgumentParser(prog="forced")
    add_protocol_arguments(sampled)
    add_protocol_arguments(forced, sampling=False, default="epikv")
    assert "--temperature" in sampled.format_help() and "--top-p" in sampled.format_help()
    assert "--temperature" not in forced.format_help() and "--top-p" not in forced.format_help()
    assert "(default: epikv)" in forced.format_help() and forced.parse_args([]).protocol == "epikv"
    # still parsed, so the CLI can refuse them saying why instead of calling them unknown
    assert protocol_overrides(vars(forced.parse_args(["--temperature", "0.6"])))["temperature"] == 0.6
    with pytest.raises(UsageError, match="unknown protocol 'epikvv'"):
        add_protocol_arguments(ArgumentParser(prog="x"), default="epikvv")


def test_run_sweep_is_the_library_behind_the_command_line(tiny_dir, data_file, tmp_path):
    from core.schemas import as_json
    from evictor.protocol import parse_budgets
    from evictor.sweep import SweepConfig, run_sweep
    from tasks.run import GenerationConfig

    generation = GenerationConfig(dataset="gsm8k", model=tiny_dir, data_file=data_file, limit=2, max_new_tokens=12)
    config = SweepConfig(generation, policies=("full", "recency"), budgets=parse_budgets("40,48"),
                         protocol_settings={"buffer": 4, "block": 32, "protect": "sinks"})
    out = tmp_path / "sweep"
    cells = run_sweep(config, out, quiet=True)
    assert [c.id for c in cells] == ["full", "recency-K40", "recency-K48"]
    assert as_json(cells) == json.loads((out / "summary.json").read_text())
    assert cells[1].mean_rounds > 0 and cells[0].mean_rounds == 0
    assert cells[0].evicted is None and cells[1].evicted == 2  # full never evicts; both problems outgrow K = 40
    before = {c.id: lines(out / c.id / "generations.jsonl") for c in cells}
    # the command line with the same settings is the same run: it resumes it, decoding nothing again
    assert run(tiny_dir, data_file, out, "--policy", "full,recency", "--budget", "40,48", "--protect", "sinks",
               "--limit", "2") == 0
    assert {c.id: lines(out / c.id / "generations.jsonl") for c in cells} == before
    # records state the protocol's sampling, so a generation that samples otherwise is refused, before any output
    never = tmp_path / "never"
    for bad, message in ((dataclasses.replace(config, protocol="random_attention"), "samples with"),
                         (dataclasses.replace(config, budgets=()), "at least one policy and one budget"),
                         (dataclasses.replace(config, policies=("recency", "randon")), "did you mean 'random'")):
        with pytest.raises(UsageError, match=message):
            run_sweep(bad, never)
    assert not never.exists()


def test_an_interrupted_run_exits_130_keeping_its_finished_batches(tiny_dir, data_file, tmp_path, capsys,
                                                                  monkeypatch):
    import evictor.sweep as module

    decode = module.run_batch
    batches = []

    def interrupted_at_the_second_batch(worker, batch):
        batches.append(batch)
        if len(batches) == 2:
            raise KeyboardInterrupt
        return decode(worker, batch)

    monkeypatch.setattr(module, "run_batch", interrupted_at_the_second_batch)
    out = tmp_path / "run"
    args = ("--policy", "recency", "--budget", "48", "--protect", "sinks")
    assert run(tiny_dir, data_file, out, *args) == 130
    assert "interrupted; finished batches are saved; rerun the same command to resume" in capsys.readouterr().err
    assert [r["id"] for r in lines(out / "generations.jsonl")] == ["p1"] and not (out / "summary.json").exists()
    monkeypatch.setattr(module, "run_batch", decode)
    assert run(tiny_dir, data_file, out, *args) == 0
    assert [r["id"] for r in lines(out / "generations.jsonl")] == ["p1", "p2", "p3"]


def _main(tiny_dir, data_file, out, *extra):
    """`evictor.run` without the protocol flags `run` adds: the preset alone decides."""
    argv = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", data_file, "--out", str(out), "--quiet"]
    return main([*argv, "--max-new-tokens", "12", *extra])


def test_epikv_preset_resolves_each_problems_recency_and_records_it(tiny_dir, data_file, tmp_path):
    """--protocol epikv with a fractional budget: each problem's K = ceil(0.5 L), its recency window min(128, K/4),
    K counting only the scored tokens (prompt protected, so the effective K is K + |prompt| + w), no buffer, a step
    trigger: the cache peaks at one slot above the effective K, and every record states the resolved protocol."""
    dense = tmp_path / "dense"
    assert _main(tiny_dir, data_file, dense, "--policy", "full") == 0
    lengths = {r["id"]: len(r["generated_ids"]) for r in lines(dense / "generations.jsonl")}
    out = tmp_path / "epikv"
    assert _main(tiny_dir, data_file, out, "--policy", "recency", "--protocol", "epikv", "--budget", "0.5",
                 "--reference", str(dense)) == 0
    records = lines(out / "generations.jsonl")
    for record in records:
        protocol = record["protocol"]
        assert (protocol["protocol"], protocol["trigger"], protocol["buffer"], protocol["budget_scope"]) == (
            "epikv", "step", 0, "trace")
        assert (protocol["recency"], protocol["recency_share"], protocol["explicit"]) == (128, 0.25, [])
        assert record["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": 0}
        k = math.ceil(0.5 * lengths[record["id"]])
        assert record["eviction"]["recency"] == min(128, k // 4)  # this problem's own window
        assert record["budget_tokens"] == k + len(record["prompt_ids"]) + k // 4  # the effective K
        if record["eviction"]["rounds"]:
            assert record["eviction"]["peak_slots"] == record["budget_tokens"] + 1
    assert any(r["eviction"]["rounds"] for r in records)
    (cell,) = json.loads((out / "summary.json").read_text())
    assert cell["protocol"] == records[0]["protocol"]
    assert cell["max_peak_slots"] == max(r["eviction"]["peak_slots"] for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["preset"] == "epikv" and config["identity"]["protocol"]["recency_share"] == 0.25

    # an explicit flag overrides the preset and is marked explicit; a rerun without it is refused, naming it
    fixed = tmp_path / "fixed"
    assert _main(tiny_dir, data_file, fixed, "--policy", "recency", "--protocol", "epikv", "--budget", "4",
                 "--recency", "2", "--limit", "1") == 0
    (record,) = lines(fixed / "generations.jsonl")
    assert (record["protocol"]["recency"], record["protocol"]["recency_share"]) == (2, None)
    assert record["eviction"]["recency"] == 2
    assert record["protocol"]["explicit"] == ["recency"]
    assert _main(tiny_dir, data_file, fixed, "--policy", "recency", "--protocol", "epikv", "--budget", "4",
                 "--limit", "1") == 2


def test_policy_all_leaves_out_the_calibrated_policies_saying_how_to_include_them(tmp_path):
    from evictor.policy import left_out_line
    from evictor.run import _sweep_config

    argv = ["--dataset", "gsm8k", "--out", str(tmp_path / "never")]
    config, left_out = _sweep_config(build_parser().parse_args([*argv, "--policy", "all"]))
    assert left_out == ["thinkv", "triattention"] and "full" in config.policies and "h2o" in config.policies
    assert not set(left_out) & set(config.policies)
    line = left_out_line(left_out)
    assert "\n" not in line and "python -m evictor.calibrate triattention" in line and "--policy-config" in line
    # a --policy-config for one of them brings it back; several files configure several policies
    tri, rkv = tmp_path / "tri.json", tmp_path / "rkv.json"
    tri.write_text(json.dumps({"policy": "triattention", "params": {"calibration": "tri-calibration.json"}}))
    # a calibration file that does not exist is refused before anything runs
    with pytest.raises(UsageError, match="calibration file 'tri-calibration.json' does not exist"):
        _sweep_config(build_parser().parse_args([*argv, "--policy", "all", "--policy-config", str(tri)]))
    from test_triattention import write_calibration

    one = torch.tensor([1.0])
    calibration = write_calibration(tmp_path / "tri-calibration.json", one, one, torch.complex(one, one)[None],
                                    one[None])
    tri.write_text(json.dumps({"policy": "triattention", "params": {"calibration": calibration}}))
    rkv.write_text(json.dumps({"policy": "r_kv", "params": {"lam": 0.5}}))
    config, left_out = _sweep_config(build_parser().parse_args(
        [*argv, "--policy", "all", "--policy-config", str(tri), "--policy-config", str(rkv)]))
    assert left_out == ["thinkv"] and "triattention" in config.policies
    assert config.policy_params == {"triattention": {"calibration": calibration}, "r_kv": {"lam": 0.5}}
    config, _ = _sweep_config(build_parser().parse_args([*argv, "--policy-config", str(tri), "--policy-config",
                                                         str(rkv)]))
    assert config.policies == ("triattention", "r_kv")  # the files' policies are the default --policy
    with pytest.raises(UsageError, match="twice; give each once"):  # the same file twice
        build_parser().parse_args([*argv, "--policy-config", str(rkv), "--policy-config", str(rkv)])
    other = tmp_path / "rkv-other.json"
    other.write_text(json.dumps({"policy": "r_kv", "params": {"lam": 0.25}}))
    with pytest.raises(UsageError, match="configures 'r_kv' a second time"):
        _sweep_config(build_parser().parse_args([*argv, "--policy-config", str(rkv), "--policy-config", str(other)]))


def test_a_ruler_task_is_compressed_block_by_block_and_graded(tiny_dir, tmp_path):
    """The long-context protocol on a generated RULER task: the prompt (the haystack) is longer than K, so the cache
    is pruned at every block boundary and never holds more than K + B; the full cell keeps all of it."""
    out = tmp_path / "ruler"
    argv = ["--model", tiny_dir, "--dataset", "ruler_niah_multikey@512", "--limit", "2", "--policy", "full,valuediff",
            "--budget", "128", "--protocol", "valuediff", "--max-new-tokens", "4", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    for cell, peak in (("full", None), ("valuediff-K128", 128 + 128)):
        records = lines(out / cell / "generations.jsonl")
        assert [r["id"] for r in records] == ["ruler_niah_multikey@512-0", "ruler_niah_multikey@512-1"]
        for record in records:
            prompt = len(record["prompt_ids"])
            assert 256 < prompt <= 512 + 64 and len(record["gold"]) == 7 and record["gold"].isdigit()
            if peak is None:
                assert record["eviction"]["rounds"] == 0 and record["eviction"]["peak_slots"] >= prompt
            else:
                assert record["eviction"]["peak_slots"] == peak
                assert record["eviction"]["rounds"] >= math.ceil(prompt / 128) - 1
