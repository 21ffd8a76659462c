"""Planted-fact probe: pinning, schedule, instance layout and statistics on hand-made inputs; the machinery on tiny
models (the fact is held exactly by the chosen (layer, head)s); the CLI's bad-input handling and output directory
contract shared by both probe CLIs; a smoke run on the default model (SmolLM2 with one KV head per query head)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import probes.config
from core.errors import UsageError
from core.rundir import RunDir
from core.schemas import ProbeRow
from evictor.engine import EvictionEngine
from evictor.policies import get_policy
from evictor.protocol import EvictionConfig
from probes.forcing import dense_logprobs, run_forced
from probes.instances import InstanceBuilder, Layout, base_layout, stub_ids
from probes.passcode import main as passcode_main
from probes.planted_fact import (
    SCRIPTS,
    PinnedFact,
    PlantedFactConfig,
    build_conditions,
    keep_mask,
    main,
    parse_head_sets,
    parse_layers,
    pin_scores,
    run_planted_fact,
)
from probes.schedule import Distance, Schedule, eviction_rounds, fact_rounds, parse_distance, protocol_layout
from probes.statistics import graded_recall, ratio_bootstrap, retrieval_statistics
from scoring.policy import ScoreInputs

REPO = Path(__file__).resolve().parents[1]
TEXTS = [(f"t{i}", f"Step {i}: we expand the product and collect like terms, so the sum of the roots is "
          f"{i + 2} over {i + 3}. Then we check the result by substitution and simplify the fraction. ")
         for i in range(6)]


# --- pure functions ----------------------------------------------------------------------------------------------
def test_pin_scores_forces_the_box_per_head():
    scores = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]])  # [batch 1, kv_head 2, candidates 4]
    positions = torch.tensor([[[10, 11, 12, 13], [10, 12, 13, 14]]])
    keep = torch.tensor([[True, False]])  # head 0 keeps the box [11, 13), head 1 deletes it
    out = pin_scores(scores, positions, (11, 13), keep)
    inf = math.inf
    expected = torch.tensor([[[0.1, inf, inf, 0.4], [0.5, -inf, 0.7, 0.8]]])
    assert torch.equal(out, expected)


def test_pinned_fact_wraps_the_policy_and_averages_shared_scores():
    keep = torch.zeros(2, 3, 2, dtype=torch.bool)  # rows 2, layers 3, kv_heads 2
    keep[0, 1, 1] = True
    positions = torch.arange(4).expand(2, 2, 4)
    inputs = ScoreInputs(layer=1, step=5, positions=positions, candidate_mask=torch.ones(2, 2, 4, dtype=torch.bool))
    pinned = PinnedFact(get_policy("recency"), (1, 3), keep).for_depth(3)  # recency: score = position, shared
    out = pinned.score(inputs)
    assert out[0, 1, 1] == math.inf and out[0, 1, 2] == math.inf  # row 0, head 1 keeps positions 1 and 2
    assert out[0, 0, 1] == -math.inf and torch.all(out[1, :, 1:3] == -math.inf)
    assert out[0, 0, 3] == 3.0 and out[1, 1, 0] == 0.0  # other candidates keep the policy's score
    assert pinned.default_protection == "prompt" and pinned.needs == get_policy("recency").needs
    with pytest.raises(UsageError, match="never evicts"):
        PinnedFact(get_policy("full"), (0, 1), keep)


def test_parse_head_sets_and_layers():
    sets = parse_head_sets("0; 1,0 ;all;none", 3, "m")
    assert [(s.label, s.heads) for s in sets] == [("0", (0,)), ("1,0", (0, 1)), ("all", (0, 1, 2)), ("none", ())]
    with pytest.raises(UsageError, match="twice"):  # the same set, however written, would be run twice
        parse_head_sets("0,1;1,0", 3, "m")
    with pytest.raises(UsageError, match="twice"):
        parse_head_sets("0,0", 3, "m")
    with pytest.raises(UsageError, match=r"heads 3, 5 out of range: smollm2-135m has KV heads 0\.\.2"):
        parse_head_sets("2,3,5", 3, "smollm2-135m")
    with pytest.raises(UsageError, match="empty head set"):
        parse_head_sets("0;;1", 3, "m")
    with pytest.raises(UsageError, match="not a head number"):
        parse_head_sets("x", 3, "m")
    assert parse_layers("all", 4, "m") == (0, 1, 2, 3)
    assert parse_layers("0-1,3", 4, "m") == (0, 1, 3)
    with pytest.raises(UsageError, match=r"layer 7 out of range: m has layers 0\.\.3"):
        parse_layers("2,7", 4, "m")


def test_keep_mask_and_conditions_dedupe_masks():
    mask = keep_mask((0, 2), (1,), n_layers=2, n_heads=3)
    assert mask.tolist() == [[False, False, False], [True, False, True]]
    conditions = build_conditions(parse_head_sets("0;all;none", 2, "m"), (0, 1), n_layers=2, n_heads=2)
    # 'all' over every layer is the kept reference and 'none' the deleted one: three distinct rows
    assert len(conditions.masks) == 3
    assert conditions.row_of["all"] == conditions.row_of["kept"]
    assert conditions.row_of["none"] == conditions.row_of["deleted"]
    restricted = build_conditions(parse_head_sets("all", 2, "m"), (1,), n_layers=2, n_heads=2)
    assert restricted.row_of["all"] != restricted.row_of["kept"]  # layers outside --layers delete the fact


def test_graded_recall_on_hand_made_numbers():
    lp, kept, deleted = [-1.0, -3.0], [0.0, -1.0], [-4.0, -5.0]
    # (3 + 2) / (4 + 4)
    assert graded_recall(lp, kept, deleted) == pytest.approx(0.625)
    assert graded_recall(kept, kept, deleted) == 1.0 and graded_recall(deleted, kept, deleted) == 0.0
    assert math.isnan(graded_recall(lp, deleted, kept))  # keeping no better than deleting: R undefined
    replicates = ratio_bootstrap([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 50, np.random.default_rng(0))
    assert np.allclose(replicates, 0.5)  # every instance has ratio 1/2, so every resample does too
    row = retrieval_statistics([1, 0, 1, 1], [-1.0, -5.0, -1.0, -1.0], 200, 0.95, 0, kept=[0.0] * 4,
                               deleted=[-6.0] * 4)
    assert row["retrieval"] == 0.75 and row["mean_lp"] == -2.0
    assert row["R"] == pytest.approx((5 + 1 + 5 + 5) / 24)
    assert row["retrieval_lo"] < 0.75 < row["retrieval_hi"] and row["R_lo"] <= row["R"] <= row["R_hi"]


def test_eviction_schedule_by_hand():
    config = EvictionConfig(budget=8, buffer=2)
    plain = Schedule(config, budget=8, limit=4, recency=0)
    # interval trigger: the first round once 8 + 2*2 = 12 tokens are resident, then every 2 tokens
    assert eviction_rounds(4, 17, plain) == [12, 14, 16]
    step = Schedule(EvictionConfig(budget=8, buffer=2, trigger="step"), budget=8, limit=4, recency=0)
    assert eviction_rounds(4, 13, step) == [11, 12, 13]  # whenever over 8 + 2
    layout = Layout(stub=4, lead=1, box=2, gap=0, question=3, value=2)  # box [5, 7), value at 10
    # a round sees the whole box as a candidate once box_end <= next_pos - buffer; it counts if next_pos < 10
    assert fact_rounds([8, 9, 10, 11], layout, plain) == 1
    resolved = protocol_layout(layout, Distance(3, "rounds"), config, ["prompt"])
    rounds = eviction_rounds(4, resolved.value_start, plain)
    assert fact_rounds(rounds, resolved, plain) == 3
    shorter = replace(resolved, gap=resolved.gap - 1)
    assert fact_rounds(eviction_rounds(4, shorter.value_start, plain), shorter, plain) == 2
    assert parse_distance("300t") == Distance(300, "tokens") and parse_distance("4") == Distance(4, "rounds")
    with pytest.raises(UsageError):
        parse_distance("4x")


def test_epikv_schedule_counts_the_recency_window_and_the_protection_by_hand():
    """EpiKV's protocol: K counts only scored tokens, a recency window min(128, K/4) is kept unscored, no buffer."""
    epikv = EvictionConfig(budget=8, buffer=0, trigger="step", recency=128, recency_share=0.25, budget_scope="trace")
    schedule = Schedule.of(epikv, "prompt", 10)
    # w = min(128, floor(8 / 4)) = 2; K_eff = 8 scored + 10 protected + 2 recent = 20: a round whenever over 20
    assert schedule == Schedule(epikv, budget=20, limit=10, recency=2)
    assert eviction_rounds(10, 23, schedule) == [21, 22, 23]
    layout = Layout(stub=10, lead=1, box=2, gap=0, question=6, value=2)  # box [11, 13), value at 19
    # the box is a candidate once it is older than the 2-token recency window: next_pos - 2 >= 13
    assert fact_rounds([14, 15, 16], layout, schedule) == 2
    # protecting only 4 sinks leaves K_eff = 14: rounds start earlier, so the layout for both protections is the
    # one the prompt-protecting policy needs
    sinks = protocol_layout(layout, Distance(2, "rounds"), epikv, ["sinks"])
    prompt = protocol_layout(layout, Distance(2, "rounds"), epikv, ["prompt"])
    assert prompt.gap > sinks.gap
    assert protocol_layout(layout, Distance(2, "rounds"), epikv, ["sinks", "prompt"]) == prompt


