"""What the occluded windows of a label set did, and where in the traces they fall.

A label protocol is a measuring instrument: before trusting its flips, look at them. `outcome_breakdown` counts the
windows of each outcome (`labeling.windows.OUTCOMES`: same answer, a different answer, no answer, a degenerate
continuation) by where the window sits in its trace's reasoning span: in fifths of the span by the window's start,
with the window that ends at the answer boundary in a row of its own (a block of filler right before the answer is
where a model is most likely to stop answering, whatever the window said).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from core.schemas import Label
from labeling.windows import DIFFERENT, OUTCOMES, SAME

FIFTHS = ("first fifth", "second fifth", "third fifth", "fourth fifth", "last fifth")
AT_BOUNDARY = "ends at the answer boundary"
PLACES = (*FIFTHS, AT_BOUNDARY)


def window_place(start: int, end: int, reasoning_start: int, answer_start: int) -> str:
    """Where a window of a span ``[reasoning_start, answer_start)`` sits (one of `PLACES`)."""
    if end == answer_start:
        return AT_BOUNDARY
    room = answer_start - reasoning_start - (end - start)  # the latest start a window can have
    share = (start - reasoning_start) / room if room > 0 else 0.0
    return FIFTHS[min(len(FIFTHS) - 1, int(share * len(FIFTHS)))]


def outcome_of(window: dict) -> str:
    """A window's outcome; records made before outcomes were kept know only whether the window flipped."""
    return window.get("outcome") or (DIFFERENT if window["flipped"] else SAME)


def outcome_breakdown(labels: Iterable[Label]) -> list[dict]:
    """One row per place (`PLACES`) and a total: windows of each outcome there, over every labelled trace."""
    counts = {place: dict.fromkeys(OUTCOMES, 0) for place in PLACES}
    for label in labels:
        if not label.labelled:
            continue
        assert label.reasoning_start is not None and label.answer_start is not None  # a labelled record has both
        for window in label.windows or []:
            place = window_place(window["start"], window["end"], label.reasoning_start, label.answer_start)
            counts[place][outcome_of(window)] += 1
    rows: list[dict[str, Any]] = [{"where": place, **row, "windows": sum(row.values())}
                                  for place, row in counts.items()]
    total = {name: sum(row[name] for row in rows) for name in (*OUTCOMES, "windows")}
    return rows + [{"where": "all", **total}]


def no_answer_share(rows: list[dict]) -> float | None:
    """Of the windows whose answer did not stay the same, the share that gave no answer at all (None: none)."""
    total = rows[-1]
    changed = total["windows"] - total[SAME]
    return (changed - total[DIFFERENT]) / changed if changed else None


def effect_breakdown(labels: Iterable[Label]) -> list[dict]:
    """Where a label set's important windows lie, for any label kind: one row per place (`PLACES`) and a total, each
    with its windows, the important ones (``flipped``: the answer changed, or for joint labels a unit whose interval
    lies above zero), their share of all important windows, and the mean graded effect of the windows there (None
    where no window carries one). Is there ground truth before the last fifth?"""
    windows = dict.fromkeys((*PLACES, "all"), 0)
    important = dict.fromkeys((*PLACES, "all"), 0)
    effects: dict[str, list[float]] = {place: [] for place in (*PLACES, "all")}
    for label in labels:
        if not label.labelled:
            continue
        assert label.reasoning_start is not None and label.answer_start is not None  # a labelled record has both
        for window in label.windows or []:
            place = window_place(window["start"], window["end"], label.reasoning_start, label.answer_start)
            for where in (place, "all"):
                windows[where] += 1
                important[where] += bool(window.get("flipped"))
                if window.get("effect") is not None:
                    effects[where].append(float(window["effect"]))
    total = important["all"]
    return [{"where": place, "windows": windows[place], "important": important[place],
             "share": important[place] / total if total else None,
             "mean_effect": sum(effects[place]) / len(effects[place]) if effects[place] else None}
            for place in windows]
