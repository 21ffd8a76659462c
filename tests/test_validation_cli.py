"""validation.layers / validation.compare CLIs: outputs, resolved config, policy JSON, the run-directory contract
(--out a file, a second concurrent run, other settings) and exit code 2 on bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from validation import compare, layers
from validation.signals import Aligned, AlignedTrace

REPO = Path(__file__).resolve().parents[1]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _label(trace_id: str, positions, labels, start: int, end: int, **extra) -> dict:
    return {"kind": "label", "id": trace_id, "dataset": "gsm8k", "model": "m", "status": "labelled",
            "positions": positions, "labels": labels, "reasoning_start": start, "answer_start": end, **extra}


def _signal(trace_id: str, positions, signals: dict, smoothing: str, window: int | None) -> dict:
    record = {"kind": "signal", "id": trace_id, "model": "m", "n_tokens": positions[-1] + 1, "n_prompt": positions[0],
              "positions": positions, "signals": signals, "smoothing": smoothing}
    return record if window is None else {**record, "window": window}


def _layer_data(tmp_path: Path, n_traces: int = 20, tokens: int = 80, signal_ids=None, strength: float = 3.0,
                incorrect_every: int = 0, undefined_first: bool = False):
    """Labels and two `python -m signals` files (rolling mean and rolling z, window 64) with Band A = layers 1-3
    (positive), Band B = 5-6 (negative) in hidden_diff, and a layerless h2o score in the mean file.

    The raw (mean64) signals carry a within-trace positional trend that the detrended (z64) ones lack, falling in
    the early band and rising in the late one (EpiKV §3.2), so the trends add up in the raw combined score and the
    detrended combined score ranks better. Every `incorrect_every`-th trace is marked answered incorrectly (labels
    made with labeling.occlusion --include-incorrect); `undefined_first` writes null at the first reasoning position
    of layer 0, as `python -m signals` does for hidden_diff at a trace's first position.
    """
    rng = np.random.default_rng(0)
    labels, means, zs = [], [], []
    for i in range(n_traces):
        start = 10
        lab = (rng.random(tokens) < 0.3).astype(int)
        positions = list(range(start + tokens))
        correct = not (incorrect_every and i % incorrect_every == 0)
        labels.append(_label(f"p{i}", positions, [1] * start + lab.tolist(), start, start + tokens, correct=correct))
        trend = np.linspace(0, 3, tokens)
        mean, z_scores = {}, {}
        for layer in range(8):
            coef = strength if 1 <= layer <= 3 else (-strength if layer in (5, 6) else 0.0)
            z = coef * lab + rng.normal(size=tokens)
            z_scores[str(layer)] = z.tolist()
            # As in EpiKV §3.2: the early band's raw signal falls with position, the late band's rises.
            mean[str(layer)] = (z + (trend if layer >= 4 else -trend)).tolist()
        if undefined_first:
            mean["0"][0] = z_scores["0"][0] = None
        trace_id = f"p{i}" if signal_ids is None else signal_ids(i)
        means.append(_signal(trace_id, positions[start:], {"hidden_diff": mean,
                                                           "h2o": {"agg": rng.normal(size=tokens).tolist()}},
                             "mean", 64))
        zs.append(_signal(trace_id, positions[start:], {"hidden_diff": z_scores}, "z", 64))
    signal_files = [str(_write_jsonl(tmp_path / "signals_mean.jsonl", means)),
                    str(_write_jsonl(tmp_path / "signals_z.jsonl", zs))]
    return str(_write_jsonl(tmp_path / "labels.jsonl", labels)), signal_files


def _read_csv(path: Path) -> list[dict]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_layers_cli_writes_tables_policy_and_config(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "500"]) == 0
    assert {p.name for p in out.iterdir()} == {"layers.csv", "scorers.csv", "positional.csv", "summary.json",
                                               "policy.json", "config.json"}
    policy = json.loads((out / "policy.json").read_text())
    assert policy["policy"] == "epikv"  # the detrended combined score beats the raw one
    assert set(policy["params"]) == {"positive_layers", "negative_layers", "window"}
    assert len(policy["params"]["positive_layers"]) == 1 and policy["params"]["positive_layers"][0] in (1, 2, 3)
    assert len(policy["params"]["negative_layers"]) == 1 and policy["params"]["negative_layers"][0] in (5, 6)
    assert policy["params"]["window"] == 64  # the window the signals were smoothed with, read from their names
    prov = policy["provenance"]
    assert [(b["sign"], b["layers"]) for b in prov["bands"]] == [(1, [1, 2, 3]), (-1, [5, 6])]
    assert prov["n_traces"] == 20 and prov["n_tokens"] == 20 * 80
    assert prov["chosen"]["signal"] == "band:hidden_diff.z64"
    assert prov["combined_scores"]["epikv"]["within_rho"] > prov["combined_scores"]["epikv_raw"]["within_rho"]
    chosen = prov["chosen"]
    assert chosen["within_lo"] < chosen["within_rho"] < chosen["within_hi"]
    assert chosen["within_t_lo"] < chosen["within_rho"] < chosen["within_t_hi"]
    assert chosen["within_boot_lo"] < chosen["within_rho"] < chosen["within_boot_hi"]
    assert prov["significance"] == "within_t_significant"
    config = json.loads((out / "config.json").read_text())
    assert (config["family"], config["raw_transform"], config["detrended_transform"], config["band_transform"]) == (
        "hidden_diff", "mean64", "z64", "mean64")
    assert config["identity"]["n_boot"] == 500 and config["identity"]["correct_only"] is False
    rows = _read_csv(out / "layers.csv")
    assert len(rows) == 17 and all(r["within_n_eff"] == "20" for r in rows)
    assert {"within_boot_lo", "within_boot_hi", "position_boot_lo", "position_boot_hi"} <= set(rows[0])
    positional = {r["layer"]: r for r in _read_csv(out / "positional.csv")}
    combined = positional["combined"]
    assert float(combined["raw_position_t_lo"]) < float(combined["raw_position_rho"]) < float(
        combined["raw_position_t_hi"])
    assert float(combined["raw_position_rho"]) < -0.3 and abs(float(combined["detrended_position_rho"])) < 0.1
    assert float(combined["abs_position_rho_reduction"]) > 0.3
    assert "policy epikv" in capsys.readouterr().out


def test_bands_rest_on_the_t_interval_not_the_papers_interval():
    # Twelve long traces whose per-trace rho agree closely (SD ~0.05) on a modest value, +0.25 at layers 1-2 and
    # -0.25 at layer 3: the paper's Fisher-z interval on 12 traces (half-width 0.65 in z) calls no layer
    # significant; the t-interval over the traces finds both bands.
    rng = np.random.default_rng(2)
    names = [f"hidden_diff.l{layer}.mean64" for layer in range(4)]
    traces = []
    for i in range(12):
        lab = (rng.random(400) < 0.3).astype(float)
        values = np.column_stack([w * lab + rng.normal(size=400) for w in (0.0, 0.55, 0.55, -0.55)])
        traces.append(AlignedTrace(f"t{i}", np.arange(400), lab, values))
    config = layers.LayersConfig(labels="labels.jsonl", signals=("signals.jsonl",), n_boot=200)
    result = layers.analyse(Aligned(names, traces), config)
    rows = {r["layer"]: r for r in result.rows}
    assert not any(r["within_significant"] for r in rows.values())
    assert [rows[layer]["within_t_significant"] for layer in range(4)] == [False, True, True, True]
    assert [(b.sign, b.layers) for b in result.bands] == [(1, (1, 2)), (-1, (3,))]


def test_layers_cli_band_mean_mode(tmp_path):
    labels, signals = _layer_data(tmp_path)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "200",
                        "--band-layers", "all", "--correction", "bonferroni", "--window", "32"]) == 0
    params = json.loads((out / "policy.json").read_text())["params"]
    assert params == {"positive_layers": [1, 2, 3], "negative_layers": [5, 6], "window": 32}


def test_layers_cli_uses_labels_made_with_include_incorrect_without_repeating_it(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path, incorrect_every=2)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "200"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_traces"] == 20 and summary["skipped_label_records"] == {}
    capsys.readouterr()
    assert layers.main(["--labels", labels, "--signals", *signals, "--correct-only", "--n-boot", "200"]) == 0
    assert "hidden_diff.l2.z64" in capsys.readouterr().out
    only_correct = layers.validate_layers(layers.LayersConfig(labels=labels, signals=tuple(signals),
                                                              correct_only=True, n_boot=200))
    assert only_correct.n_traces == 10 and only_correct.skipped_label_records == {"not correct": 10}


def _two_families(tmp_path: Path, families=("hidden_diff",), smoothing: str = "mean") -> tuple[str, str]:
    """Labels and one signal file of rolling means over 32 tokens (no detrended transform) for each family."""
    rng = np.random.default_rng(1)
    labels, signals = [], []
    for i in range(10):
        lab = (rng.random(60) < 0.4).astype(int)
        labels.append(_label(f"p{i}", list(range(60)), lab.tolist(), 0, 60))
        per_family = {family: {str(layer): ({1: 4.0, 2: -4.0}.get(layer, 0.0) * lab + rng.normal(size=60)).tolist()
                               for layer in range(4)} for family in families}
        signals.append(_signal(f"p{i}", list(range(60)), per_family, smoothing, 32 if smoothing == "mean" else None))
    return str(_write_jsonl(tmp_path / "labels.jsonl", labels)), str(_write_jsonl(tmp_path / "s.jsonl", signals))


def test_layers_cli_raw_only_signals_give_raw_policy(tmp_path):
    labels, signals = _two_families(tmp_path)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", signals, "--out", str(out), "--n-boot", "200"]) == 0
    policy = json.loads((out / "policy.json").read_text())
    # No detrended transform in the file: only the raw combined score exists; window from "mean32".
    assert policy["policy"] == "epikv_raw"
    assert policy["params"] == {"positive_layers": [1], "negative_layers": [2], "window": 32}
    assert not (out / "positional.csv").exists()


def test_layers_cli_unsmoothed_signals_configure_no_policy(tmp_path, capsys):
    labels, signals = _two_families(tmp_path, smoothing="raw")
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", signals, "--out", str(out), "--n-boot", "200"]) == 0
    # Bands are found in raw g, but epikv_raw scores with a rolling mean of g: nothing validated it.
    assert json.loads((out / "summary.json").read_text())["bands"] and not (out / "policy.json").exists()
    assert "rolling mean (epikv_raw) or rolling z-score (epikv)" in capsys.readouterr().out


def test_layers_cli_needs_family_when_ambiguous(tmp_path, capsys):
    labels, signals = _two_families(tmp_path, families=("key_norm", "value_variance"))
    assert layers.main(["--labels", labels, "--signals", signals, "--out", str(tmp_path / "o")]) == 2
    assert "--family" in capsys.readouterr().err and not (tmp_path / "o").exists()
    out = tmp_path / "kv"
    assert layers.main(["--labels", labels, "--signals", signals, "--family", "key_norm", "--n-boot", "200",
                        "--out", str(out)]) == 0
    # Bands exist in key_norm, but no band policy scores with it: no configuration that would deploy g_l instead.
    assert json.loads((out / "summary.json").read_text())["bands"] and not (out / "policy.json").exists()
    assert "score with hidden_diff, not key_norm" in capsys.readouterr().out


def test_layers_cli_drops_undefined_positions(tmp_path):
    labels, signals = _layer_data(tmp_path, undefined_first=True)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "200"]) == 0
    policy = json.loads((out / "policy.json").read_text())
    assert policy["policy"] == "epikv" and policy["params"]["window"] == 64
    prov = policy["provenance"]
    assert (prov["raw_transform"], prov["detrended_transform"]) == ("mean64", "z64")
    assert prov["nonfinite_positions_dropped"] == 20  # the first reasoning position of each trace
    assert prov["n_tokens"] == 20 * 79


def test_layers_cli_one_sided_bands_write_no_policy(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path)
    names = [f"hidden_diff.l{layer}.mean64" for layer in range(5)]  # only the positive band is present
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--signal-names", *names, "--n-boot", "200",
                        "--out", str(out)]) == 0
    assert "need both a positive and a negative band" in capsys.readouterr().out
    assert (out / "layers.csv").exists() and not (out / "policy.json").exists()


def test_layers_cli_without_band_writes_tables_but_no_policy(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path, strength=0.0)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "200"]) == 0
    assert (out / "layers.csv").exists() and not (out / "policy.json").exists()
    assert "no policy" in capsys.readouterr().out


def test_layers_cli_without_out_writes_nothing(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path)
    before = set(tmp_path.iterdir())
    assert layers.main(["--labels", labels, "--signals", *signals, "--n-boot", "200"]) == 0
    assert set(tmp_path.iterdir()) == before
    assert "hidden_diff.l2.z64" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case,extra,message",
    [
        ("other_traces", [], "share no trace"),
        ("few_traces", [], "n_eff=3"),
        ("ok", ["--signal-names", "hidden_diff.l2.z65"], "unknown signal 'hidden_diff.l2.z65'"),
        ("ok", ["--correction", "fdr"], "unknown multiple-comparison correction"),
        ("ok", ["--family", "hiden_diff"], "did you mean 'hidden_diff'"),
        ("ok", ["--raw-transform", "mean32"], "unknown transform"),
        ("ok", ["--alpha", "1.5"], "--alpha"),
        ("ok", ["--n-boot", "0"], "--n-boot"),
        ("ok", ["--include-incorrect"], "unrecognized arguments: --include-incorrect"),
    ],
)
def test_layers_cli_bad_input_exits_2_without_output(tmp_path, capsys, case, extra, message):
    if case == "other_traces":
        labels, signals = _layer_data(tmp_path, signal_ids=lambda i: f"other{i}")
    else:
        labels, signals = _layer_data(tmp_path, n_traces=3 if case == "few_traces" else 20)
    out = tmp_path / "out"
    assert layers.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "200",
                        *extra]) == 2
    assert message in _one_line(capsys)
    assert not out.exists()


def _trace(problem: str, correct, policy: str | None = None, budget=None, **extra) -> dict:
    """A trace record as tasks.run (no policy: dense) or evictor.run writes it."""
    record = {"kind": "trace", "id": problem, "dataset": "gsm8k", "model": "m", "prompt_ids": [1, 2],
              "generated_ids": [3, 4], "correct": correct, **extra}
    if policy is not None:
        record.update(policy=policy, budget=budget, eviction={"rounds": 0 if policy == "full" else 2})
    return record


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    a = [1, 1, 0, 1, 0, 1, 1, 1]
    b = [0, 1, 0, 0, 0, 1, 0, 1]
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    run_a.mkdir()
    run_b.mkdir()
    _write_jsonl(run_a / "generations.jsonl", [_trace(f"q{i}", bool(c), "epikv", 512) for i, c in enumerate(a)]
                 + [_trace("q99", None, "epikv", 512)])  # ungraded: left out
    _write_jsonl(run_b / "generations.jsonl", [_trace(f"q{i}", bool(c), "h2o", 512) for i, c in enumerate(b)]
                 + [_trace("extra", True, "h2o", 512)])
    return run_a, run_b


def test_compare_cli_outputs_and_values(tmp_path):
    run_a, run_b = _runs(tmp_path)
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(run_a), str(run_b), "--out", str(out), "--n-boot", "2000"]) == 0
    assert {p.name for p in out.iterdir()} == {"comparison.csv", "comparison.json", "accuracy.csv", "config.json"}
    (row,) = json.loads((out / "comparison.json").read_text())["comparisons"]
    # Paired on the 8 shared problems: 6/8 vs 3/8; A wins 3 discordant problems, B none -> sign p = 2/8.
    assert row["n_problems"] == 8 and row["only_in_b"] == 1 and row["only_in_a"] == 0
    assert (row["policy_a"], row["budget_a"], row["policy_b"], row["budget_b"]) == ("epikv", 512, "h2o", 512)
    assert row["accuracy_a"] == pytest.approx(0.75) and row["accuracy_b"] == pytest.approx(0.375)
    assert row["difference"] == pytest.approx(0.375) and row["ci_lo"] <= 0.375 <= row["ci_hi"]
    assert row["sign_p_value"] == pytest.approx(0.25) and row["sign_n_discordant"] == 3
    accuracy = {r["run"]: r for r in _read_csv(out / "accuracy.csv")}
    assert float(accuracy["B"]["accuracy"]) == pytest.approx(4 / 9) and accuracy["B"]["problems"] == "9"
    assert accuracy["A"]["ci_method"] == "wilson" and {"ci_lo", "ci_hi"} <= set(accuracy["A"])
    config = json.loads((out / "config.json").read_text())
    assert config["policies_a"] == ["epikv"] and config["identity"]["n_boot"] == 2000


def test_compare_single_budget_baseline_against_every_budget(tmp_path):
    baseline = _write_jsonl(tmp_path / "full.jsonl", [_trace(f"q{i}", True) for i in range(5)])
    swept = _write_jsonl(tmp_path / "sweep.jsonl", [
        _trace(f"q{i}", i < k, "random", budget, sample=s)
        for budget, k in ((256, 1), (1024, 4)) for i in range(5) for s in range(2)])
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(baseline), str(swept), "--out", str(out), "--n-boot", "500"]) == 0
    rows = json.loads((out / "comparison.json").read_text())["comparisons"]
    assert [(r["policy_a"], r["budget_a"], r["budget_b"]) for r in rows] == [("full", None, 256), ("full", None, 1024)]
    assert [r["accuracy_b"] for r in rows] == pytest.approx([0.2, 0.8])
    accuracy = _read_csv(out / "accuracy.csv")
    assert [r["ci_method"] for r in accuracy if r["run"] == "B"] == ["bootstrap", "bootstrap"]  # 2 samples each
    assert [r["samples"] for r in accuracy if r["run"] == "B"] == ["10", "10"]


def _sweep_and_dense(tmp_path: Path) -> tuple[Path, Path]:
    """An evictor.run sweep (one directory per cell, two policies x two budgets) and a tasks.run dense run."""
    sweep, dense = tmp_path / "evict", tmp_path / "dense"
    correct = {("random", 128): [0, 0, 1, 0, 0, 1], ("random", 256): [1, 0, 1, 0, 1, 1],
               ("epikv", 128): [1, 0, 1, 1, 0, 1], ("epikv", 256): [1, 1, 1, 1, 0, 1]}
    for (policy, budget), values in correct.items():
        cell = sweep / f"{policy}-K{budget}"
        cell.mkdir(parents=True)
        _write_jsonl(cell / "generations.jsonl", [_trace(f"q{i}", bool(c), policy, budget)
                                                  for i, c in enumerate(values)])
    dense.mkdir()
    _write_jsonl(dense / "generations.jsonl", [_trace(f"q{i}", True) for i in range(6)])
    (dense / "summary.json").write_text("{}\n")  # other files of a run directory are not read
    return sweep, dense


def test_compare_a_sweep_of_several_policies_against_the_dense_run(tmp_path, capsys):
    sweep, dense = _sweep_and_dense(tmp_path)
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(sweep), str(dense), "--out", str(out), "--n-boot", "300"]) == 0
    rows = json.loads((out / "comparison.json").read_text())["comparisons"]
    assert [(r["policy_a"], r["budget_a"], r["policy_b"], r["budget_b"]) for r in rows] == [
        ("epikv", 128, "full", None), ("epikv", 256, "full", None),
        ("random", 128, "full", None), ("random", 256, "full", None)]
    assert [r["accuracy_a"] for r in rows] == pytest.approx([4 / 6, 5 / 6, 2 / 6, 4 / 6])
    assert all(r["accuracy_b"] == 1.0 and r["n_problems"] == 6 for r in rows)
    accuracy = _read_csv(out / "accuracy.csv")
    assert [(r["run"], r["policy"], r["budget"]) for r in accuracy] == [
        ("A", "epikv", "128"), ("A", "epikv", "256"), ("A", "random", "128"), ("A", "random", "256"),
        ("B", "full", "")]
    # One policy of the sweep against the dense run, selected by name; "full" names the dense generation.
    capsys.readouterr()
    assert compare.main(["--runs", str(sweep), str(dense), "--policies", "epikv", "full", "--n-boot", "300"]) == 0
    printed = capsys.readouterr().out
    assert "A epikv@128 - B full@None" in printed and "random" not in printed


def test_compare_names_the_policies_a_run_has(tmp_path, capsys):
    sweep, dense = _sweep_and_dense(tmp_path)
    assert compare.main(["--runs", str(sweep), str(dense), "--policies", "all", "dense"]) == 2
    assert "unknown policy in" in (err := _one_line(capsys)) and "valid choices: full" in err
    assert compare.main(["--runs", str(sweep), str(sweep)]) == 2
    assert "both runs hold several policies (A: epikv, random; B: epikv, random)" in _one_line(capsys)
    assert compare.main(["--runs", str(sweep), str(sweep), "--policies", "epikv", "random", "--n-boot", "200"]) == 0


def test_compare_selects_policies_from_one_file(tmp_path):
    both = _write_jsonl(tmp_path / "both.jsonl", [
        _trace(f"q{i}", bool(c), p, 64) for p, cs in (("x", [1, 1, 0, 1]), ("y", [0, 1, 0, 0]))
        for i, c in enumerate(cs)])
    assert compare.main(["--runs", str(both), str(both)]) == 2  # two policies on each side, no --policies
    assert compare.main(["--runs", str(both), str(both), "--policies", "x", "y", "--n-boot", "200"]) == 0


@pytest.mark.parametrize(
    "records_b,extra,message",
    [
        ([_trace("other", True)], [], "no problem id appears in both"),
        ([_trace("q0", "yes")], [], 'correct "yes" is not true or false'),
        ([_trace("q0", True), _trace("q0", False)], [], "duplicate record"),
        ([_trace("q0", True, "h2o", 64)], ["--policies", "epikv", "h20"], "did you mean 'h2o'"),
        ([_trace("q0", True)], ["--ci", "wald"], "unknown accuracy interval method"),
        ([_trace("q0", None)], [], "no graded trace"),
        ([{"kind": "label", "id": "q0", "dataset": "gsm8k", "model": "m", "status": "skipped"}], [],
         "is a label record, not a trace record"),
    ],
)
def test_compare_cli_bad_input_exits_2_without_output(tmp_path, capsys, records_b, extra, message):
    a = _write_jsonl(tmp_path / "a.jsonl", [_trace("q0", True, "epikv", 64)])
    b = _write_jsonl(tmp_path / "b.jsonl", records_b)
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(a), str(b), "--out", str(out), *extra]) == 2
    assert message in _one_line(capsys)
    assert not out.exists()


def _capped(problem: str, correct: bool, policy: str, budget, peak: int | None) -> dict:
    """An evictor.run trace that evicted and held at most `peak` cache slots per KV head."""
    return {**_trace(problem, correct, policy, budget), "eviction": {"rounds": 3, "peak_slots": peak}}


def test_compare_refuses_unequal_peak_cache_unless_told_to(tmp_path, capsys):
    """The same K under two protocols is not the same cache: refused in one line naming both peaks, unless
    --allow-unequal-cache (recorded); equal peaks and the dense reference pass."""
    correct = [1, 0, 1, 1, 0, 1]
    epikv = _write_jsonl(tmp_path / "epikv.jsonl", [_capped(f"q{i}", bool(c), "epikv", 128, 161 + (i == 5))
                                                    for i, c in enumerate(correct)])
    random = _write_jsonl(tmp_path / "random.jsonl", [_capped(f"q{i}", bool(c), "random", 128, 256 if i else None)
                                                      for i, c in enumerate(correct)])
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(epikv), str(random), "--out", str(out), "--n-boot", "200"]) == 2
    err = _one_line(capsys)
    assert "A epikv at budget 128 and B random at budget 128 held unequal peak cache: 162 vs 256 slots" in err
    assert "(problem 'q1': 161 vs 256)" in err and "--allow-unequal-cache" in err and not out.exists()
    assert compare.main(["--runs", str(epikv), str(random), "--out", str(out), "--n-boot", "200",
                         "--allow-unequal-cache"]) == 0
    (row,) = json.loads((out / "comparison.json").read_text())["comparisons"]
    assert (row["peak_slots_a"], row["peak_slots_b"], row["equal_cache"]) == (162, 256, False)
    assert json.loads((out / "config.json").read_text())["identity"]["allow_unequal_cache"] is True

    equal = _write_jsonl(tmp_path / "equal.jsonl", [_capped(f"q{i}", bool(c), "random", 128, 161 + (i == 5))
                                                    for i, c in enumerate(correct)])
    assert compare.main(["--runs", str(epikv), str(equal), "--out", str(tmp_path / "eq"), "--n-boot", "200"]) == 0
    (row,) = json.loads((tmp_path / "eq" / "comparison.json").read_text())["comparisons"]
    assert (row["peak_slots_a"], row["peak_slots_b"], row["equal_cache"]) == (162, 162, True)
    dense = _write_jsonl(tmp_path / "dense.jsonl", [_trace(f"q{i}", True) for i in range(6)])
    assert compare.main(["--runs", str(epikv), str(dense), "--out", str(tmp_path / "dn"), "--n-boot", "200"]) == 0
    (row,) = json.loads((tmp_path / "dn" / "comparison.json").read_text())["comparisons"]
    assert (row["peak_slots_a"], row["peak_slots_b"], row["equal_cache"]) == (162, None, None)


# --- the run-directory contract, for both CLIs ------------------------------------------------------------------
def _layers_argv(tmp_path: Path) -> list[str]:
    labels, signals = _layer_data(tmp_path)
    return ["--labels", labels, "--signals", *signals, "--n-boot", "100"]


def _compare_argv(tmp_path: Path) -> list[str]:
    return ["--runs", *map(str, _runs(tmp_path)), "--n-boot", "100"]


CLIS = [pytest.param(layers, _layers_argv, "validate_layers", id="layers"),
        pytest.param(compare, _compare_argv, "compare", id="compare")]


@pytest.mark.parametrize("module,argv_of,_", CLIS)
def test_out_that_is_a_file_or_below_one_exits_2_and_writes_nothing(tmp_path, capsys, module, argv_of, _):
    argv = argv_of(tmp_path)
    file = tmp_path / "taken"
    file.write_text("keep me\n")
    before = sorted(tmp_path.rglob("*"))
    assert module.main([*argv, "--out", str(file)]) == 2
    assert "is a file, not a directory" in _one_line(capsys)
    assert module.main([*argv, "--out", str(file / "below")]) == 2
    assert "cannot create it" in _one_line(capsys)
    assert sorted(tmp_path.rglob("*")) == before and file.read_text() == "keep me\n"


@pytest.mark.parametrize("module,argv_of,stage", CLIS)
def test_a_second_concurrent_run_on_the_same_out_exits_2_at_once(tmp_path, capsys, monkeypatch, module, argv_of,
                                                                  stage):
    argv = [*argv_of(tmp_path), "--out", str(tmp_path / "out")]
    real = getattr(module, stage)
    second = []

    def first_run_still_working(config):
        second.append(module.main(argv))  # started while the first run holds --out
        return real(config)

    monkeypatch.setattr(module, stage, first_run_still_working)
    capsys.readouterr()
    assert module.main(argv) == 0
    assert second == [2]
    assert "is in use by another run (pid" in capsys.readouterr().err
    assert not (tmp_path / "out" / ".kvscope.lock").exists()


def test_a_rerun_with_other_settings_is_refused_naming_them(tmp_path, capsys):
    argv = [*_layers_argv(tmp_path), "--out", str(tmp_path / "out")]
    assert layers.main(argv) == 0
    before = (tmp_path / "out" / "layers.csv").read_text()
    assert layers.main(argv) == 0  # the same settings: the same results again
    assert (tmp_path / "out" / "layers.csv").read_text() == before
    capsys.readouterr()
    assert layers.main([*argv, "--correction", "holm"]) == 2
    err = _one_line(capsys)
    assert 'correction "fdr_bh" (now "holm")' in err and "another --out" in err
    assert (tmp_path / "out" / "layers.csv").read_text() == before


def test_module_entry_points_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv in (["-m", "validation.layers", "--labels", str(tmp_path / "no.jsonl"), "--signals", "x.jsonl"],
                 ["-m", "validation.select", "--labels", str(tmp_path / "no.jsonl"), "--signals", "x.jsonl", "--out",
                  str(tmp_path / "select")],
                 ["-m", "validation.compare", "--runs", str(tmp_path / "a"), str(tmp_path / "b")]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, env=env)
        assert proc.returncode == 2
        assert "does not exist" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert proc.stderr.startswith(argv[1] + ": error:")
