"""Joint labels (``--intervention joint``): what each part of a trace is worth to the answer *given that the rest of
the cache is being evicted too*, from random keep-sets at an evictor's budget.

Token and cache-level occlusion remove one window from an otherwise whole cache, so a fact the trace states twice is
never missed by either: each copy alone is redundant. An evictor removes most of the trace at once. Joint labels ask
its question. Per trace, the reasoning span ``[reasoning_start, answer_start)`` is cut into units of `unit` tokens
(`trace_units`; the last may be shorter). Each of M draws keeps the prompt and each unit independently with
probability `budget` (Random Attention's keep rule: the prompt kept, the trace sampled uniformly; in units instead of
tokens so that each unit's keep indicator varies from draw to draw, and independently so that the budget holds in
expectation while a unit's coefficient stays identified: with exactly ``budget * U`` units in every draw the keep
indicators would sum to a constant, collinear with the intercept), either one set shared by every KV head
(``draw="shared"``) or one per KV head (``"per-head"``; the same in every layer). The dense cache of the context is
prefilled once and each draw's pruned copy forces the cue and the reference answer
(`labeling.pruned.PrunedContext`): ``y_m`` is the answer's teacher-forced log-probability, ``greedy_m`` whether
greedy decoding would still give it.

Each unit's label comes from its coefficient in the linear datamodel of ``y`` on the units' keep shares
(`labeling.datamodel`, HC3 intervals), the expected log-probability gained by keeping the unit at this budget
(``coef``, with ``coef_lo`` / ``coef_hi``). Its *effect*, as every label kind writes it, is the change of the
answer's log-probability when the unit is taken away: ``effect = -coef`` (negative when the answer needs it, with
``effect_lo = -coef_hi``, ``effect_hi = -coef_lo``); a unit is *important* when its effect's interval lies below zero.
Positions take their unit's label (the prompt is 1). The share of draws whose greedy answer is still the reference
is an offline estimate of what random eviction at this budget keeps, at the answer boundary.

How M is chosen and checked: by default ``M = max(MIN_DRAWS, DRAWS_PER_UNIT * U)`` (`auto_draws`), enough for a
least-squares fit of U coefficients with room for intervals; the record states M and the split-half reliability of
the coefficients (Spearman-Brown), which says whether more draws would change the ranking (`docs/labels.md` gives
the reliability against M on real traces). Every draw (its kept units per head, ``y``, ``greedy``) is stored, so the
fit can be recomputed from the records alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.schemas import Label
from core.seeds import derive_seed
from labeling.cache_labels import as_label, reference_answer, skipped_record
from labeling.pruned import PrunedContext

# The labeller (`labeling.labeler.OcclusionLabeler`) calls this module for its intervention, so its types are not
# imported here (that would close an import cycle): `labeler` is an OcclusionLabeler, `unit` a Unit, `plan` a
# TracePlan, `config` an OcclusionConfig, `progress` a callable taking a count.

MIN_DRAWS = 128
DRAWS_PER_UNIT = 8


def trace_units(plan: Any, reasoning_start: int, unit: int) -> list[tuple[int, int]]:
    """The reasoning span cut into consecutive ``[start, end)`` units of `unit` tokens (the last may be shorter)."""
    answer_start = plan.boundary.answer_start
    return [(start, min(start + unit, answer_start)) for start in range(reasoning_start, answer_start, unit)]


def auto_draws(units: int) -> int:
    return max(MIN_DRAWS, DRAWS_PER_UNIT * units)


def draws_for(config: Any, units: int) -> int:
    return config.draws if config.draws is not None else auto_draws(units)


def draw_keep_sets(rng: np.random.Generator, draws: int, heads: int, units: int, budget: float) -> np.ndarray:
    """``[draws, heads, units]`` booleans: each unit kept in each draw and head independently with probability
    `budget`."""
    return rng.random((draws, heads, units)) < budget


def label_joint(labeler: Any, unit: Any, progress: Any = None) -> list[Label]:
    """Joint labels of the unit's traces, in order (see the module docstring)."""
    return [_label_trace(labeler, trace, progress) for trace in unit.traces]


