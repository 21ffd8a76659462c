"""Planted-fact probe: pinning, schedule, instance layout and statistics on hand-made inputs; the machinery on tiny
models (the fact is held exactly by the chosen (layer, head)s); the CLI's bad-input handling; a SmolLM2 smoke run."""

from __future__ import annotations

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

from evictor.engine import EvictionEngine
from evictor.policy import ScoreInputs, get_policy
from evictor.protocol import EvictionConfig
from core.errors import UsageError
from probes._eviction_probe import (
    Distance,
    InstanceBuilder,
    Layout,
    base_layout,
    dense_logprobs,
    eviction_rounds,
    fact_rounds,
    graded_recall,
    parse_distance,
    protocol_layout,
    ratio_bootstrap,
    run_forced,
    stub_ids,
    summarise,
)
from probes.planted_fact import (
    SCRIPTS,
    PinnedFact,
    build_conditions,
    keep_mask,
    main,
    parse_head_sets,
    parse_layers,
    pin_scores,
)

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
    sets = parse_head_sets("0; 0,1 ;all;none;1,0", 3, "m")
    assert [(s.label, s.heads) for s in sets] == [("0", (0,)), ("0,1", (0, 1)), ("all", (0, 1, 2)), ("none", ()),
                                                  ("1,0", (0, 1))]
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
    row = summarise([1, 0, 1, 1], [-1.0, -5.0, -1.0, -1.0], 200, 0.95, 0, kept=[0.0] * 4, deleted=[-6.0] * 4)
    assert row["retrieval"] == 0.75 and row["mean_lp"] == -2.0
    assert row["R"] == pytest.approx((5 + 1 + 5 + 5) / 24)
    assert row["retrieval_lo"] < 0.75 < row["retrieval_hi"] and row["R_lo"] <= row["R"] <= row["R_hi"]


def test_eviction_schedule_by_hand():
    config = EvictionConfig(budget=8, buffer=2)
    # interval trigger: the first round once 8 + 2*2 = 12 tokens are resident, then every 2 tokens
    assert eviction_rounds(4, 17, budget=8, limit=4, config=config) == [12, 14, 16]
    step = EvictionConfig(budget=8, buffer=2, trigger="step")
    assert eviction_rounds(4, 13, budget=8, limit=4, config=step) == [11, 12, 13]  # whenever over 8 + 2
    layout = Layout(stub=4, lead=1, box=2, gap=0, question=3, value=2)  # box [5, 7), value at 10
    # a round sees the whole box as a candidate once box_end <= next_pos - buffer; it counts if next_pos < 10
    assert fact_rounds([8, 9, 10, 11], layout, config) == 1
    resolved = protocol_layout(layout, Distance(3, "rounds"), config, "prompt")
    rounds = eviction_rounds(4, resolved.value_start, 8, 4, config)
    assert fact_rounds(rounds, resolved, config) == 3
    shorter = replace(resolved, gap=resolved.gap - 1)
    assert fact_rounds(eviction_rounds(4, shorter.value_start, 8, 4, config), shorter, config) == 2
    assert parse_distance("300t") == Distance(300, "tokens") and parse_distance("4") == Distance(4, "rounds")
    with pytest.raises(UsageError):
        parse_distance("4x")


# --- tiny-model machinery ----------------------------------------------------------------------------------------
def _setup(lm, budget=128, buffer=8, distance=3):
    config = EvictionConfig(budget=budget, buffer=buffer)
    stub = stub_ids(lm.tokenizer)
    layout = base_layout(lm.tokenizer, SCRIPTS["ask"], len(stub), lead=8, box=16)
    layout = protocol_layout(layout, Distance(distance, "rounds"), config, "prompt")
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
    assert forced.rounds == eviction_rounds(len(stub), layout.total - 1, 128, len(stub), config)
    assert fact_rounds(forced.rounds, layout, config) >= 3
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
    rows = {r["condition"]: r for r in summary["rows"]}
    assert rows["all"]["R"] == pytest.approx(1.0) or math.isnan(rows["all"]["R"])  # 'all' is the kept reference
    assert (out / "summary.csv").exists() and json.loads((out / "config.json").read_text())["n"] == 3
    assert main(_cli(tmp_path, data_dir, "--heads", "0;all;none")) == 0  # resume: nothing recomputed
    assert len((out / "instances.jsonl").read_text().splitlines()) == 3
    assert main(_cli(tmp_path, data_dir, "--heads", "1;all;none")) == 2
    assert "different settings" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--heads", "0;;1"], "empty head set"),
    (["--heads", "0,2"], "head 2 out of range: tiny-llama has KV heads 0..1"),
    (["--layers", "9"], "layer 9 out of range: tiny-llama has layers 0..3"),
    (["--policy", "randon"], "did you mean 'random'"),
    (["--policy", "full"], "never evicts"),
    (["--dataset", "math5000"], "unknown dataset"),
    (["--budget", "64"], "raise --budget"),
    (["--distance", "3x"], "--distance"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, data_dir, capsys, extra, message):
    argv = _cli(tmp_path, data_dir, *extra)
    if "--dataset" in extra:
        argv = [a for a in argv if not a.endswith("math500.jsonl") and a != "--data-file"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_cli_out_of_range_heads_on_smollm2_exit_code(tmp_path):
    """The brief's example: SmolLM2 has KV heads 0..2, so --heads 2,3,5 fails cleanly in a real process."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "probes.planted_fact", "--heads", "2,3,5", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "heads 3, 5 out of range: smollm2-135m has KV heads 0..2" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


# --- SmolLM2 -----------------------------------------------------------------------------------------------------
def test_smollm2_smoke_kept_beats_deleted(tmp_path, data_dir, capsys):
    argv = ["--heads", "all;none", "--n", "2", "--budget", "80", "--buffer", "8", "--lead", "8", "--distance", "2",
            "--threads", "1", "--n-boot", "200", "--data-file", os.path.join(data_dir, "math500.jsonl"),
            "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    rows = {r["condition"]: r for r in json.loads((tmp_path / "s" / "summary.json").read_text())["rows"]}
    assert rows["all"]["retrieval"] >= rows["none"]["retrieval"]
    assert rows["all"]["mean_lp"] > rows["none"]["mean_lp"]
    assert rows["all"]["held"] == 1.0 and rows["none"]["held"] == 0.0
