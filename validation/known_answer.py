"""Occlusion labels and scorers checked against a known answer: the facts of a constructed trace (`tasks.known_answer`).

A known-answer trace says where its facts are (``Trace.extra["known_answer"]``, absolute token positions
``[start, end)``): the *needed* notes, whose values the answer depends on and which appear nowhere else in the context,
and *decoy* notes of the same form that the answer does not depend on. A needed note has a ``hop`` (1, or 2 for the
box note of a two-hop task, whose hop-1 note's value is the box) and a ``copy`` (2 for the second statement of a
needed note stated twice); a decoy has the hop of the needed note it imitates. Everything here is a pure function of
those spans, a labeller's windows and per-token scores (`validation.signals.SignalSet`), and holds for any label kind
whose records are `core.schemas.Label` with ``windows`` of ``{"start", "end", "flipped", ...}``, ``flipped`` True
(the window matters), False (it does not) or None (no evidence).

**Window classes** (`window_class`, first match wins):

==============  =======================================================================================================
``planted``     the window overlaps a token of a needed note's *value*: by construction the answer cannot be derived
                without it (the code exists nowhere else in the occluded context: the prompt never states it and the
                copy in the answer statement lies after the answer boundary; a two-hop link's box can then only be
                guessed among the boxes no note assigns); where the value is stated twice, only occluding both copies
                removes it, so a single-window labeller is not expected to flip either
``key``         the window overlaps the rest of a needed note (the name it belongs to, "The code for", "is") but not its
                value: a model that looks the value up by name needs these tokens, one that copies the latest note's
                value (SmolLM2-135M often does) does not, so the task does not say whether the answer depends on them;
                they count as neither positive nor negative and are reported on their own
``decoy_key``   the window overlaps a decoy's key but not its value, and the decoy follows a needed note of its hop
                (the needed-first layout): a model that looks the name up may need the decoy's name to rule the decoy
                out (without it, "The code for ___ is 7305" after the needed note may read as the asked person's),
                so these too are neither positive nor negative, reported on their own
``decoy``       the window overlaps a decoy note otherwise: same form, not needed
``filler``      anything else: the digit-free filler sentences (the answer statement lies after the boundary, untested)
==============  =======================================================================================================

**Label precision and recall** (`label_scores`): over the windows of every labelled trace, recall = flipped planted
windows / planted windows, precision = flipped planted windows / flipped planted, decoy and filler windows; each with
a Wilson interval (`validation.stats.wilson_interval`), which treats windows as independent (they are not quite:
windows of one trace share its context, so the intervals are somewhat narrow). The share of decoy and filler windows
that kept the answer is the specificity per class. Recall is also split by the needed note a planted window
overlaps: per hop (``hop1``, ``hop2``) and per copy (``copy1``, ``copy2``: a window over the first statement of the
value and one over the second are scored apart), and the decoy windows per hop; precision is not split, since a
flipped filler window belongs to no hop or copy. ``found_all`` is the share of traces in which *every* needed note has
a flipped planted window ("both copies found", "both hops found"), over the traces where every needed note has a
planted window with evidence. A window whose ``flipped`` is None (a labeller that leaves an outcome out of its label
rule, as the exclude and own-class rules leave out a window after which no answer came back) is counted as
``excluded`` and used nowhere else. Windows flush with the answer boundary (``end == answer_start``), where a filler
block right before the answer may make the model print filler, are counted separately as well (``flush``), whatever
their class.

**Scorer AUC** (`scorer_auc`): per trace, the probability that a needed-fact token scores above a decoy-fact token
(the Mann-Whitney AUC, ties count one half; higher score = keep), over the tokens of one part of the notes (``value``
by default, the tokens needed by construction; ``key`` or ``note``), or above a filler token of the reasoning span
(``against="filler"``); with `hop` given, only the needed and decoy notes of that hop. Non-finite scores are left out,
and a trace with nothing on either side has no AUC. The AUC of a scorer is the mean over traces, with a percentile
bootstrap over traces (`validation.stats.bootstrap_means`). 0.5 is chance. Where every decoy precedes the needed
notes (the default layout, `tasks.known_answer` says why), a score that grows with position has AUC 1 against the
decoys on every trace, and against the filler, most of which follows the needed note, it has not; where the needed
notes come first, the same score has AUC 0 against the decoys.
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
from tasks.known_answer import MAX_COPIES, MAX_HOPS, META, SPAN_PARTS
from validation.signals import SignalSet
from validation.stats import DEFAULT_N_BOOT, bootstrap_means, percentile_interval, wilson_interval

CLASSES = ("planted", "key", "decoy_key", "decoy", "filler")
# The per-note groups of `LabelScores.to_json`: name, window class, hop, copy (None: any).
GROUPS = ([(f"hop{hop}", "planted", hop, None) for hop in range(1, MAX_HOPS + 1)]
          + [(f"copy{copy}", "planted", None, copy) for copy in range(1, MAX_COPIES + 1)]
          + [(f"decoy_hop{hop}", "decoy", hop, None) for hop in range(1, MAX_HOPS + 1)])
PARTS = SPAN_PARTS
AGAINST = ("decoy", "filler")
Span = tuple[int, int]


@dataclass(frozen=True)
class Note:
    """One note of a known-answer trace: its parts as absolute ``[start, end)`` token positions, its hop and, for a
    needed note stated twice, which statement it is."""

    note: Span
    key: Span
    value: Span
    hop: int = 1
    copy: int = 1

    def part(self, name: str) -> Span:
        return {"note": self.note, "key": self.key, "value": self.value}[name]


@dataclass(frozen=True)
class FactSpans:
    """Where a known-answer trace's facts are: its needed and its decoy notes, and the reasoning span."""

    needed: list[Note]
    decoys: list[Note]
    reasoning: Span  # [reasoning start, answer boundary): what occlusion slides over


