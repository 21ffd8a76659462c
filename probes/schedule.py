"""When a probe sequence evicts, and the gap that puts its fact a chosen distance before the question.

Distance: ``N`` (or ``Nr``) eviction rounds = the shortest gap such that N rounds fire with the whole fact box among
the candidates (older than the buffer and the recency window) before the value's first token is predicted; ``Nt``
= N filler tokens. The schedule comes from simulating the engine's own `evictor.protocol.plan_round`, and every
instance records the rounds that actually fired.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from core.errors import UsageError
from evictor.protocol import EvictionConfig, plan_round, sequence_budgets
from probes.instances import Layout


@dataclass(frozen=True)
class Distance:
    amount: int
    unit: str  # "rounds" | "tokens"

    def __str__(self) -> str:
        return f"{self.amount}{'r' if self.unit == 'rounds' else 't'}"


def parse_distance(text: str) -> Distance:
    """``"4"`` / ``"4r"`` -> 4 eviction rounds; ``"300t"`` -> 300 filler tokens."""
    match = re.fullmatch(r"\s*(\d+)\s*([rt]?)\s*", text)
    if not match:
        raise UsageError(f"--distance {text!r} must be N (eviction rounds), Nr (rounds) or Nt (filler tokens)")
    amount, unit = int(match.group(1)), "tokens" if match.group(2) == "t" else "rounds"
    if unit == "rounds" and amount < 1:
        raise UsageError(f"--distance {text!r}: at least 1 eviction round")
    return Distance(amount, unit)


@dataclass(frozen=True)
class Schedule:
    """When one probe sequence evicts: the protocol, and the sequence's effective budget K, protection limit and
    recency window as `evictor.protocol.sequence_budgets` resolves them (the engine uses the same)."""

    config: EvictionConfig
    budget: int
    limit: int
    recency: int

    @classmethod
    def of(cls, config: EvictionConfig, protect: str, prompt_len: int,
           kept_recent: Callable[[int], int] | None = None) -> Schedule:
        """The schedule of a sequence with a `prompt_len`-token prompt; `kept_recent` is the policy's own
        `Policy.kept_recent` (the newest tokens it keeps, which widen the recency window)."""
        assert config.budget is not None  # a probe's protocol has one K for every sequence (--budget)
        resolved = sequence_budgets([int(config.budget)], [prompt_len], protect, config, kept_recent=kept_recent)
        return cls(config, resolved.budgets[0], resolved.limits[0], resolved.recency[0])


def eviction_rounds(prompt_len: int, end: int, schedule: Schedule) -> list[int]:
    """``next_pos`` at every eviction round of one sequence whose positions ``0..end-1`` are fed (prompt in
    prefill blocks, then one token per step), replaying `evictor.protocol.plan_round` on host-side counts."""
    config = schedule.config
    fired, n = [], 0
    feeds = [(min(s + config.block, prompt_len), True) for s in range(0, prompt_len, config.block)]
    feeds += [(pos, False) for pos in range(prompt_len + 1, end + 1)]
    produced = 0
    for next_pos, boundary in feeds:
        n += next_pos - produced
        produced = next_pos
        plan = plan_round(slots=n, n_valid=[n], next_pos=[next_pos], limits=[schedule.limit],
                          budgets=[schedule.budget], buffer=config.buffer, recency=[schedule.recency],
                          trigger=config.trigger, boundary=boundary, interval=config.interval)
        if plan is not None:
            n = plan.n_keep[0]
            fired.append(next_pos)
    return fired


def fact_rounds(rounds: Sequence[int], layout: Layout, schedule: Schedule) -> int:
    """Rounds that had the whole fact box among their candidates and fired before the value's first token was
    predicted (a round after the forward of position p has ``next_pos = p + 1``; the value's first token is
    predicted by the forward of position ``value_start - 1``)."""
    unscored = schedule.config.buffer + schedule.recency
    return sum(1 for next_pos in rounds if layout.box_end <= next_pos - unscored and next_pos < layout.value_start)


def resolve_gap(layout: Layout, distance: Distance, schedule: Schedule) -> Layout:
    """The layout with its gap: `distance` tokens, or the shortest gap giving `distance` fact rounds."""
    if distance.unit == "tokens":
        return replace(layout, gap=distance.amount)

    def count(gap: int) -> int:
        trial = replace(layout, gap=gap)
        return fact_rounds(eviction_rounds(layout.stub, trial.value_start, schedule), trial, schedule)

    config = schedule.config
    # a round at most every `period` steps, each reaching back past the buffer and the recency window
    span = config.buffer + config.period + schedule.recency + 1
    high = schedule.budget + config.buffer + config.period + (distance.amount + 2) * span + layout.box
    if count(high) < distance.amount:
        raise UsageError(f"--distance {distance}: the protocol fires fewer than {distance.amount} rounds within "
                         f"{high} tokens (budget {schedule.budget}, buffer {config.buffer}, trigger {config.trigger})")
    low = 0
    while low < high:  # the count never decreases as the gap grows
        middle = (low + high) // 2
        if count(middle) >= distance.amount:
            high = middle
        else:
            low = middle + 1
    return replace(layout, gap=low)


def protocol_layout(layout: Layout, distance: Distance, config: EvictionConfig, protections: Sequence[str]) -> Layout:
    """The layout whose gap gives every one of `protections` (the policies' resolved protection) at least
    `distance`: under a budget that counts only scored tokens (EpiKV) the protection moves the schedule."""
    return max((resolve_gap(layout, distance, Schedule.of(config, protect, layout.stub)) for protect in protections),
               key=lambda resolved: resolved.gap)
