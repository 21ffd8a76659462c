"""Run directories: the one place where an output directory is claimed, checked, locked and resumed.

Every stage that writes results (`tasks.run`, `evictor.run`, `labeling.occlusion`, `signals`, the probes,
`geometry.survey`, `study`) claims its ``--out`` with a `RunDir` before it does any expensive work:

1. **Path.** An existing file, or a directory that cannot be created, is a `UsageError` naming the path.
2. **Lock.** An exclusive, non-blocking ``flock`` on a lock file inside the directory: a second run on the same
   output exits at once naming the first (pid, command, start time). The operating system drops the lock when a
   run dies, however it dies, so a crashed run never blocks its own resume.
3. **Identity.** The settings that change what a record contains (the stage's *identity*) are stored in the config
   file; a rerun with different settings is refused naming each differing setting with both values, so records
   made differently never mix. The same settings resume: `store` reopens the JSONL files and skips finished work.
   Paths compare in their portable spelling (`core.paths`), so a committed run, its paths spelled that way, resumes
   in any checkout.

Nothing in the directory is written before the run has read what it resumes: `save_config` holds the configuration
in memory until the run stores its first record (written just before it, so no record is ever without its
configuration) or ends without an error. A run refused or failed before then (bad input discovered after the claim:
an unloadable model, a request that does not fit, a damaged file to resume) leaves every file as it found it, at
whatever moment it is stopped. Resuming refuses, before anything is written, a result file that is not the run's (a
line that is not a record, a record without its key, a key twice: `core.records.JsonlStore`). On exit the lock is
released, and a directory this run created and left empty is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from core.cli import write_json
from core.errors import UsageError
from core.paths import portable, roots
from core.records import JsonlStore

LOCK_NAME = ".kvscope.lock"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def identity_differences(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``["max_new_tokens 256 (now 512)", ...]`` for every setting of `current` whose stored value differs. Paths
    compare in their portable spelling (`core.paths`): a run whose config spells its paths that way (a committed
    run) resumes in any checkout."""
    spellings = roots()
    return [f"{key} {_canonical(previous.get(key))} (now {_canonical(value)})"
            for key, value in current.items()
            if _canonical(portable(previous.get(key), spellings)) != _canonical(portable(value, spellings))]


def check_identity(config_path: Path, identity: Mapping[str, Any], what: str) -> None:
    """Refuse `config_path`'s run when its stored identity differs from `identity` (nothing stored: accept)."""
    if not config_path.exists():
        return
    try:
        stored = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise UsageError(f"{config_path} is not valid JSON; use another --out") from None
    except OSError as err:
        raise UsageError(f"{config_path} cannot be read ({err.strerror or err}); use another --out") from None
    previous = stored.get("identity", stored) if isinstance(stored, dict) else None
    if not isinstance(previous, dict):
        raise UsageError(f"{config_path} is not a kvscope run configuration; use another --out")
    differences = identity_differences(previous, identity)
    if differences:
        raise UsageError(f"{what} holds a run made with other settings: {'; '.join(differences)}; rerun with the "
                         "same settings to resume, or use another --out")


