"""Saving a figure as PNG (200 dpi) and PDF, each written atomically."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.mathtext import MathTextParser

from core.cli import atomic_write, check_file_name
from core.errors import UsageError

PNG_DPI = 200
FORMATS = ("png", "pdf")


def check_stem(stem: str, out_dir: str | os.PathLike = ".") -> None:
    """Refuse a figure file stem that is no plain file name, or too long a name for the files of every format."""
    if not stem or "/" in stem or stem.startswith("."):
        raise UsageError(f"--stem {stem!r}: a figure file stem must be a plain file name")
    check_file_name("--stem", f"{stem}.{max(FORMATS, key=len)}", out_dir)


def check_title(title: str | None) -> None:
    """Refuse a --title matplotlib cannot draw: text between ``$`` signs that is not valid mathtext."""
    if title is None:
        return
    try:
        MathTextParser("path").parse(title)
    except ValueError as err:
        reason = str(err).strip().splitlines()[-1].strip()
        raise UsageError(f"--title '{title}' is not text matplotlib can draw ({reason}); escape a literal $ as "
                         "\\$") from None


def save_figure(fig: Figure, out_dir: str | os.PathLike, stem: str) -> list[Path]:
    """Write `out_dir/stem.png` and `out_dir/stem.pdf`; returns their paths.

    Each file goes through a temporary file renamed into place, so a crash never leaves a truncated figure that
    looks finished. The PDF carries no creation date, so re-rendering the same data gives the same bytes.
    """
    check_stem(stem, out_dir)
    paths = []
    for fmt in FORMATS:
        path = Path(out_dir) / f"{stem}.{fmt}"
        metadata = {"CreationDate": None} if fmt == "pdf" else None
        with atomic_write(path, "wb") as handle:
            fig.savefig(handle, format=fmt, dpi=PNG_DPI, metadata=metadata)
        os.chmod(path, 0o644)  # the temporary file is created owner-only; a figure is meant to be shared
        paths.append(path)
    return paths
