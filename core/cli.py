"""The command-line contract every kvscope CLI shares: one-line errors with exit status 2, argument types, atomic
output files.

A CLI's ``main`` is ``main_guard(_run)``: a `UsageError` raised anywhere in ``_run`` (bad flag, bad file, unknown
name, an output directory in use) becomes one line ``<module>: error: <message>`` on stderr and exit status 2, with
no traceback and, because every stage checks its input before it writes (`core.rundir`), no partial output.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from core.errors import UsageError

USAGE_EXIT_CODE = 2
DTYPES = ("float32", "bfloat16", "float16")


class Main(Protocol):
    """A CLI entry point: ``main()`` reads ``sys.argv``, ``main([...])`` the given arguments; returns the exit
    status."""

    def __call__(self, argv: list[str] | None = None) -> int: ...


def main_guard(main: Callable[[list[str] | None], int | None]) -> Main:
    """Wrap a CLI `main` so a `UsageError`, or a path with a name too long for the file system, becomes one line on
    stderr and exit status 2."""

    def guarded(argv: list[str] | None = None) -> int:
        try:
            return main(argv) or 0
        except UsageError as err:
            print(f"{program_name()}: error: {err}", file=sys.stderr)
            return USAGE_EXIT_CODE
        except OSError as err:
            # kvscope names no file longer than the file system takes, so such a name came from the command line;
            # it fails wherever the path is first touched (even `Path.exists` raises), before anything is written
            if err.errno != errno.ENAMETOOLONG:
                raise
            print(f"{program_name()}: error: {err.filename!r}: a name in this path is longer than the file system "
                  "takes; give a shorter path", file=sys.stderr)
            return USAGE_EXIT_CODE

    return guarded


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are `UsageError`s, so `main_guard` prints one line and exits with status 2
    (plain argparse prints the whole usage block first)."""

    def error(self, message: str):
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, refusing what no kvscope flag means anything by: an empty text value (a path, a name, a list;
        leave the flag out for its default) and a NaN or infinite ``type=float`` value."""
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(namespace, action.dest, None)
            name = "/".join(action.option_strings) or action.dest
            many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
            if many and isinstance(value, list) and value is not action.default:
                distinct(name, " ".join(map(str, value)), value)
            if value is action.default or action.type not in (None, float):
                continue
            for item in value if isinstance(value, list) else [value]:
                if action.type is None and isinstance(item, str) and not item.strip():
                    raise UsageError(f"argument {name}: the value is empty; give one, or leave the flag out for its "
                                     "default")
                if action.type is float and isinstance(item, float) and not math.isfinite(item):
                    raise UsageError(f"argument {name}: must be a finite number, got {item}")
        return namespace, extras


def distinct(flag: str, text: str, items: Sequence[Any]) -> None:
    """Refuse a list flag (`text` as given) naming an item twice: a repeated budget, layer, policy or file would be
    run, or counted, twice, or silently merged, and is always a slip."""
    seen: set[Any] = set()
    for item in items:
        if item in seen:
            raise UsageError(f"{flag} {text!r} gives {item} twice; give each once")
        seen.add(item)


def program_name() -> str:
    """`python -m evictor.run` -> "evictor.run" (argv[0] would only say run.py or __main__.py)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return spec.name.removesuffix(".__main__")
    return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "kvscope"


