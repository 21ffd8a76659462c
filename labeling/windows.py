"""Where a trace's reasoning ends, which windows occlusion tests, and how window flips become position labels.

Positions are absolute indices into ``prompt_ids + generated_ids``. A trace splits into

- the prompt ``[0, reasoning_start)`` (``reasoning_start = len(prompt_ids)``): labelled 1, never occluded;
- the reasoning span ``[reasoning_start, answer_start)``: slid over by the occlusion windows;
- the answer span ``[answer_start, end)``: regenerated for every window, not labelled.

The answer boundary (EpiKV Appendix 8) is the first ``</think>`` in the generated text, else the last ``\\boxed{``,
else the final `tail` generated tokens. It is located in the decoded text and mapped back to the token holding the
marker's first character, so a marker split over several tokens, or merged with the text before it, still counts.

Forced-answer labelling (`find_answer_cue`) appends the trace's own *answer cue* to every occluded context: the tokens
from the boundary up to the first token of the answer itself (``\\boxed{`` in ``So the total is \\boxed{18}``, or
``The answer is`` in a trace without a box). It needs a boundary whose answer is introduced by a marker: after the
first ``</think>``, the last ``\\boxed{`` or else the last answer phrase (``The answer is``, ``Final answer:``,
``####``); before it, the boundary is the ``</think>`` or the phrase itself. The ``tail`` fallback has no marker, so a
trace with none of them has no cue (`find_answer_cue` returns None).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

THINK_END = "</think>"
BOXED = "\\boxed{"
DEFAULT_TAIL = 64
# The answer prompt forced after a trace that has no cue of its own (`generic_cue`), and its boundary's kind.
GENERIC_CUE = "\n\nSo the final answer is \\boxed{"
GENERIC = "generic"


# What introduces an answer in a trace without a box: the phrases `tasks.grading` reads answers after, and GSM8K's
# ``####`` line.
ANSWER_PHRASE = re.compile(r"(?:\bthe\s+)?(?:final\s+)?answer\s+is\b|final\s+answer\s*[:=]|^\W*answer\W*?:|####",
                           re.IGNORECASE | re.MULTILINE)
# What may stand between a cue and its answer: spaces, a colon, an opening "$" or "**".
_CUE_GAP = re.compile(r"[\s:*$]*")


@dataclass(frozen=True)
class Boundary:
    answer_start: int  # absolute position of the first answer-span token
    kind: str  # "think" | "boxed" | "tail" | "phrase" (forced-answer labelling only, `find_answer_cue`)


@dataclass(frozen=True)
class Cue:
    """The answer cue of a trace: ``[boundary.answer_start, end)`` in absolute positions, and its text; `box` when
    it opens the box the answer goes in (else an answer phrase introduces the answer: `labeling.answer`).

    A generic cue (`generic_cue`) is not part of the trace: its tokens `ids` follow the trace's reasoning, which then
    ends where the trace's own text ends (``end == boundary.answer_start``)."""

    boundary: Boundary
    end: int  # absolute position of the first token of the answer itself
    text: str
    box: bool = True
    ids: tuple[int, ...] | None = None  # a generic cue's own tokens (None: the trace's ``[answer_start, end)``)

    @property
    def box_open(self) -> bool:
        """Whether the cue already opens the answer's box: a tokenizer may merge its brace into the answer's first
        token (``{(``), leaving the cue at ``\\boxed``."""
        marker = self.text.rfind(BOXED[:-1])
        return self.box and "{" in (self.text[marker:] if marker >= 0 else self.text[-1:])

    def to_json(self) -> dict:
        data = {"start": self.boundary.answer_start, "end": self.end, "text": self.text, "kind": self.boundary.kind,
                "box": self.box, "box_open": self.box_open}
        return {**data, "ids": list(self.ids)} if self.ids is not None else data


def _token_holding_char(tokenizer, ids: list[int], char_index: int) -> int:
    """The index of the token of `ids` whose decoded text holds character `char_index` of ``decode(ids)``."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:  # smallest i with len(decode(ids[: i + 1])) > char_index
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[: mid + 1], skip_special_tokens=False)) > char_index:
            hi = mid
        else:
            lo = mid + 1
    return lo


def find_answer_boundary(tokenizer, prompt_len: int, generated_ids: list[int], tail: int = DEFAULT_TAIL) -> Boundary:
    """Where the answer span of a trace starts (see the module docstring)."""
    text = tokenizer.decode(generated_ids, skip_special_tokens=False)
    think = text.find(THINK_END)
    if think >= 0:
        return Boundary(prompt_len + _token_holding_char(tokenizer, generated_ids, think), "think")
    boxed = text.rfind(BOXED)
    if boxed >= 0:
        return Boundary(prompt_len + _token_holding_char(tokenizer, generated_ids, boxed), "boxed")
    return Boundary(prompt_len + max(0, len(generated_ids) - tail), "tail")


def find_answer_cue(tokenizer, prompt_len: int, generated_ids: list[int]) -> Cue | None:
    """The trace's answer cue (see the module docstring), or None when no marker introduces its answer."""
    text = tokenizer.decode(generated_ids, skip_special_tokens=False)
    think = text.find(THINK_END)
    region = think + len(THINK_END) if think >= 0 else 0
    boxed = text.rfind(BOXED, region)
    if boxed >= 0:
        marker, answer = boxed, boxed + len(BOXED)
    else:
        phrases = list(ANSWER_PHRASE.finditer(text, region))
        if not phrases:
            return None
        marker, answer = phrases[-1].start(), phrases[-1].end()
    gap = _CUE_GAP.match(text, answer)
    assert gap is not None  # the gap pattern matches the empty string too
    answer = gap.end()
    if answer >= len(text):  # the marker ends the trace: no answer follows it
        return None
    start = _token_holding_char(tokenizer, generated_ids, think if think >= 0 else marker)
    end = _token_holding_char(tokenizer, generated_ids, answer)
    if end <= start:  # the answer shares the marker's first token: there is no cue to feed
        return None
    kind = "think" if think >= 0 else "boxed" if boxed >= 0 else "phrase"
    cue_text = tokenizer.decode(generated_ids[start:end], skip_special_tokens=False)
    return Cue(Boundary(prompt_len + start, kind), prompt_len + end, cue_text, box=boxed >= 0)


