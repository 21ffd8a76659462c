"""Readers for occlusion labels and per-token signals, their alignment, and signal-name parsing.

Labels (JSONL, `labeling.occlusion` output), one record per trace::

    {"trace_id": str, "labels": [0/1 ...], "positions": [int ...], "reasoning_start": int, "answer_start": int,
     "status"?: "labelled" | "skipped", "correct"?: bool}

`labels[i]` is the occlusion label of absolute position `positions[i]` (EpiKV §3.4, Appendix 8). Only positions in
the reasoning span [reasoning_start, answer_start) are used: prompt positions are fixed to 1 by the protocol and the
answer span is not tested, so neither carries information about a signal. Records whose "status" is not "labelled"
are skipped, and so are traces marked "correct": false unless asked otherwise (EpiKV labels only correctly
answered traces, §3.4).

Signals, either

- JSONL, one record per trace: {"trace_id": str, "positions": [int ...], "signals": {...}} where each entry of
  "signals" is either a flat array `name: [v ...]` (one value per position), or a per-layer object
  `signal: {"<layer>": [v ...], ...}` as `probes.signals` writes it, read as the signals `{signal}.l{layer}.{smoothing}`
  with the record's "smoothing" field ("raw" if absent); or
- `.npz` in long format, one row per token: arrays `trace_id` [N] (str), `position` [N] (int), and every other
  array a signal named by its key, shape [N].

Several signal files (e.g. one per smoothing) are merged by trace_id and position; their names must not collide.
Every trace of a file must carry the same signal names. null / NaN values are allowed (hidden_diff is undefined at
position 0): `Aligned.finite()` drops every position where a signal is non-finite. Traces are aligned by trace_id and
then by absolute position; only positions present in the labels and every signal file are kept.

Signal names: a *layered* signal is `{family}.l{layer}.{transform}` (e.g. "hidden_diff.l10.roll64",
"hidden_diff.l21.z64") or `{family}_l{layer}_{transform}` (e.g. "g_l10_mean64"); a missing transform reads "raw".
Anything else ("kv_key", "h2o") is a layerless signal.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.errors import UsageError, unknown_choice
from core.records import read_jsonl

_LAYERED = re.compile(r"^(?P<family>[A-Za-z][\w]*?)[._]l(?P<layer>\d+)(?:[._](?P<transform>\w+))?$")


@dataclass(frozen=True)
class SignalName:
    name: str
    family: str  # the whole name for a layerless signal
    layer: int | None
    transform: str


def parse_signal_name(name: str) -> SignalName:
    """Split a signal name into (family, layer, transform); a layerless name keeps layer None."""
    match = _LAYERED.match(name)
    if match is None:
        return SignalName(name, name, None, "raw")
    return SignalName(name, match["family"], int(match["layer"]), match["transform"] or "raw")


@dataclass
class LabelTrace:
    trace_id: str
    positions: np.ndarray  # [T] absolute positions inside the reasoning span
    labels: np.ndarray  # [T] 0/1


@dataclass
class SignalTrace:
    trace_id: str
    positions: np.ndarray  # [T]
    values: np.ndarray  # [T, signals], columns in the file's name order


@dataclass
class SignalSet:
    names: list[str]
    traces: list[SignalTrace]


@dataclass
class AlignedTrace:
    trace_id: str
    positions: np.ndarray  # [T] absolute positions present in both labels and signals
    labels: np.ndarray  # [T]
    values: np.ndarray  # [T, signals]


@dataclass
class Aligned:
    names: list[str]
    traces: list[AlignedTrace]
    dropped_traces: list[str] = field(default_factory=list)  # on one side only, or with no shared position
    skipped_labels: dict[str, int] = field(default_factory=dict)  # label records left out, by reason
    nonfinite_positions: int = 0  # positions `finite()` removed

    def _replace(self, names: list[str], traces: list[AlignedTrace], **changes) -> Aligned:
        fields = {"dropped_traces": self.dropped_traces, "skipped_labels": self.skipped_labels,
                  "nonfinite_positions": self.nonfinite_positions, **changes}
        return Aligned(names, traces, **fields)

    def select(self, names: Iterable[str]) -> Aligned:
        """The same traces restricted to `names` (in that order); an unknown name is a `UsageError`."""
        names = list(names)
        index = {n: i for i, n in enumerate(self.names)}
        for n in names:
            if n not in index:
                raise unknown_choice("signal", n, self.names)
        cols = [index[n] for n in names]
        traces = [AlignedTrace(t.trace_id, t.positions, t.labels, t.values[:, cols]) for t in self.traces]
        return self._replace(names, traces)

    def with_columns(self, names: list[str], columns: list[list[np.ndarray]]) -> Aligned:
        """Append derived signals; `columns[j][i]` is signal `names[j]` for trace i ([T_i])."""
        traces = [
            AlignedTrace(t.trace_id, t.positions, t.labels, np.column_stack([t.values, *(c[i] for c in columns)]))
            for i, t in enumerate(self.traces)
        ]
        return self._replace(self.names + names, traces)

    def finite(self) -> Aligned:
        """Drop every position where any signal is non-finite; a trace left without positions is dropped."""
        traces, removed, dropped = [], 0, list(self.dropped_traces)
        for t in self.traces:
            keep = np.isfinite(t.values).all(axis=1)
            removed += int((~keep).sum())
            if keep.any():
                traces.append(AlignedTrace(t.trace_id, t.positions[keep], t.labels[keep], t.values[keep]))
            else:
                dropped.append(t.trace_id)
        return self._replace(self.names, traces, dropped_traces=dropped,
                             nonfinite_positions=self.nonfinite_positions + removed)


def _int_array(value, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise UsageError(f"{what} must be a list of numbers") from None
    if arr.ndim != 1 or not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
        raise UsageError(f"{what} must be a flat list of integers")
    return arr.astype(np.int64)


def _require(record: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise UsageError(f"{where}: missing field(s) {', '.join(missing)}")


def _check_unique(trace_id: str, seen: set[str], path: Path) -> None:
    if trace_id in seen:
        raise UsageError(f"{path}: trace_id {trace_id!r} appears more than once")
    seen.add(trace_id)


def read_labels(path: str | os.PathLike, include_incorrect: bool = False) -> tuple[list[LabelTrace], dict[str, int]]:
    """Read occlusion labels, keeping only positions inside each trace's reasoning span.

    Returns the traces and how many records were skipped, by reason ("status <s>", "incorrect").
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"labels file not found: {path}")
    traces, seen, skipped = [], set(), Counter()
    for number, record in enumerate(read_jsonl(path), start=1):
        where = f"{path}: record {number}"
        if record.get("status", "labelled") != "labelled":
            skipped[f"status {record['status']}"] += 1
            continue
        if record.get("correct") is False and not include_incorrect:
            skipped["incorrect"] += 1
            continue
        _require(record, ("trace_id", "labels", "positions", "reasoning_start", "answer_start"), where)
        trace_id = str(record["trace_id"])
        _check_unique(trace_id, seen, path)
        positions = _int_array(record["positions"], f"{where}: positions")
        labels = _int_array(record["labels"], f"{where}: labels")
        if positions.shape != labels.shape:
            raise UsageError(f"{where}: {labels.size} labels for {positions.size} positions")
        if not np.isin(labels, (0, 1)).all():
            raise UsageError(f"{where}: labels must be 0 or 1")
        if np.unique(positions).size != positions.size:
            raise UsageError(f"{where}: repeated positions")
        span = (positions >= int(record["reasoning_start"])) & (positions < int(record["answer_start"]))
        traces.append(LabelTrace(trace_id, positions[span], labels[span].astype(float)))
    if not traces:
        reasons = ", ".join(f"{n} {r}" for r, n in skipped.items()) or "the file is empty"
        raise UsageError(f"{path}: no usable label records ({reasons})")
    return traces, dict(skipped)


