"""Commit a run's directory to results/ and bring it back, so that a long run can go in resumable pieces.

    python -m core.pack --source runs/study/stages/evictor-ff8863d50098 --out results/study/stages/evictor-ff8863d50098
    python -m core.pack --restore --source results/study/stages --out runs/study/stages

Committing copies every file of the run directory but hidden ones (the run's lock, an unfinished atomic write),
spells each absolute path in its text files portably (`core.paths`: relative to the checkout, ``$KVSCOPE_DATA_DIR``,
``~``; the only bytes changed) and gzips the raw per-problem and per-token records (``generations.jsonl``,
``replay.jsonl``, ``signals-*.jsonl``) deterministically (no name, no time stamp); a file --out already holds with
the same content (gzipped by any tool) is left as it is, so committing again changes only what changed. A run still
running in the source (a held lock) is refused: its last record may be half written. Restoring copies a committed
folder back and unpacks what was gzipped. Nothing needs editing after it: stage keys and run identities compare
paths in the portable spelling, so the study or tool resumes there.

An existing --out is brought up to date: files are replaced, a file's other form (``x.jsonl`` beside a new
``x.jsonl.gz``) is removed, and files the source does not have are kept.
"""

from __future__ import annotations

import fnmatch
import gzip
import zlib
from pathlib import Path

from core.cli import ArgumentParser, atomic_write, main_guard
from core.errors import UsageError
from core.paths import portable_path, roots
from core.rundir import lock_holder

GZIPPED = ("generations.jsonl", "replay.jsonl", "signals-*.jsonl")  # raw records: large, read by the tools only
TEXT_SUFFIXES = (".json", ".jsonl", ".csv", ".md", ".txt")


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _files(source: Path) -> list[Path]:
    """The files below `source` (relative to it) but hidden ones."""
    return sorted(relative for path in source.rglob("*") if path.is_file()
                  and not _hidden(relative := path.relative_to(source)))


def _replace(target: Path, other_form: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(target, "wb") as handle:
        handle.write(data)
    other_form.unlink(missing_ok=True)


def _holds(target: Path, data: bytes, packed: bool) -> bool:
    """Whether `target` already holds `data` (unpacked first when `packed`): a file gzipped by another tool, or by an
    earlier commit, with the same content is left as it is, so an unchanged record makes no change to commit."""
    if not target.is_file():
        return False
    held = target.read_bytes()
    try:
        return (gzip.decompress(held) if packed else held) == data
    except (gzip.BadGzipFile, EOFError):
        return False


def commit(source: Path, out: Path, gzipped: tuple[str, ...] = GZIPPED) -> tuple[int, int, int]:
    """Copy run directory `source` to `out` as the module docstring says; (files written, of them gzipped, files
    left as they were because they already held the same content)."""
    spellings = roots()
    written = packed = unchanged = 0
    for relative in _files(source):
        data = (source / relative).read_bytes()
        if relative.suffix in TEXT_SUFFIXES:
            text = data.decode(errors="surrogateescape")
            data = portable_path(text, spellings).encode(errors="surrogateescape")
        target = out / relative
        other = target.with_name(target.name + ".gz")
        pack = any(fnmatch.fnmatch(relative.name, pattern) for pattern in gzipped)
        if pack:
            target, other = other, target
        if _holds(target, data, pack):
            other.unlink(missing_ok=True)
            unchanged += 1
            continue
        _replace(target, other, gzip.compress(data, mtime=0) if pack else data)  # no name, no time: same bytes
        written += 1
        packed += pack
    return written, packed, unchanged


def restore(source: Path, out: Path) -> tuple[int, int]:
    """Copy committed folder `source` to `out`, unpacking each ``.gz``; (files written, of them unpacked). Every
    ``.gz`` is read through before the first file is written, so a damaged one (not gzip, cut short) leaves --out
    as it was."""
    files = _files(source)
    for relative in files:
        if relative.suffix == ".gz":
            _unpack(source / relative, check_only=True)
    written = unpacked = 0
    for relative in files:
        data, target = (source / relative).read_bytes(), out / relative
        if relative.suffix == ".gz":
            data, target = _unpack(source / relative), target.with_suffix("")
            unpacked += 1
        _replace(target, target.with_name(target.name + ".gz"), data)
        written += 1
    return written, unpacked


def _unpack(path: Path, check_only: bool = False) -> bytes:
    """The content of gzip file `path` (read in pieces and dropped with `check_only`, to check a large file whole
    without holding it); a file that is not gzip or is cut short is a `UsageError` naming it."""
    pieces = []
    try:
        with gzip.open(path, "rb") as handle:
            while piece := handle.read(2**24):
                if not check_only:
                    pieces.append(piece)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise UsageError(f"--source {str(path)!r} is not a whole gzip file ({err})") from None
    return b"".join(pieces)


def check_directories(source: Path, out: Path, restoring: bool) -> None:
    """Refuse, before anything is written: a source that is no directory or holds a running run, an --out that is
    a file or overlaps the source."""
    if not source.is_dir():
        raise UsageError(f"--source {str(source)!r} is not a directory; give a run directory"
                         + (" (a committed folder with --restore)" if restoring else ""))
    for lock in (path for path in source.rglob(".*lock*") if path.is_file()):
        if (holder := lock_holder(lock)) is not None:
            raise UsageError(f"--source {str(source)!r} is in use by a running run ({holder}); stop it first")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; give a directory")
    if any(parent.exists() and not parent.is_dir() for parent in out.parents):
        raise UsageError(f"--out {str(out)!r} lies below a file; give a directory")
    src, dst = source.resolve(), out.resolve()
    if dst == src or dst.is_relative_to(src) or src.is_relative_to(dst):
        raise UsageError(f"--out {str(out)!r} overlaps --source {str(source)!r}; give separate folders")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m core.pack",
        description="Commit a run directory (a stage of a study, a tasks.run output, ...) to results/: hidden files "
        "left out, absolute paths spelled relative to the checkout, $KVSCOPE_DATA_DIR or ~, raw records gzipped "
        "deterministically. With --restore, copy a committed folder back and unpack it, ready to resume.",
    )
    parser.add_argument("--source", required=True,
                        help="the directory to copy: a run directory, or with --restore a committed folder")
    parser.add_argument("--out", required=True,
                        help="where to copy it (created; an existing one is brought up to date, files it has that "
                        "the source lacks kept)")
    parser.add_argument("--restore", action="store_true",
                        help="copy a committed folder back to a run directory, unpacking every .gz")
    parser.add_argument("--gzip", action="append", default=None, metavar="PATTERN",
                        help="a file name to gzip when committing (a shell pattern matched against names, "
                        f"repeatable; default: {', '.join(GZIPPED)})")
    return parser


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.restore and args.gzip:
        raise UsageError("--gzip only applies when committing; leave it out with --restore")
    bad = next((pattern for pattern in args.gzip or () if "/" in pattern), None)
    if bad is not None:
        raise UsageError(f"--gzip {bad!r} holds a '/': patterns match file names, not paths")
    source, out = Path(args.source), Path(args.out)
    check_directories(source, out, args.restore)
    try:
        if args.restore:
            written, unpacked = restore(source, out)
            print(f"restored {written} files ({unpacked} unpacked) from {source} to {out}")
        else:
            written, packed, unchanged = commit(source, out, tuple(args.gzip or GZIPPED))
            print(f"committed {written} files ({packed} gzipped) from {source} to {out}, paths spelled portably; "
                  f"{unchanged} already there unchanged")
    except OSError as err:
        raise UsageError(f"--out {str(out)!r}: cannot write there ({err.strerror or err})") from None
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
