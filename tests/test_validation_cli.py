"""validation.layers / validation.compare CLIs: outputs, resolved config, policy JSON, exit code 2 on bad input."""

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

REPO = Path(__file__).resolve().parents[1]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _layer_data(tmp_path: Path, n_traces: int = 20, tokens: int = 80, signal_ids=None, strength: float = 3.0):
    """Labels + signals with Band A = layers 1-3 (positive), Band B = 5-6 (negative) in hidden_diff.

    The raw (roll64) signals carry a within-trace positional trend that the detrended (z64) ones lack, falling in
    the early band and rising in the late one (EpiKV §3.2), so the trends add up in the raw combined score and the
    detrended combined score ranks better.
    """
    rng = np.random.default_rng(0)
    labels, signals = [], []
    for i in range(n_traces):
        start = 10
        lab = (rng.random(tokens) < 0.3).astype(int)
        positions = list(range(start + tokens))
        labels.append({"trace_id": f"p{i}", "labels": [1] * start + lab.tolist(), "positions": positions,
                       "reasoning_start": start, "answer_start": start + tokens})
        sig = {"h2o": rng.normal(size=tokens).tolist()}
        trend = np.linspace(0, 3, tokens)
        for layer in range(8):
            coef = strength if 1 <= layer <= 3 else (-strength if layer in (5, 6) else 0.0)
            z = coef * lab + rng.normal(size=tokens)
            sig[f"hidden_diff.l{layer}.z64"] = z.tolist()
            # As in EpiKV §3.2: the early band's raw signal falls with position, the late band's rises.
            sig[f"hidden_diff.l{layer}.roll64"] = (z + (trend if layer >= 4 else -trend)).tolist()
        trace_id = f"p{i}" if signal_ids is None else signal_ids(i)
        signals.append({"trace_id": trace_id, "positions": positions[start:], "signals": sig})
    return _write_jsonl(tmp_path / "labels.jsonl", labels), _write_jsonl(tmp_path / "signals.jsonl", signals)


def _read_csv(path: Path) -> list[dict]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_layers_cli_writes_tables_policy_and_config(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path)
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", str(signals), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"layers.csv", "scorers.csv", "positional.csv", "summary.json",
                                               "policy.json", "config.json"}
    policy = json.loads((out / "policy.json").read_text())
    assert policy["policy"] == "epikv"  # the detrended combined score beats the raw one
    assert set(policy["params"]) == {"positive_layers", "negative_layers", "window"}
    assert len(policy["params"]["positive_layers"]) == 1 and policy["params"]["positive_layers"][0] in (1, 2, 3)
    assert len(policy["params"]["negative_layers"]) == 1 and policy["params"]["negative_layers"][0] in (5, 6)
    assert policy["params"]["window"] == 64
    prov = policy["provenance"]
    assert [(b["sign"], b["layers"]) for b in prov["bands"]] == [(1, [1, 2, 3]), (-1, [5, 6])]
    assert prov["n_traces"] == 20 and prov["n_tokens"] == 20 * 80
    assert prov["chosen"]["signal"] == "band:hidden_diff.z64"
    assert prov["combined_scores"]["epikv"]["within_rho"] > prov["combined_scores"]["epikv_raw"]["within_rho"]
    config = json.loads((out / "config.json").read_text())
    assert (config["family"], config["raw_transform"], config["detrended_transform"], config["band_transform"]) == (
        "hidden_diff", "roll64", "z64", "roll64")
    rows = _read_csv(out / "layers.csv")
    assert len(rows) == 17 and all(r["within_n_eff"] == "20" for r in rows)
    positional = {r["layer"]: r for r in _read_csv(out / "positional.csv")}
    combined = positional["combined"]
    assert float(combined["raw_position_rho"]) < -0.3 and abs(float(combined["detrended_position_rho"])) < 0.1
    assert float(combined["abs_position_rho_reduction"]) > 0.3
    assert "policy epikv" in capsys.readouterr().out


def test_layers_cli_band_mean_mode(tmp_path):
    labels, signals = _layer_data(tmp_path)
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", str(signals), "--out", str(out),
                        "--band-layers", "all", "--correction", "bonferroni", "--window", "32"]) == 0
    params = json.loads((out / "policy.json").read_text())["params"]
    assert params == {"positive_layers": [1, 2, 3], "negative_layers": [5, 6], "window": 32}