# --- tiny-model machinery ----------------------------------------------------------------------------------------
def _setup(lm, budget=128, buffer=8, distance=3):
    config = EvictionConfig(budget=budget, buffer=buffer)
    stub = stub_ids(lm.tokenizer)
    layout = base_layout(lm.tokenizer, SCRIPTS["ask"], len(stub), lead=8, box=16)
    layout = protocol_layout(layout, Distance(distance, "rounds"), config, ["prompt"])
    builder = InstanceBuilder(lm.tokenizer, SCRIPTS["ask"], TEXTS, layout, seed=0, uses_var=True)
    return config, stub, layout, builder


def test_instances_follow_the_layout(tiny_llama):
    tok = tiny_llama.tokenizer
    _, stub, layout, builder = _setup(tiny_llama)
    inst = builder.build(3)
    assert inst == builder.build(3)  # instance i depends only on (seed, i)
    assert len(inst.body) == layout.total - layout.stub
    text = tok.decode(inst.body)
    assert f"Let {inst.var} = {inst.value}." in text and text.endswith(f"{inst.var} = {inst.value}")
    fact = tok.decode(inst.body[layout.lead: layout.lead + layout.box])
    assert fact.startswith(f"\nLet {inst.var} = {inst.value}.")
    assert tok.decode([inst.body[p - layout.stub] for p in inst.watch]) == str(inst.value)
    assert tok.decode(inst.body[-layout.value:]) == str(inst.value)
    assert 1000 <= inst.value < 10000


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pinning_holds_the_fact_exactly_in_the_chosen_heads(family, tiny_llama, tiny_gemma3):
    lm = tiny_llama if family == "llama" else tiny_gemma3
    config, stub, layout, builder = _setup(lm)
    cfg = lm.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    conditions = build_conditions(parse_head_sets("0;1;all;none", n_heads, "tiny"), (0, 1, 3), n_layers, n_heads)
    keep = torch.stack(conditions.masks)  # one instance, one row per distinct mask
    inst = builder.build(0)
    engine = EvictionEngine(lm, PinnedFact(get_policy("random"), (layout.box_start, layout.box_end), keep), config)
    forced = run_forced(engine, stub, [inst.body] * len(keep), layout.value, inst.watch, seed=1)
    # the engine fires exactly the rounds the layout was planned with (the last value token is never fed)
    schedule = Schedule(config, budget=128, limit=len(stub), recency=0)
    assert forced.rounds == eviction_rounds(len(stub), layout.total - 1, schedule)
    assert fact_rounds(forced.rounds, layout, schedule) >= 3
    expected = keep.numpy().copy()
    window = getattr(cfg, "sliding_window", None)
    for layer, kind in enumerate(getattr(cfg, "layer_types", None) or []):
        if kind == "sliding_attention" and layout.value_start - 1 - min(inst.watch) >= window:
            expected[:, layer] = False  # out of the window: unreachable whatever the pin
    assert np.array_equal(forced.resident, expected)
    assert expected.any() and not expected.all()


