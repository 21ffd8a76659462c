"""validation.signals: label and signal records, alignment by id and position, signal-name parsing."""

from __future__ import annotations

import json

import pytest

from core.errors import UsageError
from validation.signals import align, load_aligned, parse_signal_name, read_labels, read_signals


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _label(trace_id, positions, labels, start, end, **extra):
    return {"kind": "label", "id": trace_id, "dataset": "gsm8k", "model": "m", "status": "labelled",
            "positions": positions, "labels": labels, "reasoning_start": start, "answer_start": end, **extra}


def _skipped(trace_id, reason="span too short"):
    return {"kind": "label", "id": trace_id, "dataset": "gsm8k", "model": "m", "status": "skipped", "reason": reason}


def _signal(trace_id, positions, signals, **extra):
    """A Signal record; `signals` is {signal: {layer key: values}}."""
    return {"kind": "signal", "id": trace_id, "model": "m", "n_tokens": max(positions) + 1, "n_prompt": 0,
            "positions": positions, "signals": signals, **extra}


def _agg(**columns):
    """Layerless signals as a policy's aggregate: {name: {"agg": values}}."""
    return {name: {"agg": values} for name, values in columns.items()}


def _parts(name):
    parsed = parse_signal_name(name)
    assert parsed.name == name
    return parsed.family, parsed.layer, parsed.transform


def test_parse_signal_name():
    assert _parts("hidden_diff.l10.mean64") == ("hidden_diff", 10, "mean64")
    assert _parts("hidden_diff.l21.z64") == ("hidden_diff", 21, "z64")
    assert _parts("g_l10_mean64") == ("g", 10, "mean64")
    assert _parts("attn_entropy.l3") == ("attn_entropy", 3, "raw")
    assert _parts("snapkv.agg.raw") == ("snapkv", None, "raw")
    assert _parts("kv_key") == ("kv_key", None, "raw")
    assert _parts("h2o") == ("h2o", None, "raw")


def test_labels_keep_only_the_reasoning_span(tmp_path):
    path = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1, 2, 3, 4, 5], [1, 1, 0, 1, 0, 0], 2, 5)])
    (trace,), skipped = read_labels(path)
    assert skipped == {}
    assert trace.id == "a" and trace.positions.tolist() == [2, 3, 4]  # prompt (0, 1) and answer (5) dropped
    assert trace.labels.tolist() == [0, 1, 0]


def test_alignment_by_id_and_position(tmp_path):
    labels = _write_jsonl(tmp_path / "labels.jsonl", [
        _label("a", [10, 11, 12, 13], [0, 1, 0, 1], 10, 14),
        _label("b", [5, 6], [1, 0], 5, 7),
        _label("only_labels", [1, 2], [0, 1], 1, 3),
    ])
    signals = _write_jsonl(tmp_path / "signals.jsonl", [
        # Different order and an extra position (14) outside the labels; 10 missing from the signals.
        _signal("a", [14, 13, 12, 11], _agg(s=[9.0, 3.0, 2.0, 1.0], t=[0, 0, 0, 1])),
        _signal("b", [5, 6], _agg(s=[1.0, 2.0], t=[3, 4])),
        _signal("only_signals", [1], _agg(s=[1.0], t=[1.0])),
    ])
    aligned = load_aligned(labels, [signals])
    assert aligned.names == ["s.agg.raw", "t.agg.raw"]
    a, b = aligned.traces
    assert a.id == "a" and a.positions.tolist() == [11, 12, 13]
    assert a.labels.tolist() == [1, 0, 1] and a.values[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert b.values.tolist() == [[1.0, 3.0], [2.0, 4.0]]
    assert sorted(aligned.dropped_traces) == ["only_labels", "only_signals"]
    picked = aligned.select(["t.agg.raw"])
    assert picked.names == ["t.agg.raw"] and picked.traces[0].values[:, 0].tolist() == [1, 0, 0]
    with pytest.raises(UsageError, match="unknown signal 'u'"):
        aligned.select(["u"])
    only_b = picked.restrict({"b", "not-aligned"})
    assert only_b.names == ["t.agg.raw"] and [t.id for t in only_b.traces] == ["b"]
    assert only_b.traces[0].values.tolist() == [[3.0], [4.0]]  # the picked column, not the first of all


def test_records_keyed_by_the_older_trace_id_still_read(tmp_path):
    old_labels = _label("a", [0, 1, 2], [0, 1, 0], 0, 3)
    old_labels["trace_id"] = old_labels.pop("id")
    del old_labels["kind"]
    old_signals = _signal("a", [0, 1, 2], {"hidden_diff": {"1": [0.1, 0.2, 0.3]}}, smoothing="raw")
    old_signals["trace_id"] = old_signals.pop("id")
    del old_signals["kind"]
    aligned = load_aligned(_write_jsonl(tmp_path / "l.jsonl", [old_labels]),
                           [_write_jsonl(tmp_path / "s.jsonl", [old_signals])])
    assert [t.id for t in aligned.traces] == ["a"] and aligned.names == ["hidden_diff.l1.raw"]


def test_a_file_of_another_kind_is_refused(tmp_path):
    labels = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1], [0, 1], 0, 2)])
    with pytest.raises(UsageError, match="is a label record, not a signal record"):
        read_signals(labels)
    with pytest.raises(UsageError, match="not a label record"):
        read_labels(_write_jsonl(tmp_path / "s.jsonl", [_signal("a", [0], _agg(s=[1.0]))]))


