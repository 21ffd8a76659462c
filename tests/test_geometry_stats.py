"""Hand-made tensors for every geometry statistic; each expected value is derived by hand in the comment beside it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from geometry.attention import layer_attention
from geometry.stats import (
    bos_cosine,
    dispersion,
    distances_to_mean,
    first_token_kept,
    jaccard_stability,
    leading_token_attention,
    prefix_kth_largest,
    query_positions,
    sink_mask,
    sink_rate,
    top_singular_value,
)
from geometry.summary import GeometryAccumulator, build_tables
from models.attention import LayerSpec

NEG_INF = float("-inf")


def test_dispersion_of_known_vectors():
    # mean is 0; distances 1, 1, 3, 3 -> mean 2, population std 1
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [3.0, 0.0], [-3.0, 0.0]])
    assert dispersion(x).item() == pytest.approx(1.0)
    # identical vectors have no spread; a leading head axis is kept
    batch = torch.stack([x, torch.ones(4, 2)])
    assert dispersion(batch).tolist() == pytest.approx([1.0, 0.0])


def test_dispersion_is_translation_invariant_and_scales_linearly():
    x = torch.randn(3, 50, 8)
    assert torch.allclose(dispersion(x + 5.0), dispersion(x), atol=1e-5)
    assert torch.allclose(dispersion(2.5 * x), 2.5 * dispersion(x), atol=1e-5)


def test_bos_cosine():
    # k_0 = (1, 0); content mean (-1, 0) -> anti-aligned, cos = -1
    anti = torch.tensor([[1.0, 0.0], [-1.0, 1.0], [-1.0, -1.0]])
    # content mean (1, 1) -> cos 45 degrees
    diagonal = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    assert bos_cosine(torch.stack([anti, diagonal])).tolist() == pytest.approx([-1.0, 1 / math.sqrt(2)], abs=1e-6)


def test_top_singular_value():
    assert top_singular_value(torch.tensor([[3.0, 0.0], [0.0, 4.0]])).item() == pytest.approx(4.0)
    # rank one: u v^T with |u| = sqrt(5), |v| = sqrt(2)
    assert top_singular_value(torch.tensor([[1.0, 1.0], [2.0, 2.0]])).item() == pytest.approx(math.sqrt(10))
    # fewer vectors than dimensions (the weight-matrix case) uses the other Gram matrix
    assert top_singular_value(torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])).item() == pytest.approx(4.0)
    for shape in [(2, 40, 6), (3, 5, 30)]:
        x = torch.randn(shape)
        assert torch.allclose(top_singular_value(x), torch.linalg.matrix_norm(x, ord=2), atol=1e-4)


def test_leading_token_attention_excludes_t0_and_unreachable_queries():
    column = torch.tensor([[1.0, 0.5, 0.3, 0.1]])
    assert leading_token_attention(column).item() == pytest.approx(0.3)  # (0.5 + 0.3 + 0.1) / 3
    # window 3: queries t >= 3 cannot see position 0 -> mean over t = 1, 2
    assert leading_token_attention(column, window=3).item() == pytest.approx(0.4)
    with pytest.raises(ValueError):
        leading_token_attention(torch.tensor([1.0]))


def test_sink_rate_of_hand_made_alpha():
    alpha = torch.tensor([[0.5, 0.2], [0.31, 0.3]])
    assert sink_mask(alpha, 0.3).tolist() == [[True, False], [True, False]]  # 0.3 itself is not above tau
    assert sink_rate(alpha, 0.3) == pytest.approx(0.5)
    assert sink_rate(alpha, 0.1) == pytest.approx(1.0)


def test_sink_rate_from_a_hand_made_attention_map():
    # two heads over T = 4: head 0 puts 0.6 on position 0 from every query, head 1 puts 0.1
    probs = torch.zeros(2, 4, 4)
    probs[:, 0, 0] = 1.0
    for t in range(1, 4):
        probs[0, t, 0], probs[0, t, t] = 0.6, 0.4
        probs[1, t, 0], probs[1, t, t] = 0.1, 0.9
    alpha = leading_token_attention(probs[..., 0])
    assert alpha.tolist() == pytest.approx([0.6, 0.1])
    assert sink_rate(alpha, 0.3) == pytest.approx(0.5)


def test_query_positions_follow_the_k_plus_32_rule():
    # [4 + 32, 299] in 4 steps: 36, 123.67, 211.33, 299
    assert query_positions(300, 4, 4).tolist() == [36, 124, 211, 299]
    # fewer positions in range than asked: every position once
    assert query_positions(40, 4, 10).tolist() == [36, 37, 38, 39]
    with pytest.raises(ValueError):
        query_positions(36, 4, 10)


def test_prefix_kth_largest_by_hand_and_against_topk():
    row = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 9.0]])
    # 2nd largest of [5, 1] = 1; of [5, 1, 4, 2] = 4; of the whole row = 5
    assert prefix_kth_largest(row, torch.tensor([2, 4, 6]), 2).tolist() == [[1.0, 4.0, 5.0]]
    torch.manual_seed(0)
    for n_tokens, k in [(50, 5), (300, 64), (37, 3)]:
        rows = torch.randn(6, n_tokens)
        ties = torch.randint(0, 4, (6, n_tokens)).float()  # heavy ties: the k-th value is still exact
        ends = torch.linspace(k, n_tokens, 9).round().long().unique()
        for data in (rows, ties):
            expected = [[r[:e].topk(k).values[-1].item() for e in ends.tolist()] for r in data]
            assert prefix_kth_largest(data, ends, k).tolist() == expected


def _hand_scores() -> tuple[torch.Tensor, torch.Tensor]:
    """One head, queries at t = 3, 5, 7, k = 2 (keys beyond a query are masked)."""
    scores = torch.full((1, 3, 8), NEG_INF)
    scores[0, 0, :3] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 1, :5] = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    scores[0, 2, :7] = torch.tensor([3.0, 1.0, 2.0, 4.0, 5.0, 0.5, 0.7])
    return scores, torch.tensor([3, 5, 7])


def test_jaccard_shared_prefix_rule_by_hand():
    scores, positions = _hand_scores()
    # pair (3,5) over [0,3): {0,1} vs {1,2} -> 1/3; pair (3,7) over [0,3): {0,1} vs {0,2} -> 1/3;
    # pair (5,7) over [0,5): {3,4} vs {3,4} -> 1.  s = mean over the other two queries.
    stability = jaccard_stability(scores, positions, k=2)
    assert stability[0].tolist() == pytest.approx([1 / 3, 2 / 3, 2 / 3])


def test_jaccard_sliding_window_by_hand():
    scores, positions = _hand_scores()
    # window 6: pair (3,5) shares [0,3) -> 1/3; pair (3,7) shares only [2,3) (< k keys) -> undefined;
    # pair (5,7) shares [2,5): {3,4} vs {3,4} -> 1.
    assert jaccard_stability(scores, positions, k=2, window=6)[0].tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])
    # window 4: no pair shares 2 keys -> undefined everywhere
    assert torch.isnan(jaccard_stability(scores, positions, k=2, window=4)).all()


def _brute_force_stability(scores, positions, k, window=None):
    """The Appendix D definition written with Python sets, pair by pair."""
    heads, n, _ = scores.shape
    out = np.full((heads, n), np.nan)
    for h in range(heads):
        for i in range(n):
            values = []
            for j in range(n):
                if j == i:
                    continue
                t_lo, t_hi = sorted((int(positions[i]), int(positions[j])))
                start = 0 if window is None else max(0, t_hi - window + 1)
                if t_lo - start < k:
                    continue
                sets = []
                for row in (i, j):
                    shared = scores[h, row, start:t_lo].tolist()
                    sets.append({start + p for p in sorted(range(len(shared)), key=lambda p: -shared[p])[:k]})
                values.append(len(sets[0] & sets[1]) / len(sets[0] | sets[1]))
            if values:
                out[h, i] = np.mean(values)
    return out


@pytest.mark.parametrize("window", [None, 40, 25])
def test_jaccard_matches_brute_force_on_random_rows(window):
    torch.manual_seed(1)
    positions = torch.tensor([10, 14, 20, 27, 33, 41, 50, 59])
    scores = torch.randn(2, len(positions), 60)
    for row, t in enumerate(positions.tolist()):
        scores[:, row, t + 1 :] = NEG_INF
    got = jaccard_stability(scores, positions, k=6, window=window).numpy()
    np.testing.assert_allclose(got, _brute_force_stability(scores, positions, 6, window), rtol=1e-6)


def test_layer_attention_by_hand():
    # one KV head shared by two query heads (GQA), T = 3, d = 1, scaling 1
    keys = torch.tensor([[[0.0], [math.log(2.0)], [0.0]]])  # logits of a unit query: 0, ln 2, 0
    queries = torch.tensor([[[1.0], [1.0], [1.0]], [[0.0], [0.0], [0.0]]])
    out = layer_attention(queries, keys, scaling=1.0, sampled=torch.tensor([2]), chunk=2)
    # head 0: row 1 softmax(0, ln2) = (1/3, 2/3); row 2 softmax(0, ln2, 0) = (1/4, 1/2, 1/4)
    # head 1: uniform over the visible keys
    expected = torch.tensor([[1.0, 1 / 3, 1 / 4], [1.0, 1 / 2, 1 / 3]])
    assert torch.allclose(out.first_column, expected, atol=1e-6)
    assert out.sampled_logits[0, 0].tolist() == pytest.approx([0.0, math.log(2.0), 0.0])
    windowed = layer_attention(queries, keys, scaling=1.0, sampled=torch.tensor([1]), window=2)
    # window 2: query 2 sees keys 1, 2 only; query 1's logits beyond itself are masked
    assert windowed.first_column[:, 2].tolist() == [0.0, 0.0]
    assert windowed.sampled_logits[0, 0].tolist() == pytest.approx([0.0, math.log(2.0), NEG_INF])
    capped = layer_attention(queries, keys * 100, scaling=1.0, sampled=torch.tensor([2]), softcap=1.0)
    # logits 0, tanh(69.3) ~ 1 -> row 1 = (1, e) / (1 + e)
    assert capped.first_column[0, 1].item() == pytest.approx(1 / (1 + math.e), abs=1e-6)


def _record(alpha, jaccard, scale=1.0):
    # 2 layers x 1 KV head, 2 query heads per layer
    return {
        "sigma_k": [[2.0 * scale], [1.0 * scale]], "sigma_v": [[1.0], [1.0]], "bos_cos": [[-0.5], [0.5]],
        "sigma1_k": [[4.0], [4.0]], "sigma1_v": [[1.0], [3.0]], "alpha_bos": alpha, "jaccard": jaccard,
        "valuediff_first_k25": [[1.0], [0.0]], "valuediff_first_k50": [[1.0], [scale - 1.0]],
    }


def test_accumulator_and_tables_follow_the_aggregation_rules():
    acc = GeometryAccumulator(tau=0.3)
    acc.add(_record([[0.5, 0.1], [0.4, 0.2]], [[0.4, 0.6], [None, None]]))
    acc.add(_record([[0.2, 0.1], [0.4, 0.2]], [[0.2, None], [None, None]], scale=2.0))
    means = acc.means()
    assert means["sink"].tolist() == [[0.5, 0.0], [1.0, 0.0]]  # fraction of sequences above tau
    assert means["sigma_k"].tolist() == [[3.0], [1.5]]
    assert means["jaccard"][0].tolist() == pytest.approx([0.3, 0.6])  # undefined entries are skipped
    assert np.isnan(means["jaccard"][1]).all()
    assert acc.state_dict()["count"] == 2
    specs = [LayerSpec(0, "sliding_attention", 4, 1.0, None), LayerSpec(1, "full_attention", None, 1.0, None)]
    weights = {"w_k": [2.0, 4.0], "w_v": [1.0, 1.0], "w_k_head": [[2.0], [4.0]], "w_v_head": [[1.0], [1.0]]}
    tables = build_tables(means, specs, weights, "hand")
    rows = {row["scope"]: row for row in tables["model"]}
    assert set(rows) == {"all", "sliding_attention", "full_attention"}
    everything = rows["all"]
    assert everything["sink_rate"] == pytest.approx(0.375)  # (0.5 + 0 + 1 + 0) / 4
    assert everything["sigma_ratio"] == pytest.approx(1.0 / 2.25)  # ratio of means: 1 / mean(3, 1.5)
    assert everything["weight_ratio"] == pytest.approx(1.0 / 3.0)  # mean ||W_V|| 1 / mean ||W_K|| 3
    assert everything["sigma1_ratio"] == pytest.approx(2.0 / 4.0)
    assert everything["jaccard"] == pytest.approx(0.45)
    assert everything["gqa_ratio"] == 2.0
    # the first token kept in layer 0 in both sequences, in layer 1 at half the context in the second only
    assert (everything["valuediff_first_k25"], everything["valuediff_first_k50"]) == (0.5, 0.75)
    assert rows["full_attention"]["jaccard"] is None  # JSON-safe: NaN becomes None
    assert [row["kv_head"] for row in tables["heads_q"]] == [0, 0, 0, 0]
    assert tables["layers"][0]["sigma_ratio"] == pytest.approx(1 / 3)


def test_first_token_kept_counts_the_tokens_that_outscore_position_0():
    scores = torch.tensor([[3.0, 5.0, 1.0, 4.0, 0.0, 2.0, 3.0, 6.0],   # 3 others above 3.0 (5, 4, 6): rank 4 of 8
                           [9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])  # the highest: rank 1
    # a quarter of 8 keeps 2: only row 1; half keeps 4: both (the tie with slot 6's 3.0 goes to position 0)
    assert first_token_kept(scores, 0.25).tolist() == [False, True]
    assert first_token_kept(scores, 0.5).tolist() == [True, True]
    assert first_token_kept(scores[:, :3], 0.25).tolist() == [False, True]  # ceil(0.75) = 1 kept
    with pytest.raises(ValueError, match="fraction"):
        first_token_kept(scores, 0.0)


def test_distances_to_mean_are_valuediffs_score_over_the_whole_context():
    from signals.kv import distance_to_mean

    values = torch.randn(2, 3, 10, 4, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(distances_to_mean(values), distance_to_mean(values))
    # by hand: values 0 and 2 along one axis, mean 1: both at distance 1
    assert distances_to_mean(torch.tensor([[0.0], [2.0]])).tolist() == [1.0, 1.0]
