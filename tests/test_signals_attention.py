"""Attention-derived scores on hand-made attention maps whose answers are worked out in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from signals import attention as att

# 3 queries (oldest first) over 4 keys, each row a distribution
A = torch.tensor([
    [0.7, 0.3, 0.0, 0.0],
    [0.1, 0.2, 0.7, 0.0],
    [0.25, 0.25, 0.25, 0.25],
])


def test_h2o_window_and_tova():
    assert torch.allclose(att.cumulative_attention(A), torch.tensor([1.05, 0.75, 0.95, 0.25]))
    assert torch.allclose(att.window_attention(A, 2), torch.tensor([0.35, 0.45, 0.95, 0.25]))
    assert torch.allclose(att.last_query_attention(A), torch.tensor([0.25] * 4))


def test_snapkv_max_pool_by_hand():
    # one query whose window sum is a spike at slots 1 and 4: kernel 3 spreads each to its neighbours
    attn = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])[None, None]  # [batch, head, query, key]
    pooled = att.snapkv_scores(attn, window=32, kernel=3, pooling="max")
    assert pooled.flatten().tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 0.0]
    # a padding slot carrying garbage does not leak into its real neighbours
    mask = torch.tensor([True] * 6 + [False])[None, None]
    garbage = attn.clone()
    garbage[..., 6] = 9.0
    assert att.snapkv_scores(garbage, 32, 3, mask, "max")[..., :6].flatten().tolist() == [1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="odd"):
        att.pool_keys(pooled, 4)
    # SnapKV's own average pooling divides by the kernel, edges included: (0 + 0 + 1) / 3 at slot 0
    averaged = att.snapkv_scores(attn, window=32, kernel=3).flatten()
    assert torch.allclose(averaged, torch.tensor([1, 1, 1, 2, 2, 2, 0.0]) / 3)


def test_attention_entropies():
    # per query: row 2 is uniform over 4 keys (log 4); a one-hot row has entropy 0
    rows = att.attention_entropy(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25] * 4]))
    assert torch.allclose(rows, torch.tensor([0.0, math.log(4)]))
    # per key: key 3 is attended only by the last query (entropy 0); key 2 by queries 1 and 2 with .7/.25
    cols = att.received_attention_entropy(A)
    p = torch.tensor([0.7, 0.25]) / 0.95
    assert cols[3].item() == pytest.approx(0.0)
    assert cols[2].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)
    # a key nobody attends to has entropy 0, not NaN
    assert att.received_attention_entropy(torch.zeros(2, 3)).tolist() == [0.0, 0.0, 0.0]


def test_r_kv_combination():
    importance = torch.tensor([0.5, 0.0])
    redundancy = torch.tensor([0.0, 1.0])
    # lam .1: .1*.5 - .9*0 = .05; .1*0 - .9*1 = -.9
    assert torch.allclose(att.r_kv_scores(importance, redundancy, 0.1), torch.tensor([0.05, -0.9]))


def test_fastcaote_weight():
    # alpha .5 -> weight 1; alpha .2 -> .25; alpha 1 stays finite
    scores = att.fastcaote_scores(torch.tensor([0.5, 0.2, 1.0]), torch.tensor([2.0, 2.0, 1.0]))
    assert torch.allclose(scores[:2], torch.tensor([2.0, 0.5]))
    assert torch.isfinite(scores[2])


def test_raas_timestamps_by_hand():
    # keys at positions 0,1,2,3; queries at 10,11,12 (rows of A); refresh above .2
    stamps = att.raas_timestamps(A, torch.tensor([10, 11, 12]), torch.tensor([0, 1, 2, 3]), 0.2)
    # key 0: .7@10, .25@12 -> 12; key 1: .3@10, .25@12 -> 12; key 2: .7@11, .25@12 -> 12; key 3: .25@12 -> 12
    assert stamps.tolist() == [12.0, 12.0, 12.0, 12.0]
    stamps = att.raas_timestamps(A, torch.tensor([10, 11, 12]), torch.tensor([0, 1, 2, 30]), 0.26)
    # above .26: key 0 at 10, key 1 at 10, key 2 at 11, key 3 never -> its entry position 30
    assert stamps.tolist() == [10.0, 10.0, 11.0, 30.0]


def test_longflow_contribution():
    values = torch.tensor([[1.0, -2.0], [0.5, 0.5]])
    assert torch.allclose(att.longflow_contribution(torch.tensor([0.5, 0.1]), values), torch.tensor([1.5, 0.1]))


def test_vase_keeps_largest_ranges_then_samples_by_weight():
    ranges = torch.tensor([5.0, 1.0, 4.0, 0.5, 9.0])
    weights = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    mask = torch.tensor([True, True, True, True, False])  # slot 4 is padding: its range must not win
    u = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5])
    scores = att.vase_scores(ranges, weights, 2, u, mask)
    top2 = set(scores[:4].topk(2).indices.tolist())
    assert top2 == {0, 2}  # the two largest real ranges
    # the sampled part ranks positive weights above zero weights
    assert scores[1] > scores[4] and scores[3] > scores[4]


def test_vase_sampling_is_proportional_to_weight():
    # keep one of two keys with weights 1 and 3: the second is chosen with probability 3/4
    gen = torch.Generator().manual_seed(0)
    n = 20000
    u = 1.0 - torch.rand(n, 2, generator=gen)
    weights = torch.tensor([1.0, 3.0]).expand(n, 2)
    scores = att.vase_scores(torch.zeros(n, 2), weights, 0, u, torch.ones(n, 2, dtype=torch.bool))
    assert (scores.argmax(-1) == 1).float().mean().item() == pytest.approx(0.75, abs=0.015)
