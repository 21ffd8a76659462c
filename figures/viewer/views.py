"""The viewer's data model: everything the page shows of one trace (`TraceView`), built from stored records.

A `TraceView` holds the trace's tokens as text, its regions (prompt, reasoning, answer), its `Layer`s (label fields,
scores, signals, the known-answer classes: `figures.viewer.layers`), the occlusion windows of each label set (shown on
hover) and one `RunView` per generation of its problem under eviction: the answer it gave, where its tokens left the
dense trace's, and, when the evictor stored a keep-log (``evictor.run --keep-log``, `evictor.instrument`), which
positions each layer's KV heads still held at the end of the generation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.schemas import Signal, Trace
from figures.viewer.encode import bits
from figures.viewer.layers import LabelSet, Layer, known_layer, label_layers, signal_layers, windows

# The evicted run's own text after it leaves the dense trace, cut here: the answer it gave is within it on every
# task kvscope runs (a forced known-answer trace leaves the dense one at its answer).
CONTINUATION_TOKENS = 400
NO_KEEP_LOG = ("this run stored no keep-log, so which tokens it kept is unknown here (rerun the cell with "
               "`evictor.run --keep-log` to record it)")


@dataclass(frozen=True)
class Run:
    """A generation of a trace's problem under eviction (or the dense ``full`` baseline) and its keep-log arrays
    (`evictor.instrument.KeepLog.for_sequence`, as ``evictor.run --keep-log`` saves them), if any."""

    trace: Trace
    label: str | None = None  # the configuration's name; the trace's policy by default
    keep_log: Mapping[str, np.ndarray] | None = None

    @property
    def name(self) -> str:
        return self.label or self.trace.policy


@dataclass
class RunView:
    """One `Run` as the page shows it, over the dense trace's positions."""

    name: str
    budget: str  # as asked: "0.5" (a fraction of the dense length) or "256" (tokens); "dense" for full
    budget_tokens: int | None
    answer: str | None
    correct: bool | None
    rounds: int | None
    peak_slots: int | None
    diverges_at: int | None  # the first position whose token differs from the dense trace's (None: none does)
    continuation: str  # the run's own text from there on
    keep: np.ndarray | None  # [layer, kv_head, position] kept at the end of the generation, positions of the trace
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        keep = None if self.keep is None else {"layers": self.keep.shape[0], "heads": self.keep.shape[1],
                                                "bits": bits(self.keep)}
        return {"name": self.name, "budget": self.budget, "budget_tokens": self.budget_tokens, "answer": self.answer,
                "correct": self.correct, "rounds": self.rounds, "peak_slots": self.peak_slots,
                "diverges_at": self.diverges_at, "continuation": self.continuation, "keep": keep, "note": self.note}


@dataclass
class TraceView:
    """Everything the page shows of one trace."""

    id: str
    tokens: list[str]
    regions: list[tuple[str, int, int]]  # (name, start, end), in order
    summary: dict[str, Any]
    layers: list[Layer] = field(default_factory=list)
    windows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # label set -> its windows
    runs: list[RunView] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "tokens": self.tokens, "regions": [list(r) for r in self.regions],
                "summary": self.summary, "layers": [layer.to_json() for layer in self.layers],
                "windows": self.windows, "runs": [run.to_json() for run in self.runs]}


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's own text (special tokens included), decoded once per distinct id."""
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in set(ids)}
    return [texts[i] for i in ids]


def answer_start(trace: Trace, labels: Iterable[LabelSet], signals: Iterable[Signal]) -> int | None:
    """Where the trace's answer span starts, as the records that split it say (labels, then a replay's signals,
    then a known-answer trace's own spans); None when none does."""
    found = [s.records[trace.id].get("answer_start") for s in labels if trace.id in s.records]
    found += [s.extra.get("answer_start") for s in signals]
    found.append((trace.extra.get("known_answer") or {}).get("answer_start"))
    return next((value for value in found if isinstance(value, int)), None)


def regions(n_prompt: int, n_tokens: int, start: int | None) -> list[tuple[str, int, int]]:
    if start is None or not n_prompt <= start <= n_tokens:
        return [("prompt", 0, n_prompt), ("generated", n_prompt, n_tokens)]
    return [("prompt", 0, n_prompt), ("reasoning", n_prompt, start), ("answer", start, n_tokens)]