def fact_spans(trace: Trace) -> FactSpans:
    """The fact spans of a trace made by `tasks.known_answer.problem_trace` (a note without ``hop`` or ``copy`` is hop
    1, copy 1, as in every trace made before those existed); a `UsageError` for any other trace."""
    info = trace.extra.get(META)
    if not isinstance(info, dict) or "needed" not in info or "decoys" not in info:
        raise UsageError(f"trace {trace.id!r} is not a known-answer trace (no extra[{META!r}] with its fact spans)")

    def notes(items: Sequence[Mapping[str, Any]]) -> list[Note]:
        def span(note: Mapping[str, Any], part: str) -> Span:
            return int(note[part][0]), int(note[part][1])

        return [Note(span(note, "note"), span(note, "key"), span(note, "value"), int(note.get("hop", 1)),
                     int(note.get("copy", 1))) for note in items]

    return FactSpans(notes(info["needed"]), notes(info["decoys"]), (len(trace.prompt_ids), int(info["answer_start"])))


def _overlaps(start: int, end: int, span: Span) -> bool:
    return start < span[1] and end > span[0]


def classify(start: int, end: int, spans: FactSpans) -> tuple[str, Note | None]:
    """The class of window ``[start, end)`` (see the module docstring) and the note that decides it (None for
    filler)."""
    for cls, notes, part in (("planted", spans.needed, "value"), ("key", spans.needed, "note")):
        for note in notes:
            if _overlaps(start, end, note.part(part)):
                return cls, note
    for note in spans.decoys:
        if (_overlaps(start, end, note.key) and not _overlaps(start, end, note.value)
                and any(n.hop == note.hop and n.note[0] < note.note[0] for n in spans.needed)):
            return "decoy_key", note
    for note in spans.decoys:
        if _overlaps(start, end, note.note):
            return "decoy", note
    return "filler", None