def generic_cue(tokenizer, prompt_len: int, generated_ids: list[int], stop_ids: Sequence[int]) -> Cue:
    """The cue forced after a trace with no answer cue of its own: `GENERIC_CUE` after everything the trace says
    (its text without the stop tokens that end it), as answer forcing appends an answer prompt to a chain of thought.
    The whole generation is then reasoning: occlusion may also cover an answer the trace stated in words."""
    end = len(generated_ids)
    while end and generated_ids[end - 1] in stop_ids:
        end -= 1
    ids = tuple(tokenizer.encode(GENERIC_CUE, add_special_tokens=False))
    return Cue(Boundary(prompt_len + end, GENERIC), prompt_len + end, GENERIC_CUE, box=True, ids=ids)


def occlusion_windows(reasoning_start: int, answer_start: int, window: int, stride: int) -> list[tuple[int, int]]:
    """Full-size ``[start, end)`` windows every `stride` tokens over the reasoning span, plus one flush with its end.

    Every window has exactly `window` tokens, so each occluded context has the same length (and, with deletion, the
    same shortened length). The last regular window may stop short of the span's end; one more window ending at
    `answer_start` then covers the tail. A span shorter than `window` has no windows.
    """
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be >= 1, got {window} and {stride}")
    if stride > window:
        raise ValueError(f"stride {stride} > window {window} would leave positions untested")
    starts = list(range(reasoning_start, answer_start - window + 1, stride))
    if starts and starts[-1] + window < answer_start:
        starts.append(answer_start - window)
    return [(s, s + window) for s in starts]


def occlude(ids: list[int], start: int, end: int, replacement: int | None) -> list[int]:
    """`ids` with ``[start, end)`` replaced by `replacement` (same length), or deleted when it is None."""
    filler = [] if replacement is None else [replacement] * (end - start)
    return ids[:start] + filler + ids[end:]


# What a regenerated answer did once a window was occluded (`labeling.labeler` classifies each window).
SAME, DIFFERENT, NO_ANSWER, DEGENERATE = "same", "different", "no_answer", "degenerate"
OUTCOMES = (SAME, DIFFERENT, NO_ANSWER, DEGENERATE)
# How a window that gave no answer (no answer, or a degenerate continuation) enters the position labels.
NO_ANSWER_RULES = ("flip", "exclude", "own-class")


def rule_labels(reasoning_start: int, answer_start: int, windows: list[tuple[int, int]], outcomes: list[str],
                rule: str) -> dict[int, int]:
    """Position -> label for ``[0, answer_start)`` under a no-answer `rule` (positions left out have no label).

    The prompt is 1. A reasoning position is 1 when a covering window changed the answer, and with rule

    - ``flip``: also when a covering window gave no answer (EpiKV App. 8 read literally: no answer is a change), else
      0;
    - ``exclude``: else 0 when a covering window kept the answer, else unlabelled (every covering window gave no
      answer, which says nothing about what the window says);
    - ``own-class``: else unlabelled when a covering window gave no answer, else 0 (a window that broke the answer
      taints its positions: they form their own class, left out of validation).
    """
    if rule not in NO_ANSWER_RULES:
        raise ValueError(f"no-answer rule must be one of {NO_ANSWER_RULES}, got {rule!r}")
    covering: dict[int, set[str]] = {position: set() for position in range(reasoning_start, answer_start)}
    for (start, end), outcome in zip(windows, outcomes, strict=True):
        for position in range(start, end):
            covering[position].add(outcome)
    labels = dict.fromkeys(range(reasoning_start), 1)
    for position, seen in covering.items():
        silent = bool(seen & {NO_ANSWER, DEGENERATE})
        if DIFFERENT in seen or (rule == "flip" and silent):
            labels[position] = 1
        elif rule == "flip" or (rule == "exclude" and SAME in seen) or (rule == "own-class" and seen and not silent):
            labels[position] = 0
    return labels
