"""Append-only JSONL result files that survive a crash and resume without duplicates.

Every long kvscope job (generation, eviction sweeps, occlusion labels) writes one JSON record per finished unit
of work. A job killed mid-write leaves at most one torn final line; `JsonlStore` drops it on open, so rerunning
the same command skips the finished units and appends the rest.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

from core.errors import UsageError


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield the records of a JSONL file; a malformed line is a `UsageError` naming its line number."""
    path = Path(path)
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise UsageError(f"{path}: line {number} is not a JSON object")
            yield record


class JsonlStore:
    """A resumable JSONL file keyed by `key(record)`.

    Opening repairs a torn last line left by a crash (the only line that can be incomplete, because each record is
    written with a single flushed write). A malformed line anywhere else is corruption, reported, never skipped.
    """

    def __init__(self, path: str | os.PathLike, key: Callable[[dict[str, Any]], Hashable]):
        self.path = Path(path)
        self.key = key
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            self._load_and_repair()
        self.done = {self.key(r) for r in self.records}

    def _load_and_repair(self) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        complete, tail = lines[:-1], lines[-1]
        good_bytes = len(raw) - len(tail)
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(complete) and not tail:
                    good_bytes -= len(line) + 1
                    break
                raise UsageError(f"{self.path}: line {number} is not valid JSON; refusing to resume") from None
        if good_bytes != len(raw):
            with self.path.open("r+b") as handle:
                handle.truncate(good_bytes)
            print(f"{self.path}: dropped a torn last line ({len(raw) - good_bytes} bytes) left by an interrupted "
                  "run; that record will be made again", file=sys.stderr)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.done

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=_to_builtin) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self.records.append(json.loads(line))
        self.done.add(self.key(record))


def _to_builtin(value: Any) -> Any:
    """JSON fallback for numpy / torch scalars and arrays."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot serialise {type(value).__name__}")
