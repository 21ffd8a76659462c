"""The command line every figure shares: `python -m figures.<name> --input TABLE --out DIR [figure flags]`.

The input is read and checked against the columns the figure declares (`read_input`), and the figure fully drawn,
before the output directory is claimed (`core.rundir.RunDir`), so bad input (unknown file, a file that is no table,
missing column, empty table) and a bad --out (a file, a path that cannot be created) exit with status 2 and one line,
and leave no files behind.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from core.cli import ArgumentParser, Main, main_guard
from core.errors import UsageError
from core.rundir import RunDir
from figures.save import check_stem, check_title, save_figure
from figures.tables import TABLE_SUFFIXES, read_table

Draw = Callable[[pd.DataFrame, argparse.Namespace], Figure]
# The column sets a figure can draw from (any one complete set will do), or a function of its parsed flags giving
# them, for a figure whose flags name its columns.
Columns = Sequence[Sequence[str]] | Callable[[argparse.Namespace], Sequence[Sequence[str]]]


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


def check_figure_flags(args: argparse.Namespace) -> None:
    """Refuse, before anything is drawn, a --stem no file can be named after and a --title matplotlib cannot draw
    (`figure_parser`'s flags)."""
    check_stem(args.stem, args.out)
    check_title(args.title)


def read_input(path: str | os.PathLike, needs: Sequence[Sequence[str]]) -> pd.DataFrame:
    """The --input table; one `UsageError` line naming the file when it is no table (`read_table`), holds none of the
    column sets `needs` complete, or has no rows.

    The plot functions check their columns too, but only the CLI knows the file, and a user with several tables
    needs to be told which one is wrong. A table lacking columns is told those of the set it comes closest to.
    """
    table = read_table(path)
    have = [str(column) for column in table.columns]
    closest = min(needs, key=lambda columns: sum(column not in have for column in columns))
    missing = [column for column in closest if column not in have]
    if missing:
        wanted = "; or ".join(", ".join(columns) for columns in needs)
        raise UsageError(f"input table {str(path)!r} lacks column(s) {', '.join(missing)}; the figure needs {wanted} "
                         f"(has: {', '.join(have) or 'none'})")
    if table.empty:
        raise UsageError(f"input table {str(path)!r} has no rows")
    return table


@contextmanager
def output_directory(out: str | os.PathLike) -> Iterator[Path]:
    """The claimed --out directory: a file or an uncreatable path is one `UsageError`, a figure run writing into the
    same directory at the same time is refused rather than interleaved, and so is the directory of another kvscope
    run (one holding a run configuration): figures share a directory with figures only, never with results."""
    configs = sorted(path.name for path in Path(out).glob("*config.json")) if Path(out).is_dir() else []
    if configs:
        raise UsageError(f"--out {str(out)!r} holds another run's results ({configs[0]}); give figures a directory "
                         "of their own")
    with RunDir(out, identity={}) as run:
        yield run.path


def figure_main(parser: argparse.ArgumentParser, draw: Draw, columns: Columns) -> Main:
    """A guarded `main(argv)` that parses `parser`'s flags, reads --input holding one of the sets of `columns`
    (`read_input`), draws with `draw`, saves PNG + PDF."""

    def main(argv: list[str] | None = None) -> int:
        args = parser.parse_args(argv)
        check_figure_flags(args)
        needs = columns(args) if callable(columns) else columns
        fig = draw(read_input(args.input, needs), args)
        with output_directory(args.out) as out:
            for path in save_figure(fig, out, args.stem):
                print(path)
        return 0

    return main_guard(main)
