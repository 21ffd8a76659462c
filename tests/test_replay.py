"""Dense replay (`evictor.replay`): for every registered policy, the scores the replay reports equal what a real
eviction round computes on the same cache; the Signal records it writes; the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_thinkv import PIECES  # tests/ is on sys.path under pytest
from test_triattention import TEXTS, calibrated, write_traces

from core.schemas import Signal, Trace, read_records
from core.seeds import derive_seed
from evictor.engine import EvictionEngine
from evictor.instrument import kept_positions
from evictor.policies import get_policy, policy_names
from evictor.protocol import TOKENS, WHOLE_PROMPT, Budget, EvictionConfig
from evictor.replay import AGGREGATE, ReplayConfig, chosen_policies, head_key, policy_signals, replay_scores
from evictor.replay import main as replay_main
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SCORED = [name for name in policy_names() if name != "full"]  # `full` evicts nothing: it has no score
PROMPT = [int(t) for t in torch.randint(5, 200, (12,), generator=torch.Generator().manual_seed(1))]
GENERATED = [int(t) for t in torch.randint(5, 200, (40,), generator=torch.Generator().manual_seed(2))]
SPAN = 30  # reasoning tokens; the last 10 generated tokens are the answer span
ANSWER_START = len(PROMPT) + SPAN
SEED = 11


@pytest.fixture(scope="module")
def calibrations(tmp_path_factory):
    """Calibration files made by ``python -m evictor.calibrate`` on tiny-llama traces."""
    return {"triattention": {"calibration": str(calibrated(tmp_path_factory, "triattention", TEXTS)[1])},
            "thinkv": {"calibration": str(calibrated(tmp_path_factory, "thinkv", PIECES, "--tau", "8")[1]),
                       "tau": 8}}


@pytest.fixture(scope="module")
def peaked():
    """Tiny models with far-from-uniform attention (per-head attention scores differ), Llama and sliding Gemma3."""
    return {family: tiny_model(family, seed=0, initializer_range=0.1) for family in ("llama", "gemma3")}


def real_round(lm, policy):
    """A real session teacher-forced through the same tokens whose protocol fires its first round after the forward
    of position ANSWER_START - 1, over exactly the reasoning span: returns that round's per-layer scores, its
    candidate positions and the keep log."""
    config = EvictionConfig(budget=ANSWER_START - 1, buffer=0, recency=0, trigger="step", protect="prompt",
                            block=WHOLE_PROMPT, keep_log=True)
    engine = EvictionEngine(lm, policy, config)
    captured = []
    with torch.inference_mode(), engine.session([PROMPT], max_new_tokens=SPAN, seed=SEED) as session:
        scorer = session.round_scores

        def recorded(span, candidate, keep):
            scores = scorer(span, candidate, keep)
            positions = session.cache.layers[0].positions[:, :, span[0]:span[1]]
            captured.append((torch.stack([layer[0] for layer in scores]).clone(), positions[0].clone(),
                             candidate.expand_as(positions)[0].clone(), keep))
            return scores

        session.round_scores = recorded
        session.prefill()
        for token in GENERATED[:SPAN]:
            session.step(torch.tensor([token]))
        log = session.keep_log.for_sequence(0)
    assert len(captured) == 1, "exactly one round, held at the answer boundary"
    scores, positions, candidate, keep = captured[0]
    assert candidate.all() and keep == SPAN - 1
    return scores, positions, log, engine


def without_own_window(policy):
    """`policy` keeping no newest tokens of its own (`Policy.kept_recent`): these tests score every reasoning
    position of a 30-token span, which a round covers only if none of it is kept unscored (SnapKV's 32-token window
    would not even fit the span); the policies' own windows are tested in tests/test_protection.py."""
    policy.kept_recent = lambda budget: 0
    return policy


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", SCORED)
def test_replay_scores_equal_a_real_rounds_scores(name, family, peaked, calibrations):
    lm = peaked[family]
    params = calibrations.get(name, {})
    if params and family != "llama":
        pytest.skip("the calibration files are made on tiny-llama")
    scores, positions, log, engine = real_round(lm, without_own_window(get_policy(name, **params)))
    assert all(torch.equal(row, torch.arange(len(PROMPT), ANSWER_START)) for row in positions)  # the whole span
    config = ReplayConfig(keep=Budget(SPAN - 1, TOKENS))
    replay_engine = EvictionEngine(lm, without_own_window(get_policy(name, **params)), config.protocol())
    replayed = replay_scores(replay_engine, PROMPT, GENERATED, ANSWER_START, keep=config.survivors(SPAN), seed=SEED)
    assert replayed.shape == (lm.config.num_hidden_layers, lm.config.num_key_value_heads, SPAN)
    torch.testing.assert_close(replayed, scores, rtol=0, atol=0, equal_nan=True)
    # and they are the scores the real round kept by: no evicted candidate outranks a kept one (per layer and head;
    # the layer mean where the keep set is shared across layers; sliding layers evict out-of-window slots first)
    ranked = replayed.mean(0, keepdim=True).expand_as(replayed) if engine.shared_layers else replayed
    info = torch.finfo(torch.float32)
    layer_types = getattr(lm.config, "layer_types", None) or ["full_attention"] * len(ranked)
    for layer, layer_type in enumerate(layer_types):
        if layer_type == "sliding_attention" and not engine.shared_layers:
            continue
        for head in range(ranked.shape[1]):
            kept = torch.tensor(np.isin(positions[head].numpy(), kept_positions(log, 0, layer, head)))
            values = ranked[layer, head].nan_to_num(nan=info.min)
            assert kept.sum() == SPAN - 1 and values[kept].min() >= values[~kept].max()


