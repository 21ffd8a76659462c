"""Saving a figure as PNG (200 dpi) and PDF, each written atomically."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure

from core.cli import atomic_write
from core.errors import UsageError

PNG_DPI = 200
FORMATS = ("png", "pdf")


def save_figure(fig: Figure, out_dir: str | os.PathLike, stem: str) -> list[Path]:
    """Write `out_dir/stem.png` and `out_dir/stem.pdf`; returns their paths.

    Each file goes through a temporary file renamed into place, so a crash never leaves a truncated figure that
    looks finished. The PDF carries no creation date, so re-rendering the same data gives the same bytes.
    """
    if not stem or "/" in stem or stem.startswith("."):
        raise UsageError(f"figure file stem {stem!r} must be a plain file name")
    paths = []
    for fmt in FORMATS:
        path = Path(out_dir) / f"{stem}.{fmt}"
        metadata = {"CreationDate": None} if fmt == "pdf" else None
        with atomic_write(path, "wb") as handle:
            fig.savefig(handle, format=fmt, dpi=PNG_DPI, metadata=metadata)
        os.chmod(path, 0o644)  # the temporary file is created owner-only; a figure is meant to be shared
        paths.append(path)
    return paths
