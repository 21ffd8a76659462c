"""Helpers every kvscope CLI shares: the exit-code-2 guard, atomic output files, resolved-config files."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from models.errors import UsageError

USAGE_EXIT_CODE = 2


def main_guard(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI `main` so a `UsageError` becomes one line on stderr and exit status 2."""

    def guarded(argv: list[str] | None = None) -> int:
        try:
            return main(argv) or 0
        except UsageError as err:
            print(f"{_program_name()}: error: {err}", file=sys.stderr)
            return USAGE_EXIT_CODE

    return guarded


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are `UsageError`s, so `main_guard` prints one line and exits with status 2
    (plain argparse prints the whole usage block first)."""

    def error(self, message: str):
        raise UsageError(message)


def _program_name() -> str:
    """`python -m evictor.run` -> "evictor.run" (argv[0] would only say run.py or __main__.py)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return spec.name.removesuffix(".__main__")
    return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "kvscope"


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (budgets, limits, block sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type for counts that may be 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Write `path` through a temporary file in the same directory, renamed into place only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
        # mkstemp creates owner-only files; results are meant to be shared like any other file the user writes.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_config(out_dir: str | os.PathLike, config: dict[str, Any], name: str = "config.json") -> Path:
    """Save a run's resolved configuration next to its outputs."""
    target = Path(out_dir) / name
    with atomic_write(target) as handle:
        json.dump(config, handle, indent=2, sort_keys=True, default=str)
        handle.write("\n")
    return target
