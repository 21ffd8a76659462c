"""Cache-level occlusion labels (``--intervention cache``): each window's keys and values removed from the dense
cache at the answer boundary, the answer forced from what is left.

Per trace: the context up to the boundary is prefilled once (`labeling.pruned.PrunedContext`); the reference is the
greedy forced answer after the cue with nothing removed, and the graded baseline its teacher-forced score there. Each
window of the reasoning span (the windows token occlusion tests) becomes one row that removes the window's entries
from every KV head of every layer (``heads="all"``), or one row per KV head removing them from that head only in
every layer (``heads="each"``: which heads hold what the answer needs). Every row scores the reference answer after
the cue in one batched forward (`AnswerScore`: its effect is the change of the answer's log-probability); a row
whose greedy tokens would not reproduce the reference is decoded greedily from its pruned cache to name the answer it
gives instead, so each window's outcome (same, different, no answer, degenerate) means what it means for token
occlusion, and positions are labelled by the same rule (`labeling.windows.rule_labels`; with ``heads="each"`` a
position is important when removing it from any one head changes the answer).

What differs from token occlusion: the tokens after the window keep the keys and values they computed while the
window was there (eviction's situation), so a later restatement of the window's content still holds it; no filler is
read, so there is no replacement to choose; and nothing is re-prefilled, so a window costs one forward of the cue and
the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from core.schemas import Label
from labeling.pruned import PrunedContext

# The labeller (`labeling.labeler.OcclusionLabeler`) calls this module for its intervention, so its types are not
# imported here (that would close an import cycle): `labeler` is an OcclusionLabeler, `unit` a Unit, `plan` a
# TracePlan, `progress` a callable taking a count.


def label_cache(labeler: Any, unit: Any, progress: Any = None) -> list[Label]:
    """Cache-level labels of the unit's traces, in order (see the module docstring)."""
    return [_label_trace(labeler, trace, progress) for trace in unit.traces]


def reference_answer(labeler: Any, plan: Any,
                     context: PrunedContext) -> tuple[list[int], list[int] | None]:
    """The greedy forced answer after the cue from the whole dense cache (the reference), and its answer tokens
    (None when it never completes)."""
    cue = list(plan.context[plan.boundary.answer_start:])
    complete = labeler.completion([plan])
    tokens = context.greedy(torch.ones(1, 1, context.length, dtype=torch.bool), cue, labeler.config.answer_cap,
                            labeler.stop_ids, (lambda out: complete(0, out)) if complete else None)[0]
    return tokens, labeler._answer_ids(tokens, plan)


def skipped_record(labeler: Any, trace, plan: Any, intervention: str,
                   reason: str | None) -> dict[str, Any]:
    """The fields every label record of `trace` starts from (a skipped one when `reason` is given)."""
    record = {"n_tokens": len(trace.token_ids), "reasoning_start": len(trace.prompt_ids),
              "answer_start": plan.boundary.answer_start, "boundary": plan.boundary.kind,
              "forced_cue": plan.cue.to_json() if plan.cue else None, "no_answer_rule": labeler.config.no_answer,
              "intervention": intervention}
    return {**record, "status": "skipped", "reason": reason} if reason else record


def as_label(labeler: Any, trace, record: dict[str, Any]) -> Label:
    assert labeler.replacement is not None  # resolved when the labeler is made
    return Label(id=trace.id, dataset=trace.dataset, model=trace.model, correct=trace.correct,
                 trace_answer=trace.answer, gold=trace.gold, replacement=None,
                 extra={"trace_policy": trace.policy} if trace.evicted else {}, **record)


def _label_trace(labeler: Any, trace, progress: Any) -> Label:
    config = labeler.config
    plan = labeler.plan(trace)
    if not plan.windows:
        return as_label(labeler, trace, skipped_record(labeler, trace, plan, "cache", plan.skip_reason))
    answer_start = plan.boundary.answer_start
    context = PrunedContext(labeler.model, plan.context[:answer_start])
    cue = list(plan.context[answer_start:])
    reference_tokens, answer = reference_answer(labeler, plan, context)
    record = skipped_record(labeler, trace, plan, "cache", None)
    if answer is None:
        record.update(status="skipped", reason="no answer extracted from the unoccluded forced answer",
                      reference_text=labeler.tokenizer.decode(reference_tokens, skip_special_tokens=True))
        return as_label(labeler, trace, record)
    heads = range(context.kv_heads) if config.heads == "each" else [None]
    rows = [(start, end, head) for start, end in plan.windows for head in heads]
    keep = torch.ones(len(rows), context.kv_heads if config.heads == "each" else 1, context.length, dtype=torch.bool)
    for row, (start, end, head) in enumerate(rows):
        keep[row, 0 if head is None else head, start:end] = False
    base = context.score(torch.ones(1, 1, context.length, dtype=torch.bool), cue, answer)[0]
    scores = context.score(keep, cue, answer, config.batch_size)
    if progress:
        progress(len(rows) + 1)
    diverging = [row for row, score in enumerate(scores) if not score.greedy]
    complete = labeler.completion([plan])
    decoded = context.greedy(keep[diverging], cue, config.answer_cap, labeler.stop_ids,
                             (lambda out: complete(0, out)) if complete else None) if diverging else []
    by_row = dict(zip(diverging, decoded))
    continuations = [by_row.get(row, answer) for row in range(len(rows))]
    windows = [(start, end) for start, end, _ in rows]
    labeler._finish(record, trace.token_ids, dataclasses.replace(plan, windows=windows), reference_tokens,
                    continuations, [base, *scores], trace.gold)
    if config.heads == "each":
        for window, (_, _, head) in zip(record.get("windows") or [], rows):
            window["head"] = head
    return as_label(labeler, trace, record)
