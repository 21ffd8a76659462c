"""ThinKV: sparsity, block types, segments and budgets on hand-made inputs whose answers are derived in the comments;
the calibration command on a tiny model; the policy inside the engine with the calibration it wrote."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_triattention import calibrated  # tests/ is on sys.path under pytest

from core.errors import UsageError
from evictor.calibration.thinkv import attention_sparsity, kde_thresholds, rolling_means, token_sparsity
from evictor.engine import EvictionEngine
from evictor.instrument import kept_positions
from evictor.policies import get_policy
from evictor.policies.thinkv import (
    SPARSITY,
    UNCLASSIFIED,
    block_types,
    rank_in_segment,
    record_sparsity,
    segment_ids,
    thinkv_scores,
)
from evictor.protocol import EvictionConfig
from scoring.policy import ScoreInputs

pytestmark = pytest.mark.usefixtures("one_thread")

R, E, T = 0, 1, 2
NAN = math.nan


def test_attention_sparsity_by_hand():
    attn = torch.tensor([[0.5, 0.3, 0.1, 0.1]])
    # all four visible: uniform share .25, so .1 and .1 are below: 2 of 4
    assert attention_sparsity(attn, torch.ones(1, 4, dtype=torch.bool)).tolist() == [0.5]
    # the last key hidden: visible mass .9 over 3 keys, share .3; only .1 is below (.3 is not): 1 of 3
    visible = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(attention_sparsity(attn, visible), torch.tensor([1 / 3]))
    assert attention_sparsity(attn, torch.zeros(1, 4, dtype=torch.bool)).isnan().all()


def test_record_sparsity_keeps_the_first_sighting():
    table = record_sparsity(None, torch.tensor([[0.2, 0.4]]), torch.tensor([[1, 2]]))
    assert table[0, 0].isnan() and table[0, 1:].tolist() == pytest.approx([0.2, 0.4])
    # a later round sees query 2 again (over a smaller cache) and query 3 for the first time; -1 is no query
    table = record_sparsity(table, torch.tensor([[0.9, 0.6, 0.7]]), torch.tensor([[2, 3, -1]]))
    assert table[0, 1:].tolist() == pytest.approx([0.2, 0.4, 0.6])


def test_block_types_by_hand():
    # tau 2, thresholds .3 / .6, bands low R, middle E, high T; next position 7: block 3 (positions 6, 7) is still
    # being generated, block 4 never seen. Block means: .1 -> R, .5 -> E, .85 -> T.
    table = torch.tensor([[0.1, 0.1, 0.4, 0.6, 0.9, 0.8, 0.2]])
    types = block_types(table, torch.tensor([7]), 2, torch.tensor([0.3, 0.6]), (R, E, T), n_blocks=5)
    assert types.tolist() == [[R, E, T, UNCLASSIFIED, UNCLASSIFIED]]
    # the band order maps the low band to T and the high band to R
    types = block_types(table, torch.tensor([7]), 2, torch.tensor([0.3, 0.6]), (T, E, R), n_blocks=3)
    assert types.tolist() == [[T, E, R]]
    # a complete block whose queries were never seen stays unclassified
    unseen = torch.tensor([[NAN, NAN, 0.4, 0.4]])
    assert block_types(unseen, torch.tensor([4]), 2, torch.tensor([0.3, 0.6]), (R, E, T), 2).tolist() == [
        [UNCLASSIFIED, E]]


def test_segments_are_runs_of_one_type_and_unclassified_blocks_stand_alone():
    types = torch.tensor([[R, R, E, UNCLASSIFIED, UNCLASSIFIED, E, E, T]])
    assert segment_ids(types).tolist() == [[0, 0, 1, 2, 3, 4, 4, 5]]


def test_rank_in_segment_by_hand():
    importance = torch.tensor([[[0.1, 0.4, 0.3, 0.2, 0.5, 0.5]]])
    segment = torch.tensor([[[0, 0, 0, 1, 1, 1]]])
    # segment 0: .4 first, then .3, then .1; segment 1: the tie .5/.5 goes to the older (slot 4) first
    assert rank_in_segment(importance, segment).tolist() == [[[2, 0, 1, 2, 0, 1]]]


def test_thinkv_scores_keep_sets_by_hand():
    # tau 4: positions 0-3 an R block, 4-7 a T block, 8-11 an E block; budgets R 2, E 1, T 1; next position 12.
    # In budget: R keeps its two most attended (1: .4, 2: .3), T keeps 4 (.5), E keeps 10 (.2).
    # Scores: tier (R 3, E 2, T 1) + attention / (Q + 1); everything else position / 13.
    positions = torch.arange(12).view(1, 1, 12)
    importance = torch.tensor([[[0.1, 0.4, 0.3, 0.2, 0.5, 0.1, 0.1, 0.1, 0.0, 0.0, 0.2, 0.1]]])
    types = torch.tensor([[R, T, E]])
    scores = thinkv_scores(positions, importance, 4, types, 4, torch.tensor([12]), (2, 1, 1))
    assert scores[0, 0, 1].item() == pytest.approx(3 + 0.4 / 5) and scores[0, 0, 11].item() == pytest.approx(11 / 13)

    def keep(k):
        return set(scores[0, 0].topk(k).indices.tolist())

    assert keep(2) == {1, 2}  # R before everything
    assert keep(3) == {1, 2, 10}  # then E: the T segment's token goes first
    assert keep(4) == {1, 2, 10, 4}
    assert keep(5) == {1, 2, 10, 4, 11}  # K larger than the budgets: the newest over-budget tokens fill it
    # unclassified blocks count as R, each its own segment: two blocks keep two tokens each
    unclassified = thinkv_scores(positions[..., :8], importance[..., :8], 4, torch.tensor([[-1, -1]]), 4,
                                 torch.tensor([12]), (2, 1, 1))
    assert set(unclassified[0, 0].topk(4).indices.tolist()) == {1, 2, 4, 5}


def test_kde_thresholds_find_the_valleys_of_three_modes():
    rng = np.random.default_rng(0)
    samples = np.concatenate([rng.normal(centre, 0.03, 400) for centre in (0.2, 0.5, 0.8)])
    low, high, method = kde_thresholds(samples)
    assert method == "kde" and 0.3 < low < 0.4 and 0.6 < high < 0.7
    one_mode = rng.normal(0.5, 0.05, 600)
    low, high, method = kde_thresholds(one_mode)
    assert method == "tertiles" and [low, high] == pytest.approx(np.quantile(one_mode, [1 / 3, 2 / 3]).tolist())
    assert rolling_means(np.array([1.0, 2.0, 3.0, 6.0]), 2).tolist() == [1.5, 2.5, 4.5]
    assert rolling_means(np.array([1.0, 2.0]), 4).tolist() == [1.5]


PIECES = (("Solve 3 * 14.", " Wait, 3 * 14 = 3 * 10 + 3 * 4 = 30 + 12 = 42. Check: 42 / 3 = 14. So 42."),
          ("Is 91 prime?", " Hmm, 91 = 7 * 13, so no. Alternatively try 11: 11 * 8 = 88, not 91. Not prime."))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    return calibrated(tmp_path_factory, "thinkv", PIECES, "--tau", "8")[1]


def test_token_sparsity_reads_the_eager_probabilities():
    from models.tiny import tiny_model

    eager = tiny_model("llama", attn_implementation="eager")
    ids = list(range(5, 25))
    sparsity = token_sparsity(eager, ids)
    with torch.inference_mode():
        weights = eager.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions[1][0]  # [4 q, n, n]
    per_kv = weights.view(2, 2, 20, 20).mean(1)  # query heads 0, 1 -> KV head 0; 2, 3 -> KV head 1
    expected = []
    for q in range(20):
        row = per_kv[:, q, : q + 1]  # causal: keys 0..q, uniform share 1 / (q + 1)
        expected.append(((row < 1 / (q + 1)).float().mean(-1)).mean().item())
    np.testing.assert_allclose(sparsity[1], expected, atol=1e-6)


def test_calibration_file_holds_per_layer_thresholds_of_the_block_means(calibration):
    data = json.loads(calibration.read_text())
    assert (data["kind"], data["n_layers"], data["tau"], data["band_order"]) == ("thinkv_calibration", 4, 8,
                                                                                   ["R", "E", "T"])
    assert len(data["thresholds"]) == 4 and all(low <= high for low, high in data["thresholds"])
    assert set(data["threshold_method"]) <= {"kde", "tertiles"}
    assert (calibration.parent / "tiny-llama.thinkv.config.json").exists()


def test_policy_refuses_a_calibration_of_another_tau_or_none(calibration, tiny_llama):
    with pytest.raises(UsageError, match="tau = 8, not 128"):
        get_policy("thinkv", calibration=str(calibration))
    with pytest.raises(UsageError, match="python -m evictor.calibrate thinkv"):
        EvictionEngine(tiny_llama, get_policy("thinkv"), EvictionConfig(budget=64))
    with pytest.raises(UsageError, match="budgets must be three"):
        get_policy("thinkv", calibration=str(calibration), tau=8, budgets=[1, 2])


def run_thinkv(lm, calibration, budgets, steps=60):
    policy = get_policy("thinkv", calibration=str(calibration), tau=8, budgets=budgets)
    # EpiKV's accounting: recency window inside K, every step, no prompt protection
    config = EvictionConfig(budget=32, buffer=0, block=16, trigger="step", recency=8, keep_log=True)
    prompt = [lm.tokenizer.bos_token_id] + lm.tokenizer("Think: 7 * 8 = 56, then 56 + 4 = 60.").input_ids
    with EvictionEngine(lm, policy, config).session([prompt], max_new_tokens=steps) as session:
        logits = session.prefill()
        session.begin_decode()
        for _ in range(steps - 1):
            logits = session.step(logits.argmax(-1))
        session.end_decode()
        states = [dict(state) for state in session.states]
        result = session.result([[0] * steps], ["length"])
    return result.sequences[0], states


def test_policy_runs_in_the_engine_with_its_calibration(calibration, tiny_llama):
    sequence, states = run_thinkv(tiny_llama, calibration, (6, 3, 1))
    log = sequence.keep_log
    last = len(log["round_next_pos"]) - 1
    end = int(log["round_next_pos"][last])
    assert sequence.rounds > 0 and max(sequence.cache_sizes[-50:]) == 33  # decode: K + the token just appended
    # every query the rounds saw has a recorded sparsity, in every layer
    assert all(not states[layer][SPARSITY][0, -8:].isnan().any() for layer in range(4))
    recency = set(range(end - 8, end))
    kept = [set(kept_positions(log, last, layer, head).tolist()) for layer in range(4) for head in range(2)]
    assert all(recency <= k and len(k) == 32 for k in kept)
    assert any(min(k) < end - 32 for k in kept)  # older tokens survive in their segments' budgets
    # with every budget 0 nothing is budgeted: the fill is the newest tokens, a plain recency window
    zero, _ = run_thinkv(tiny_llama, calibration, (0, 0, 0))
    log = zero.keep_log
    last = len(log["round_next_pos"]) - 1
    newest = set(range(int(log["round_next_pos"][last]) - 32, int(log["round_next_pos"][last])))
    assert all(set(kept_positions(log, last, layer, 0).tolist()) == newest for layer in range(4))


def test_score_reads_sparsity_only_of_real_queries(calibration):
    policy = get_policy("thinkv", calibration=str(calibration), tau=8)
    positions = torch.arange(16).view(1, 1, 16).expand(1, 2, 16)
    attn = torch.full((1, 2, 8, 16), 1 / 16)
    query_positions = torch.tensor([[-1, -1, 16, 17, 18, 19, 20, 21]])  # two rows of an unfilled window
    attn[:, :, :2] = float("nan")  # whatever those rows hold is ignored
    inputs = ScoreInputs(layer=0, step=1, positions=positions, candidate_mask=torch.ones(1, 2, 16, dtype=torch.bool),
                         attention=attn, query_positions=query_positions)
    scores = policy.score(inputs)
    assert torch.isfinite(scores).all()
    table = inputs.state[SPARSITY]
    assert table[0, :16].isnan().all() and (table[0, 16:22] == 0).all()  # uniform rows: nothing below the share