def _npz_legacy(tmp_path: Path, families=("g",)) -> tuple[Path, Path]:
    """Labels + .npz long-format signals named `{family}_l{layer}_mean32` (raw rolling means only)."""
    rng = np.random.default_rng(1)
    labels, columns = [], {"trace_id": [], "position": []}
    for i in range(10):
        lab = (rng.random(60) < 0.4).astype(int)
        labels.append({"trace_id": f"p{i}", "labels": lab.tolist(), "positions": list(range(60)),
                       "reasoning_start": 0, "answer_start": 60})
        columns["trace_id"] += [f"p{i}"] * 60
        columns["position"] += list(range(60))
        for family in families:
            for layer in range(4):
                coef = {1: 4.0, 2: -4.0}.get(layer, 0.0)
                columns.setdefault(f"{family}_l{layer}_mean32", []).extend(coef * lab + rng.normal(size=60))
    npz = tmp_path / "signals.npz"
    np.savez(npz, **{k: np.asarray(v) for k, v in columns.items()})
    return _write_jsonl(tmp_path / "labels.jsonl", labels), npz


def test_layers_cli_npz_legacy_names_give_raw_policy(tmp_path):
    labels, npz = _npz_legacy(tmp_path)
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", str(npz), "--out", str(out)]) == 0
    policy = json.loads((out / "policy.json").read_text())
    # No detrended transform in the file: only the raw combined score exists; window from "mean32".
    assert policy["policy"] == "epikv_raw"
    assert policy["params"] == {"positive_layers": [1], "negative_layers": [2], "window": 32}
    assert not (out / "positional.csv").exists()


def test_layers_cli_needs_family_when_ambiguous(tmp_path, capsys):
    labels, npz = _npz_legacy(tmp_path, families=("g", "kv"))
    assert layers.main(["--labels", str(labels), "--signals", str(npz), "--out", str(tmp_path / "o")]) == 2
    assert "--family" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert layers.main(["--labels", str(labels), "--signals", str(npz), "--family", "kv"]) == 0


def test_layers_cli_reads_probes_signals_files_one_per_smoothing(tmp_path):
    labels, signals = _layer_data(tmp_path)
    files = []
    for smoothing, transform in (("mean", "roll64"), ("z", "z64")):
        records = []
        for rec in map(json.loads, signals.read_text().splitlines()):
            per_layer = {str(layer): rec["signals"][f"hidden_diff.l{layer}.{transform}"] for layer in range(8)}
            per_layer["0"] = [None] + per_layer["0"][1:]  # probes.signals writes null where g is undefined
            records.append({"trace_id": rec["trace_id"], "positions": rec["positions"], "smoothing": smoothing,
                            "signals": {"hidden_diff": per_layer}})
        files.append(str(_write_jsonl(tmp_path / f"signals_{smoothing}.jsonl", records)))
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", *files, "--out", str(out)]) == 0
    policy = json.loads((out / "policy.json").read_text())
    assert policy["policy"] == "epikv" and policy["params"]["window"] == 64
    prov = policy["provenance"]
    assert (prov["raw_transform"], prov["detrended_transform"]) == ("mean", "z")
    assert prov["nonfinite_positions_dropped"] == 20  # the first reasoning position of each trace
    assert prov["n_tokens"] == 20 * 79


def test_layers_cli_one_sided_bands_write_no_policy(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path)
    names = [f"hidden_diff.l{layer}.roll64" for layer in range(5)]  # only the positive band is present
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", str(signals), "--signal-names", *names,
                        "--out", str(out)]) == 0
    assert "need both a positive and a negative band" in capsys.readouterr().out
    assert (out / "layers.csv").exists() and not (out / "policy.json").exists()


def test_layers_cli_without_band_writes_tables_but_no_policy(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path, strength=0.0)
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", str(signals), "--out", str(out)]) == 0
    assert (out / "layers.csv").exists() and not (out / "policy.json").exists()
    assert "no policy" in capsys.readouterr().out


