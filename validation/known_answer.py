"""Occlusion labels and scorers checked against a known answer: the facts of a constructed trace (`tasks.known_answer`).

A known-answer trace says where its facts are (``Trace.extra["known_answer"]``, absolute token positions
``[start, end)``): the *needed* note, whose value the answer copies and which appears nowhere else in the context, and
*decoy* notes of the same form that the answer does not depend on. Everything here is a pure function of those spans,
the labeller's windows (`core.schemas.Label`) and per-token scores (`validation.signals.SignalSet`).

**Window classes** (`window_class`, first match wins):

==========  ===========================================================================================================
``planted`` the window overlaps a token of a needed note's *value*: its digits exist nowhere else in the occluded
            context (the prompt never states them; the copy in the answer statement lies after the answer boundary),
            so by construction the answer cannot survive it
``key``     the window overlaps the rest of a needed note (the name it belongs to, "The code for", "is") but not its
            value: a model that looks the value up by name needs these tokens, one that copies the latest note's value
            (SmolLM2-135M often does) does not, so the task does not say whether the answer depends on them; they count
            as neither positive nor negative and are reported on their own
``decoy``   the window overlaps a decoy note: same form, not needed
``filler``  anything else: the digit-free filler sentences (the answer statement lies after the boundary, untested)
==========  ===========================================================================================================

**Label precision and recall** (`label_scores`): over the windows of every labelled trace, recall = flipped planted
windows / planted windows, precision = flipped planted windows / flipped planted, decoy and filler windows; each with
a Wilson interval (`validation.stats.wilson_interval`), which treats windows as independent (they are not quite:
windows of one trace share its context, so the intervals are somewhat narrow). The share of decoy and filler windows
that kept the answer is the specificity per class. A window whose ``flipped`` is None (a labeller that leaves an
outcome out of its label rule, as the exclude and own-class rules leave out a window after which no answer came
back) is counted as ``excluded`` and used nowhere else. Windows flush with the answer
boundary (``end == answer_start``), where a filler block right before the answer may make the model print filler,
are counted separately as well (``flush``), whatever their class.

**Scorer AUC** (`scorer_auc`): per trace, the probability that a needed-fact token scores above a decoy-fact token
(the Mann-Whitney AUC, ties count one half; higher score = keep), over the tokens of one part of the notes (``value``
by default, the tokens needed by construction; ``key`` or ``note``), or above a filler token of the reasoning span
(``against="filler"``); non-finite scores are left out, and a trace with nothing on either side has no AUC. The AUC of
a scorer is the mean over traces, with a percentile bootstrap over traces (`validation.stats.bootstrap_means`). 0.5
is chance. In ``known_facts`` every decoy precedes the needed note (`tasks.known_answer` says why), so a score that
grows with position has AUC 1 against the decoys on every trace; against the filler, most of which follows the
needed note, it has not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import UsageError, unknown_choice
from core.schemas import Label, Trace
from labeling.windows import DEGENERATE, NO_ANSWER
from tasks.known_answer import META
from validation.signals import SignalSet
from validation.stats import DEFAULT_N_BOOT, bootstrap_means, percentile_interval, wilson_interval

CLASSES = ("planted", "key", "decoy", "filler")
PARTS = ("value", "key", "note")
AGAINST = ("decoy", "filler")
Span = tuple[int, int]


@dataclass(frozen=True)
class FactSpans:
    """Where a known-answer trace's facts are: per note, its parts (``note``, ``key``, ``value``) as absolute
    ``[start, end)`` token positions."""

    needed: list[dict[str, Span]]
    decoys: list[dict[str, Span]]
    reasoning: Span  # [reasoning start, answer boundary): what occlusion slides over


def fact_spans(trace: Trace) -> FactSpans:
    """The fact spans of a trace made by `tasks.known_answer.problem_trace`; a `UsageError` for any other trace."""
    info = trace.extra.get(META)
    if not isinstance(info, dict) or "needed" not in info or "decoys" not in info:
        raise UsageError(f"trace {trace.id!r} is not a known-answer trace (no extra[{META!r}] with its fact spans)")

    def notes(items: Sequence[Mapping[str, Sequence[int]]]) -> list[dict[str, Span]]:
        return [{part: (int(span[0]), int(span[1])) for part, span in note.items()} for note in items]

    return FactSpans(notes(info["needed"]), notes(info["decoys"]), (len(trace.prompt_ids), int(info["answer_start"])))


def _overlaps(start: int, end: int, span: Span) -> bool:
    return start < span[1] and end > span[0]


def window_class(start: int, end: int, spans: FactSpans) -> str:
    """The class of window ``[start, end)`` (see the module docstring): planted, key, decoy or filler."""
    if any(_overlaps(start, end, note["value"]) for note in spans.needed):
        return "planted"
    if any(_overlaps(start, end, note["note"]) for note in spans.needed):
        return "key"
    if any(_overlaps(start, end, note["note"]) for note in spans.decoys):
        return "decoy"
    return "filler"


@dataclass(frozen=True)
class Rate:
    """``k`` of ``n`` with its Wilson interval (NaN and no interval when n is 0)."""

    k: int
    n: int
    level: float = 0.95

    @property
    def value(self) -> float:
        return self.k / self.n if self.n else float("nan")

    @property
    def interval(self) -> tuple[float | None, float | None]:
        return wilson_interval(self.k, self.n, self.level) if self.n else (None, None)


@dataclass(frozen=True)
class LabelScores:
    """How a labeller's flips match the planted windows: per class (and for the flush windows) how many windows there
    were and how many flipped, with recall, precision and specificity as `Rate`s."""

    traces: int
    windows: dict[str, int]
    flipped: dict[str, int]
    excluded: int
    level: float = 0.95

    @property
    def recall(self) -> Rate:
        return Rate(self.flipped["planted"], self.windows["planted"], self.level)

    @property
    def precision(self) -> Rate:
        flips = sum(self.flipped[c] for c in ("planted", "decoy", "filler"))
        return Rate(self.flipped["planted"], flips, self.level)

    def kept(self, cls: str) -> Rate:
        """The share of `cls` windows whose answer did not change."""
        return Rate(self.windows[cls] - self.flipped[cls], self.windows[cls], self.level)

    def to_json(self) -> dict[str, Any]:
        """A flat row: counts per class, then each rate with ``<name>_lo`` / ``<name>_hi``."""
        row: dict[str, Any] = {"traces": self.traces, "excluded": self.excluded}
        for cls in (*CLASSES, "flush"):
            row[f"{cls}_windows"], row[f"{cls}_flipped"] = self.windows[cls], self.flipped[cls]
        for name, rate in (("recall", self.recall), ("precision", self.precision),
                           ("decoy_kept", self.kept("decoy")), ("filler_kept", self.kept("filler"))):
            row[name] = rate.value
            row[f"{name}_lo"], row[f"{name}_hi"] = rate.interval
        return row


def label_scores(labels: Sequence[Label], spans: Mapping[str, FactSpans], level: float = 0.95) -> LabelScores:
    """Window-level recall and precision of `labels` against the planted windows (see the module docstring).

    Only labelled records are used; each needs the fact spans of its trace (`spans`, by trace id) and a ``windows``
    list of ``{"start", "end", "flipped"}``. A labelled record without spans or windows is a `UsageError`.
    """
    windows = dict.fromkeys((*CLASSES, "flush"), 0)
    flipped = dict.fromkeys((*CLASSES, "flush"), 0)
    excluded = traces = 0
    for label in labels:
        if not label.labelled:
            continue
        if label.id not in spans:
            raise UsageError(f"label {label.id!r} has no known-answer trace (no fact spans for it)")
        if not label.windows:
            raise UsageError(f"label {label.id!r} is labelled but records no windows")
        traces += 1
        for window in label.windows:
            start, end, flip = int(window["start"]), int(window["end"]), window["flipped"]
            if label.no_answer_rule not in (None, "flip") and window.get("outcome") in (NO_ANSWER, DEGENERATE):
                flip = None  # under its rule a window without an answer is no evidence either way
            if flip is None:
                excluded += 1
                continue
            cls = window_class(start, end, spans[label.id])
            windows[cls] += 1
            flipped[cls] += bool(flip)
            if end == label.answer_start:
                windows["flush"] += 1
                flipped["flush"] += bool(flip)
    if not traces:
        raise UsageError("no labelled known-answer trace to score")
    return LabelScores(traces, windows, flipped, excluded, level)


def _positions(notes: Sequence[Mapping[str, Span]], part: str) -> np.ndarray:
    return np.array([p for note in notes for p in range(*note[part])], dtype=np.int64)


def _filler_positions(facts: FactSpans) -> np.ndarray:
    """The reasoning-span positions outside every note (filler sentences and the answer statement)."""
    span = np.arange(*facts.reasoning)
    return span[~np.isin(span, _positions([*facts.needed, *facts.decoys], "note"))]


def trace_auc(positions: np.ndarray, scores: np.ndarray, needed: np.ndarray, decoys: np.ndarray) -> float:
    """P(score of a needed token > score of a decoy token) + P(tie) / 2 over the tokens of `needed` and `decoys`
    (absolute positions, or any other set to compare against) found in `positions` with a finite score; NaN when
    either side has none."""
    positions, scores = np.asarray(positions), np.asarray(scores, dtype=float)
    finite = np.isfinite(scores)
    a = scores[finite & np.isin(positions, needed)]
    b = scores[finite & np.isin(positions, decoys)]
    if a.size == 0 or b.size == 0:
        return float("nan")
    greater = (a[:, None] > b[None, :]).sum()
    ties = (a[:, None] == b[None, :]).sum()
    return float((greater + 0.5 * ties) / (a.size * b.size))


@dataclass(frozen=True)
class ScorerAUC:
    """One scorer's mean per-trace AUC over `traces` traces, with the bootstrap interval over traces."""

    name: str
    auc: float
    auc_lo: float | None
    auc_hi: float | None
    traces: int
    per_trace: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"signal": self.name, "auc": self.auc, "auc_lo": self.auc_lo, "auc_hi": self.auc_hi,
                "traces": self.traces}