def _label_trace(labeler: Any, trace, progress: Any) -> Label:
    from labeling.datamodel import fit_datamodel

    config = labeler.config
    plan = labeler.plan(trace)
    reasoning_start = len(trace.prompt_ids)
    units = trace_units(plan, reasoning_start, config.unit) if plan.windows else []
    if len(units) < 2:
        reason = plan.skip_reason or f"reasoning span of {len(units)} unit of {config.unit} tokens: nothing to draw"
        return as_label(labeler, trace, skipped_record(labeler, trace, plan, "joint", reason))
    answer_start = plan.boundary.answer_start
    context = PrunedContext(labeler.model, plan.context[:answer_start])
    cue = list(plan.context[answer_start:])
    reference_tokens, answer = reference_answer(labeler, plan, context)
    record = skipped_record(labeler, trace, plan, "joint", None)
    reference = labeler.read_answer(plan, reference_tokens) if answer is not None else None
    if answer is None or reference is None:
        record.update(status="skipped", reason="no answer extracted from the unoccluded forced answer",
                      reference_text=labeler.tokenizer.decode(reference_tokens, skip_special_tokens=True))
        return as_label(labeler, trace, record)
    draws, heads = draws_for(config, len(units)), context.kv_heads if config.draw == "per-head" else 1
    rng = np.random.default_rng(derive_seed(config.seed, ("joint", trace.id, config.budget, config.draw)))
    chosen = draw_keep_sets(rng, draws, heads, len(units), config.budget)
    keep = torch.zeros(draws, heads, context.length, dtype=torch.bool)
    keep[:, :, :reasoning_start] = True
    for u, (start, end) in enumerate(units):
        keep[:, :, start:end] = torch.from_numpy(chosen[:, :, u])[..., None]
    base = context.score(torch.ones(1, 1, context.length, dtype=torch.bool), cue, answer)[0]
    scores = context.score(keep, cue, answer, config.batch_size)
    if progress:
        progress(draws + 1)
    y = np.array([score.logp for score in scores])
    fit = fit_datamodel(chosen.mean(axis=1), y)
    windows: list[dict[str, Any]] = []
    for u, (start, end) in enumerate(units):
        coef, lo, hi = (round(float(v[u]), 6) for v in (fit.coef, fit.lo, fit.hi))
        windows.append({"start": start, "end": end, "coef": coef, "coef_lo": lo, "coef_hi": hi,
                        "se": round(float(fit.se[u]), 6), "effect": -coef, "effect_lo": -hi, "effect_hi": -lo,
                        "flipped": bool(lo > 0)})
    labels = dict.fromkeys(range(reasoning_start), 1)
    for (start, end), window in zip(units, windows):
        labels.update(dict.fromkeys(range(start, end), int(window["flipped"])))
    reasoning = [labels[p] for p in range(reasoning_start, answer_start)]
    record.update(
        status="labelled", token_ids=trace.token_ids, positions=list(labels), labels=list(labels.values()),
        reference_answer=reference,
        reference_text=labeler.tokenizer.decode(reference_tokens, skip_special_tokens=True), windows=windows,
        important_fraction=sum(reasoning) / len(reasoning),
        reference_matches_gold=None if trace.gold is None else bool(labeler.same(reference, trace.gold)),
        graded={"answer_ids": answer, **{f"reference_{k}": v for k, v in base.to_json().items()}},
        joint={"budget": config.budget, "unit": config.unit, "draw": config.draw, "draws": draws,
               "units": len(units), "kept_share": round(float(chosen.mean()), 6), "intercept": round(fit.intercept, 6),
               "r2": round(fit.r2, 6), "reliability": None if fit.reliability is None else round(fit.reliability, 6),
               "greedy_share": float(np.mean([score.greedy for score in scores])),
               "records": [{"kept": [np.flatnonzero(chosen[m, h]).tolist() for h in range(heads)],
                            "logp": round(score.logp, 6), "greedy": score.greedy}
                           for m, score in enumerate(scores)]})
    return as_label(labeler, trace, record)