def test_layers_cli_without_out_writes_nothing(tmp_path, capsys):
    labels, signals = _layer_data(tmp_path)
    before = set(tmp_path.iterdir())
    assert layers.main(["--labels", str(labels), "--signals", str(signals)]) == 0
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
        ("ok", ["--raw-transform", "roll32"], "unknown transform"),
        ("ok", ["--alpha", "1.5"], "--alpha"),
    ],
)
def test_layers_cli_bad_input_exits_2_without_output(tmp_path, capsys, case, extra, message):
    if case == "other_traces":
        labels, signals = _layer_data(tmp_path, signal_ids=lambda i: f"other{i}")
    else:
        labels, signals = _layer_data(tmp_path, n_traces=3 if case == "few_traces" else 20)
    out = tmp_path / "out"
    assert layers.main(["--labels", str(labels), "--signals", str(signals), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    a = [1, 1, 0, 1, 0, 1, 1, 1]
    b = [0, 1, 0, 0, 0, 1, 0, 1]
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    run_a.mkdir()
    run_b.mkdir()
    _write_jsonl(run_a / "results.jsonl", [{"id": f"q{i}", "correct": bool(c), "policy": "epikv", "budget": 512}
                                           for i, c in enumerate(a)] + [{"id": "q99", "note": "ungraded"}])
    _write_jsonl(run_b / "results.jsonl", [{"id": f"q{i}", "correct": bool(c), "policy": "h2o", "budget": 512}
                                           for i, c in enumerate(b)] + [{"id": "extra", "correct": True,
                                                                         "policy": "h2o", "budget": 512}])
    return run_a, run_b


def test_compare_cli_outputs_and_values(tmp_path):
    run_a, run_b = _runs(tmp_path)
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(run_a), str(run_b), "--out", str(out), "--n-boot", "2000"]) == 0
    assert {p.name for p in out.iterdir()} == {"comparison.csv", "comparison.json", "accuracy.csv", "config.json"}
    (row,) = json.loads((out / "comparison.json").read_text())["comparisons"]
    # Paired on the 8 shared problems: 6/8 vs 3/8; A wins 3 discordant problems, B none -> sign p = 2/8.
    assert row["n_problems"] == 8 and row["only_in_b"] == 1 and row["only_in_a"] == 0
    assert row["accuracy_a"] == pytest.approx(0.75) and row["accuracy_b"] == pytest.approx(0.375)
    assert row["difference"] == pytest.approx(0.375) and row["ci_lo"] <= 0.375 <= row["ci_hi"]
    assert row["sign_p_value"] == pytest.approx(0.25) and row["sign_n_discordant"] == 3
    accuracy = {r["run"]: r for r in _read_csv(out / "accuracy.csv")}
    assert float(accuracy["B"]["accuracy"]) == pytest.approx(4 / 9) and accuracy["B"]["n_problems"] == "9"
    assert accuracy["A"]["ci_method"] == "wilson"
    config = json.loads((out / "config.json").read_text())
    assert config["policy_a"] == "epikv" and config["n_boot"] == 2000


def test_compare_single_budget_baseline_against_every_budget(tmp_path):
    baseline = _write_jsonl(tmp_path / "full.jsonl", [{"id": f"q{i}", "correct": True} for i in range(5)])
    swept = _write_jsonl(tmp_path / "sweep.jsonl", [
        {"id": f"q{i}", "correct": i < k, "budget": budget, "sample": s}
        for budget, k in ((256, 1), (1024, 4)) for i in range(5) for s in range(2)])
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(baseline), str(swept), "--out", str(out), "--n-boot", "500"]) == 0
    rows = json.loads((out / "comparison.json").read_text())["comparisons"]
    assert [(r["budget_a"], r["budget_b"]) for r in rows] == [(None, 256), (None, 1024)]
    assert [r["accuracy_b"] for r in rows] == pytest.approx([0.2, 0.8])
    accuracy = _read_csv(out / "accuracy.csv")
    assert [r["ci_method"] for r in accuracy if r["run"] == "B"] == ["bootstrap", "bootstrap"]  # 2 samples each


def test_compare_selects_policies_from_one_run(tmp_path):
    both = _write_jsonl(tmp_path / "both.jsonl", [
        {"id": f"q{i}", "correct": c, "policy": p} for p, cs in (("x", [1, 1, 0, 1]), ("y", [0, 1, 0, 0]))
        for i, c in enumerate(cs)])
    assert compare.main(["--runs", str(both), str(both)]) == 2  # two policies, no --policies
    assert compare.main(["--runs", str(both), str(both), "--policies", "x", "y", "--n-boot", "200"]) == 0


@pytest.mark.parametrize(
    "records_b,extra,message",
    [
        ([{"id": "other", "correct": True}], [], "no problem id appears in both"),
        ([{"id": "q0", "correct": "yes"}], [], "'correct' must be"),
        ([{"id": "q0", "correct": True}, {"id": "q0", "correct": False}], [], "duplicate record"),
        ([{"id": "q0", "correct": True, "policy": "h2o"}], ["--policies", "epikv", "h20"], "did you mean 'h2o'"),
        ([{"id": "q0", "correct": True}], ["--ci", "wald"], "unknown accuracy interval method"),
        ([{"id": "q0"}], [], "no records with both"),
    ],
)
def test_compare_cli_bad_input_exits_2_without_output(tmp_path, capsys, records_b, extra, message):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"id": "q0", "correct": True, "policy": "epikv"}])
    b = _write_jsonl(tmp_path / "b.jsonl", records_b)
    out = tmp_path / "cmp"
    assert compare.main(["--runs", str(a), str(b), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_module_entry_points_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv in (["-m", "validation.layers", "--labels", str(tmp_path / "no.jsonl"), "--signals", "x.jsonl"],
                 ["-m", "validation.compare", "--runs", str(tmp_path / "a"), str(tmp_path / "b")]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, env=env)
        assert proc.returncode == 2
        assert "not found" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