def _number(text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    if kind is int and abs(value) >= 2**63:  # beyond what torch, numpy and every count kvscope keeps can hold
        raise argparse.ArgumentTypeError(f"{text} is too large; integers must be below 2**63")
    return value


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (budgets, limits, block sizes)."""
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type for counts that may be 0."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seed_int(text: str) -> int:
    """argparse type for ``--seed``: an integer in [0, 2**63), the range every generator kvscope seeds accepts."""
    value = _number(text, int)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text}")
    return value


def thread_count(text: str) -> int:
    """argparse type for ``--threads``: a positive integer no larger than the CPU cores this process may use."""
    from core.limits import cpu_count

    value = positive_int(text)
    if value > cpu_count():
        raise argparse.ArgumentTypeError(f"{value} threads, but this machine has {cpu_count()} CPU cores")
    return value


def memory_size(text: str) -> int:
    """argparse type for ``--max-memory``: an amount of memory with its unit (``16GiB``, ``512MB``), in bytes."""
    from core.limits import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def non_negative_float(text: str) -> float:
    """argparse type for temperatures and other finite quantities >= 0."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def unit_interval(text: str) -> float:
    """argparse type for a probability or fraction in (0, 1] (top-p, confidence levels)."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def open_unit_interval(text: str) -> float:
    """argparse type for a significance or confidence level: a probability strictly between 0 and 1."""
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def device(text: str) -> str:
    """argparse type for ``--device``: a torch device that exists where the command runs (cpu, cuda, cuda:N, mps)."""
    import torch

    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        choices = ", ".join(available_devices())
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; valid choices: {choices}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here; valid choices: "
                                             f"{', '.join(available_devices())}")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) exist here")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available here; valid choices: "
                                         f"{', '.join(available_devices())}")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text!r}: kvscope runs on {', '.join(available_devices())}")
    return text


def available_devices() -> list[str]:
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def add_device_arguments(parser: argparse.ArgumentParser, *, dtype_default: str | None = None) -> None:
    """``--device``, ``--dtype`` and ``--max-memory``, validated the same way by every CLI that loads a model; the
    CLI checks its request's estimated peak against the memory limit (`core.limits.MemoryLimit`) before it starts."""
    parser.add_argument("--device", type=device, default=None,
                        help="torch device: cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)")
    default_text = dtype_default or "bfloat16 on CUDA, float32 on CPU"
    parser.add_argument("--dtype", default=dtype_default, choices=DTYPES,
                        help=f"weights dtype (default: {default_text})")
    parser.add_argument("--max-memory", type=memory_size, default=None,
                        help="the memory this run may use, with its unit (e.g. 8GiB): a request whose estimated "
                        "peak exceeds it is refused before it starts (default: all of the device's memory; "
                        "docs/limits.md)")


def check_output_file(path: Path, flag: str = "--out") -> None:
    """Refuse an output file path that cannot become a file (a name too long, a directory, a path below a file, a
    place no file can be created), before any work starts."""
    check_file_name(flag, path.name, path.parent)
    if path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a directory; give a file name")
    parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    try:  # a real write, removed at once: permission bits do not bind root, and /proc or a read-only mount refuse
        if not parent.is_dir():
            raise NotADirectoryError(str(parent))
        tempfile.TemporaryFile(dir=parent).close()
    except OSError:
        raise UsageError(f"{flag} {str(path)!r}: cannot create files under {str(parent)!r}") from None


# `atomic_write` writes through ``.<name>.<8 random characters>.tmp`` beside the file.
_TEMPORARY_EXTRA = len("...tmp") + 8


def check_file_name(flag: str, name: str, directory: str | os.PathLike = ".") -> None:
    """Refuse a file name the file system under `directory` cannot hold, with `atomic_write`'s temporary name beside
    it, before anything is written: longer than its limit on a name (255 bytes on most)."""
    existing = next((p for p in (Path(directory), *Path(directory).parents) if p.is_dir()), Path("."))
    limit = os.pathconf(existing, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    if len(os.fsencode(name)) + _TEMPORARY_EXTRA > limit:
        raise UsageError(f"{flag} {name!r} is too long a file name: {len(os.fsencode(name))} bytes, where this file "
                         f"system takes {limit - _TEMPORARY_EXTRA} at most")


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


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """`data` as indented JSON, written atomically."""
    with atomic_write(path) as handle:
        json.dump(data, handle, indent=2, sort_keys=True, default=str)
        handle.write("\n")
    return Path(path)


def save_config(out_dir: str | os.PathLike, config: dict[str, Any], name: str = "config.json") -> Path:
    """Save a resolved configuration next to a run's outputs (stages with a `core.rundir.RunDir` use its method)."""
    return write_json(Path(out_dir) / name, config)