class RunDir:
    """An output directory claimed by one run. Use as a context manager::

        with RunDir(out, identity) as run:
            lm = load_model(...)
            run.save_config(loaded_model=lm.describe())
            store = run.store("generations.jsonl", key="id")

    `config_name` and `lock_name` let several independent runs share one directory (shards of one labelling job,
    several signal files); each then has its own config, lock and identity.
    """

    def __init__(self, path: str | os.PathLike, identity: Mapping[str, Any], *, config_name: str = "config.json",
                 lock_name: str = LOCK_NAME, flag: str = "--out"):
        self._given = str(path)
        self.path = Path(path)
        self.identity = dict(identity)
        self.config_path = self.path / config_name
        self.lock_path = self.path / lock_name
        self.flag = flag
        self._fd: int | None = None
        self._created: list[Path] = []
        self._writes = _Writes()  # shared with the cells of a sweep (`child`)

    # --- claim and release ------------------------------------------------------------------------------------------
    def __enter__(self) -> RunDir:
        self.claim()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self._writes.flush()
        self.release()

    def claim(self) -> RunDir:
        where = f"{self.flag} {str(self.path)!r}"
        if not self._given.strip() or "\0" in self._given:
            raise UsageError(f"{self.flag} {self._given!r} is not a directory path")
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"{where} is a file, not a directory; give a directory path")
        self._make_directory(where)
        try:
            self._lock(where)
            check_identity(self.config_path, self.identity, where)
        except BaseException:
            self.release()
            raise
        return self

    def _make_directory(self, where: str) -> None:
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"{where}: cannot create it ({err.strerror or err})") from None
        self._created = missing

    def _lock(self, where: str) -> None:
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise UsageError(f"{where}: cannot write there ({err.strerror or err})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise UsageError(f"{where} is in use by another run ({holder}); wait for it to finish or use "
                                 "another --out") from None
            # The previous holder may have unlinked the file between our open and our flock: lock the live file.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        ours = {"pid": os.getpid(), "command": shlex.join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(ours).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        for directory in self._created:  # innermost first; only directories this run made and left empty
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._created = []

    # --- contents ---------------------------------------------------------------------------------------------------
    def save_config(self, **extra: Any) -> None:
        """The resolved configuration: the identity plus whatever else describes the run. It is written when the run
        stores its first record or ends without an error, whichever comes first (`_Writes`), at once after that."""
        self._writes.config(self.config_path, {"identity": self.identity, **extra})

    def store(self, name: str, key: str | Callable[[dict[str, Any]], Hashable] = "id") -> JsonlStore:
        """A resumable JSONL file in this directory, its records keyed by field `key` (or a key function); a file
        that is not this store's is refused before anything is written."""
        key_of = functools.partial(_field_key, key) if isinstance(key, str) else key
        return JsonlStore(self.path / name, key=key_of, before_append=self._writes.flush)

    def child(self, name: str, identity: Mapping[str, Any]) -> RunDir:
        """A subdirectory with its own identity (a cell of a sweep), covered by this directory's lock."""
        sub = RunDir(self.path / name, identity, flag=f"{self.flag} cell")
        check_identity(sub.config_path, sub.identity, f"{self.flag} {str(sub.path)!r}")
        sub._writes = self._writes
        return sub


class _Writes:
    """The configurations a run has saved (its own and its cells', shared with `RunDir.child`) but not yet written:
    held until the run stores its first record, so that a run refused or failed before then has changed nothing,
    and written from then on as they are saved."""

    def __init__(self) -> None:
        self.pending: dict[Path, dict[str, Any]] = {}
        self.started = False

    def config(self, path: Path, config: dict[str, Any]) -> None:
        self.pending[path] = config
        if self.started:
            self.flush()

    def flush(self) -> None:
        """Write every held configuration (the run is storing a record, or has ended without an error)."""
        self.started = True
        while self.pending:
            path, config = self.pending.popitem()
            write_json(path, config)


def _field_key(name: str, record: dict[str, Any]) -> str:
    """A record's key field as a string; a key that is not a string or an integer is no record of a run."""
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"its {name} is {json.dumps(value, default=str)[:40]}, not a string or an integer")
    return str(value)


def lock_holder(lock_path: Path) -> str | None:
    """Who holds the lock file `lock_path` (`_read_holder`'s words), or None when no live run holds it."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        holder = {}
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')}, started {holder.get('started')}: {holder.get('command')}"


def source_revision() -> dict[str, Any] | None:
    """The kvscope source a run used: ``{"commit": sha, "dirty": bool}`` (dirty: tracked files differ from the
    commit), or None outside a git checkout or without git. Recorded so a committed result names what made it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}
