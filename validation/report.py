"""Writing validation results: CSV tables and JSON with NaN as null, both written atomically."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from core.cli import atomic_write


def jsonable(value: Any) -> Any:
    """Replace non-finite floats by None recursively, so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Any) -> Path:
    with atomic_write(path) as handle:
        json.dump(jsonable(data), handle, indent=2, allow_nan=False)
        handle.write("\n")
    return Path(path)


def write_csv(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Rows as CSV; the header is the union of keys in first-seen order."""
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with atomic_write(path) as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def fmt(value: Any, digits: int = 3, sign: bool = True) -> str:
    """A number for the console summary: fixed digits, explicit sign for correlations, "nan" when undefined."""
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:{'+' if sign else ''}.{digits}f}"
    return str(value)