def test_policy_signals_layout_by_hand():
    # 2 layers, 2 KV heads, span 3 starting at position 1 of 5 tokens
    scores = torch.tensor([[[1.0, 2.0, 3.0], [3.0, 4.0, float("nan")]], [[5.0, 6.0, 7.0], [7.0, 8.0, 9.0]]])
    signals = policy_signals("p", get_policy("random"), scores, 1, 5)
    assert signals["p"]["0"] == [None, 2.0, 3.0, None, None]  # head mean; NaN is no score
    assert signals["p"]["1"] == [None, 6.0, 7.0, 8.0, None]
    assert signals["p"][AGGREGATE] == [None, 4.0, 5.0, None, None]
    assert signals[head_key("p", 1)]["0"] == [None, 3.0, 4.0, None, None]
    shared = policy_signals("s", get_policy("random_shared"), scores, 1, 5)
    assert set(shared) == {"s"}  # no per-head arrays where every head keeps the same set
    independent = policy_signals("e", get_policy("epikv"), scores, 1, 5)
    assert independent == {"e": {AGGREGATE: [None, 4.0, 5.0, None, None]}}  # one score per token


# --- command line ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traces_file(tmp_path_factory):
    return write_traces(tmp_path_factory.mktemp("replay"), TEXTS)


def test_cli_writes_one_signal_record_per_trace_and_resumes(traces_file, tmp_path, capsys):
    out = tmp_path / "replay" / "signals.jsonl"
    argv = ["--traces", str(traces_file), "--policies", "h2o,epikv,random", "--out", str(out), "--tail", "8",
            "--device", "cpu"]
    assert replay_main(argv) == 0
    records = read_records(out, Signal)
    assert [r.id for r in records] == ["p0", "p1"]
    assert (out.parent / "signals.config.json").exists()
    trace = read_records(traces_file, Trace)[0]
    record = records[0]
    start, end = len(trace.prompt_ids), len(trace.token_ids) - 8  # the tail boundary: the last 8 tokens answer
    assert (record.extra["reasoning_start"], record.extra["answer_start"], record.extra["boundary"]) == (
        start, end, "tail")
    assert record.n_tokens == len(trace.token_ids) and record.positions == list(range(record.n_tokens))
    lm = tiny_model("llama")
    config = ReplayConfig(tail=8)
    expected = replay_scores(EvictionEngine(lm, get_policy("h2o"), config.protocol()), trace.prompt_ids,
                             trace.generated_ids, end, keep=end - start, seed=derive_seed(0, [trace.id]))
    for layer in range(4):
        values = record.signals["h2o"][str(layer)]
        assert values[:start] == [None] * start and values[end:] == [None] * 8
        np.testing.assert_allclose(values[start:end], expected[layer].mean(0).numpy(), rtol=1e-6)
        for head in range(2):
            np.testing.assert_allclose(record.signals[head_key("h2o", head)][str(layer)][start:end],
                                       expected[layer, head].numpy(), rtol=1e-6)
    assert set(record.signals["epikv"]) == {AGGREGATE} and "random.h1" in record.signals
    assert record.extra["policies"] == {name: {"policy": name, "params": {}} for name in ("h2o", "epikv", "random")}
    capsys.readouterr()
    assert replay_main(argv) == 0  # resumed: nothing to add
    assert len(read_records(out, Signal)) == 2
    assert replay_main([*argv[:3], "h2o", *argv[4:]]) == 2  # other policies into the same file
    assert "policies" in capsys.readouterr().err


