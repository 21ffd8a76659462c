"""validation.correlation: pooled vs within-trace rho (Fisher-z mean), n_eff = traces, positional check, per-group
correction, significance by the t-interval over traces, exact +-1."""

from __future__ import annotations

import math

import numpy as np
import pytest
from statsmodels.stats.multitest import multipletests

from validation.correlation import (
    SIGNIFICANCE,
    informative_traces,
    per_trace_rho,
    pooled,
    rank_scorers,
    signal_table,
    within_trace,
)
from validation.signals import Aligned, AlignedTrace
from validation.stats import fisher_z_interval, t_interval


def _aligned(names, traces):
    """traces: list of (labels [T], values [T, S]); positions start at 100."""
    return Aligned(
        list(names),
        [AlignedTrace(f"t{i}", 100 + np.arange(len(lab)), np.asarray(lab, float), np.asarray(val, float).reshape(
            len(lab), -1)) for i, (lab, val) in enumerate(traces)],
        [],
    )


def test_within_trace_mean_by_hand():
    up, down = [1, 2, 3, 4], [4, 3, 2, 1]
    labels = [0, 0, 1, 1]
    # Pearson([1,2,3,4], [1.5,1.5,3.5,3.5]) = 2 / sqrt(5); the constant-label trace has no rho and is left out.
    aligned = _aligned(["s"], [(labels, up), (labels, up), (labels, down), (labels, up), ([1, 1, 1, 1], up),
                               (labels, up)])
    result = within_trace(aligned)
    r = 2 / math.sqrt(5)
    # Averaged in z-space: (4 atanh(r) - atanh(r)) / 5, back-transformed; the plain rho mean would be 3r/5.
    assert result.rho[0] == pytest.approx(math.tanh(3 * math.atanh(r) / 5))
    assert result.rho[0] != pytest.approx(3 * r / 5)
    assert result.n_eff[0] == 5
    assert result.sd[0] == pytest.approx(np.std([r, r, -r, r, r], ddof=1))
    z = 3 * math.atanh(r) / 5
    assert result.lo[0] == pytest.approx(math.tanh(z - 1.959963984540054 / math.sqrt(2)))
    assert result.hi[0] == pytest.approx(math.tanh(z + 1.959963984540054 / math.sqrt(2)))
    # The bootstrap resamples the five traces: its replicates lie between all -r and all +r.
    assert -r <= result.boot_lo[0] < result.rho[0] < result.boot_hi[0] <= r
    assert informative_traces(aligned) == 5


def test_n_eff_counts_traces_not_tokens():
    rng = np.random.default_rng(0)
    traces = []
    for _ in range(6):
        lab = (rng.random(500) < 0.3).astype(float)
        traces.append((lab, lab + rng.normal(size=500)))
    aligned = _aligned(["s"], traces)
    for result in (within_trace(aligned), pooled(aligned)):
        assert result.n_eff[0] == 6  # not 3000 tokens
        lo, hi = fisher_z_interval(result.rho[0], 6)
        assert (result.lo[0], result.hi[0]) == pytest.approx((float(lo), float(hi)))
    # With 3000 "independent" tokens the interval would be ~20x narrower; ours is the trace-level width.
    assert within_trace(aligned).hi[0] - within_trace(aligned).lo[0] > 0.3


def test_pooled_overstates_when_structure_is_across_traces():
    # Trace i has a signal offset i and an important fraction rising with i, but no within-trace relation
    # (EpiKV §3.2: the aggregate rho is driven partly by cross-problem structure).
    rng = np.random.default_rng(1)
    traces = []
    for i in range(10):
        lab = (rng.random(200) < 0.05 + 0.09 * i).astype(float)
        traces.append((lab, i + rng.random(200) * 0.5))
    aligned = _aligned(["s"], traces)
    assert pooled(aligned).rho[0] > 0.3
    assert abs(within_trace(aligned).rho[0]) < 0.05


def test_position_rho_detects_a_trend_and_detrending_removes_it():
    rng = np.random.default_rng(2)
    traces = []
    for _ in range(8):
        lab = (rng.random(300) < 0.3).astype(float)
        noise = rng.normal(size=300)
        trend = np.linspace(0, 5, 300)
        traces.append((lab, np.column_stack([trend + noise, noise])))
    aligned = _aligned(["raw", "detrended"], traces)
    position = within_trace(aligned, "position")
    assert position.rho[0] > 0.8
    assert abs(position.rho[1]) < 0.05
    assert position.n_eff.tolist() == [8, 8]


