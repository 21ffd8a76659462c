"""Agreement between two occlusion label sets of the same traces (made with different replacements, say).

Only the reasoning span ``[reasoning_start, answer_start)`` is compared: prompt positions are 1 by construction and
the answer span is unlabelled, so either would inflate agreement. Positions are pooled over the traces both sets
labelled. Cohen's kappa corrects the raw agreement for what two independent labellings with the same important
fractions would reach by chance: kappa = (p_o - p_e) / (1 - p_e), p_e = p_a p_b + (1 - p_a)(1 - p_b).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from core.schemas import Label


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


def reasoning_labels(label: Label) -> list[int]:
    return list(label.labels[label.reasoning_start:label.answer_start])


def label_agreement(a: Iterable[Label], b: Iterable[Label]) -> Agreement:
    """Agreement of label sets `a` and `b` over the traces both labelled (matched by id; see the module docstring).

    A trace present in both with a different token sequence or reasoning span is a `ValueError`: the sets do not
    label the same traces.
    """
    first = {label.id: label for label in a if label.labelled}
    second = {label.id: label for label in b if label.labelled}
    shared = [trace_id for trace_id in first if trace_id in second]
    pooled_a: list[int] = []
    pooled_b: list[int] = []
    for trace_id in shared:
        x, y = first[trace_id], second[trace_id]
        if (x.token_ids, x.reasoning_start, x.answer_start) != (y.token_ids, y.reasoning_start, y.answer_start):
            raise ValueError(f"trace {trace_id!r} differs between the two label sets (tokens or reasoning span)")
        pooled_a += reasoning_labels(x)
        pooled_b += reasoning_labels(y)
    n = len(pooled_a)
    return Agreement(
        traces=len(shared),
        positions=n,
        agreement=sum(x == y for x, y in zip(pooled_a, pooled_b)) / n if n else None,
        kappa=cohen_kappa(pooled_a, pooled_b),
        important_a=sum(pooled_a) / n if n else None,
        important_b=sum(pooled_b) / n if n else None,
        only_a=tuple(trace_id for trace_id in first if trace_id not in second),
        only_b=tuple(trace_id for trace_id in second if trace_id not in first),
    )