def test_all_is_every_scoring_policy_but_uncalibrated_ones(calibrations, tmp_path, capsys):
    policies = chosen_policies("all", [])
    assert list(policies) == [name for name in SCORED if name not in ("triattention", "thinkv")]
    assert "--policies all leaves out thinkv, triattention" in capsys.readouterr().err
    config = tmp_path / "tri.json"
    config.write_text(json.dumps({"policy": "triattention", "params": calibrations["triattention"]}))
    assert chosen_policies("all", [str(config)])["triattention"] == calibrations["triattention"]  # the file's params
    assert chosen_policies(None, [str(config)]) == {"triattention": calibrations["triattention"]}  # the default


def test_cli_refuses_bad_input_in_one_line(traces_file, tmp_path, capsys):
    out = tmp_path / "signals.jsonl"
    cases = [
        (["--policies", "h2oo"], "did you mean 'h2o'"),
        (["--policies", "full"], "evicts nothing"),
        (["--policies", "triattention"], "python -m evictor.calibrate triattention"),
        ([], "give --policies"),
        (["--policies", "h2o", "--keep", "2.5"], "--keep '2.5' is neither a fraction in (0, 1]"),
        (["--policies", "h2o", "--policy-config", str(tmp_path / "none.json")], "does not exist"),
    ]
    for extra, message in cases:
        assert replay_main(["--traces", str(traces_file), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    config = tmp_path / "raas.json"
    config.write_text(json.dumps({"policy": "raas", "params": {"threshold": 2.0}}))
    # a configured policy is replayed with its parameters, beside those --policies names
    code = replay_main(["--traces", str(traces_file), "--out", str(out), "--policy-config", str(config),
                        "--policies", "h2o", "--limit", "1", "--tail", "8"])
    (record,) = read_records(out, Signal)
    assert code == 0 and record.signals["raas"] and record.signals["h2o"]
    # the records name the configuration that deploys these scores: the file's, as evictor.run reads it
    assert record.extra["policies"] == {"h2o": {"policy": "h2o", "params": {}},
                                        "raas": {"policy": "raas", "params": {"threshold": 2.0}}}
    stored = json.loads((tmp_path / "signals.config.json").read_text())["identity"]["policies"]
    assert stored == [{"name": "h2o"}, {"name": "raas", "threshold": 2.0}]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", SCORED)
def test_teacher_forcing_in_blocks_gives_the_stepwise_scores(name, family, peaked, calibrations):
    """Feeding the generated tokens 7 per forward (not a divisor of any policy's period) scores as one decode step
    per token does, to float32 rounding of the block matmuls, for every registered policy."""
    lm = peaked[family]
    params = calibrations.get(name, {})
    if params and family != "llama":
        pytest.skip("the calibration files are made on tiny-llama")
    engine = EvictionEngine(lm, without_own_window(get_policy(name, **params)), ReplayConfig().protocol())
    args = (engine, PROMPT, GENERATED, ANSWER_START)
    stepwise = replay_scores(*args, keep=SPAN, seed=SEED)
    blocked = replay_scores(*args, keep=SPAN, seed=SEED, teacher_block=7)
    torch.testing.assert_close(blocked, stepwise, rtol=1e-4, atol=1e-5, equal_nan=True)
