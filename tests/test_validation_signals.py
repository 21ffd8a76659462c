"""validation.signals: label / signal readers, alignment by trace and position, signal-name parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.errors import UsageError
from validation.signals import align, load_aligned, parse_signal_name, read_labels, read_signals


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _label(trace_id, positions, labels, start, end):
    return {"trace_id": trace_id, "positions": positions, "labels": labels, "reasoning_start": start,
            "answer_start": end}


def _parts(name):
    parsed = parse_signal_name(name)
    assert parsed.name == name
    return parsed.family, parsed.layer, parsed.transform


def test_parse_signal_name():
    assert _parts("hidden_diff.l10.roll64") == ("hidden_diff", 10, "roll64")
    assert _parts("hidden_diff.l21.z64") == ("hidden_diff", 21, "z64")
    assert _parts("g_l10_mean64") == ("g", 10, "mean64")
    assert _parts("attn_entropy.l3") == ("attn_entropy", 3, "raw")
    assert _parts("kv_key") == ("kv_key", None, "raw")
    assert _parts("h2o") == ("h2o", None, "raw")


def test_labels_keep_only_the_reasoning_span(tmp_path):
    path = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1, 2, 3, 4, 5], [1, 1, 0, 1, 0, 0], 2, 5)])
    (trace,), skipped = read_labels(path)
    assert skipped == {}
    assert trace.positions.tolist() == [2, 3, 4]  # prompt (0, 1) and answer (5) dropped
    assert trace.labels.tolist() == [0, 1, 0]


def test_alignment_by_trace_id_and_position(tmp_path):
    labels = _write_jsonl(tmp_path / "labels.jsonl", [
        _label("a", [10, 11, 12, 13], [0, 1, 0, 1], 10, 14),
        _label("b", [5, 6], [1, 0], 5, 7),
        _label("only_labels", [1, 2], [0, 1], 1, 3),
    ])
    signals = _write_jsonl(tmp_path / "signals.jsonl", [
        # Different order and an extra position (14) outside the labels; 10 missing from the signals.
        {"trace_id": "a", "positions": [14, 13, 12, 11], "signals": {"s": [9.0, 3.0, 2.0, 1.0], "t": [0, 0, 0, 1]}},
        {"trace_id": "b", "positions": [5, 6], "signals": {"s": [1.0, 2.0], "t": [3, 4]}},
        {"trace_id": "only_signals", "positions": [1], "signals": {"s": [1.0], "t": [1.0]}},
    ])
    aligned = load_aligned(labels, [signals])
    assert aligned.names == ["s", "t"]
    a, b = aligned.traces
    assert a.trace_id == "a" and a.positions.tolist() == [11, 12, 13]
    assert a.labels.tolist() == [1, 0, 1] and a.values[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert b.values.tolist() == [[1.0, 3.0], [2.0, 4.0]]
    assert sorted(aligned.dropped_traces) == ["only_labels", "only_signals"]
    picked = aligned.select(["t"])
    assert picked.names == ["t"] and picked.traces[0].values[:, 0].tolist() == [1, 0, 0]
    with pytest.raises(UsageError, match="unknown signal 'u'"):
        aligned.select(["u"])


def test_npz_long_format_reads_like_jsonl(tmp_path):
    jsonl = _write_jsonl(tmp_path / "signals.jsonl", [
        {"trace_id": "a", "positions": [0, 1, 2], "signals": {"x.l1.roll64": [1.0, 2.0, 3.0], "h2o": [3, 2, 1]}},
        {"trace_id": "b", "positions": [4, 5], "signals": {"x.l1.roll64": [5.0, 6.0], "h2o": [0, 1]}},
    ])
    npz = tmp_path / "signals.npz"
    np.savez(npz, trace_id=np.array(["a", "a", "a", "b", "b"]), position=np.array([0, 1, 2, 4, 5]),
             **{"x.l1.roll64": np.array([1.0, 2, 3, 5, 6]), "h2o": np.array([3.0, 2, 1, 0, 1])})
    (names_j, traces_j), (names_n, traces_n) = ((s.names, s.traces) for s in (read_signals(jsonl), read_signals(npz)))
    assert sorted(names_j) == sorted(names_n)
    order = [names_n.index(n) for n in names_j]
    for tj, tn in zip(traces_j, traces_n):
        assert tj.trace_id == tn.trace_id and tj.positions.tolist() == tn.positions.tolist()
        assert np.array_equal(tj.values, tn.values[:, order])


def test_no_shared_trace_is_a_usage_error(tmp_path):
    labels, _ = read_labels(_write_jsonl(tmp_path / "l.jsonl", [_label("a", [0, 1], [0, 1], 0, 2)]))
    signals = read_signals(_write_jsonl(tmp_path / "s.jsonl", [
        {"trace_id": "z", "positions": [0, 1], "signals": {"s": [1, 2]}}]))
    with pytest.raises(UsageError, match="share no trace"):
        align(labels, signals)


@pytest.mark.parametrize(
    "record,message",
    [
        ({"trace_id": "a", "positions": [0, 1], "signals": {"s": [1.0]}}, "1 values for 2 positions"),
        ({"trace_id": "a", "positions": [0, 0], "signals": {"s": [1.0, 2.0]}}, "repeated positions"),
        ({"trace_id": "a", "positions": [0, 1]}, "missing field"),
        ({"trace_id": "a", "positions": [0, 1], "signals": {}}, "non-empty"),
    ],
)
def test_bad_signal_records(tmp_path, record, message):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(UsageError, match=message):
        read_signals(path)


def test_signal_names_must_agree_across_traces(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [
        {"trace_id": "a", "positions": [0], "signals": {"s": [1.0]}},
        {"trace_id": "b", "positions": [0], "signals": {"t": [1.0]}},
    ])
    with pytest.raises(UsageError, match="differ"):
        read_signals(path)


def test_bad_label_records(tmp_path):
    with pytest.raises(UsageError, match="0 or 1"):
        read_labels(_write_jsonl(tmp_path / "a.jsonl", [_label("a", [0, 1], [0, 2], 0, 2)]))
    with pytest.raises(UsageError, match="more than once"):
        read_labels(_write_jsonl(tmp_path / "b.jsonl", [_label("a", [0], [0], 0, 1)] * 2))
    with pytest.raises(UsageError, match="not found"):
        read_labels(tmp_path / "missing.jsonl")


def test_labels_skip_unlabelled_and_incorrect_traces(tmp_path):
    path = _write_jsonl(tmp_path / "labels.jsonl", [
        {**_label("a", [0, 1], [0, 1], 0, 2), "status": "labelled", "correct": True},
        {"trace_id": "b", "status": "skipped", "reason": "span too short"},
        {**_label("c", [0, 1], [1, 0], 0, 2), "correct": False},
    ])
    traces, skipped = read_labels(path)
    assert [t.trace_id for t in traces] == ["a"] and skipped == {"status skipped": 1, "incorrect": 1}
    traces, skipped = read_labels(path, include_incorrect=True)
    assert [t.trace_id for t in traces] == ["a", "c"] and skipped == {"status skipped": 1}
    only_skipped = _write_jsonl(tmp_path / "none.jsonl", [{"trace_id": "b", "status": "skipped"}])
    with pytest.raises(UsageError, match="no usable label records"):
        read_labels(only_skipped)


def test_probes_signals_layout_and_merging_files(tmp_path):
    # probes.signals writes {signal: {layer: [...]}} plus the file's smoothing; null where undefined.
    mean = _write_jsonl(tmp_path / "mean.jsonl", [
        {"trace_id": "a", "positions": [0, 1, 2, 3], "smoothing": "mean",
         "signals": {"hidden_diff": {"0": [None, 1.0, 2.0, 3.0], "2": [None, 4.0, 5.0, 6.0]}}}])
    z = _write_jsonl(tmp_path / "z.jsonl", [
        {"trace_id": "a", "positions": [1, 2, 3, 4], "smoothing": "z",
         "signals": {"hidden_diff": {"0": [0.1, 0.2, 0.3, 0.4]}}}])
    assert read_signals(mean).names == ["hidden_diff.l0.mean", "hidden_diff.l2.mean"]
    labels = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1, 2, 3, 4], [1, 0, 1, 0, 1], 0, 5)])
    aligned = load_aligned(labels, [mean, z])
    assert aligned.names == ["hidden_diff.l0.mean", "hidden_diff.l2.mean", "hidden_diff.l0.z"]
    (trace,) = aligned.traces
    assert trace.positions.tolist() == [1, 2, 3]  # position 0 missing from z, 4 missing from mean
    assert trace.values.tolist() == [[1.0, 4.0, 0.1], [2.0, 5.0, 0.2], [3.0, 6.0, 0.3]]
    with pytest.raises(UsageError, match="more than one signal file"):
        load_aligned(labels, [mean, mean])


def test_finite_drops_positions_with_any_nonfinite_signal(tmp_path):
    labels = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1, 2], [1, 0, 1], 0, 3),
                                                      _label("b", [0], [1], 0, 1)])
    signals = _write_jsonl(tmp_path / "s.jsonl", [
        {"trace_id": "a", "positions": [0, 1, 2], "signals": {"s": [None, 1.0, 2.0], "t": [1.0, float("nan"), 3.0]}},
        {"trace_id": "b", "positions": [0], "signals": {"s": [None], "t": [1.0]}}])
    aligned = load_aligned(labels, [signals])
    assert aligned.traces[0].values.shape == (3, 2)
    clean = aligned.finite()
    assert [t.trace_id for t in clean.traces] == ["a"] and clean.traces[0].positions.tolist() == [2]
    assert clean.nonfinite_positions == 3 and "b" in clean.dropped_traces
    # Restricting to "s" first keeps position 1 (only "t" is NaN there).
    assert aligned.select(["s"]).finite().traces[0].positions.tolist() == [1, 2]