def scorer_auc(signals: SignalSet, spans: Mapping[str, FactSpans], part: str = "value", against: str = "decoy",
               level: float = 0.95, n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> list[ScorerAUC]:
    """Per signal of `signals` (in its order): the mean over traces of `trace_auc`, needed tokens of `part` (value,
    key or note) against the decoy notes' tokens of the same part (`against` "decoy") or against the filler tokens of
    the reasoning span (``filler``: every position of it outside the notes), with a percentile bootstrap over traces
    (`n_boot` replicates, seeded by `seed`).

    Traces of `signals` without fact spans are left out; a trace without decoys has no AUC. A signal with no AUC on
    any trace gets NaN and no interval.
    """
    if part not in PARTS:
        raise unknown_choice("fact part", part, PARTS)
    if against not in AGAINST:
        raise unknown_choice("AUC comparison", against, AGAINST)
    ids, rows = [], []
    for trace in signals.traces:
        if trace.id not in spans:
            continue
        facts = spans[trace.id]
        needed = _positions(facts.needed, part)
        others = _positions(facts.decoys, part) if against == "decoy" else _filler_positions(facts)
        ids.append(trace.id)
        rows.append([trace_auc(trace.positions, trace.values[:, j], needed, others)
                     for j in range(len(signals.names))])
    if not rows:
        raise UsageError("no signal trace has known-answer fact spans")
    table = np.asarray(rows, dtype=float)  # [traces, signals]
    defined = np.isfinite(table)
    some = defined.any(axis=0)
    lo, hi = np.full(table.shape[1], np.nan), np.full(table.shape[1], np.nan)
    if some.any():
        replicates = bootstrap_means(table[:, some], n_boot, np.random.default_rng(seed))
        lo[some], hi[some] = percentile_interval(replicates, level)
    results = []
    for j, name in enumerate(signals.names):
        column = table[:, j]
        if not some[j]:
            results.append(ScorerAUC(name, float("nan"), None, None, 0))
            continue
        kept = defined[:, j]
        results.append(ScorerAUC(name, float(column[kept].mean()), float(lo[j]), float(hi[j]), int(kept.sum()),
                                 {i: float(v) for i, v, k in zip(ids, column, kept) if k}))
    return results


def finding_scorer(auc: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row of `auc` (one per scorer: ``auc_decoy`` and ``auc_filler``, as the study's known stage writes them)
    whose lower AUC is highest: a scorer that finds the planted facts must rank the needed value above the decoys
    *and* above the filler, and a score that grows with position passes the first by construction (every decoy
    precedes the needed note) but not the second. None when no row has both AUCs, or none is above chance (0.5)."""
    def lower(row: Mapping[str, Any]) -> float:
        values = [v for v in (row.get("auc_decoy"), row.get("auc_filler")) if isinstance(v, float) and math.isfinite(v)]
        return min(values) if len(values) == 2 else float("nan")

    defined = [row for row in auc if math.isfinite(lower(row))]
    best = max(defined, key=lower, default=None)
    return best if best is not None and lower(best) > 0.5 else None