def test_no_shared_trace_is_a_usage_error(tmp_path):
    labels, _ = read_labels(_write_jsonl(tmp_path / "l.jsonl", [_label("a", [0, 1], [0, 1], 0, 2)]))
    signals = read_signals(_write_jsonl(tmp_path / "s.jsonl", [_signal("z", [0, 1], _agg(s=[1, 2]))]))
    with pytest.raises(UsageError, match="share no trace"):
        align(labels, signals)


@pytest.mark.parametrize(
    "record,message",
    [
        (_signal("a", [0, 1], _agg(s=[1.0])), "1 values for 2 positions"),
        (_signal("a", [0, 0], _agg(s=[1.0, 2.0])), "repeated positions"),
        ({k: v for k, v in _signal("a", [0, 1], _agg(s=[1.0, 2.0])).items() if k != "signals"}, "has no signals"),
        (_signal("a", [0, 1], {}), "non-empty"),
        (_signal("a", [0, 1], {"s": [1.0, 2.0]}), "is not an object of objects of lists"),
        (_signal("a", [0, 1], {"s": {"last": [1.0, 2.0]}}), "layer key 'last'"),
        (_signal("a", [0, 1], _agg(s=[1.0, 2.0]), window="64"), "window '64' is not an integer"),
    ],
)
def test_bad_signal_records(tmp_path, record, message):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(UsageError, match=message):
        read_signals(path)


def test_signal_names_must_agree_across_traces(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [_signal("a", [0], _agg(s=[1.0])), _signal("b", [0], _agg(t=[1.0]))])
    with pytest.raises(UsageError, match="differ"):
        read_signals(path)


def test_bad_label_records(tmp_path):
    with pytest.raises(UsageError, match="0 or 1"):
        read_labels(_write_jsonl(tmp_path / "a.jsonl", [_label("a", [0, 1], [0, 2], 0, 2)]))
    with pytest.raises(UsageError, match="appears twice"):
        read_labels(_write_jsonl(tmp_path / "b.jsonl", [_label("a", [0], [0], 0, 1)] * 2))
    with pytest.raises(UsageError, match="does not exist"):
        read_labels(tmp_path / "missing.jsonl")
    with pytest.raises(UsageError, match="without labels"):
        read_labels(_write_jsonl(tmp_path / "c.jsonl", [_label("a", [0], None, 0, 1)]))