def diverges_at(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (the end of the shorter one if it is a prefix of the
    longer); None when they are equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def kept(log: Mapping[str, np.ndarray], n_run: int, n_positions: int, shape: tuple[int, int]) -> np.ndarray:
    """``[layer, kv_head, position]``: whether each layer's head held each of the first `n_positions` positions at
    the end of a generation of `n_run` tokens whose keep-log is `log` (`evictor.instrument.kept_positions` after its
    last round; positions added after that round were all held). `shape` is the model's (layers, KV heads), widened
    to what the log names."""
    from evictor.instrument import kept_positions

    log = dict(log)
    layers = max(shape[0], int(log["layer"].max()) + 1 if len(log["layer"]) else 0)
    heads = max(shape[1], int(log["head"].max()) + 1 if len(log["head"]) else 0)
    flags = np.zeros((layers, heads, n_positions), dtype=bool)
    flags[:, :, :n_run] = True
    last = len(log["round_next_pos"]) - 1
    if last < 0:
        return flags
    upto = min(int(log["round_next_pos"][last]), n_positions)
    for layer in range(layers):
        for head in range(heads):
            held = kept_positions(log, last, layer, head)
            flags[layer, head, :upto] = False
            flags[layer, head, held[held < upto]] = True
    return flags


def run_view(run: Run, dense: Trace, tokenizer, shape: tuple[int, int] | None) -> RunView:
    """`run` over the positions of `dense`; with a keep-log, which positions each layer's heads held (the model's cache
    `shape` counts the layers and heads the log does not name), up to where its tokens leave the dense trace's
    (beyond it, a position holds another token)."""
    ids, dense_ids = run.trace.token_ids, dense.token_ids
    split = diverges_at(ids, dense_ids)
    shown = split if split is not None else len(ids)
    keep, note = None, ""
    if run.keep_log is not None:
        keep = kept(run.keep_log, len(ids), len(dense_ids), shape or (0, 0))
        keep[:, :, shown:] = False
    elif run.trace.evicted:
        note = NO_KEEP_LOG
    eviction = run.trace.eviction or {}
    budget = "dense" if run.trace.budget is None else f"{run.trace.budget:g}"
    continuation = "" if split is None else tokenizer.decode(ids[split:split + CONTINUATION_TOKENS],
                                                             skip_special_tokens=False)
    return RunView(run.name, budget, run.trace.budget_tokens, run.trace.answer, run.trace.correct,
                   eviction.get("rounds"), eviction.get("peak_slots"), split, continuation, keep, note)


def trace_view(trace: Trace, tokenizer, *, labels: Sequence[LabelSet] = (),
               signals: Sequence[tuple[str, Signal]] = (), runs: Sequence[Run] = (),
               cache_shape: tuple[int, int] | None = None, heads: bool = False) -> TraceView:
    """The `TraceView` of `trace`: `labels` (the label sets, each holding at most one record per trace), `signals`
    ((selector group, its record of this trace)), `runs` (its problem under eviction) and the model's
    cache shape (layers, KV heads), which keep-logs are read against; `heads` adds per-KV-head scores."""
    ids = trace.token_ids
    n = len(ids)
    relevant = [signal for _, signal in signals]
    view = TraceView(trace.id, token_texts(tokenizer, ids),
                     regions(len(trace.prompt_ids), n, answer_start(trace, labels, relevant)),
                     {"dataset": trace.dataset, "model": trace.model, "answer": trace.answer, "gold": trace.gold,
                      "correct": trace.correct, "prompt_tokens": len(trace.prompt_ids),
                      "generated_tokens": len(trace.generated_ids)})
    for label_set in labels:
        record = label_set.records.get(trace.id)
        if record is None:
            continue
        found = label_layers(label_set.kind, label_set.name, record, n)
        view.layers += found
        if found and (spans := windows(record, n)):
            view.windows[label_set.name] = spans
    if (known := known_layer(trace, n)) is not None:
        view.layers.append(known)
    for group, signal in signals:
        view.layers += signal_layers(signal, group, n, heads=heads)
    view.runs = [run_view(run, trace, tokenizer, cache_shape) for run in runs]
    view.runs.sort(key=lambda r: (r.name != "full", r.name, _budget_order(r.budget)))
    return view


def _budget_order(budget: str) -> float:
    try:
        return float(budget)
    except ValueError:
        return -math.inf