def _flatten(record: dict, where: str) -> dict[str, object]:
    """Name -> values, expanding per-layer objects into `{signal}.l{layer}.{smoothing}`."""
    smoothing = str(record.get("smoothing") or "raw")
    flat: dict[str, object] = {}
    for name, value in record["signals"].items():
        if isinstance(value, dict):
            for layer, values in value.items():
                if not str(layer).isdigit():
                    raise UsageError(f"{where}: signal {name!r} has a non-integer layer key {layer!r}")
                flat[f"{name}.l{int(layer)}.{smoothing}"] = values
        else:
            flat[name] = value
    return flat


def _signal_matrix(trace_id: str, signals: dict, names: list[str], n: int, where: str) -> np.ndarray:
    if sorted(signals) != sorted(names):
        extra = sorted(set(signals) - set(names))
        missing = sorted(set(names) - set(signals))
        raise UsageError(f"{where}: trace {trace_id!r} signal names differ from the first trace "
                         f"(missing {missing}, extra {extra})")
    columns = []
    for name in names:
        try:
            col = np.asarray(signals[name], dtype=float)
        except (TypeError, ValueError):
            raise UsageError(f"{where}: signal {name!r} of trace {trace_id!r} is not numeric") from None
        if col.shape != (n,):
            raise UsageError(f"{where}: signal {name!r} of trace {trace_id!r} has {col.size} values for {n} positions")
        columns.append(col)
    return np.column_stack(columns)


