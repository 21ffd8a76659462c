"""A finished probe run and what it leaves in its directory.

Each probe is a `probes.config.ProbeConfig` subclass and a function that runs it into a `core.rundir.RunDir` (the
directory is claimed before the model loads, so a second run on it is refused at once) and returns a `ProbeResult`
whose rows are `core.schemas.ProbeRow` records. The directory holds ``instances.jsonl`` (one record per instance, and
per policy in the passcode test; resumable), ``summary.json`` / ``summary.csv`` (the rows) and ``config.json``.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.cli import atomic_write, write_json
from core.schemas import ProbeRow, as_json
from evictor.summary import csv_value
from probes.instances import Layout


@dataclass(frozen=True)
class ProbeResult:
    """A finished probe run: one `ProbeRow` per condition, the layout every instance shared, and the run-level
    facts written beside the rows in ``summary.json``."""

    rows: list[ProbeRow]
    layout: Layout
    out: Path
    context: dict[str, Any]


def default_out(probe: str, model: str, *parts: object) -> Path:
    return Path("runs") / probe / "-".join([Path(model).name, *map(str, parts)])


def write_summary(out: Path, rows: list[ProbeRow], context: dict[str, Any]) -> None:
    """``summary.json`` (the rows and `context`) and ``summary.csv`` (the rows), both written atomically."""
    records = as_json(rows)
    write_json(out / "summary.json", {"rows": records, **context})
    columns = list(dict.fromkeys(k for record in records for k in record))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows({k: csv_value(v) for k, v in record.items()} for record in records)
    with atomic_write(out / "summary.csv") as handle:
        handle.write(buffer.getvalue())


def format_table(rows: list[ProbeRow], columns: Sequence[tuple[str, str, int]], graded: bool) -> str:
    """Rows as a fixed-width table: the label `columns` ((key, header, width), the first left-aligned), then
    n, retrieval and its interval, mean LP and its interval, R and its interval when `graded`, and held."""

    def num(value, spec):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    def ci(row, lo, hi, spec):
        return "-" if row.get(lo) is None else f"[{num(row[lo], spec)}, {num(row[hi], spec)}]"

    stats = [("n", 4, lambda r: str(r["n"])), ("retr", 6, lambda r: num(r["retrieval"], ".3f")),
             ("retr CI", 15, lambda r: ci(r, "retrieval_lo", "retrieval_hi", ".3f")),
             ("mean LP", 8, lambda r: num(r["mean_lp"], ".3f")),
             ("LP CI", 17, lambda r: ci(r, "lp_lo", "lp_hi", ".2f"))]
    if graded:
        stats += [("R", 6, lambda r: num(r.get("R"), ".3f")), ("R CI", 15, lambda r: ci(r, "R_lo", "R_hi", ".2f"))]
    stats.append(("held", 5, lambda r: num(r.get("held"), ".2f")))

    def line(labels: list[str], values: list[str]) -> str:
        (_, _, first), *rest = columns
        parts = [f"{labels[0][:first]:<{first}}"] + [f"{v:>{w}}" for v, (_, _, w) in zip(labels[1:], rest)]
        return " ".join(parts + [f"{v:>{w}}" for v, (_, w, _) in zip(values, stats)])

    records = as_json(rows)
    head = line([h for _, h, _ in columns], [h for h, _, _ in stats])
    body = [line(["-" if r.get(k) is None else str(r[k]) for k, _, _ in columns], [f(r) for _, _, f in stats])
            for r in records]
    return "\n".join([head, "-" * len(head), *body])


def layout_record(layout: Layout) -> dict[str, int]:
    return {**asdict(layout), **layout.positions()}
