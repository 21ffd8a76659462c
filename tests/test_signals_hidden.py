"""Hidden-state change and the causal smoothers: hand-derived values, causality, chunking and state round-trips."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import UsageError
from models.hooks import capture
from signals.extract import SignalStream
from signals.hidden import (
    EMA,
    BandScore,
    HiddenDiff,
    RollingStats,
    Smoother,
    band_difference,
    band_score,
    hidden_diff,
    hidden_diffs,
    hidden_state_name,
    smooth,
)

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_hidden_diff_is_the_l2_norm_of_the_change():
    prev = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    cur = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    assert hidden_diff(prev, cur).tolist() == [5.0, 0.0]
    assert hidden_diff(prev.half(), cur.half()).dtype == torch.float32


def test_hidden_diffs_first_position_is_nan_without_a_predecessor():
    h = torch.tensor([[[0.0, 0.0], [3.0, 4.0], [3.0, 4.0]]])  # [batch 1, pos 3, d 2]
    g = hidden_diffs(h)
    assert math.isnan(g[0, 0]) and g[0, 1:].tolist() == [5.0, 0.0]
    g_prev = hidden_diffs(h[:, 1:], prev=h[:, 0])
    assert g_prev.tolist() == [[5.0, 0.0]]


def test_rolling_stats_hand_values_window_3():
    mean, std = RollingStats(3).add(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    # windows: [1], [1,2], [1,2,3], [2,3,4]; population std of [1,2,3] is sqrt(2/3)
    assert torch.allclose(mean, torch.tensor([[1.0, 1.5, 2.0, 3.0]]))
    assert torch.allclose(std, torch.tensor([[0.0, 0.5, math.sqrt(2 / 3), math.sqrt(2 / 3)]]))


def test_rolling_stats_skips_nan_but_counts_its_slot():
    mean, std = RollingStats(2).add(torch.tensor([[NAN, 2.0, 4.0, NAN, NAN]]))
    # windows: [nan], [nan,2], [2,4], [4,nan], [nan,nan]
    assert math.isnan(mean[0, 0]) and math.isnan(mean[0, 4])
    assert mean[0, 1:4].tolist() == [2.0, 3.0, 4.0]
    assert std[0, 1:4].tolist() == [0.0, 1.0, 0.0]


def test_zscore_is_eq2_with_eps():
    z = RollingStats(2, eps=0.5).zscore(torch.tensor([[1.0, 3.0]]))
    # t=0: mean 1, std 0 -> 0 / 0.5 = 0; t=1: mean 2, std 1 -> (3 - 2) / 1.5
    assert torch.allclose(z, torch.tensor([[0.0, 1 / 1.5]]))


def test_ema_hand_values_and_nan():
    out = EMA(alpha=0.5).add(torch.tensor([[NAN, 2.0, 4.0, NAN, 8.0]]))
    assert math.isnan(out[0, 0])
    assert out[0, 1:].tolist() == [2.0, 3.0, 3.0, 5.5]


def test_band_score_mean_is_eq1():
    g_a = torch.tensor([1.0, 3.0, 5.0])
    g_b = torch.tensor([2.0, 2.0, 8.0])
    # rolling-2 means: a [1, 2, 4], b [2, 2, 5]
    assert band_score(g_a, g_b, smoothing="mean", window=2).tolist() == [-1.0, 0.0, -1.0]


def test_band_difference_by_hand_on_tensors_and_arrays():
    import numpy as np

    # band A = layers with values [1, 2] and [3, 6] (mean [2, 4]); band B = [1, 1] -> [1, 3]
    a1, a2, b1 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([1.0, 1.0])
    assert band_difference([a1, a2], [b1]).tolist() == [1.0, 3.0]
    assert band_difference([], [b1]).tolist() == [-1.0, -1.0]  # an empty side contributes 0
    assert band_difference([np.array([1.0, 2.0]), np.array([3.0, 6.0])], []).tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="at least one layer"):
        band_difference([], [])


def test_band_score_of_several_layers_averages_each_smoothed_layer():
    g_a1, g_a2 = torch.tensor([[1.0, 3.0, 5.0]]), torch.tensor([[3.0, 1.0, 1.0]])
    g_b = torch.tensor([[2.0, 2.0, 8.0]])
    # rolling-2 means: a1 [1, 2, 4], a2 [3, 2, 1] -> band A [2, 2, 2.5]; b [2, 2, 5]
    assert band_score([g_a1, g_a2], g_b, smoothing="mean", window=2).tolist() == [[0.0, 0.0, -2.5]]
    stream = BandScore("mean", window=2)
    parts = [stream.add([g_a1[:, i:i + 1], g_a2[:, i:i + 1]], [g_b[:, i:i + 1]]) for i in range(3)]
    assert torch.cat(parts, 1).tolist() == [[0.0, 0.0, -2.5]]
    assert band_score([], g_b, smoothing="mean", window=2).tolist() == [[-2.0, -2.0, -5.0]]


@pytest.mark.parametrize("kind", ["raw", "mean", "ema", "z"])
def test_smoothing_is_causal_and_chunking_invariant(kind):
    torch.manual_seed(0)
    x = torch.rand(2, 50)
    x[:, 0] = NAN
    full = smooth(x, kind, window=7)
    # Appending later tokens never changes an earlier score: bit-identical prefix.
    for cut in (1, 13, 49):
        prefix = smooth(x[:, :cut], kind, window=7)
        assert torch.equal(prefix.nan_to_num(-1), full[:, :cut].nan_to_num(-1))
    # Feeding the stream in arbitrary chunks gives the same values as one block.
    smoother = Smoother(kind, window=7)
    chunks = [smoother.add(x[:, a:b]) for a, b in ((0, 1), (1, 5), (5, 6), (6, 50))]
    assert torch.allclose(torch.cat(chunks, 1), full, equal_nan=True)


def test_band_score_z_is_causal():
    torch.manual_seed(1)
    g_a, g_b = torch.rand(1, 40), torch.rand(1, 40)
    full = band_score(g_a, g_b, smoothing="z", window=8)
    assert torch.equal(band_score(g_a[:, :25], g_b[:, :25], smoothing="z", window=8), full[:, :25])
    stream = BandScore("z", window=8)
    streamed = torch.cat([stream.add(g_a[:, i:i + 1], g_b[:, i:i + 1]) for i in range(40)], 1)
    assert torch.allclose(streamed, full)


@pytest.mark.parametrize("make", [lambda: RollingStats(5), lambda: EMA(0.8), lambda: BandScore("mean", 5)])
def test_state_dict_round_trip_resumes_the_stream(make):
    torch.manual_seed(2)
    x, y = torch.rand(1, 20), torch.rand(1, 20)

    def feed(obj, a, b):
        out = obj.add(x[:, a:b], y[:, a:b]) if isinstance(obj, BandScore) else obj.add(x[:, a:b])
        return out[0] if isinstance(out, tuple) else out

    reference = make()
    expected = feed(reference, 0, 20)[:, 12:]
    first = make()
    feed(first, 0, 12)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert torch.allclose(feed(resumed, 12, 20), expected)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        RollingStats(0)
    with pytest.raises(ValueError):
        EMA(1.0)
    with pytest.raises(ValueError):
        Smoother("median")
    with pytest.raises(ValueError, match="batch size"):
        stats = RollingStats(3)
        stats.add(torch.zeros(2, 1))
        stats.add(torch.zeros(1, 1))


def test_hidden_diff_stream_over_prefill_and_decode_matches_one_block(tiny_llama):
    """Chunked forwards (prefill 5 + single tokens) give the g of one forward over the same ids."""
    from transformers import DynamicCache

    model = tiny_llama.model
    ids = torch.arange(20, 32)[None]
    stream = SignalStream(model, [1, 3], ["hidden_diff"])
    with torch.no_grad(), stream.attached():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :5], cache=cache, use_cache=True)
        for t in range(5, ids.shape[1]):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    with torch.no_grad():
        hidden_states = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer in (1, 3):
        expected = hidden_diffs(hidden_states[layer])  # EpiKV's h_l: output_hidden_states[l] = input of block l
        got = stream.result()["hidden_diff"][layer]
        assert got.shape == (1, 12)
        assert torch.allclose(got, expected, atol=1e-5, equal_nan=True)
        assert math.isnan(got[0, 0]) and bool(torch.isfinite(got[0, 1:]).all())


def test_hidden_state_hook_is_resid_pre_unless_told(tiny_llama):
    assert hidden_state_name(10) == "blocks.10.hook_resid_pre"
    assert hidden_state_name(10, "hook_resid_post") == "blocks.10.hook_resid_post"
    with pytest.raises(UsageError, match="hook_resid_pre"):
        hidden_state_name(10, "hook_resid_mid")
    ids = torch.arange(20, 28)[None]
    post = HiddenDiff()  # the signal takes whichever h_l it is fed: here block 1's output
    with torch.no_grad(), capture(tiny_llama.model, [hidden_state_name(1, "hook_resid_post")],
                                  callback=lambda name, hidden: post.add(hidden)):
        hidden_states = tiny_llama.model(input_ids=ids, output_hidden_states=True).hidden_states
    # the block's output is the next block's input: one layer deeper than h_l
    assert torch.allclose(post.result(), hidden_diffs(hidden_states[2]), atol=1e-5, equal_nan=True)