def test_teacher_forcing_matches_a_dense_forward(tiny):
    """With the never-evicting policy the decode path must give the dense forward's log-probs (no off-by-one)."""
    config, stub, layout, builder = _setup(tiny)
    bodies = [builder.build(i).body for i in range(2)]
    watch = builder.build(0).watch
    forced = run_forced(EvictionEngine(tiny, "full", config), stub, bodies, layout.value, watch, seed=0)
    dense = dense_logprobs(tiny, stub, bodies, layout.value, watch)
    assert forced.logprobs.shape == (2, layout.value) and forced.rounds == []
    np.testing.assert_allclose(forced.logprobs, dense.logprobs, atol=2e-4)
    assert np.array_equal(forced.argmax, dense.argmax)
    assert np.array_equal(forced.resident, dense.resident)


# --- CLI ---------------------------------------------------------------------------------------------------------
def _cli(tmp_path, data_dir, *extra):
    return ["--model", "tiny-llama", "--n", "3", "--batch-size", "2", "--budget", "128", "--buffer", "8",
            "--lead", "8", "--distance", "2", "--n-boot", "200", "--threads", "1",
            "--data-file", os.path.join(data_dir, "math500.jsonl"), "--out", str(tmp_path / "run"), *extra]


def test_cli_runs_resumes_and_refuses_other_settings(tmp_path, data_dir, capsys):
    assert main(_cli(tmp_path, data_dir, "--heads", "0;all;none")) == 0
    out = tmp_path / "run"
    printed = capsys.readouterr().out
    for label in ("0 ", "all", "none", "full"):
        assert f"\n{label}" in printed
    records = [json.loads(line) for line in (out / "instances.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["i00000", "i00001", "i00002"]
    assert set(records[0]["conditions"]) == {"0", "all", "none", "kept", "deleted"}
    assert records[0]["conditions"]["0"]["resident"] == pytest.approx(0.5)  # head 0 of 2, every layer
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["condition"]: ProbeRow.from_json(r) for r in summary["rows"]}
    assert list(rows) == ["0", "all", "none", "full"]
    assert all(r.probe == "planted_fact" and r.id == label and r.n == 3 for label, r in rows.items())
    assert rows["0"].extra["n_heads"] == 1 and rows["none"].extra["n_heads"] == 0
    protocol = rows["0"].extra["protocol"]
    assert (protocol["protocol"], protocol["buffer"], protocol["trigger"], protocol["explicit"]) == (
        "custom", 8, "interval", ["buffer"])
    assert rows["0"].extra["peak_slots"] == 128 + 2 * 8  # the interval trigger fires at K + 2r
    assert rows["all"].R == pytest.approx(1.0) or math.isnan(rows["all"].R)  # 'all' is the kept reference
    assert rows["none"].R == pytest.approx(0.0) or math.isnan(rows["none"].R)  # 'none' is the deleted reference
    assert all(r.retrieval_lo <= r.retrieval <= r.retrieval_hi for r in rows.values())
    with open(out / "summary.csv") as handle:
        assert [r["condition"] for r in csv.DictReader(handle)] == list(rows)
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["n"] == 3 and config["config"]["heads"] == "0;all;none"
    assert main(_cli(tmp_path, data_dir, "--heads", "0;all;none")) == 0  # resume: nothing recomputed
    assert len((out / "instances.jsonl").read_text().splitlines()) == 3
    assert main(_cli(tmp_path, data_dir, "--heads", "1;all;none")) == 2
    assert 'head_sets ["0", "all", "none"] (now ["1", "all", "none"])' in capsys.readouterr().err


def test_library_returns_probe_rows(tmp_path, data_dir):
    config = PlantedFactConfig(model="tiny-llama", heads="1", n=2, budget=128, protocol_settings={"buffer": 8},
                               lead=8, distance="2",
                               n_boot=100, data_file=os.path.join(data_dir, "math500.jsonl"))
    result = run_planted_fact(config, tmp_path / "lib", progress=False)
    assert [r.condition for r in result.rows] == ["1", "kept", "deleted", "full"]
    assert all(isinstance(r, ProbeRow) and r.n == 2 for r in result.rows)
    assert result.rows[0].held == pytest.approx(0.5) and result.layout.box == 16


@pytest.mark.parametrize("extra, message", [
    (["--heads", "0;;1"], "empty head set"),
    (["--heads", "0,2"], "head 2 out of range: tiny-llama has KV heads 0..1"),
    (["--layers", "9"], "layer 9 out of range: tiny-llama has layers 0..3"),
    (["--policy", "randon"], "did you mean 'random'"),
    (["--policy", "full"], "never evicts"),
    (["--dataset", "math5000"], "unknown dataset"),
    (["--budget", "64"], "raise --budget"),
    (["--distance", "3x"], "--distance"),
    (["--level", "1"], "--level must be in (0, 1)"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, data_dir, capsys, extra, message):
    argv = _cli(tmp_path, data_dir, *extra)
    if "--dataset" in extra:
        argv = [a for a in argv if not a.endswith("math500.jsonl") and a != "--data-file"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("probe_main", [main, passcode_main], ids=["planted_fact", "passcode"])
@pytest.mark.parametrize("extra, message", [
    (["--out", "{file}"], "is a file, not a directory"),
    (["--out", "{file}/run"], "cannot create it"),
    (["--out", "{held}"], "is in use by another run"),
    (["--device", "bogus"], "'bogus' is not a device"),
])
def test_probe_clis_refuse_an_unusable_out_or_device_at_once(tmp_path, data_dir, capsys, monkeypatch, probe_main,
                                                             extra, message):
    """Both probes: an --out that is a file, lies below a file or is held by a running probe, and a device that does
    not exist, are one line and exit 2 before any model is loaded, and nothing is written."""
    monkeypatch.setattr(probes.config, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    occupied = tmp_path / "occupied"
    occupied.write_text("a file where a run directory is asked for")
    with RunDir(tmp_path / "held", {"probe": "another run"}):
        before = sorted(tmp_path.rglob("*"))
        argv = ["--model", "tiny-llama", "--data-file", os.path.join(data_dir, "math500.jsonl"), "--box", "32",
                "--out", str(tmp_path / "run"), *(arg.format(file=occupied, held=tmp_path / "held") for arg in extra)]
        assert probe_main(argv) == 2
        assert sorted(tmp_path.rglob("*")) == before
    assert occupied.read_text() == "a file where a run directory is asked for"
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_out_of_range_heads_on_smollm2_exit_code(tmp_path):
    """SmolLM2 itself has KV heads 0..2, so --heads 2,3,5 fails cleanly on it in a real process."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "probes.planted_fact", "--model", "smollm2-135m", "--heads",
                             "2,3,5", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "heads 3, 5 out of range: smollm2-135m has KV heads 0..2" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


# --- the default model -------------------------------------------------------------------------------------------
@pytest.mark.realmodel
def test_default_model_smoke_heads_2_3_5(tmp_path, data_dir, capsys):
    """The default model is SmolLM2 with 9 KV heads: the paper's head set {2,3,5} exists on it, the fact is held by
    exactly those heads, and keeping it everywhere beats deleting it."""
    argv = ["--heads", "2,3,5;all;none", "--n", "2", "--budget", "80", "--buffer", "8", "--lead", "8", "--distance",
            "2", "--threads", "1", "--n-boot", "200", "--data-file", os.path.join(data_dir, "math500.jsonl"),
            "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    assert "\n2,3,5 " in capsys.readouterr().out
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["loaded_model"]["name"] == "smollm2-135m-mha" and config["loaded_model"]["kv_heads"] == 9
    rows = {r["condition"]: r for r in json.loads((tmp_path / "s" / "summary.json").read_text())["rows"]}
    assert rows["2,3,5"]["held"] == pytest.approx(3 / 9) and rows["2,3,5"]["n_heads"] == 3
    assert rows["all"]["retrieval"] >= rows["none"]["retrieval"]
    assert rows["all"]["mean_lp"] > rows["none"]["mean_lp"]
    assert rows["all"]["held"] == 1.0 and rows["none"]["held"] == 0.0