def window_class(start: int, end: int, spans: FactSpans) -> str:
    """The class of window ``[start, end)``: planted, key, decoy_key, decoy or filler."""
    return classify(start, end, spans)[0]


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
    were and how many flipped; per note ((class, hop, copy) for the planted and the decoy windows) the same; and in
    how many traces every needed note was found. Recall, precision and specificity come as `Rate`s."""

    traces: int
    windows: dict[str, int]
    flipped: dict[str, int]
    excluded: int
    level: float = 0.95
    by_note: dict[tuple[str, int, int], tuple[int, int]] = field(default_factory=dict)
    found_all: tuple[int, int] = (0, 0)  # traces with every needed note found, traces where each had evidence

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

    def flip_rate(self, cls: str, hop: int | None = None, copy: int | None = None) -> Rate:
        """The share of `cls` windows (planted or decoy) over the notes of `hop` and `copy` (None: any) that flipped:
        for the planted windows, the recall of that hop or copy."""
        counts = [c for (kind, h, k), c in self.by_note.items()
                  if kind == cls and hop in (None, h) and copy in (None, k)]
        return Rate(sum(f for _, f in counts), sum(w for w, _ in counts), self.level)

    @property
    def every_note_found(self) -> Rate:
        return Rate(*self.found_all, self.level)

    def to_json(self) -> dict[str, Any]:
        """A flat row: counts per class, then the planted windows' counts per hop and per copy and the decoy windows'
        per hop, then each rate with ``<name>_lo`` / ``<name>_hi`` (recall, precision, the kept shares, recall per
        hop and per copy, ``found_all`` with ``found_all_traces``); the same columns whatever the traces hold (a hop
        or copy that no trace has: 0 windows, NaN recall)."""
        row: dict[str, Any] = {"traces": self.traces, "excluded": self.excluded}
        for cls in (*CLASSES, "flush"):
            row[f"{cls}_windows"], row[f"{cls}_flipped"] = self.windows[cls], self.flipped[cls]
        rates = [("recall", self.recall), ("precision", self.precision), ("decoy_kept", self.kept("decoy")),
                 ("filler_kept", self.kept("filler"))]
        for group, cls, hop, copy in GROUPS:
            rate = self.flip_rate(cls, hop, copy)
            row[f"{group}_windows"], row[f"{group}_flipped"] = rate.n, rate.k
            if cls == "planted":
                rates.append((f"{group}_recall", rate))
        rates.append(("found_all", self.every_note_found))
        for name, rate in rates:
            row[name] = rate.value
            row[f"{name}_lo"], row[f"{name}_hi"] = rate.interval
        row["found_all_traces"] = self.found_all[1]
        return row


def label_scores(labels: Sequence[Label], spans: Mapping[str, FactSpans], level: float = 0.95) -> LabelScores:
    """Window-level recall and precision of `labels` against the planted windows (see the module docstring).

    Only labelled records are used; each needs the fact spans of its trace (`spans`, by trace id) and a ``windows``
    list of ``{"start", "end", "flipped"}``. A labelled record without spans or windows is a `UsageError`.
    """
    windows = dict.fromkeys((*CLASSES, "flush"), 0)
    flipped = dict.fromkeys((*CLASSES, "flush"), 0)
    by_note: dict[tuple[str, int, int], list[int]] = {}
    excluded = traces = found = testable = 0
    for label in labels:
        if not label.labelled:
            continue
        if label.id not in spans:
            raise UsageError(f"label {label.id!r} has no known-answer trace (no fact spans for it)")
        if not label.windows:
            raise UsageError(f"label {label.id!r} is labelled but records no windows")
        traces += 1
        facts = spans[label.id]
        # per needed note of this trace: [planted windows with evidence, flipped]
        tested = {note: [0, 0] for note in facts.needed}
        for window in label.windows:
            start, end, flip = int(window["start"]), int(window["end"]), window["flipped"]
            if label.no_answer_rule not in (None, "flip") and window.get("outcome") in (NO_ANSWER, DEGENERATE):
                flip = None  # under its rule a window without an answer is no evidence either way
            if flip is None:
                excluded += 1
                continue
            cls, note = classify(start, end, facts)
            windows[cls] += 1
            flipped[cls] += bool(flip)
            if note is not None and cls in ("planted", "decoy"):
                for counts in [by_note.setdefault((cls, note.hop, note.copy), [0, 0])] + (
                        [tested[note]] if cls == "planted" else []):
                    counts[0] += 1
                    counts[1] += bool(flip)
            if end == label.answer_start:
                windows["flush"] += 1
                flipped["flush"] += bool(flip)
        if tested and all(n for n, _ in tested.values()):
            testable += 1
            found += all(k for _, k in tested.values())
    if not traces:
        raise UsageError("no labelled known-answer trace to score")
    return LabelScores(traces, windows, flipped, excluded, level, {key: (w, f) for key, (w, f) in by_note.items()},
                       (found, testable))


def _positions(notes: Sequence[Note], part: str) -> np.ndarray:
    return np.array([p for note in notes for p in range(*note.part(part))], dtype=np.int64)


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
               level: float = 0.95, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
               hop: int | None = None) -> list[ScorerAUC]:
    """Per signal of `signals` (in its order): the mean over traces of `trace_auc`, needed tokens of `part` (value,
    key or note) against the decoy notes' tokens of the same part (`against` "decoy") or against the filler tokens of
    the reasoning span (``filler``: every position of it outside the notes), with a percentile bootstrap over traces
    (`n_boot` replicates, seeded by `seed`); with `hop`, the needed and decoy notes of that hop only.

    Traces of `signals` without fact spans are left out; a trace without decoys (of `hop`) has no AUC against them. A
    signal with no AUC on any trace gets NaN and no interval.
    """
    if part not in PARTS:
        raise unknown_choice("fact part", part, PARTS)
    if against not in AGAINST:
        raise unknown_choice("AUC comparison", against, AGAINST)
    if hop is not None and hop not in range(1, MAX_HOPS + 1):
        raise UsageError(f"hop must be in 1..{MAX_HOPS}, got {hop!r}")
    ids, rows = [], []
    for trace in signals.traces:
        if trace.id not in spans:
            continue
        facts = spans[trace.id]
        needed = _positions([n for n in facts.needed if hop in (None, n.hop)], part)
        others = (_positions([n for n in facts.decoys if hop in (None, n.hop)], part) if against == "decoy"
                  else _filler_positions(facts))
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
