"""The command line every figure shares: `python -m figures.<name> --input TABLE --out DIR [figure flags]`.

The input is read and the figure fully drawn before the output directory is claimed (`core.rundir.RunDir`), so bad
input (unknown file, missing column, empty table) and a bad --out (a file, a path that cannot be created) exit with
status 2 and one line, and leave no files behind.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from core.cli import ArgumentParser, main_guard
from core.rundir import RunDir
from figures.save import save_figure
from figures.tables import TABLE_SUFFIXES, read_table

Draw = Callable[[pd.DataFrame, argparse.Namespace], Figure]


def figure_parser(prog: str, description: str, stem: str, columns: str | None) -> argparse.ArgumentParser:
    """--input (unless `columns` is None: a figure computed from flags alone), --out, --stem, --title."""
    parser = ArgumentParser(prog=f"python -m figures.{prog}", description=description)
    if columns is not None:
        parser.add_argument("--input", required=True,
                            help=f"input table ({', '.join(TABLE_SUFFIXES)}) with columns: {columns}")
    parser.add_argument("--out", required=True,
                        help="output directory; STEM.png (200 dpi) and STEM.pdf are written there")
    parser.add_argument("--stem", default=stem, help=f"output file name without extension (default: {stem})")
    parser.add_argument("--title", default=None, help="figure title (default: none; papers put it in the caption)")
    return parser


@contextmanager
def output_directory(out: str | os.PathLike) -> Iterator[Path]:
    """The claimed --out directory: a file or an uncreatable path is one `UsageError`, and a figure run writing
    into the same directory at the same time is refused rather than interleaved."""
    with RunDir(out, identity={}) as run:
        yield run.path


def figure_main(parser: argparse.ArgumentParser, draw: Draw) -> Callable[[list[str] | None], int]:
    """A guarded `main(argv)` that parses `parser`'s flags, reads --input, draws with `draw`, saves PNG + PDF."""

    def main(argv: list[str] | None = None) -> int:
        args = parser.parse_args(argv)
        fig = draw(read_table(args.input), args)
        with output_directory(args.out) as out:
            for path in save_figure(fig, out, args.stem):
                print(path)
        return 0

    return main_guard(main)
