"""Reading occlusion labels and per-token signals, aligning them by trace and position, and naming signals.

Both files are read through their `core.schemas` record: labels are `Label` records (`labeling.occlusion`), signals
are `Signal` records (`python -m signals`, or a policy's scores replayed by the evictor); one `id` per trace, the same
in both (older files keyed by ``trace_id`` still read).

Labels: `labels[i]` is the occlusion label of absolute position `positions[i]` (EpiKV §3.4, Appendix 8). Only
positions in the reasoning span [reasoning_start, answer_start) are used: prompt positions are fixed to 1 by the
protocol and the answer span is not tested, so neither carries information about a signal. Records whose status is
not "labelled" are skipped (counted by reason). Every labelled record is used unless `correct_only` asks for the
traces answered correctly only: the labeller already chose which traces to label (EpiKV labels correct traces only,
`labeling.occlusion --include-incorrect` labels the others too), so the labels file itself says what to validate.

Signals: ``signals[signal][layer]`` of a `Signal` record is one value per position of ``positions``; each becomes the
named column ``{signal}.l{layer}.{transform}``, or ``{signal}.agg.{transform}`` for the layer key "agg" (a policy's
own aggregate over layers and heads). The transform is the record's smoothing ("raw" when absent) followed by its
window when the record states one (``z`` with window 64 -> ``z64``), so files of several smoothings or windows merge
without a name clash and the window travels with the name into the policy configuration.

Several signal files (e.g. one per smoothing) are merged by id and position; their names must not collide. Every
trace of a file must carry the same signal names. null / NaN values are allowed (hidden_diff is undefined at
position 0): `Aligned.finite()` drops every position where a signal is non-finite. Traces are aligned by id and
then by absolute position; only positions present in the labels and every signal file are kept.

Signal names: a *layered* signal is ``{family}.l{layer}.{transform}`` (``hidden_diff.l10.mean64``) or
``{family}_l{layer}_{transform}`` (``g_l10_mean64``); ``{family}.agg.{transform}`` is a family's aggregate (no layer);
a missing transform reads "raw". A replayed policy's per-head scores are the family ``{policy}.h{k}``
(``valuediff.h2.l10.raw``). Anything else ("h2o") is a layerless signal that is its own family.

What a file says about its signals travels with the aligned set: ``extra["policies"]`` of a record maps a signal
(a replayed policy's name) to the ``{"policy", "params"}`` configuration it was scored with, which runs unchanged in
`evictor.run --policy-config`; ``extra["hidden_hook"]`` names the residual stream hidden_diff was read at.
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
from core.schemas import Label, Signal, read_records

_NAMED = re.compile(r"^(?P<family>[A-Za-z]\w*?(?:\.h\d+)?)[._](?:l(?P<layer>\d+)|agg)(?:[._](?P<transform>\w+))?$")
_HEAD = re.compile(r"\.h\d+$")
AGGREGATE = "agg"


@dataclass(frozen=True)
class SignalName:
    name: str
    family: str  # the whole name for a layerless signal
    layer: int | None  # None: a layerless signal or a family's aggregate
    transform: str


def signal_source(family: str) -> str:
    """The signal a family's values come from: a policy's per-head family ``valuediff.h2`` -> ``valuediff``."""
    return _HEAD.sub("", family)


def parse_signal_name(name: str) -> SignalName:
    """Split a signal name into (family, layer, transform); a layerless name keeps layer None."""
    match = _NAMED.match(name)
    if match is None:
        return SignalName(name, name, None, "raw")
    layer = None if match["layer"] is None else int(match["layer"])
    return SignalName(name, match["family"], layer, match["transform"] or "raw")


@dataclass
class LabelTrace:
    id: str
    positions: np.ndarray  # [T] absolute positions inside the reasoning span
    labels: np.ndarray  # [T] 0/1


@dataclass
class SignalTrace:
    id: str
    positions: np.ndarray  # [T]
    values: np.ndarray  # [T, signals], columns in the file's name order


@dataclass
class SignalSet:
    names: list[str]
    traces: list[SignalTrace]
    policies: dict[str, dict] = field(default_factory=dict)  # signal -> {"policy", "params"} it was replayed with
    hidden_hook: str | None = None  # where hidden_diff's h_l was read, when the records state it


@dataclass
class AlignedTrace:
    id: str
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
    policies: dict[str, dict] = field(default_factory=dict)  # as `SignalSet.policies`
    hidden_hook: str | None = None

    def _replace(self, names: list[str], traces: list[AlignedTrace], **changes) -> Aligned:
        fields = {"dropped_traces": self.dropped_traces, "skipped_labels": self.skipped_labels,
                  "nonfinite_positions": self.nonfinite_positions, "policies": self.policies,
                  "hidden_hook": self.hidden_hook, **changes}
        return Aligned(names, traces, **fields)

    def select(self, names: Iterable[str]) -> Aligned:
        """The same traces restricted to `names` (in that order); an unknown name is a `UsageError`."""
        names = list(names)
        index = {n: i for i, n in enumerate(self.names)}
        for n in names:
            if n not in index:
                raise unknown_choice("signal", n, self.names)
        cols = [index[n] for n in names]
        traces = [AlignedTrace(t.id, t.positions, t.labels, t.values[:, cols]) for t in self.traces]
        return self._replace(names, traces)

    def restrict(self, ids: set[str]) -> Aligned:
        """The same signals on the traces whose id is in `ids` only."""
        return self._replace(self.names, [t for t in self.traces if t.id in ids])

    def with_columns(self, names: list[str], columns: list[list[np.ndarray]]) -> Aligned:
        """Append derived signals; `columns[j][i]` is signal `names[j]` for trace i ([T_i])."""
        traces = [AlignedTrace(t.id, t.positions, t.labels, np.column_stack([t.values, *(c[i] for c in columns)]))
                  for i, t in enumerate(self.traces)]
        return self._replace(self.names + names, traces)

    def finite(self) -> Aligned:
        """Drop every position where any signal is non-finite; a trace left without positions is dropped."""
        traces, removed, dropped = [], 0, list(self.dropped_traces)
        for t in self.traces:
            keep = np.isfinite(t.values).all(axis=1)
            removed += int((~keep).sum())
            if keep.any():
                traces.append(AlignedTrace(t.id, t.positions[keep], t.labels[keep], t.values[keep]))
            else:
                dropped.append(t.id)
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


def read_labels(path: str | os.PathLike, correct_only: bool = False) -> tuple[list[LabelTrace], dict[str, int]]:
    """Read occlusion labels, keeping only positions inside each trace's reasoning span.

    Returns the traces and how many records were left out, by reason ("status <s>", "not correct").
    """
    path = Path(path)
    traces: list[LabelTrace] = []
    skipped: Counter[str] = Counter()
    for number, record in enumerate(read_records(path, Label), start=1):
        where = f"{path}: record {number}"
        if not record.labelled:
            skipped[f"status {record.status}"] += 1
            continue
        if correct_only and record.correct is not True:
            skipped["not correct"] += 1
            continue
        missing = [name for name in ("labels", "positions", "reasoning_start", "answer_start")
                   if getattr(record, name) is None]
        if missing:
            raise UsageError(f"{where}: a labelled record without {', '.join(missing)}")
        positions = _int_array(record.positions, f"{where}: positions")
        labels = _int_array(record.labels, f"{where}: labels")
        if positions.shape != labels.shape:
            raise UsageError(f"{where}: {labels.size} labels for {positions.size} positions")
        if not np.isin(labels, (0, 1)).all():
            raise UsageError(f"{where}: labels must be 0 or 1")
        if np.unique(positions).size != positions.size:
            raise UsageError(f"{where}: repeated positions")
        span = (positions >= record.reasoning_start) & (positions < record.answer_start)
        traces.append(LabelTrace(record.id, positions[span], labels[span].astype(float)))
    if not traces:
        reasons = ", ".join(f"{n} {r}" for r, n in skipped.items())
        raise UsageError(f"{path}: no usable label records ({reasons})")
    return traces, dict(skipped)


def transform_name(record: Signal) -> str:
    """The transform part of a record's column names: its smoothing, then its window when it states one."""
    window = record.extra.get("window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise UsageError(f"signal record {record.id!r}: window {window!r} is not an integer")
    return f"{record.smoothing or 'raw'}{'' if window is None else window}"


def _columns(record: Signal, where: str) -> dict[str, object]:
    """Column name -> values: every (signal, layer) of the record (see the module docstring)."""
    transform = transform_name(record)
    if not isinstance(record.signals, dict) or not record.signals:
        raise UsageError(f"{where}: 'signals' must be a non-empty object {{signal: {{layer: [values]}}}}")
    flat: dict[str, object] = {}
    for name, per_layer in record.signals.items():
        if not isinstance(per_layer, dict):
            raise UsageError(f"{where}: signal {name!r} must map layer keys to value lists")
        for layer, values in per_layer.items():
            layer = str(layer)
            if layer == AGGREGATE:
                flat[f"{name}.{AGGREGATE}.{transform}"] = values
            elif layer.isdigit():
                flat[f"{name}.l{int(layer)}.{transform}"] = values
            else:
                raise UsageError(f"{where}: signal {name!r} has layer key {layer!r}; give a layer index or "
                                 f"{AGGREGATE!r}")
    return flat


def _signal_matrix(trace_id: str, columns: dict, names: list[str], n: int, where: str) -> np.ndarray:
    if sorted(columns) != sorted(names):
        extra = sorted(set(columns) - set(names))
        missing = sorted(set(names) - set(columns))
        raise UsageError(f"{where}: trace {trace_id!r} signal names differ from the first trace "
                         f"(missing {missing}, extra {extra})")
    matrix = []
    for name in names:
        try:
            col = np.asarray(columns[name], dtype=float)
        except (TypeError, ValueError):
            raise UsageError(f"{where}: signal {name!r} of trace {trace_id!r} is not numeric") from None
        if col.shape != (n,):
            raise UsageError(f"{where}: signal {name!r} of trace {trace_id!r} has {col.size} values for {n} positions")
        matrix.append(col)
    return np.column_stack(matrix)


def _policies(record: Signal, where: str) -> dict[str, dict]:
    """The record's ``extra["policies"]``: signal -> ``{"policy": name, "params": {...}}``."""
    policies = record.extra.get("policies") or {}
    valid = isinstance(policies, dict) and all(
        isinstance(c, dict) and isinstance(c.get("policy"), str) and isinstance(c.get("params", {}), dict)
        for c in policies.values())
    if not valid:
        raise UsageError(f'{where}: "policies" must map signal names to {{"policy": name, "params": {{...}}}}')
    return {name: {"policy": c["policy"], "params": dict(c.get("params", {}))} for name, c in policies.items()}


def read_signals(path: str | os.PathLike) -> SignalSet:
    """Read a file of `Signal` records into one column per (signal, layer); see the module docstring."""
    path = Path(path)
    names: list[str] | None = None
    traces = []
    policies: dict[str, dict] = {}
    hooks = set()
    for number, record in enumerate(read_records(path, Signal), start=1):
        where = f"{path}: record {number}"
        columns = _columns(record, where)
        if names is None:
            names = list(columns)
        for name, config in _policies(record, where).items():
            if policies.setdefault(name, config) != config:
                raise UsageError(f"{where}: signal {name!r} was scored with {config}, an earlier record with "
                                 f"{policies[name]}; one configuration per file")
        hooks.add(record.extra.get("hidden_hook"))
        positions = _int_array(record.positions, f"{where}: positions")
        if np.unique(positions).size != positions.size:
            raise UsageError(f"{where}: trace {record.id!r} has repeated positions")
        traces.append(SignalTrace(record.id, positions, _signal_matrix(record.id, columns, names, positions.size,
                                                                       where)))
    if len(hooks) > 1:
        raise UsageError(f"{path}: records read hidden states at different hooks ({', '.join(map(str, hooks))})")
    assert names is not None  # read_records refuses a file without records
    return SignalSet(names, traces, policies, hooks.pop())


def merge_signals(sets: Sequence[SignalSet]) -> SignalSet:
    """One signal set from several files: traces present in every file, positions present in every file."""
    names = [n for s in sets for n in s.names]
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise UsageError(f"signal name(s) {', '.join(repeated[:5])} appear in more than one signal file")
    merged = sets[0].traces
    for other in sets[1:]:
        by_id = {t.id: t for t in other.traces}
        joined = []
        for t in merged:
            o = by_id.get(t.id)
            if o is None:
                continue
            _, i, j = np.intersect1d(t.positions, o.positions, assume_unique=True, return_indices=True)
            joined.append(SignalTrace(t.id, t.positions[i], np.column_stack([t.values[i], o.values[j]])))
        merged = joined
    hooks = {s.hidden_hook for s in sets if s.hidden_hook is not None}
    if len(hooks) > 1:
        raise UsageError(f"the signal files read hidden states at different hooks ({', '.join(sorted(hooks))})")
    policies = {name: config for s in sets for name, config in s.policies.items()}
    return SignalSet(names, merged, policies, hooks.pop() if hooks else None)


def align(labels: list[LabelTrace], signals: SignalSet) -> Aligned:
    """Pair label and signal traces by id and keep the positions present in both (sorted by position).

    Raises `UsageError` when no trace shares both an id and at least one position.
    """
    by_id = {t.id: t for t in signals.traces}
    traces, dropped = [], []
    for lab in labels:
        sig = by_id.get(lab.id)
        if sig is None:
            dropped.append(lab.id)
            continue
        _, li, si = np.intersect1d(lab.positions, sig.positions, assume_unique=True, return_indices=True)
        if li.size == 0:
            dropped.append(lab.id)
            continue
        traces.append(AlignedTrace(lab.id, lab.positions[li], lab.labels[li], sig.values[si]))
    label_ids = {t.id for t in labels}
    dropped += [t.id for t in signals.traces if t.id not in label_ids]
    if not traces:
        sample_l = ", ".join(sorted(label_ids)[:3])
        sample_s = ", ".join(sorted(by_id)[:3])
        raise UsageError(f"labels and signals share no trace with a common position (label ids: {sample_l}...; "
                         f"signal ids: {sample_s}...)")
    return Aligned(list(signals.names), traces, dropped, policies=signals.policies, hidden_hook=signals.hidden_hook)


def load_aligned(labels_path: str | os.PathLike, signal_paths: Sequence[str | os.PathLike],
                 correct_only: bool = False) -> Aligned:
    """Read labels and one or more signal files and align them (non-finite values are kept; see `finite`)."""
    labels, skipped = read_labels(labels_path, correct_only)
    aligned = align(labels, merge_signals([read_signals(p) for p in signal_paths]))
    aligned.skipped_labels = skipped
    return aligned
