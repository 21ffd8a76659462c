"""validation.bands: contiguous significant runs, representative layers, combined score, policy JSON."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import UsageError
from validation.bands import Band, choose_layers, combined_score, find_bands, policy_config


def _epikv_like_profile():
    """32 layers: Band A 7-13 positive, Band B 18-25 negative, l31 positive but isolated (EpiKV Appendix 6)."""
    layers = list(range(32))
    rho = np.full(32, 0.02)
    rho[7:14] = [0.10, 0.15, 0.20, 0.30, 0.25, 0.18, 0.12]
    rho[18:26] = [-0.10, -0.14, -0.20, -0.28, -0.22, -0.16, -0.12, -0.09]
    rho[31] = 0.2
    significant = np.abs(rho) >= 0.09
    return layers, rho, significant


def test_two_bands_found_on_synthetic_profile():
    layers, rho, sig = _epikv_like_profile()
    bands = find_bands(layers, rho, sig)
    assert [(b.sign, b.layers) for b in bands] == [(1, tuple(range(7, 14))), (-1, tuple(range(18, 26))), (1, (31,))]
    assert bands[0].peak_layer == 10 and bands[1].peak_layer == 21
    assert bands[0].peak_rho == pytest.approx(0.30) and bands[1].mean_rho == pytest.approx(np.mean(rho[18:26]))
    # Requiring two layers drops the isolated l31.
    assert [b.layers[0] for b in find_bands(layers, rho, sig, min_length=2)] == [7, 18]


def test_runs_break_on_sign_change_gap_and_non_significance():
    # Sign change between 3 and 4; not significant at 6; layer 9 missing (not measured).
    layers = [8, 1, 2, 3, 4, 5, 6, 7, 10]
    rho = [0.3, 0.2, 0.3, 0.25, -0.2, -0.3, 0.4, 0.3, 0.3]
    sig = [True, True, True, True, True, True, False, True, True]
    bands = find_bands(layers, rho, sig)
    assert [(b.sign, b.layers) for b in bands] == [(1, (1, 2, 3)), (-1, (4, 5)), (1, (7, 8)), (1, (10,))]


def test_no_band_without_significance_and_zero_rho_never_counts():
    assert find_bands([0, 1, 2], [0.5, 0.5, 0.5], [False, False, False]) == []
    assert find_bands([0, 1], [0.0, np.nan], [True, True]) == []
    with pytest.raises(UsageError):
        find_bands([0], [0.5], [True], min_length=0)


def test_choose_layers_picks_strongest_band_per_sign():
    bands = [
        Band(1, (2, 3), (0.2, 0.3)),
        Band(1, (7, 8, 9), (0.4, 0.5, 0.45)),
        Band(-1, (12, 13), (-0.3, -0.35)),
    ]
    assert choose_layers(bands, "peak") == ((8,), (13,))
    assert choose_layers(bands, "all") == ((7, 8, 9), (12, 13))
    assert choose_layers(bands[:2]) == ((8,), ())
    with pytest.raises(UsageError, match="band layer mode"):
        choose_layers(bands, "median")


def test_combined_score_by_hand():
    values = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # columns: layer 10, 21, 22
    cols = {10: 0, 21: 1, 22: 2}
    # EpiKV Eq. 1 with one layer per band: g10 - g21.
    assert combined_score(values, cols, (10,), (21,)).tolist() == [-1.0, -1.0]
    # Band means: g10 - (g21 + g22) / 2.
    assert combined_score(values, cols, (10,), (21, 22)).tolist() == [-1.5, -1.5]
    assert combined_score(values, cols, (), (22,)).tolist() == [-3.0, -6.0]
    with pytest.raises(UsageError, match="layer"):
        combined_score(values, cols, (11,), (21,))


def test_policy_config_schema():
    config = policy_config("epikv", (10,), (21, 22), 64, {"n_traces": 7})
    assert config == {"policy": "epikv",
                      "params": {"positive_layers": [10], "negative_layers": [21, 22], "window": 64},
                      "provenance": {"n_traces": 7}}
    with pytest.raises(UsageError):
        policy_config("h2o", (10,), (), 64, {})
