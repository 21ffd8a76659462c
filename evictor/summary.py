"""A sweep's cells and its table: one `core.schemas.Cell` row per cell (accuracy with its Wilson 95% interval,
eviction cost, peak cache), written as ``summary.json`` and ``summary.csv`` and printed as the command line's table."""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.cli import atomic_write, write_json
from core.schemas import Cell, Trace
from evictor.protocol import Budget, EvictionConfig
from tasks.run import summarize


@dataclass(frozen=True)
class SweepCell:
    """One cell of a sweep: a policy as configured at one budget."""

    policy: str
    params: dict[str, Any]
    budget: Budget | None  # None: the policy never evicts

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}-K{self.budget:g}"

    @property
    def written_budget(self) -> int | float | None:
        """The budget as records, summary rows and identities write it (`Budget.to_json`); None: never evicts."""
        return None if self.budget is None else self.budget.to_json()


def summarise_cell(cell: SweepCell, traces: Sequence[Trace], protocol: dict[str, Any] | None = None) -> Cell:
    """The cell's row: `tasks.run.summarize` of its traces, a Wilson 95% interval on accuracy, eviction cost, size."""
    from validation.stats import wilson_interval

    counts = summarize(traces)
    lo, hi = wilson_interval(counts["correct"], counts["problems"]) if counts["problems"] else (None, None)
    evictions = [t.eviction or {} for t in traces]

    def mean(key: str) -> float | None:
        values = [e[key] for e in evictions if e.get(key) is not None]
        return statistics.fmean(values) if values else None

    def most(key: str) -> int | None:
        return max((e[key] for e in evictions if e.get(key) is not None), default=None)

    outside = [e["outside_protocol"] for e in evictions if e.get("outside_protocol")]

    return Cell(
        id=cell.label,
        policy=cell.policy,
        budget=cell.written_budget,
        params=cell.params,
        protocol=protocol,
        ci_lo=lo,
        ci_hi=hi,
        **counts,
        mean_rounds=mean("rounds"),
        evicted=None if cell.budget is None else sum(1 for e in evictions if e.get("rounds")),
        mean_round_ms=mean("round_ms_mean"),
        mean_round_share=mean("round_share"),
        max_peak_slots=most("peak_slots"),
        max_peak_cache_bytes=most("peak_cache_bytes"),
        max_peak_memory_bytes=most("peak_memory_bytes"),
        outside_protocol=f"{len(outside)} of {len(traces)} problems: {outside[0]}" if outside else None,
    )


def never_evicted_warning(cell: SweepCell, traces: Sequence[Trace], protocol: EvictionConfig) -> str | None:
    """One line when a cell with a budget never ran an eviction round: it then equals dense decoding."""
    if cell.budget is None or not traces or any((t.eviction or {}).get("rounds") for t in traces):
        return None
    longest = max(len(t.prompt_ids) + len(t.generated_ids) for t in traces)
    ks = sorted({t.budget_tokens for t in traces if t.budget_tokens is not None})
    k = "-" if not ks else f"{ks[0]}" if len(ks) == 1 else f"{ks[0]}..{ks[-1]}"
    return (
        f"warning: {cell.label} equals dense decoding: none of its {len(traces)} problems ran an eviction round, "
        f"because the longest context ({longest} tokens, prompt + generated) never outgrew the budget (K={k}, "
        f"buffer {protocol.buffer}, trigger {protocol.trigger}); lower --budget or raise --max-new-tokens"
    )


def csv_value(value: Any) -> Any:
    """A value as a CSV cell: None empty, an object or list as its JSON text."""
    if value is None:
        return ""
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value


def write_summary(out: Path, cells: Sequence[Cell]) -> None:
    """``summary.json`` and ``summary.csv``: one row per cell, the columns `core.schemas.Cell`'s fields."""
    rows = [cell.to_json() for cell in cells]
    write_json(out / "summary.json", rows)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({k: csv_value(v) for k, v in row.items()} for row in rows)
    with atomic_write(out / "summary.csv") as handle:
        handle.write(buffer.getvalue())


def format_table(cells: Sequence[Cell]) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    header = (
        f"{'cell':<28} {'n':>4} {'acc':>6} {'95% CI':>13} {'noans':>5} {'empty':>5} {'trunc':>5} {'tokens':>7} "
        f"{'tok/s':>7} {'rounds':>7} {'evict':>5} {'ms/rnd':>7} {'share':>6} {'slots':>6} {'cacheMB':>8}"
    )
    lines = [header, "-" * len(header)]
    for c in cells:
        cache_mb = None if c.max_peak_cache_bytes is None else c.max_peak_cache_bytes / 2**20
        interval = "-" if c.ci_lo is None else f"{c.ci_lo:.1%}-{c.ci_hi:.1%}"
        lines.append(
            f"{c.id[:28]:<28} {c.problems:>4} {c.accuracy:>6.1%} {interval:>13} {c.no_answer:>5} {c.empty_output:>5} "
            f"{c.truncated:>5} {fmt(c.mean_generated, '7.1f')} {fmt(c.median_tokens_per_s, '7.2f')} "
            f"{fmt(c.mean_rounds, '7.1f')} {fmt(c.evicted, '5d')} {fmt(c.mean_round_ms, '7.2f')} "
            f"{fmt(c.mean_round_share, '6.1%')} {fmt(c.max_peak_slots, '6d')} {fmt(cache_mb, '8.2f')}"
        )
    return "\n".join(lines)
