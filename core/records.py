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
    """Yield the records of a JSONL file; a file that cannot be read, a line that is not UTF-8 text (a binary file)
    and a line that is not one JSON object are `UsageError`s naming the file and the line."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as err:
        raise UsageError(f"{path}: cannot read it ({err.strerror or err})") from None
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield parse_line(line, path, number)
        except OSError as err:  # a directory opens, then fails to read
            raise UsageError(f"{path}: cannot read it ({err.strerror or err})") from None


def parse_line(line: bytes, path: Path, number: int) -> dict[str, Any]:
    """One JSONL line as a JSON object; anything else is a `UsageError` naming the file and the line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: line {number} is not UTF-8 text; is it a binary file, not JSONL?") from None
    if "\x00" in text:
        raise UsageError(f"{path}: line {number} holds NUL bytes; is it a binary file, not JSONL?")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
    except RecursionError:
        raise UsageError(f"{path}: line {number} nests JSON too deeply to read") from None
    if not isinstance(record, dict):
        raise UsageError(f"{path}: line {number} is a JSON {type(record).__name__}, not an object (one record per "
                         "line)")
    return record


def read_resumable(path: Path, key: Callable[[dict[str, Any]], Hashable]
                   ) -> tuple[list[dict[str, Any]], int, int]:
    """The finished records of a file to resume, the bytes they take (a torn last line, what a crash leaves, is not
    counted) and the file's size. A file that is not a store keyed by `key` (a line that is not a JSON object, a
    record without its key, a key twice) is a `UsageError` naming the file and the line; nothing is changed."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UsageError(f"{path}: cannot read it to resume ({err.strerror or err})") from None
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    good_bytes = len(raw) - len(tail)
    resume = "; refusing to resume: move the file away or use another --out"
    records: list[dict[str, Any]] = []
    done: set[Hashable] = set()
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = parse_line(line, path, number)
        except UsageError as err:
            if number == len(complete) and not tail and line.lstrip().startswith(b"{"):
                good_bytes -= len(line) + 1  # a record cut short by a crash: the newline came first
                break
            raise UsageError(f"{err}{resume}") from None
        try:
            found = key(record)
        except (KeyError, TypeError, ValueError) as err:
            detail = f"no {err}" if isinstance(err, KeyError) else str(err)
            raise UsageError(f"{path}: line {number} is not a record of this run ({detail}){resume}") from None
        if found in done:
            raise UsageError(f"{path}: line {number} repeats the record {found!r}{resume}")
        records.append(record)
        done.add(found)
    return records, good_bytes, len(raw)


class JsonlStore:
    """A resumable JSONL file keyed by `key(record)`.

    Opening repairs a torn last line left by a crash (the only line that can be incomplete, because each record is
    written with a single flushed write). A malformed line anywhere else is corruption, reported, never skipped.
    """

    def __init__(self, path: str | os.PathLike, key: Callable[[dict[str, Any]], Hashable],
                 before_append: Callable[[], None] | None = None):
        self.path = Path(path)
        self.key = key
        # called before each record is written (`core.rundir` writes the run's configuration before its first record)
        self.before_append = before_append
        self.records: list[dict[str, Any]] = []
        self.done: set[Hashable] = set()
        if self.path.exists():
            self._load_and_repair()

    def _load_and_repair(self) -> None:
        """Read the finished records, refusing (before anything is changed) a file that is not this store's
        (`read_resumable`); only then is a torn last line dropped."""
        self.records, good_bytes, size = read_resumable(self.path, self.key)
        self.done = {self.key(record) for record in self.records}
        if good_bytes != size:
            with self.path.open("r+b") as handle:
                handle.truncate(good_bytes)
            print(f"{self.path}: dropped a torn last line ({size - good_bytes} bytes) left by an interrupted "
                  "run; that record will be made again", file=sys.stderr)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.done

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=_to_builtin) + "\n"
        if self.before_append is not None:
            self.before_append()
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
