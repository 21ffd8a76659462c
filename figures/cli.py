"""The command line every figure shares: `python -m figures.<name> --input TABLE --out DIR [figure flags]`.

The input is read and the figure fully drawn before the output directory is created, so bad input (unknown file,
missing column, empty table) exits with status 2 and leaves no files behind.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pandas as pd
from matplotlib.figure import Figure

from figures.save import save_figure
from figures.tables import TABLE_SUFFIXES, read_table
from core.cli import main_guard

Draw = Callable[[pd.DataFrame, argparse.Namespace], Figure]


def figure_parser(prog: str, description: str, stem: str, columns: str | None) -> argparse.ArgumentParser:
    """--input (unless `columns` is None: a figure computed from flags alone), --out, --stem, --title."""
    parser = argparse.ArgumentParser(prog=f"python -m figures.{prog}", description=description)
    if columns is not None:
        parser.add_argument("--input", required=True,
                            help=f"input table ({', '.join(TABLE_SUFFIXES)}) with columns: {columns}")
    parser.add_argument("--out", required=True,
                        help="output directory; STEM.png (200 dpi) and STEM.pdf are written there")
    parser.add_argument("--stem", default=stem, help=f"output file name without extension (default: {stem})")
    parser.add_argument("--title", default=None, help="figure title (default: none; papers put it in the caption)")
    return parser


def figure_main(parser: argparse.ArgumentParser, draw: Draw) -> Callable[[list[str] | None], int]:
    """A guarded `main(argv)` that parses `parser`'s flags, reads --input, draws with `draw`, saves PNG + PDF."""

    def main(argv: list[str] | None = None) -> int:
        args = parser.parse_args(argv)
        fig = draw(read_table(args.input), args)
        for path in save_figure(fig, args.out, args.stem):
            print(path)
        return 0

    return main_guard(main)