def test_signal_table_corrects_within_each_layer_family():
    rng = np.random.default_rng(3)
    names = ["g.l0.roll64", "g.l1.roll64", "g.l2.roll64", "g.l0.z64", "h2o"]
    traces = []
    for _ in range(12):
        lab = (rng.random(100) < 0.4).astype(float)
        cols = [lab * w + rng.normal(size=100) for w in (3.0, 0.2, 0.0, 0.5, 0.1)]
        traces.append((lab, np.column_stack(cols)))
    rows = signal_table(_aligned(names, traces), correction="holm")
    by = {r["signal"]: r for r in rows}
    roll = [by[n]["within_p"] for n in names[:3]]
    expected = multipletests(roll, method="holm")[1]
    assert [by[n]["within_p_adj"] for n in names[:3]] == pytest.approx(expected)
    roll_t = [by[n]["within_t_p"] for n in names[:3]]
    assert [by[n]["within_t_p_adj"] for n in names[:3]] == pytest.approx(multipletests(roll_t, method="holm")[1])
    # A family of one is not corrected.
    assert by["g.l0.z64"]["within_p_adj"] == pytest.approx(by["g.l0.z64"]["within_p"])
    assert by["h2o"]["within_p_adj"] == pytest.approx(by["h2o"]["within_p"])
    assert by["g.l0.roll64"]["within_significant"] and not by["g.l2.roll64"]["within_significant"]
    assert by["g.l1.roll64"]["layer"] == 1 and by["h2o"]["layer"] is None
    assert all(r["n_tokens"] == 1200 and r["within_n_eff"] == 12 for r in rows)
    for row in rows:  # both intervals of the within-trace mean surround it
        assert row["within_lo"] < row["within_rho"] < row["within_hi"]
        assert row["within_boot_lo"] <= row["within_rho"] <= row["within_boot_hi"]
        assert row["within_t_lo"] < row["within_rho"] < row["within_t_hi"]
        assert row["position_boot_lo"] <= row["position_rho"] <= row["position_boot_hi"]
        assert row["position_t_lo"] <= row["position_rho"] <= row["position_t_hi"]
    ranked = [r["signal"] for r in rank_scorers(rows)]
    assert ranked[0] == "g.l0.roll64" and ranked[1] == "g.l0.z64"


def test_rank_scorers_puts_undefined_last():
    rows = [{"signal": "a", "within_rho": float("nan")}, {"signal": "b", "within_rho": -0.2},
            {"signal": "c", "within_rho": 0.1}]
    assert [r["signal"] for r in rank_scorers(rows)] == ["c", "b", "a"]


def test_significance_rests_on_the_t_interval_over_traces():
    # Twelve long traces that agree closely on a modest rho (~0.25, SD ~0.05): the paper's half-width in z,
    # 1.96 / sqrt(12 - 3) = 0.65, spans zero; the t-interval over the traces' spread does not.
    rng = np.random.default_rng(5)
    traces = []
    for _ in range(12):
        lab = (rng.random(400) < 0.3).astype(float)
        traces.append((lab, np.column_stack([0.55 * lab + rng.normal(size=400), rng.normal(size=400)])))
    aligned = _aligned(["s.l0.raw", "s.l1.raw"], traces)
    rows = {r["signal"]: r for r in signal_table(aligned, correction="none", n_boot=500)}
    assert SIGNIFICANCE["within"] == "within_t"
    signal, noise = rows["s.l0.raw"], rows["s.l1.raw"]
    assert 0.15 < signal["within_rho"] < 0.35
    assert signal["within_lo"] < 0 and not signal["within_significant"]  # the paper's decision
    assert signal["within_t_lo"] > 0 and signal["within_t_significant"]  # kvscope's
    assert signal["within_boot_lo"] > 0
    # With no correction the decision is exactly "the t-interval excludes zero" and "t-test p < 0.05".
    for row in (signal, noise):
        excludes = row["within_t_lo"] > 0 or row["within_t_hi"] < 0
        assert row["within_t_significant"] == excludes == (row["within_t_p"] < 0.05)
    assert not noise["within_t_significant"]


def test_t_interval_of_the_within_mean_is_tanh_of_the_t_interval_of_z():
    rng = np.random.default_rng(6)
    traces = []
    for _ in range(7):
        lab = (rng.random(60) < 0.4).astype(float)
        traces.append((lab, lab + rng.normal(size=60)))
    aligned = _aligned(["s"], traces)
    z = np.arctanh(per_trace_rho(aligned)[:, 0])
    _, lo, hi, p = t_interval(z)
    result = within_trace(aligned)
    assert (result.t_lo[0], result.t_hi[0], result.t_p[0]) == pytest.approx((math.tanh(lo), math.tanh(hi), p))


def test_a_scorer_that_is_position_has_position_rho_exactly_one():
    # recency's score is the position itself: rho 1 in every trace, so 1 exactly, not the clip 0.9999.
    rng = np.random.default_rng(7)
    traces = [((rng.random(50) < 0.3).astype(float), 100 + np.arange(50.0)) for _ in range(6)]
    rows = signal_table(_aligned(["recency.agg.raw"], traces), n_boot=200)
    row = rows[0]
    assert row["position_rho"] == 1.0
    assert [row[f"position_{b}"] for b in ("lo", "hi", "t_lo", "t_hi", "boot_lo", "boot_hi")] == [1.0] * 6
    assert -1 < row["within_rho"] < 1
