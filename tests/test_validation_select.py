"""validation.select: ranking (scorer, layer) pairs of `python -m signals` and evictor.replay files against occlusion
labels, choosing the best scorers a policy computes, and writing configurations that evictor.run runs unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from validation import select

N_LAYERS = 4  # the tiny model's depth, so the band configuration runs on it


def _write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _files(tmp_path: Path, n_traces: int = 16, tokens: int = 60) -> tuple[str, list[str]]:
    """Labels; hidden_diff smoothed with a rolling mean and a rolling z (window 64, hook_resid_pre), Band A = layer 1
    (positive), Band B = layer 3 (negative); and a replay of two policies: valuediff, whose scores follow the labels
    (per layer, per head and aggregated), and keynorm, whose scores oppose them."""
    rng = np.random.default_rng(1)
    labels, means, zs, replays = [], [], [], []
    start, end = 8, 8 + tokens
    for i in range(n_traces):
        lab = (rng.random(tokens) < 0.3).astype(int)
        positions = list(range(end + 4))  # four answer positions after the reasoning span
        labels.append({"kind": "label", "id": f"p{i}", "dataset": "gsm8k", "model": "m", "status": "labelled",
                       "positions": positions, "labels": [1] * start + lab.tolist() + [1] * 4,
                       "reasoning_start": start, "answer_start": end})

        def column(coef: float, noise: float = 1.0, lab=lab) -> list[float | None]:
            return [None] * start + (coef * lab + noise * rng.normal(size=tokens)).tolist() + [None] * 4

        common = {"kind": "signal", "id": f"p{i}", "model": "m", "n_tokens": len(positions), "n_prompt": start,
                  "positions": positions}
        for store, smoothing in ((means, "mean"), (zs, "z")):
            g = {str(layer): column({1: 2.0, 3: -2.0}.get(layer, 0.0)) for layer in range(N_LAYERS)}
            store.append({**common, "signals": {"hidden_diff": g}, "smoothing": smoothing, "window": 64,
                          "hidden_hook": "hook_resid_pre"})
        valuediff = {str(layer): column(3.0) for layer in range(N_LAYERS)}
        signals = {"valuediff": {**valuediff, "agg": column(3.0, 0.5)},
                   "valuediff.h0": {str(layer): column(2.5) for layer in range(N_LAYERS)},
                   "keynorm": {"agg": column(-3.0), **{str(layer): column(-3.0) for layer in range(N_LAYERS)}}}
        replays.append({**common, "signals": signals,
                        "policies": {"valuediff": {"policy": "valuediff", "params": {}},
                                     "keynorm": {"policy": "keynorm", "params": {}}}})
    files = [_write_jsonl(tmp_path / "signals_mean.jsonl", means), _write_jsonl(tmp_path / "signals_z.jsonl", zs),
             _write_jsonl(tmp_path / "replay.jsonl", replays)]
    return _write_jsonl(tmp_path / "labels.jsonl", labels), files


def test_ranks_every_scorer_and_writes_runnable_configurations(tmp_path, capsys):
    labels, signals = _files(tmp_path)
    out = tmp_path / "sel"
    assert select.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "300"]) == 0
    assert {p.name for p in out.iterdir()} == {"selection.json", "ranking.csv", "configs", "best.json", "config.json"}
    summary = json.loads((out / "selection.json").read_text())
    ranking = summary["ranking"]
    rhos = [r["within_rho"] for r in ranking]
    assert rhos == sorted(rhos, reverse=True) and [r["rank"] for r in ranking] == list(range(1, len(ranking) + 1))
    assert ranking[0]["signal"] == "valuediff.agg.raw"  # the least noisy
    by_signal = {r["signal"]: r for r in ranking}
    assert by_signal["valuediff.h0.l2.raw"]["policy"] == "valuediff" and by_signal["keynorm.l0.raw"]["within_rho"] < 0
    assert by_signal["hidden_diff.l0.z64"]["policy"] is None  # one layer's g: ranked, not deployed
    assert summary["bands"] and summary["band_layers"] == [[1], [3]]

    chosen = summary["chosen"]
    assert [c["name"] for c in chosen] == ["valuediff", "epikv", "epikv_raw"]  # keynorm opposes the labels
    assert chosen[0]["signal"] == "valuediff.agg.raw" and chosen[0]["params"] == {}
    assert json.loads((out / "best.json").read_text()) == json.loads((out / "configs" / "valuediff.json").read_text())
    band = json.loads((out / "configs" / "epikv.json").read_text())
    assert band["params"] == {"positive_layers": [1], "negative_layers": [3], "window": 64,
                              "hidden_hook": "hook_resid_pre"}
    assert band["provenance"]["scorer"]["signal"] == "band:hidden_diff.z64"
    assert all(c["within_lo"] <= c["within_rho"] <= c["within_hi"] and c["within_n_eff"] == 16 for c in chosen)
    assert json.loads((out / "configs" / "valuediff.json").read_text())["policy"] == "valuediff"
    assert "chosen: valuediff" in capsys.readouterr().out

    # the statistic can be recomputed independently: per-trace Spearman rho, averaged in Fisher-z space
    label_records = [json.loads(line) for line in Path(labels).read_text().splitlines()]
    replay_records = [json.loads(line) for line in Path(signals[2]).read_text().splitlines()]
    per_trace = []
    for lab, sig in zip(label_records, replay_records):
        span = slice(lab["reasoning_start"], lab["answer_start"])
        per_trace.append(sps.spearmanr(sig["signals"]["valuediff"]["agg"][span], lab["labels"][span])[0])
    assert chosen[0]["within_rho"] == pytest.approx(np.tanh(np.mean(np.arctanh(per_trace))), abs=1e-12)


def test_a_configuration_from_the_selection_runs_in_the_evictor(tmp_path, tiny_dir, one_thread):
    from evictor.run import main as evictor_main

    labels, signals = _files(tmp_path)
    out = tmp_path / "sel"
    assert select.main(["--labels", labels, "--signals", *signals, "--out", str(out), "--n-boot", "100",
                        "--top", "2"]) == 0
    problems = _write_jsonl(tmp_path / "problems.jsonl",
                            [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in (1, 2)])
    for name in ("valuediff", "epikv"):
        run = tmp_path / f"run-{name}"
        argv = ["--model", tiny_dir, "--dataset", "gsm8k", "--data-file", problems, "--max-new-tokens", "10",
                "--budget", "24", "--protect", "sinks", "--buffer", "4", "--policy-config",
                str(out / "configs" / f"{name}.json"), "--out", str(run), "--quiet"]
        assert evictor_main(argv) == 0
        records = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
        assert all(r["policy"] == name and r["eviction"]["rounds"] > 0 for r in records)
    config = records[0]["policy_config"]
    assert (config["positive_layers"], config["negative_layers"], config["hidden_hook"]) == ([1], [3],
                                                                                             "hook_resid_pre")


def test_without_hidden_diff_only_policies_are_ranked_and_bad_input_is_one_line(tmp_path, capsys):
    labels, signals = _files(tmp_path)
    out = tmp_path / "replay-only"
    assert select.main(["--labels", labels, "--signals", signals[2], "--out", str(out), "--top", "5",
                        "--n-boot", "100"]) == 0
    summary = json.loads((out / "selection.json").read_text())
    assert summary["bands"] == [] and [c["name"] for c in summary["chosen"]] == ["valuediff"]
    capsys.readouterr()
    never = tmp_path / "never"
    assert select.main(["--labels", labels, "--signals", signals[2], "--out", str(never), "--top", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--top: must be a positive integer" in err and len(err.splitlines()) == 1 and not never.exists()
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{**json.loads(Path(signals[2]).read_text().splitlines()[0]),
                                                 "policies": {"valuediff": "valuediff"}}])
    assert select.main(["--labels", labels, "--signals", bad, "--out", str(never)]) == 2
    assert '"policies" must map signal names to {"policy": name' in capsys.readouterr().err and not never.exists()


def test_traces_replay_select_and_sweep_compose_on_the_tiny_model(tmp_path, tiny_dir, one_thread):
    """The library path the study takes, each stage reading what the one before it returned or wrote: dense traces
    (tasks.run) -> replayed scores (evictor.replay) and per-layer signals (signals.traces) -> selection against labels
    aligned to the traces -> the chosen configuration, read back from its file, runs in evictor.run's sweep."""
    from core.cli import write_json
    from core.schemas import Label, Signal, as_json, read_records
    from evictor.policy import read_policy_configs
    from evictor.protocol import TOKENS, Budget
    from evictor.replay import ReplayConfig, build_engines, replay_signals
    from evictor.sweep import SweepConfig, run_sweep
    from models.loading import load_model
    from signals.traces import SignalsConfig, trace_signals
    from tasks.run import GenerationConfig, generate_traces
    from validation.layers import LayersConfig
    from validation.signals import load_aligned

    problems = _write_jsonl(tmp_path / "problems.jsonl",
                            [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)}
                             for i in range(6)])
    generation = GenerationConfig(dataset="gsm8k", model=tiny_dir, data_file=problems, max_new_tokens=40)
    lm = load_model(tiny_dir, device="cpu", dtype="float32")
    traces = list(generate_traces(lm, generation.problems(), generation))
    _write_jsonl(tmp_path / "traces.jsonl", as_json(traces))

    replay = ReplayConfig(tail=8)
    scored = {"r_kv": {"lam": 0.5}, "valuediff": {}}  # a policy with parameters, one without
    replayed = list(replay_signals(lm, build_engines(lm, scored, replay), traces, replay))
    replay_file = _write_jsonl(tmp_path / "replay.jsonl", as_json(replayed))
    signals_file = _write_jsonl(tmp_path / "signals.jsonl",
                                as_json(trace_signals(lm, traces, SignalsConfig(signals=("hidden_diff",)))))

    # labels on the traces' reasoning spans: 1 where r_kv's replayed score is above the trace's median
    labels = []
    for trace, record in zip(traces, read_records(replay_file, Signal)):
        start, end = record.extra["reasoning_start"], record.extra["answer_start"]
        assert (record.id, start, end) == (trace.id, len(trace.prompt_ids), len(trace.token_ids) - 8)
        scores = np.array(record.signals["r_kv"]["agg"][start:end], dtype=float)
        labels.append(Label(id=trace.id, dataset=trace.dataset, model=trace.model, status="labelled",
                            correct=trace.correct, reasoning_start=start, answer_start=end,
                            positions=list(range(end)),
                            labels=[1] * start + (scores > np.median(scores)).astype(int).tolist()))
    labels_file = _write_jsonl(tmp_path / "labels.jsonl", as_json(labels))
    aligned = load_aligned(labels_file, [replay_file, signals_file])
    assert aligned.hidden_hook == "hook_resid_pre" and aligned.policies == {
        "r_kv": {"policy": "r_kv", "params": {"lam": 0.5}}, "valuediff": {"policy": "valuediff", "params": {}}}

    selection = select.select(select.SelectConfig(LayersConfig(labels_file, (replay_file, signals_file), n_boot=100),
                                                  top=1))
    (chosen,) = selection.chosen
    assert (chosen["name"], chosen["signal"], chosen["within_n_eff"]) == ("r_kv", "r_kv.agg.raw", 6)
    config_file = write_json(tmp_path / "r_kv.json", selection.configs["r_kv"])
    params = read_policy_configs([str(config_file)])
    assert params == {"r_kv": {"lam": 0.5}}  # the replayed parameters, not the policy's defaults

    sweep = SweepConfig(dataclasses.replace(generation, limit=2, max_new_tokens=10), policies=tuple(params),
                        budgets=(Budget(24, TOKENS),), policy_params=params,
                        protocol_settings={"protect": "sinks", "buffer": 4, "block": 32})
    (cell,) = run_sweep(sweep, tmp_path / "sweep", quiet=True)
    assert (cell.policy, cell.params, cell.problems) == ("r_kv", {"lam": 0.5}, 2) and cell.mean_rounds > 0
    records = [json.loads(line) for line in (tmp_path / "sweep" / "generations.jsonl").read_text().splitlines()]
    assert all(r["policy_config"]["lam"] == 0.5 for r in records)