def test_labels_use_every_labelled_trace_unless_correct_only(tmp_path):
    path = _write_jsonl(tmp_path / "labels.jsonl", [
        _label("a", [0, 1], [0, 1], 0, 2, correct=True),
        _skipped("b"),
        _label("c", [0, 1], [1, 0], 0, 2, correct=False),
    ])
    # Labels made with labeling.occlusion --include-incorrect are used as they are.
    traces, skipped = read_labels(path)
    assert [t.id for t in traces] == ["a", "c"] and skipped == {"status skipped": 1}
    traces, skipped = read_labels(path, correct_only=True)
    assert [t.id for t in traces] == ["a"] and skipped == {"status skipped": 1, "not correct": 1}
    only_skipped = _write_jsonl(tmp_path / "none.jsonl", [_skipped("b")])
    with pytest.raises(UsageError, match="no usable label records"):
        read_labels(only_skipped)


def test_probes_signals_layout_and_merging_files(tmp_path):
    # `python -m signals` writes {signal: {layer: [...]}}, its smoothing and window; null where undefined.
    mean = _write_jsonl(tmp_path / "mean.jsonl", [
        _signal("a", [0, 1, 2, 3], {"hidden_diff": {"0": [None, 1.0, 2.0, 3.0], "2": [None, 4.0, 5.0, 6.0]}},
                smoothing="mean", window=64)])
    z = _write_jsonl(tmp_path / "z.jsonl", [
        _signal("a", [1, 2, 3, 4], {"hidden_diff": {"0": [0.1, 0.2, 0.3, 0.4]}}, smoothing="z", window=64)])
    assert read_signals(mean).names == ["hidden_diff.l0.mean64", "hidden_diff.l2.mean64"]
    labels = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1, 2, 3, 4], [1, 0, 1, 0, 1], 0, 5)])
    aligned = load_aligned(labels, [mean, z])
    assert aligned.names == ["hidden_diff.l0.mean64", "hidden_diff.l2.mean64", "hidden_diff.l0.z64"]
    (trace,) = aligned.traces
    assert trace.positions.tolist() == [1, 2, 3]  # position 0 missing from z, 4 missing from mean
    assert trace.values.tolist() == [[1.0, 4.0, 0.1], [2.0, 5.0, 0.2], [3.0, 6.0, 0.3]]
    with pytest.raises(UsageError, match="more than one signal file"):
        load_aligned(labels, [mean, mean])


def test_replayed_policy_scores_per_layer_and_aggregate(tmp_path):
    signals = _write_jsonl(tmp_path / "replay.jsonl", [
        _signal("a", [0, 1, 2], {"snapkv": {"0": [0.1, 0.2, 0.3], "1": [0.3, 0.2, 0.1], "agg": [0.2, 0.2, 0.2]}})])
    names = read_signals(signals).names
    assert names == ["snapkv.l0.raw", "snapkv.l1.raw", "snapkv.agg.raw"]
    assert [parse_signal_name(n).layer for n in names] == [0, 1, None]


def test_finite_drops_positions_with_any_nonfinite_signal(tmp_path):
    labels = _write_jsonl(tmp_path / "labels.jsonl", [_label("a", [0, 1, 2], [1, 0, 1], 0, 3),
                                                      _label("b", [0], [1], 0, 1)])
    signals = _write_jsonl(tmp_path / "s.jsonl", [
        _signal("a", [0, 1, 2], _agg(s=[None, 1.0, 2.0], t=[1.0, float("nan"), 3.0])),
        _signal("b", [0], _agg(s=[None], t=[1.0]))])
    aligned = load_aligned(labels, [signals])
    assert aligned.traces[0].values.shape == (3, 2)
    clean = aligned.finite()
    assert [t.id for t in clean.traces] == ["a"] and clean.traces[0].positions.tolist() == [2]
    assert clean.nonfinite_positions == 3 and "b" in clean.dropped_traces
    # Restricting to "s" first keeps position 1 (only "t" is NaN there).
    assert aligned.select(["s.agg.raw"]).finite().traces[0].positions.tolist() == [1, 2]
