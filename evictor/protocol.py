"""The eviction protocol: every knob, its paper default, and the one place where the budget is defined.

Budget semantics (per sequence, per layer, per KV head; all counts are cache slots = tokens)
------------------------------------------------------------------------------------------
At an eviction round the resident tokens of one (sequence, layer, KV head) split, oldest to newest, into

    [ protected | candidates | recency window w | buffer r ]

- **protected**: positions below the protection limit -- the whole prompt (``protect="prompt"``), the first
  ``n_sinks`` tokens (``"sinks"``) or nothing (``"none"``). Never scored, never evicted.
- **buffer** ``r``: the ``r`` newest tokens. Never scored, never evicted, and *not* counted in the budget (Random
  Attention §3.1: the cache returns to ``K + r`` entries after each round).
- **recency window** ``w`` (default 0): the ``w`` tokens just older than the buffer. Never scored, never evicted,
  counted in the budget (EpiKV App. 9 keeps a trailing recency window of ``min(128, K/4)`` inside ``K``).
- **candidates**: everything else. The policy scores them and the top ``K - |protected| - w`` survive.

So after a round the cache holds ``K + r`` slots: ``K`` = protected + recency window + scored survivors, plus the
buffer. With ``budget_scope="trace"`` the budget counts only the scored survivors (EpiKV's footnote: "applies its
budget to the remaining positions"), i.e. the effective ``K`` becomes ``K + |protected| + w``.

If the protected part plus the recency window does not fit in ``K`` (a long prompt), the run fails with a clear
error unless ``on_long_prompt`` chooses a fallback explicitly: ``"expand"`` raises that sequence's budget to
``|prompt| + w`` (its trace then keeps only the window and the buffer), ``"sinks"`` protects only the first
``n_sinks`` tokens of that sequence.

Triggers (when a round fires for one sequence; ``n`` = its resident tokens after the forward just run):

- ``"interval"`` (Random Attention): once ``n >= K + 2r``, i.e. every ``r`` decode steps once past ``K + r``; the
  cache oscillates between ``K + r`` and ``K + 2r``. Needs ``r >= 1``.
- ``"step"`` (EpiKV, ValueDiff): whenever ``n > K + r``; the cache stays at ``K + r`` (``K + r + 1`` while attending).
- Prefill blocks (ValueDiff §2.2, both triggers): the prompt is processed in blocks of ``B`` tokens and every block
  boundary (and the end of the prefill) evicts down to ``K + r`` whenever ``n > K + r``, so the prefill peak is
  ``K + r + B``. ``B >= prompt length`` is one ordinary prefill.

Rounds run after a forward, for every layer, on the tokens that forward appended as well (the newest are in the
buffer). A sequence of a batch that does not trigger keeps everything.

Fractional budgets (`resolve_budget`): ``0 < budget < 1`` means ``ceil(budget * L)`` tokens, where ``L`` is the
length of the reference generation: the dense (``--policy full``) trace length of the same problem when a
reference run is given, otherwise ``max_new_tokens``. The prompt is not part of ``L`` (compression factor ~ 1/f of
the generated trace, as Random Attention reports it) but protected prompt tokens still count inside ``K``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from core.errors import UsageError, unknown_choice

TRIGGERS = ("interval", "step")
PROTECTIONS = ("prompt", "sinks", "none")
ON_LONG_PROMPT = ("error", "expand", "sinks")
BUDGET_SCOPES = ("all", "trace")
ATTENTION_SOURCES = ("eager", "window")

DEFAULT_BUFFER = 64  # Random Attention's r
DEFAULT_BLOCK = 128  # ValueDiff's B
DEFAULT_SINKS = 4  # StreamingLLM


@dataclass(frozen=True)
class EvictionConfig:
    """Protocol knobs with the papers' defaults (see the module docstring for the exact budget semantics).

    `protect=None` takes the policy's `default_protection`; `attention_source=None` takes "eager" when the model runs
    the eager kernel and "window" otherwise; `query_window=None` takes the policy's `Needs.queries_window`, and with
    the window source a policy asking for "every query since entry" (0) gets the last `buffer` queries instead.
    """

    budget: float = 1024
    buffer: int = DEFAULT_BUFFER
    block: int = DEFAULT_BLOCK
    trigger: str = "interval"
    protect: str | None = None
    n_sinks: int = DEFAULT_SINKS
    recency: int = 0
    budget_scope: str = "all"
    on_long_prompt: str = "error"
    shared: bool = False  # force one keep set per layer (mean of the policy's per-head scores)
    attention_source: str | None = None
    query_window: int | None = None
    seed: int = 0
    keep_log: bool = False

    def __post_init__(self) -> None:
        if not self.budget > 0 or (self.budget >= 1 and self.budget != int(self.budget)):
            raise UsageError(f"budget must be a positive whole number of tokens or a fraction in (0, 1), got {self.budget}")
        for name in ("buffer", "recency", "n_sinks"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block < 1:
            raise UsageError(f"block must be >= 1, got {self.block}")
        if self.trigger not in TRIGGERS:
            raise unknown_choice("trigger", self.trigger, TRIGGERS)
        if self.trigger == "interval" and self.buffer < 1:
            raise UsageError("trigger 'interval' evicts every `buffer` steps, so it needs buffer >= 1 (or use --trigger step)")
        if self.protect is not None and self.protect not in PROTECTIONS:
            raise unknown_choice("protection", self.protect, PROTECTIONS)
        if self.on_long_prompt not in ON_LONG_PROMPT:
            raise unknown_choice("long-prompt fallback", self.on_long_prompt, ON_LONG_PROMPT)
        if self.budget_scope not in BUDGET_SCOPES:
            raise unknown_choice("budget scope", self.budget_scope, BUDGET_SCOPES)
        if self.attention_source is not None and self.attention_source not in ATTENTION_SOURCES:
            raise unknown_choice("attention source", self.attention_source, ATTENTION_SOURCES)
        if self.query_window is not None and self.query_window < 1:
            raise UsageError(f"query_window must be >= 1, got {self.query_window}")

    @property
    def fractional(self) -> bool:
        return self.budget < 1

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_budget(budget: float, reference_length: int) -> int:
    """Tokens of a budget: an integer budget as is, a fraction ``f`` as ``ceil(f * reference_length)`` (>= 1)."""
    if budget >= 1:
        return int(budget)
    return max(1, math.ceil(round(budget * reference_length, 6)))  # round: 0.3 * 10 must give 3, not 4


def protection_limit(protect: str, prompt_len: int, n_sinks: int) -> int:
    """Positions below this limit are protected."""
    return {"prompt": prompt_len, "sinks": n_sinks, "none": 0}[protect]


def sequence_budgets(
    budgets: Sequence[int],
    prompt_lens: Sequence[int],
    protect: str,
    config: EvictionConfig,
    names: Sequence[str] | None = None,
) -> tuple[list[int], list[int]]:
    """Per-sequence effective budget K_b and protection limit, applying `budget_scope` and `on_long_prompt`.

    Raises `UsageError` naming the sequence when a protected prompt plus the recency window exceeds its budget and no
    fallback was chosen.
    """
    out_budgets, limits = [], []
    for index, (budget, prompt_len) in enumerate(zip(budgets, prompt_lens)):
        who = names[index] if names is not None else f"sequence {index}"
        limit = protection_limit(protect, prompt_len, config.n_sinks)
        if config.budget_scope == "trace":
            budget = budget + limit + config.recency
        elif limit + config.recency > budget:
            if config.on_long_prompt == "error":
                raise UsageError(
                    f"{who}: {limit} protected tokens ({protect}) + recency window {config.recency} exceed "
                    f"the budget {budget}; raise --budget, use --protect sinks|none, or choose a fallback with "
                    f"--on-long-prompt expand|sinks"
                )
            if config.on_long_prompt == "expand":
                budget = limit + config.recency
            else:
                limit = config.n_sinks
                if limit + config.recency > budget:
                    raise UsageError(
                        f"{who}: even {limit} sinks + recency window {config.recency} exceed the budget {budget}"
                    )
        out_budgets.append(budget)
        limits.append(limit)
    return out_budgets, limits


@dataclass(frozen=True)
class RoundPlan:
    """One eviction round, decided on host-side counts only (no device sync).

    Per sequence b: `n_keep[b]` slots survive; its candidates occupy slots ``[cand_start[b], cand_end[b])`` (the same
    range in every layer and head, because valid slots are right-aligned and sorted by position); `keep_cand[b]` of
    them survive. `slots` is the slot count after the round (max of `n_keep`); `span` the candidate slice
    ``[lo, hi)`` covering every triggered sequence.
    """

    triggered: tuple[bool, ...]
    n_keep: tuple[int, ...]
    cand_start: tuple[int, ...]
    cand_end: tuple[int, ...]
    keep_cand: tuple[int, ...]
    slots: int
    span: tuple[int, int]


def plan_round(
    *,
    slots: int,
    n_valid: Sequence[int],
    next_pos: Sequence[int],
    limits: Sequence[int],
    budgets: Sequence[int],
    buffer: int,
    recency: int,
    trigger: str,
    boundary: bool,
) -> RoundPlan | None:
    """Which sequences evict now and how many slots each keeps; None when no sequence evicts.

    `slots`: current slot count (valid slots of sequence b are the last ``n_valid[b]``); `next_pos[b]`: positions
    ``0..next_pos[b]-1`` have been produced; `limits[b]`: protection limit; `budgets[b]`: effective K_b;
    `boundary`: a prefill block boundary (evicts whenever over ``K + r`` regardless of the trigger).
    """
    triggered, n_keep, starts, ends, keeps = [], [], [], [], []
    for n, produced, limit, budget in zip(n_valid, next_pos, limits, budgets):
        n_prot = min(limit, produced)
        n_buf = min(buffer, n - n_prot)
        n_rec = min(recency, n - n_prot - n_buf)
        n_cand = n - n_prot - n_buf - n_rec
        keep_cand = max(0, budget - n_prot - recency)
        if boundary or trigger == "step":
            fires = n > budget + buffer
        else:
            fires = n >= budget + 2 * buffer
        fires = fires and n_cand > keep_cand
        start = slots - n + n_prot
        triggered.append(fires)
        n_keep.append(n - (n_cand - keep_cand) if fires else n)
        starts.append(start)
        ends.append(start + n_cand)
        keeps.append(keep_cand if fires else n_cand)
    if not any(triggered):
        return None
    lo = min(s for s, t in zip(starts, triggered) if t)
    hi = max(e for e, t in zip(ends, triggered) if t)
    return RoundPlan(tuple(triggered), tuple(n_keep), tuple(starts), tuple(ends), tuple(keeps), max(n_keep), (lo, hi))
