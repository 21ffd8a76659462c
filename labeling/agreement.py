"""Agreement between two occlusion label sets of the same traces (made with different replacements, say).

Two levels, both pooled over the traces both sets labelled:

- *positions*: only the reasoning span ``[reasoning_start, answer_start)`` is compared (prompt positions are 1 by
  construction and the answer span is unlabelled, so either would inflate agreement), and only positions both sets
  label (a no-answer rule may leave some unlabelled, `labeling.windows.rule_labels`);
- *windows*: each window tested by both sets (same start and end), compared on whether it flipped, among the windows
  whose outcome both sets count as evidence (an answer, or no answer under the ``flip`` rule). Deletion and a filler
  token test the same windows, so this is what the replacement changes, window by window. Beside kappa, the outcome
  table (`outcome_pairs`) shows how outcomes move between the two sets (e.g. "no answer" under a filler token that is
  "same" under deletion).

Cohen's kappa corrects the raw agreement for what two independent labellings with the same positive rates would
reach by chance: kappa = (p_o - p_e) / (1 - p_e), p_e = p_a p_b + (1 - p_a)(1 - p_b).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.schemas import Label
from labeling.windows import NO_ANSWER_RULES, SAME


@dataclass(frozen=True)
class Agreement:
    traces: int  # labelled in both sets
    positions: int  # reasoning positions compared, pooled over those traces
    agreement: float | None  # fraction of positions with equal labels (None without positions)
    kappa: float | None  # Cohen's kappa; None when undefined (chance agreement 1: both sets constant and equal)
    important_a: float | None
    important_b: float | None
    only_a: tuple[str, ...]  # trace ids labelled in the first set only
    only_b: tuple[str, ...]
    windows: int = 0  # windows compared (tested by both, counted as evidence by both)
    window_agreement: float | None = None
    window_kappa: float | None = None
    flipped_a: float | None = None  # share of the compared windows that flipped in each set
    flipped_b: float | None = None
    outcome_pairs: dict[str, int] = field(default_factory=dict)  # "outcome_a -> outcome_b" -> windows


def cohen_kappa(a: Sequence[int], b: Sequence[int]) -> float | None:
    """Cohen's kappa of two equal-length 0/1 sequences; None when chance agreement is 1 (kappa is 0/0)."""
    if len(a) != len(b):
        raise ValueError(f"label sequences differ in length: {len(a)} and {len(b)}")
    if not a:
        return None
    n = len(a)
    observed = sum(x == y for x, y in zip(a, b)) / n
    p_a, p_b = sum(a) / n, sum(b) / n
    chance = p_a * p_b + (1 - p_a) * (1 - p_b)
    return None if chance == 1 else (observed - chance) / (1 - chance)


def reasoning_labels(label: Label) -> dict[int, int]:
    """Position -> label over the reasoning span, for the positions the record labels."""
    # Only labelled records come here, and a labelled record has its labels and both span boundaries.
    assert label.positions is not None and label.labels is not None
    assert label.reasoning_start is not None and label.answer_start is not None
    return {position: value for position, value in zip(label.positions, label.labels)
            if label.reasoning_start <= position < label.answer_start}


def window_evidence(label: Label) -> dict[tuple[int, int], tuple[str, bool]]:
    """(start, end) -> (outcome, flipped) of each window the record counts as evidence: an answer came back, or the
    record's rule counts a missing answer as a flip. Records made before outcomes were kept count every window."""
    rule = label.no_answer_rule or "flip"
    if rule not in NO_ANSWER_RULES:
        raise ValueError(f"trace {label.id!r}: unknown no-answer rule {rule!r}")
    found = {}
    for window in label.windows or []:
        outcome = window.get("outcome", "different" if window["flipped"] else SAME)
        if rule == "flip" or outcome in (SAME, "different"):
            found[(window["start"], window["end"])] = (outcome, bool(window["flipped"]))
    return found


def _share(values: Sequence[int]) -> float | None:
    return sum(values) / len(values) if values else None


def label_agreement(a: Iterable[Label], b: Iterable[Label]) -> Agreement:
    """Agreement of label sets `a` and `b` over the traces both labelled (matched by id; see the module docstring).

    A trace present in both with a different token sequence or reasoning start is a `ValueError`: the sets do not
    label the same traces.
    """
    first = {label.id: label for label in a if label.labelled}
    second = {label.id: label for label in b if label.labelled}
    shared = [trace_id for trace_id in first if trace_id in second]
    pooled_a: list[int] = []
    pooled_b: list[int] = []
    windows_a: list[int] = []
    windows_b: list[int] = []
    pairs: Counter[str] = Counter()
    for trace_id in shared:
        x, y = first[trace_id], second[trace_id]
        if (x.token_ids, x.reasoning_start) != (y.token_ids, y.reasoning_start):
            raise ValueError(f"trace {trace_id!r} differs between the two label sets (tokens or reasoning start)")
        labels_x, labels_y = reasoning_labels(x), reasoning_labels(y)
        common = sorted(labels_x.keys() & labels_y.keys())
        pooled_a += [labels_x[p] for p in common]
        pooled_b += [labels_y[p] for p in common]
        evidence_x, evidence_y = window_evidence(x), window_evidence(y)
        for span in sorted(evidence_x.keys() & evidence_y.keys()):
            windows_a.append(int(evidence_x[span][1]))
            windows_b.append(int(evidence_y[span][1]))
        tested_y = {(w["start"], w["end"]): w.get("outcome") for w in y.windows or []}
        for window in x.windows or []:
            other = tested_y.get((window["start"], window["end"]))
            if other is not None and window.get("outcome") is not None:
                pairs[f"{window['outcome']} -> {other}"] += 1
    n = len(pooled_a)
    return Agreement(
        traces=len(shared),
        positions=n,
        agreement=sum(x == y for x, y in zip(pooled_a, pooled_b)) / n if n else None,
        kappa=cohen_kappa(pooled_a, pooled_b),
        important_a=_share(pooled_a),
        important_b=_share(pooled_b),
        only_a=tuple(trace_id for trace_id in first if trace_id not in second),
        only_b=tuple(trace_id for trace_id in second if trace_id not in first),
        windows=len(windows_a),
        window_agreement=(sum(x == y for x, y in zip(windows_a, windows_b)) / len(windows_a) if windows_a else None),
        window_kappa=cohen_kappa(windows_a, windows_b),
        flipped_a=_share(windows_a),
        flipped_b=_share(windows_b),
        outcome_pairs=dict(sorted(pairs.items())),
    )


def pairwise_agreement(sets: dict[str, list[Label]]) -> list[dict[str, Any]]:
    """One row per pair of label sets of the same traces (in the order given, the first of each pair as A): the
    `Agreement` of the two, flattened for a table."""
    names = list(sets)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            found = label_agreement(sets[a], sets[b])
            rows.append({"a": a, "b": b, "traces": found.traces, "positions": found.positions,
                         "agreement": found.agreement, "kappa": found.kappa, "important_a": found.important_a,
                         "important_b": found.important_b, "windows": found.windows,
                         "window_agreement": found.window_agreement, "window_kappa": found.window_kappa,
                         "flipped_a": found.flipped_a, "flipped_b": found.flipped_b,
                         "outcome_pairs": found.outcome_pairs})
    return rows
