"""Where a trace's reasoning ends, which windows occlusion tests, and how window flips become position labels.

Positions are absolute indices into ``prompt_ids + generated_ids``. A trace splits into

- the prompt ``[0, reasoning_start)`` (``reasoning_start = len(prompt_ids)``): labelled 1, never occluded;
- the reasoning span ``[reasoning_start, answer_start)``: slid over by the occlusion windows;
- the answer span ``[answer_start, end)``: regenerated for every window, not labelled.

The answer boundary (EpiKV Appendix 8) is the first ``</think>`` in the generated text, else the last ``\\boxed{``,
else the final `tail` generated tokens. It is located in the decoded text and mapped back to the token holding the
marker's first character, so a marker split over several tokens, or merged with the text before it, still counts.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_END = "</think>"
BOXED = "\\boxed{"
DEFAULT_TAIL = 64


@dataclass(frozen=True)
class Boundary:
    answer_start: int  # absolute position of the first answer-span token
    kind: str  # "think" | "boxed" | "tail"


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


def position_labels(reasoning_start: int, answer_start: int, windows: list[tuple[int, int]],
                    flips: list[bool]) -> list[int]:
    """Labels for positions ``[0, answer_start)``: 1 for the prompt, else 1 iff any covering window flipped."""
    labels = [1] * reasoning_start + [0] * (answer_start - reasoning_start)
    for (start, end), flipped in zip(windows, flips, strict=True):
        if flipped:
            labels[start:end] = [1] * (end - start)
    return labels
