"""`python -m study` on a saved tiny model and a four-problem data file: every deliverable, resume reusing every stage,
a changed labelling setting recomputing labels and every stage after them, the reported rho recomputed from the
labels and signals files with scipy, the selected configuration running in the evictor, degenerate labels (an
inconclusive selection that still runs the baselines), and bad input (exit 2, one line, nothing written).

A random-init model never states an answer, so the labelling tests extract a toy answer (the first two characters of
a regeneration), as tests/test_labeling_cli.py does: every reference has one and windows can flip.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import re
import shutil

import numpy as np
import pytest
from conftest import write_arithmetic_problems  # tests/ is on sys.path under pytest
from scipy.stats import spearmanr

import core.paths
import tasks.grading
from core.errors import UsageError
from core.rundir import RunDir
from evictor.run import main as evictor_main
from models import loading
from study import pipeline
from study.__main__ import main

pytestmark = pytest.mark.usefixtures("one_thread")

SCORERS = "epikv,valuediff,keydiff,h2o,recency,random"
# The stages a study of a reasoning task runs by default; "known" runs on known-answer tasks only, the other label
# kinds and teacher-forced eviction when asked (off here).
OPTIONAL = ("known", "cache_labels", "joint_labels", "forced")
STAGES = tuple(name for name in pipeline.STAGES if name not in OPTIONAL)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_arithmetic_problems(tmp_path_factory.mktemp("data") / "problems.jsonl", 4)


def _toy_answer(text: str, dataset: str | None = None) -> str:
    return text[:2] or "-"


def _same(a: str, b: str, **kw) -> bool:
    return a == b


def study_args(tiny_dir, data_file, out, *extra):
    return ["--model", str(tiny_dir), "--dataset", "gsm8k", "--data-file", data_file, "--limit", "4",
            "--max-new-tokens", "24", "--include-incorrect", "--budget", "0.5", "--window", "8", "--stride", "4",
            "--max-answer-tokens", "4", "--tail", "6", "--no-force-answer", "--scorers", SCORERS, "--n-boot", "100",
            "--compare-n-boot", "100", "--quiet", "--out", str(out), *extra]


def run_study(tiny_dir, data_file, out, *extra, answer=_toy_answer):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks.grading, "extract_answer", answer)
        patch.setattr(tasks.grading, "is_equivalent", _same)
        return main(study_args(tiny_dir, data_file, out, *extra))


def stage_statuses(report: str) -> dict[str, str]:
    return {name: re.search(rf"^\| {name} \| (\w+) \|", report, re.M).group(1) for name in STAGES}


def stage_dirs(out) -> set[str]:
    return {path.name for path in (out / "stages").iterdir()}


MODEL_LOADS: list[str] = []  # the model directories the module's study loaded weights from


@pytest.fixture(scope="module")
def study(tiny_dir, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "out"
    real = loading._from_pretrained
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "_from_pretrained", lambda directory, *a: MODEL_LOADS.append(str(directory))
                      or real(directory, *a))
        assert run_study(tiny_dir, data_file, out) == 0
    return out


def test_the_stages_share_one_loaded_model(study, tiny_dir, data_file, tmp_path):
    """Every stage of a serial study runs on the one copy loaded first, and what it computes is what stages loading
    their own copies compute."""
    assert MODEL_LOADS == [str(tiny_dir)]
    out, own_loads = tmp_path / "own-copies", []
    real = loading._from_pretrained
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "shared_loads", contextlib.nullcontext)
        patch.setattr(loading, "_from_pretrained", lambda directory, *a: own_loads.append(directory)
                      or real(directory, *a))
        assert run_study(tiny_dir, data_file, out) == 0
    assert len(own_loads) > 1  # without sharing, the stages load their own
    for name in ("ranking.csv", "compare.csv", "accuracy.csv"):
        assert (out / name).read_text() == (study / name).read_text(), name


def test_the_study_writes_every_deliverable(study):
    report = (study / "report.md").read_text()
    for heading in ("**Question.**", "## Settings", "## Stages", "## 1. Traces and occlusion labels",
                    "### Label agreement", "## 2. Signals, statistics and selection", "## 3. Eviction at equal cache",
                    "## 4. Against random", "### What is significant", "## Reproduce"):
        assert heading in report
    assert set(stage_statuses(report).values()) == {"computed"}
    assert re.search(r"^\| known \| off \|", report, re.M) and "## The known answer" not in report
    for name in ("cache_labels", "joint_labels", "forced"):
        assert re.search(rf"^\| {name} \| off \|", report, re.M)
    for stem in ("scorer_ranking", "layer_rho", "signals_by_layer", "accuracy_budget", "difference_vs_random"):
        assert (study / "figures" / f"{stem}.png").stat().st_size > 0
        assert f"](figures/{stem}.png)" in report
    selection = json.loads((study / "selection.json").read_text())
    assert selection["status"] == "selected" and selection["n_eff"] == 4
    ran = {c["policy"] for c in selection["configs"].values()}
    assert {"full", "random", "recency", "epikv", "valuediff"} <= ran  # baselines and every paper's default
    assert selection["policy"] == selection["chosen"][0]["policy"]
    for name, config in selection["configs"].items():
        assert json.loads((study / config["file"]).read_text())["policy"] == config["policy"]
        assert config["file"] == f"configs/{name}.json"
    rows = list(csv.DictReader((study / "compare.csv").open()))
    assert rows and all(r["policy_b"] == "random" and not r["error"] for r in rows)
    assert {r["equal_cache"] for r in rows if r["policy_a"] != "full"} == {"True"}  # equal peak cache, checked
    assert {r["policy_a"] for r in rows} >= {"full", "recency", "epikv", "valuediff"}
    accuracy = list(csv.DictReader((study / "accuracy.csv").open()))
    peaks = {r["max_peak_slots"] for r in accuracy if r["policy"] != "full"}
    assert len(peaks) == 1  # one protocol, one protection: every evicting cell held the same peak cache
    agreement = re.search(r"\| (\w+) \| delete \| 4 \|", report)
    assert agreement is not None  # every labelled trace relabelled by deletion (the default) and compared
    assert "### What each occluded window did" in report and "### Scorer ranking under each replacement" in report
    assert re.search(r"- \w+ vs delete: Spearman", report)
    predicts = report.split("## 5. Does the offline statistic predict eviction?")[1].split("\n## ")[0]
    assert re.search(r"\| valuediff \| valuediff\.agg\.raw \| 0\.5 \|", predicts)  # defaults: the aggregate score
    assert "- budget 0.5: " in predicts and "Nothing to set side by side" not in predicts
    layers = list(csv.DictReader((study / "layers.csv").open()))  # the per-layer analysis behind the bands
    assert {r["layer"] for r in layers} >= {"0.0", "3.0"} and (study / "positional.csv").is_file()
    revision = json.loads((study / "config.json").read_text())["revision"]
    assert revision is None or len(revision["commit"]) == 40 and f"`{revision['commit']}`" in report


def fisher_z_mean(rhos: list[float]) -> float:
    """The within-trace rho as the study reports it: the mean of the per-trace rho on Fisher's z scale (clipped as
    the study clips a perfect rho)."""
    return float(np.tanh(np.mean(np.arctanh(np.clip(rhos, -0.9999, 0.9999)))))


def test_the_reported_rho_recomputes_from_the_labels_and_signals_files_with_scipy(study):
    report = (study / "report.md").read_text()
    labels_path = study / re.search(r"^- labels: `([^`]+)`", report, re.M).group(1)
    signal_paths = [study / p for p in re.findall(r"^- signals: `([^`]+)`", report, re.M)]
    assert len(signal_paths) == 4
    ranking = list(csv.DictReader((study / "ranking.csv").open()))
    reported = next(r for r in ranking if r["signal"].startswith("valuediff.l") and r["within_rho"] != "nan")
    family, layer, transform = re.fullmatch(r"(\w+)\.l(\d+)\.(\w+)", reported["signal"]).groups()

    labels = {r["id"]: r for r in map(json.loads, labels_path.read_text().splitlines()) if r["status"] == "labelled"}
    signals = {}
    for path in signal_paths:
        for record in map(json.loads, path.read_text().splitlines()):
            columns = [v for per_layer in record["signals"].values() for v in per_layer.values()]
            signals.setdefault(record["id"], []).append((record, columns))
    rhos = []
    for trace_id, label in labels.items():
        span = range(label["reasoning_start"], label["answer_start"])
        # positions where any signal of any file is undefined are left out for every signal (the report says so)
        kept = [p for p in span if all(column[p] is not None for _, columns in signals[trace_id]
                                       for column in columns)]
        record = next(r for r, _ in signals[trace_id] if family in r["signals"])
        x = [record["signals"][family][layer][p] for p in kept]
        y = [label["labels"][p] for p in kept]
        rho = spearmanr(x, y).statistic
        if np.isfinite(rho):
            rhos.append(rho)
    mean = fisher_z_mean(rhos)
    assert transform == "raw" and len(rhos) == int(reported["within_n_eff"])
    assert mean == pytest.approx(float(reported["within_rho"]), abs=1e-9)


def test_the_ranking_under_each_replacement_recomputes_from_the_label_sets_with_scipy(study):
    """The robustness table: each scorer's within-trace rho, read from its own aggregate score, under every label set
    the agreement stage compared, on the traces both sets labelled."""
    stages = {path.name.split("-")[0]: path for path in (study / "stages").iterdir()}
    agreement = json.loads((stages["agreement"] / "stage.json").read_text())["outputs"]
    robustness = json.loads((stages["selection"] / "stage.json").read_text())["outputs"]["robustness"]
    replay = {r["id"]: r for r in map(json.loads, (stages["signals"] / "replay.jsonl").read_text().splitlines())}
    scorers = [row["scorer"] for row in robustness["rows"]]
    assert set(scorers) == set(SCORERS.split(",")) - {"random"}
    recomputed = {}
    for chosen, path in agreement["files"].items():
        labels = [r for r in map(json.loads, (study / path).read_text().splitlines()) if r["status"] == "labelled"]
        for scorer in scorers:
            rhos = []
            for label in labels:
                scores = replay[label["id"]]["signals"]
                span = range(label["reasoning_start"], label["answer_start"])
                kept = [p for p in span if all(scores[s]["agg"][p] is not None for s in scorers)]
                rho = spearmanr([scores[scorer]["agg"][p] for p in kept], [label["labels"][p] for p in kept]).statistic
                if np.isfinite(rho):
                    rhos.append(rho)
            recomputed[chosen, scorer] = fisher_z_mean(rhos)
    assert robustness["traces"] == 4 and len(agreement["files"]) >= 2
    for row in robustness["rows"]:
        for chosen in agreement["files"]:
            assert row[chosen] == pytest.approx(recomputed[chosen, row["scorer"]], abs=1e-9, nan_ok=True), (chosen, row)
    study_filler = next(chosen for chosen, path in agreement["files"].items() if path.startswith("stages/labels-"))
    assert robustness["sets"][0] == study_filler and set(robustness["sets"]) == set(agreement["files"])
    assert {row["a"] for row in robustness["agreement"]} == {study_filler}  # each other set against the study's
    assert len({round(row[study_filler], 9) for row in robustness["rows"]}) > 2  # the scorers are told apart


def test_the_ranking_under_each_replacement_reads_each_scorer_by_name_on_shared_traces():
    """Hand-made label sets: `a` scores by position, `b` against it and `c` peaks mid-trace, behind an unrelated
    column; the labels rise with position, so rho(a) = -rho(b) = Spearman(position, labels) in every trace. A trace
    only one set labelled is left out, and the reference set comes first whatever the order of the sets."""
    from study.report import robustness_lines
    from study.stages import robustness_table
    from validation.signals import Aligned, AlignedTrace

    positions = np.arange(20)
    columns = np.column_stack([np.cos(positions), positions, -positions, -(positions - 10.0) ** 2])
    names = ["unrelated.l0.raw", "a.agg.raw", "b.agg.raw", "c.agg.raw"]

    def label_set(threshold, ids):
        labels = (positions >= threshold).astype(float)
        return Aligned(names, [AlignedTrace(i, positions, labels, columns) for i in ids])

    sets = {"delete": label_set(12, ["t0", "t1", "t2", "only-here"]), "space": label_set(15, ["t0", "t1", "t2"])}
    table = robustness_table(sets, "space", ["a", "b", "c"], level=0.95, n_boot=50, seed=0)
    assert table["traces"] == 3
    for row in table["rows"]:
        for chosen, threshold in (("space", 15), ("delete", 12)):
            step = spearmanr(positions, positions >= threshold).statistic
            expected = {"a": step, "b": -step}.get(row["scorer"])
            if expected is not None:
                assert row[chosen] == pytest.approx(expected, abs=1e-9)
    assert table["sets"] == ["space", "delete"]
    assert table["agreement"] == [{"a": "space", "b": "delete", "scorers": 3, "spearman": 1.0, "best_a": "a",
                                   "best_b": "a"}]
    text = "\n".join(robustness_lines(table))
    assert "| scorer | rho (space) | rho (delete) |\n" in text and "\n- space vs delete: Spearman 1.000" in text
    del table["sets"]  # as a selection stage stored before the fix holds it: its numbers are not shown
    assert "|" not in "\n".join(robustness_lines(table))


def test_the_selected_configuration_runs_in_the_evictor(study, tiny_dir, data_file, tmp_path):
    selection = json.loads((study / "selection.json").read_text())
    traces = next((study / "stages").glob("traces-*")) / "generations.jsonl"
    argv = ["--policy-config", str(study / "selection.json"), "--model", str(tiny_dir), "--dataset", "gsm8k",
            "--data-file", data_file, "--limit", "4", "--max-new-tokens", "24", "--budget", "0.5", "--reference",
            str(traces), "--protocol", "epikv", "--protect", "prompt", "--quiet", "--out", str(tmp_path / "rerun")]
    assert evictor_main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "rerun" / "generations.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in records} == {selection["policy"]} and len(records) == 4


def test_resume_reuses_every_stage_and_a_labelling_change_recomputes_from_labels_on(study, tiny_dir, data_file,
                                                                                    tmp_path):
    out = tmp_path / "out"
    shutil.copytree(study, out)
    before = stage_dirs(out)
    assert run_study(tiny_dir, data_file, out) == 0
    assert set(stage_statuses((out / "report.md").read_text()).values()) == {"reused"}
    assert stage_dirs(out) == before

    assert run_study(tiny_dir, data_file, out, "--stride", "8") == 0
    statuses = stage_statuses((out / "report.md").read_text())
    assert statuses == {"traces": "reused", **{name: "computed" for name in STAGES[1:]}}
    added = stage_dirs(out) - before
    assert {name.split("-")[0] for name in added} == set(STAGES[1:])
    assert len(list(out.glob("stages/labels-*/labels.jsonl"))) == 2  # the first settings' labels are kept


@pytest.mark.parametrize("reuse_traces", [False, True])
def test_a_study_committed_from_another_checkout_resumes_under_the_same_keys(study, tiny_dir, data_file, tmp_path,
                                                                             monkeypatch, reuse_traces):
    """A study made in one checkout and committed there (its paths spelled relative to that checkout, its evictor
    stage interrupted) is reused and resumed in another checkout, where the model, the data file, the --traces file
    and the study lie at other absolute paths: the stage keys and the run identities compare paths portably
    (core.paths), and reused traces are read from --traces."""
    made_in, elsewhere = tmp_path / "made-in", tmp_path / "elsewhere"
    shutil.copytree(tiny_dir, made_in / "model")
    (made_in / "data").mkdir()
    shutil.copy(data_file, made_in / "data" / "problems.jsonl")
    if reuse_traces:  # the module study's dense traces, naming their model as it lies in either checkout
        traces = next(study.glob("stages/traces-*/generations.jsonl")).read_text()
        (made_in / "traces.jsonl").write_text(traces.replace(json.dumps(str(tiny_dir)), json.dumps("model")))

    def study_in(checkout):
        monkeypatch.setattr(core.paths, "REPOSITORY", checkout)
        extra = ("--traces", str(checkout / "traces.jsonl")) if reuse_traces else ()
        assert run_study(checkout / "model", str(checkout / "data" / "problems.jsonl"), checkout / "runs/study",
                         *extra) == 0
        return checkout / "runs/study"

    out = study_in(made_in)
    keys = stage_dirs(out)
    (out / "stages" / next(name for name in keys if name.startswith("evictor-")) / "stage.json").unlink()
    for path in out.rglob("*.json*"):  # what committing does: paths under the checkout spelled relative to it
        path.write_text(path.read_text().replace(f"{made_in}/", ""))
    shutil.copytree(made_in, elsewhere)
    out = study_in(elsewhere)
    statuses = stage_statuses((out / "report.md").read_text())
    assert statuses == {**{name: "reused" for name in STAGES}, "evictor": "resumed"}
    assert stage_dirs(out) == keys


def test_uniform_labels_make_the_selection_inconclusive_and_the_baselines_still_run(tiny_dir, data_file, tmp_path):
    fresh = itertools.count()
    out = tmp_path / "out"
    # every regeneration "answers" differently, so every window flips and every position is important
    assert run_study(tiny_dir, data_file, out, "--agreement-traces", "0",
                     answer=lambda text, dataset=None: str(next(fresh))) == 0
    selection = json.loads((out / "selection.json").read_text())
    assert selection["status"] == "inconclusive" and selection["n_eff"] == 0 and selection["n_traces"] == 4
    assert selection["policy"] == "epikv" and selection["chosen"] == []
    report = (out / "report.md").read_text()
    assert "**Selection inconclusive** (n = 4 aligned traces, n_eff = 0" in report
    assert re.search(r"^\| agreement \| off \|", report, re.M)
    policies = {r["policy_a"] for r in csv.DictReader((out / "compare.csv").open())}
    assert policies == {"full", "recency", "epikv", "valuediff"}


def test_no_correct_trace_is_inconclusive_without_labels(tiny_dir, data_file, tmp_path):
    out = tmp_path / "out"
    argv = [a for a in study_args(tiny_dir, data_file, out) if a != "--include-incorrect"]
    assert main(argv) == 0  # the real answer extraction: the tiny model answers nothing, so nothing is correct
    selection = json.loads((out / "selection.json").read_text())
    assert selection["status"] == "inconclusive" and "no correctly answered trace among 4" in selection["reason"]
    statuses = stage_statuses((out / "report.md").read_text())
    assert statuses["signals"] == "off" and statuses["evictor"] == "computed"


def test_evicting_only_the_labelled_problems(tiny_dir, data_file, tmp_path):
    """Two of four problems answered correctly (a grader that accepts gold 2 and 4): only they are labelled, and with
    --evict-problems labelled only they are decoded under eviction."""
    out = tmp_path / "out"
    argv = [a for a in study_args(tiny_dir, data_file, out, "--evict-problems", "labelled")
            if a != "--include-incorrect"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks.grading, "extract_answer", _toy_answer)
        patch.setattr(tasks.grading, "is_equivalent", lambda a, b, **kw: b in ("2", "4"))
        assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["study"]["evict_problems"] == "labelled"
    (evictor,) = (out / "stages").glob("evictor-*")
    records = [json.loads(line) for file in evictor.rglob("generations.jsonl") for line in file.read_text().splitlines()
               if line.strip()]
    assert records and {r["id"] for r in records} == {"p1", "p2"}
    assert "the labelled ones" in (out / "report.md").read_text()


@pytest.mark.parametrize("change, message", [
    (("--model", "smollm3"), "unknown model 'smollm3'"),
    (("--dataset", "gsm9k"), "unknown dataset 'gsm9k'"),
    (("--budget", "0"), "--budget '0' is neither a fraction in (0, 1]"),
    (("--budget", "0.5,1.5"), "--budget '1.5' is neither a fraction in (0, 1]"),
    (("--dataset", "ruler_niah_single@512"), "--budget 0.5 on ruler_niah_single@512: a RULER task compresses"),
    (("--budget", "half"), "--budget 'half' is not a number"),
    (("--scorers", "valuedif"), "did you mean 'valuediff'"),
    (("--scorers", "full"), "evicts nothing"),
    (("--protocol", "h2o"), "invalid choice: 'h2o'"),
    (("--evict-problems", "some"), "invalid choice: 'some'"),
    (("--traces", "missing.jsonl"), "does not exist"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tiny_dir, data_file, tmp_path, capsys, change, message):
    out = tmp_path / "out"
    argv = study_args(tiny_dir, data_file, out)
    flag, value = change
    argv = argv[: argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2:] if flag in argv else \
        [*argv, flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_an_out_that_is_a_file_unwritable_or_in_use_exits_2(tiny_dir, data_file, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out, message in ((blocker, "is a file"), (blocker / "below", "cannot create it")):
        assert main(study_args(tiny_dir, data_file, out)) == 2
        assert message in capsys.readouterr().err
    busy = tmp_path / "busy"
    with RunDir(busy, {"run": "kvscope study"}):
        assert main(study_args(tiny_dir, data_file, busy)) == 2
        assert "in use by another run" in capsys.readouterr().err
    assert not (busy / "stages").exists()


def test_reused_traces_are_labelled_as_they_are(study, tiny_dir, data_file, tmp_path):
    traces = next((study / "stages").glob("traces-*")) / "generations.jsonl"
    out = tmp_path / "out"
    assert run_study(tiny_dir, data_file, out, "--traces", str(traces), "--agreement-traces", "0") == 0
    report = (out / "report.md").read_text()
    assert "| dense traces | reused from --traces |" in report
    record = json.loads(next(out.glob("stages/traces-*/stage.json")).read_text())
    assert record["outputs"]["traces"] == str(traces.resolve()) and not list(out.glob("stages/traces-*/*.jsonl"))
    labels = next(out.glob("stages/labels-*/labels.jsonl")).read_text()
    assert labels == next(study.glob("stages/labels-*/labels.jsonl")).read_text()  # the same traces, the same labels


def test_reused_traces_must_hold_every_problem_of_the_model(study, tiny_dir, data_file, tmp_path, capsys):
    traces = next((study / "stages").glob("traces-*")) / "generations.jsonl"
    short = tmp_path / "short.jsonl"
    short.write_text("".join(traces.read_text().splitlines(keepends=True)[:2]))
    assert main(study_args(tiny_dir, data_file, tmp_path / "out", "--traces", str(short))) == 2
    assert "has no trace of problem(s) p3, p4" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_selected_configuration_runs_beside_the_default_of_its_policy_or_as_the_default_it_equals():
    from study.config import StudyConfig, study_budgets
    from study.stages import BASELINE_SWEEP, sweeps

    bands = {"policy": "epikv", "params": {"positive_layers": [1], "negative_layers": [3], "window": 64}}
    selection = {"configs": {"epikv": bands, "valuediff": {"policy": "valuediff", "params": {}}}}
    plan = sweeps(StudyConfig(dataset="gsm8k", budgets=study_budgets("0.25,1")), selection)
    assert list(plan) == [BASELINE_SWEEP, "selected-epikv"] and plan["selected-epikv"] == {"selected-epikv": bands}
    assert plan[BASELINE_SWEEP]["epikv"]["params"] == {}  # EpiKV's default still runs, under its own name
    # the whole dense trace (K = L) is a budget like any other: every configuration runs at it
    assert sweeps(StudyConfig(dataset="gsm8k", budgets=study_budgets("1")), selection) == plan


def test_the_report_shows_each_scorer_once_at_its_best_layer_and_head():
    from study.report import distinct_scorers

    ranking = [{"signal": s, "family": f, "transform": t} for s, f, t in (
        ("recency.l0.raw", "recency", "raw"), ("recency.l1.raw", "recency", "raw"),
        ("keydiff.h1.l2.raw", "keydiff.h1", "raw"), ("keydiff.agg.raw", "keydiff", "raw"),
        ("hidden_diff.l5.mean64", "hidden_diff", "mean64"), ("hidden_diff.l3.z64", "hidden_diff", "z64"),
        ("hidden_diff.l4.mean64", "hidden_diff", "mean64"))]
    assert [r["signal"] for r in distinct_scorers(ranking)] == [
        "recency.l0.raw", "keydiff.h1.l2.raw", "hidden_diff.l5.mean64", "hidden_diff.l3.z64"]


def test_budgets_are_fractions_of_the_dense_trace_or_whole_tokens_in_order():
    from evictor.protocol import FRACTION, TOKENS, Budget
    from study.config import study_budgets

    assert study_budgets("0.5,0.25") == (Budget(0.25, FRACTION), Budget(0.5, FRACTION))
    with pytest.raises(UsageError, match="gives 0.5 twice"):
        study_budgets("0.5,0.25,0.5")
    assert study_budgets("1024,256") == (Budget(256, TOKENS), Budget(1024, TOKENS))
    assert study_budgets("256,1,0.5") == (Budget(0.5, FRACTION), Budget(1.0, FRACTION), Budget(256, TOKENS))
    # as the stage keys of existing study directories hold them
    assert [b.to_json() for b in study_budgets("1,0.5,192")] == [0.5, 1.0, 192]


def test_a_ruler_study_measures_accuracy_against_compression_without_labels(tiny_dir, tmp_path):
    """A RULER task's evidence is its prompt: the study skips labelling (saying why), compresses the haystack to K
    tokens with every default policy and compares each with random at the same peak cache."""
    out = tmp_path / "ruler"
    argv = ["--model", str(tiny_dir), "--dataset", "ruler_niah_single@512", "--limit", "2", "--max-new-tokens", "4",
            "--budget", "128,256", "--protocol", "valuediff", "--protect", "sinks", "--compare-n-boot", "100",
            "--quiet", "--out", str(out)]
    assert main(argv) == 0
    report = (out / "report.md").read_text()
    assert "| labels | off |" in report and "no reasoning span to occlude" in report
    assert "when the long prompt is compressed to K tokens" in report
    assert "| labels, signals, selection | off (a RULER task: its evidence is the prompt) |" in report
    (evictor,) = (out / "stages").glob("evictor-*")
    cells = sorted(p.parent.name for p in evictor.rglob("generations.jsonl"))
    assert cells == sorted(["full", *(f"{p}-K{k}" for p in ("epikv", "random", "recency", "valuediff")
                                      for k in (128, 256))])
    for record in (json.loads(line) for line in (evictor / "baselines" / "valuediff-K128" / "generations.jsonl")
                   .read_text().splitlines()):
        assert len(record["prompt_ids"]) > 256 and record["eviction"]["peak_slots"] <= 128 + 128
    with open(out / "compare.csv") as handle:
        compared = {(row["config"], row["budget_a"]) for row in csv.DictReader(handle) if row["policy_b"] == "random"}
    assert {("valuediff", "128"), ("epikv", "256"), ("recency", "128")} <= compared


def test_a_ruler_study_refuses_a_protected_prompt(tiny_dir, tmp_path, capsys):
    out = tmp_path / "ruler"
    argv = ["--model", str(tiny_dir), "--dataset", "ruler_niah_single@512", "--budget", "128", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--protect prompt on ruler_niah_single@512 keeps the whole haystack" in err and "sinks, none" in err
    assert len(err.splitlines()) == 1 and not out.exists()


def _toy_known_answer(text: str, dataset: str | None = None) -> tuple[str, str]:
    """The first two characters after the last opening brace (the forced cue's ``\\boxed{``): what the random model
    'answers', so a window flips when it changes them."""
    return text[text.rfind("{") + 1:][:2] or "-", "toy"


def test_a_known_answer_study_opens_with_the_labels_against_the_planted_facts(tiny_dir, tmp_path):
    out = tmp_path / "known"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks.grading, "extract_answer_with_rule", _toy_known_answer)
        patch.setattr(tasks.grading, "is_equivalent", _same)
        assert main(["--model", str(tiny_dir), "--dataset", "known_facts@1", "--limit", "3", "--max-new-tokens", "4",
                     "--include-incorrect", "--budget", "0.5", "--stride", "32", "--agreement-traces", "1",
                     "--scorers", "recency,keydiff,random", "--n-boot", "50", "--compare-n-boot", "50", "--quiet",
                     "--no-stop-at-answer", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert report.index("## The known answer") < report.index("## Settings")
    assert re.search(r"^\*\*Answer\.\*\* Against the planted facts the labels have recall", report, re.M)
    assert re.search(r"^\| known \| computed \|", report, re.M)
    known = json.loads(next(out.glob("stages/known-*/stage.json")).read_text())["outputs"]
    labels = known["labels"]
    assert labels["traces"] == 3 and labels["planted_windows"] >= 3  # every trace has its needed value windowed
    assert sum(labels[f"{c}_windows"] for c in ("planted", "key", "decoy", "filler")) + labels["excluded"] > 0
    assert [row["scorer"] for row in known["auc"]] == ["recency", "keydiff", "random"]
    recency = known["auc"][0]
    assert recency["auc_decoy"] == 1.0  # every decoy precedes the needed note: recency ranks it above them all
    accuracy = {row["policy"] for row in csv.DictReader((out / "accuracy.csv").open())}
    if known["finding"] is not None:  # the scorer that finds the facts ran in the evictor, to set beside random
        assert known["finding"] in accuracy and known["finding"] != "random"


def test_full_compared_with_random_at_two_budgets_is_named_by_random_s_budget():
    from study.report import comparison_label

    assert comparison_label({"config": "h2o", "budget_a": 0.5, "budget_b": 0.5}) == "h2o @ 0.5"
    assert [comparison_label({"config": "full", "budget_a": None, "budget_b": b}) for b in (0.25, 0.5)] == [
        "full vs random @ 0.25", "full vs random @ 0.5"]


def test_the_decode_rate_the_estimates_scale_from_is_kvscope_s_single_sequence_rate():
    from core.schemas import Trace
    from study.stages import kvscope_decode_rate

    def trace(rate, engine=None):
        return Trace(id="p", dataset="gsm8k", model="m", prompt_ids=[1], generated_ids=[2],
                     timings={"tokens_per_s": rate} if rate else {}, extra={"engine": engine} if engine else {})

    batched = {"name": "hf", "batch_size": 4}  # each sequence's rate times sqrt(4)
    assert kvscope_decode_rate([trace(1.0, batched), trace(3.0, batched), trace(2.0, batched)]) == 4.0
    assert kvscope_decode_rate([trace(5.0)]) == 5.0  # a trace from before the engine was recorded: hf, alone
    assert kvscope_decode_rate([trace(1.2, {"name": "vllm", "batch_size": 32}), trace(5.0)]) is None
    assert kvscope_decode_rate([trace(None)]) is None  # constructed traces are not timed


def test_the_evictor_estimate_counts_every_deployed_cell_and_the_workers_sharing_them():
    from study.config import StudyConfig, study_budgets
    from study.pipeline import STEP_OVERHEAD, StageRecord, estimate_seconds

    def record(name, outputs):
        return StageRecord(name, "key", f"stages/{name}-key", "reused", 1.0, {}, {}, outputs)

    config = StudyConfig(dataset="gsm8k", budgets=study_budgets("0.25,0.5"), scorers=("valuediff", "keydiff", "h2o"),
                         deploy_scorers=True, evict_problems="labelled", batch_size=16)
    done = {"traces": record("traces", {"n": 10, "correct": 6, "mean_generated": 300.0}),
            "labels": record("labels", {"labelled": 5}),
            "selection": record("selection", {"configs": {"keydiff": {"policy": "keydiff", "params": {}}}})}
    # full once; random, recency, epikv, valuediff, keydiff, h2o at both budgets (the selected keydiff is deployed)
    cells = 1 + 6 * 2
    alone = estimate_seconds("evictor", config, done, 10, rate=2.0)
    assert alone == pytest.approx(cells * 5 * 300.0 * STEP_OVERHEAD / 2.0 / 4)
    assert estimate_seconds("evictor", config, done, 10, rate=2.0, workers=2) == pytest.approx(alone / 2)
    assert estimate_seconds("evictor", config, done, 10, rate=None) is None


def test_a_budget_that_cannot_hold_the_prompt_is_refused_after_the_traces_and_budget_scope_trace_runs(
        tiny_dir, data_file, tmp_path, capsys):
    """Random Attention's protocol counts the protected prompt inside K, so half of a 24-token trace cannot hold it:
    the study says so (one line naming --budget-scope trace) right after the traces, before hours of labelling, and
    with K counting only the trace it runs, every cell within prompt + K + the protocol's 2r = 128 buffer slots."""
    out = tmp_path / "ra"
    assert run_study(tiny_dir, data_file, out, "--protocol", "random_attention") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the traces stage's progress
    assert ": error: epikv-K0.5, problem " in error and "exceed the budget" in error
    assert "--budget-scope trace" in error and error.endswith("--on-long-prompt expand|sinks")
    assert {name.split("-")[0] for name in stage_dirs(out)} == {"traces"}
    assert run_study(tiny_dir, data_file, out, "--protocol", "random_attention", "--budget-scope", "trace") == 0
    report = (out / "report.md").read_text()
    assert "random_attention** protocol with `--protect prompt --budget-scope trace`" in report
    assert "| traces | reused |" in report
    (evictor,) = (out / "stages").glob("evictor-*")
    assert json.loads((evictor / "stage.json").read_text())["settings"]["budget_scope"] == "trace"
    cells = [path for path in evictor.rglob("generations.jsonl") if path.parent.name != "full"]
    assert cells
    for path in cells:
        for record in map(json.loads, path.read_text().splitlines()):
            assert record["sampling"]["temperature"] == 0.6
            assert record["eviction"]["peak_slots"] <= len(record["prompt_ids"]) + record["budget_tokens"] + 128