def _read_signals_jsonl(path: Path) -> SignalSet:
    names: list[str] | None = None
    traces, seen = [], set()
    for number, record in enumerate(read_jsonl(path), start=1):
        where = f"{path}: record {number}"
        _require(record, ("trace_id", "positions", "signals"), where)
        trace_id = str(record["trace_id"])
        _check_unique(trace_id, seen, path)
        if not isinstance(record["signals"], dict) or not record["signals"]:
            raise UsageError(f"{where}: 'signals' must be a non-empty object of named arrays")
        flat = _flatten(record, where)
        if names is None:
            names = list(flat)
        positions = _int_array(record["positions"], f"{where}: positions")
        traces.append(SignalTrace(trace_id, positions, _signal_matrix(trace_id, flat, names, positions.size, where)))
    if names is None:
        raise UsageError(f"{path}: no signal records")
    return SignalSet(names, traces)


def _read_signals_npz(path: Path) -> SignalSet:
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UsageError(f"{path}: not a readable .npz file ({err})") from None
    with data:
        keys = list(data.files)
        _require(dict.fromkeys(keys), ("trace_id", "position"), str(path))
        names = [k for k in keys if k not in ("trace_id", "position")]
        if not names:
            raise UsageError(f"{path}: no signal arrays besides trace_id and position")
        ids = data["trace_id"].astype(str)
        positions = _int_array(data["position"], f"{path}: position")
        if ids.shape != positions.shape:
            raise UsageError(f"{path}: trace_id and position lengths differ")
        signals = {n: data[n] for n in names}
    for name, column in signals.items():
        if column.shape != ids.shape:
            raise UsageError(f"{path}: signal {name!r} has shape {column.shape}, expected {ids.shape}")
    traces = []
    for trace_id in dict.fromkeys(ids.tolist()):
        rows = ids == trace_id
        values = _signal_matrix(trace_id, {n: v[rows] for n, v in signals.items()}, names, int(rows.sum()), str(path))
        traces.append(SignalTrace(trace_id, positions[rows], values))
    return SignalSet(names, traces)


def read_signals(path: str | os.PathLike) -> SignalSet:
    """Read per-token signals from JSONL (one record per trace) or `.npz` (long format); see the module docstring."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"signals file not found: {path}")
    signals = _read_signals_npz(path) if path.suffix == ".npz" else _read_signals_jsonl(path)
    for t in signals.traces:
        if np.unique(t.positions).size != t.positions.size:
            raise UsageError(f"{path}: trace {t.trace_id!r} has repeated positions")
    return signals


def merge_signals(sets: Sequence[SignalSet]) -> SignalSet:
    """One signal set from several files: traces present in every file, positions present in every file."""
    names = [n for s in sets for n in s.names]
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise UsageError(f"signal name(s) {', '.join(repeated[:5])} appear in more than one signal file")
    merged = sets[0].traces
    for other in sets[1:]:
        by_id = {t.trace_id: t for t in other.traces}
        joined = []
        for t in merged:
            o = by_id.get(t.trace_id)
            if o is None:
                continue
            _, i, j = np.intersect1d(t.positions, o.positions, assume_unique=True, return_indices=True)
            joined.append(SignalTrace(t.trace_id, t.positions[i], np.column_stack([t.values[i], o.values[j]])))
        merged = joined
    return SignalSet(names, merged)


def align(labels: list[LabelTrace], signals: SignalSet) -> Aligned:
    """Pair label and signal traces by trace_id and keep the positions present in both (sorted by position).

    Raises `UsageError` when no trace shares both an id and at least one position.
    """
    by_id = {t.trace_id: t for t in signals.traces}
    traces, dropped = [], []
    for lab in labels:
        sig = by_id.get(lab.trace_id)
        if sig is None:
            dropped.append(lab.trace_id)
            continue
        _, li, si = np.intersect1d(lab.positions, sig.positions, assume_unique=True, return_indices=True)
        if li.size == 0:
            dropped.append(lab.trace_id)
            continue
        traces.append(AlignedTrace(lab.trace_id, lab.positions[li], lab.labels[li], sig.values[si]))
    label_ids = {t.trace_id for t in labels}
    dropped += [t.trace_id for t in signals.traces if t.trace_id not in label_ids]
    if not traces:
        sample_l = ", ".join(sorted(label_ids)[:3])
        sample_s = ", ".join(sorted(by_id)[:3])
        raise UsageError(
            "labels and signals share no trace with a common position "
            f"(labels trace_ids: {sample_l}...; signals trace_ids: {sample_s}...)"
        )
    return Aligned(list(signals.names), traces, dropped)


def load_aligned(
    labels_path: str | os.PathLike, signal_paths: Sequence[str | os.PathLike], include_incorrect: bool = False
) -> Aligned:
    """Read labels and one or more signal files and align them (non-finite values are kept; see `finite`)."""
    labels, skipped = read_labels(labels_path, include_incorrect)
    aligned = align(labels, merge_signals([read_signals(p) for p in signal_paths]))
    aligned.skipped_labels = skipped
    return aligned
