"""Key/value statistics on hand-made vectors whose answers are worked out in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from signals.kv import (
    LagNormaliser,
    cosine_distance_to_mean,
    cosine_to_mean,
    distance_to_mean,
    head_dim_variance,
    lag_normalised_variance,
    masked_mean,
    rkv_redundancy,
    value_range,
    vector_norm,
)

# Four value vectors; their mean is ((1+0+3+0)/4, (0+0+0+0.5)/4) = (1, 0.125).
V = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 0.0], [0.0, 0.5]])


def test_masked_mean_ignores_padding_slots():
    padded = torch.cat([V, torch.tensor([[100.0, 100.0]])])
    mask = torch.tensor([True, True, True, True, False])
    assert torch.allclose(masked_mean(padded, mask), torch.tensor([1.0, 0.125]))
    assert torch.allclose(masked_mean(V), torch.tensor([1.0, 0.125]))


def test_distance_to_mean_valuediff_by_hand():
    # v - mean: (0,-.125), (-1,-.125), (2,-.125), (-1,.375)
    expected = torch.tensor([0.125, math.sqrt(1 + 0.125**2), math.sqrt(4 + 0.125**2), math.sqrt(1 + 0.375**2)])
    scores = distance_to_mean(V)
    assert torch.allclose(scores, expected)
    assert scores.argsort(descending=True).tolist() == [2, 3, 1, 0]  # keep 2 -> {v2, v3}


def test_distance_to_mean_uses_the_reference_set():
    # candidates are v0 and v2, but the mean is the whole cache's (1, .125), padding slot excluded
    cache = torch.cat([V, torch.tensor([[50.0, 50.0]])])
    mask = torch.tensor([True, True, True, True, False])
    scores = distance_to_mean(V[[0, 2]], cache, mask)
    assert torch.allclose(scores, torch.tensor([0.125, math.sqrt(4 + 0.125**2)]))


def test_cosine_distance_to_mean_by_hand():
    norm_mean = math.sqrt(1 + 0.125**2)
    expected = torch.tensor([
        1 - 1 / norm_mean,  # (1,0) . (1,.125) / |(1,.125)|
        1.0,  # the zero vector has no direction: orthogonal
        1 - 1 / norm_mean,  # (3,0) points the same way as (1,0)
        1 - 0.125 / norm_mean,  # (0,.5): .0625 / (.5 |mean|)
    ])
    assert torch.allclose(cosine_distance_to_mean(V), expected, atol=1e-6)


def test_vector_norm_and_half_precision_is_upcast():
    keys = torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=torch.bfloat16)
    norms = vector_norm(keys)
    assert norms.dtype == torch.float32
    assert norms.tolist() == [5.0, 1.0]


def test_cosine_to_the_mean_of_unit_vectors_keydiff_anchor():
    # raw mean (2.75, .75) is dominated by the long key; the unit mean is ((1 + 0 + 0 + .7071) / 4, (0 + 1 + 1 +
    # .7071) / 4) = (.4268, .6768), |.| = .8001
    keys = torch.tensor([[10.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    r = 1 / math.sqrt(2)
    anchor = torch.tensor([(1 + r) / 4, (2 + r) / 4])
    expected = torch.tensor([anchor[0], anchor[1], anchor[1], r * (anchor[0] + anchor[1])]) / anchor.norm()
    assert torch.allclose(cosine_to_mean(keys, unit_mean=True), expected, atol=1e-6)  # .533 .846 .846 .975
    raw = cosine_to_mean(keys)  # (1, 0) . (2.75, .75) / 2.85 = .965: the two anchors rank key 0 differently
    assert raw.argmin() == 1 and cosine_to_mean(keys, unit_mean=True).argmin() == 0
    # a padding slot of the reference set does not move the anchor
    padded = torch.cat([keys, torch.tensor([[0.0, -50.0]])])
    mask = torch.tensor([True] * 4 + [False])
    assert torch.allclose(cosine_to_mean(keys, padded, mask, unit_mean=True), expected, atol=1e-6)


# k0 = k1 point the same way, k2 is orthogonal to them, k3 = (.6, .8) sits in between. Cosines (diagonal 0):
# C01 = 1, C02 = 0, C03 = .6, C12 = 0, C13 = .6, C23 = .8. Above .5, each key's most recent duplicate is exempt:
# rows 0, 1, 2 drop their entry for k3, row 3 drops k2. Column sums: c0 = C10 + C30 = 1.6, c1 = 1.6, c2 = c3 = 0.
R_KV_KEYS = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.6, 0.8]])


def test_rkv_redundancy_by_hand():
    column_mean = torch.tensor([1.6, 1.6, 0.0, 0.0]) / 4
    expected = column_mean.exp() / column_mean.exp().sum()  # .2993 .2993 .2007 .2007
    assert torch.allclose(rkv_redundancy(R_KV_KEYS), expected, atol=1e-6)
    assert rkv_redundancy(R_KV_KEYS).sum().item() == pytest.approx(1.0)
    # without the exemption (threshold above every cosine) it is the plain mean cosine: k3 is the most redundant
    plain = torch.tensor([1.6, 1.6, 0.8, 2.0]) / 4
    assert torch.allclose(rkv_redundancy(R_KV_KEYS, threshold=1.0), plain.softmax(-1), atol=1e-6)


def test_rkv_redundancy_ignores_padding_slots():
    padded = torch.cat([R_KV_KEYS, torch.tensor([[1.0, 0.0]])])  # a padding slot that would duplicate k0
    mask = torch.tensor([True] * 4 + [False])
    got = rkv_redundancy(padded, mask)
    assert torch.allclose(got[:4], rkv_redundancy(R_KV_KEYS), atol=1e-6) and got[4] == 0
    assert torch.equal(rkv_redundancy(padded, torch.zeros(5, dtype=torch.bool)), torch.zeros(5))


def test_head_dim_variance_and_value_range():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 2.0, 0.5, 0.5]])
    assert torch.allclose(head_dim_variance(x), torch.tensor([1.25, 1.125]))  # population variance
    assert torch.allclose(value_range(x), torch.tensor([3.0, 3.0]))


def test_lag_normaliser_by_hand():
    # chunk 2, one channel: tokens 0,1 are chunk 0 (range so far), 2,3 use chunk 0's range [0,2], 4 uses [1,3]
    x = torch.tensor([0.0, 2.0, 1.0, 3.0, 5.0])[:, None]
    out = LagNormaliser(chunk=2, eps=1e-12).add(x)[:, 0]
    # token 0: range {0} is empty -> 0 / eps = 0; token 1: (2-0)/2; tokens 2,3: /2; token 4: (5-1)/(3-1)
    assert torch.allclose(out, torch.tensor([0.0, 1.0, 0.5, 1.5, 2.0]))


@pytest.mark.parametrize("split", [[7], [1] * 7, [3, 1, 1, 2], [2, 5]])
def test_lag_normaliser_is_causal_and_chunking_free(split):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 4)  # [batch, kv_head, pos, d_head]
    whole = LagNormaliser(chunk=3).add(x)
    stream = LagNormaliser(chunk=3)
    parts, start = [], 0
    for size in split:
        parts.append(stream.add(x[..., start : start + size, :]))
        start += size
    assert torch.allclose(torch.cat(parts, dim=-2), whole)
    # causal: changing the future does not change the past
    future = x.clone()
    future[..., 5:, :] += 10
    assert torch.allclose(LagNormaliser(chunk=3).add(future)[..., :5, :], whole[..., :5, :])


def test_lag_normaliser_state_dict_round_trip():
    x = torch.randn(1, 1, 5, 2)
    first = LagNormaliser(chunk=2)
    first.add(x[..., :3, :])
    second = LagNormaliser()
    second.load_state_dict(first.state_dict())
    assert torch.allclose(second.add(x[..., 3:, :]), first.add(x[..., 3:, :]))


def test_lag_normalised_variance_removes_a_scale_shift():
    # chunk 2: tokens of chunk 1 are divided by chunk 0's per-channel range, so scaling the whole
    # stream by 10 leaves the normalised values (and their variance) unchanged
    x = torch.tensor([[0.0, 1.0], [2.0, 3.0], [1.0, 0.0], [3.0, 3.0]])
    assert torch.allclose(lag_normalised_variance(x, chunk=2), lag_normalised_variance(10 * x, chunk=2), atol=1e-5)
    # token 2 -> ((1-0)/2, (0-1)/2) = (.5, -.5): variance .25
    assert lag_normalised_variance(x, chunk=2)[2].item() == pytest.approx(0.25, abs=1e-5)
