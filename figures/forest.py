"""A forest plot: one row per item, its estimate with its interval, against a reference line (zero by default).

    python -m figures.forest --input ranking.csv --label signal --value within_rho --low within_lo \\
        --high within_hi --group policy --out figs --stem scorer_ranking
    python -m figures.forest --input compare.csv --label config --value difference --low ci_lo --high ci_hi \\
        --out figs --stem difference_vs_random

Draws the scorers `validation.select` ranks (within-trace rho with its Fisher-z interval) and the paired differences
`validation.compare` measures (accuracy difference with its bootstrap interval); an interval that excludes the
reference is drawn filled, one that spans it hollow, so what is significant reads at a glance.
"""

from __future__ import annotations

import argparse

import numpy as np

from core.errors import UsageError
from figures.cli import figure_main, figure_parser
from figures.style import REFERENCE_GREY, figure_style, new_figure, series_style
from figures.tables import checked, in_order, require_ci

FIGURE = "forest"
ROW_INCHES = 0.28


def columns(label: str, value: str, low: str | None, high: str | None, group: str | None) -> tuple[str, ...]:
    """The columns named by `plot_forest`'s arguments, in its order (label, value, low, high[, group]); the bounds
    default to ``<value>_lo`` / ``<value>_hi``."""
    return (label, value, low or f"{value}_lo", high or f"{value}_hi") + ((group,) if group else ())


def plot_forest(data, *, label: str = "label", value: str = "estimate", low: str | None = None,
                high: str | None = None, group: str | None = None, reference: float = 0.0,
                xlabel: str | None = None, title: str | None = None):
    """One horizontal interval per row, top to bottom in table order.

    Input columns (one row per item):
        `label`  str    the row's name (unique)
        `value`  float  the estimate; rows with NaN are not drawn
        `low`, `high`  float  its interval (default ``<value>_lo`` / ``<value>_hi``; NaN: the point alone)
        `group`  str    optional: colours and legend (e.g. the policy a scorer deploys); empty values read "-"
    A row whose interval lies wholly on one side of `reference` has a filled marker, otherwise a hollow one.
    Returns a Figure with one Axes.
    """
    required = columns(label, value, low, high, group)
    low, high = required[2:4]
    df = checked(data, FIGURE, required=required, numeric=(value, low, high), finite=(value,))
    df[label] = df[label].astype(str)
    if df[label].duplicated().any():
        raise UsageError(f"{FIGURE}: label {df[label][df[label].duplicated()].iloc[0]!r} appears twice; labels must "
                         "be unique")
    require_ci(df, value, FIGURE, low=low, high=high)
    groups = df[group].fillna("-").astype(str) if group else None
    names = in_order(groups) if groups is not None else [None]
    y = np.arange(len(df))[::-1]
    with figure_style():
        fig, ax = new_figure(size=(6.4, max(2.0, 1.2 + ROW_INCHES * len(df))))
        ax.axvline(reference, color=REFERENCE_GREY, linewidth=1.0, zorder=1)
        for index, name in enumerate(names):
            rows = df.index if name is None else df.index[groups == name]
            style = series_style(index)
            estimate, lo, hi = (df.loc[rows, c].to_numpy(float) for c in (value, low, high))
            error = np.vstack([estimate - lo, hi - estimate])
            ax.errorbar(estimate, y[rows], xerr=np.where(np.isfinite(error), error, 0.0), linestyle="none",
                        color=style["color"], capsize=2, zorder=2, label=name)
            excludes = (lo > reference) | (hi < reference)
            for mask, face in ((excludes, style["color"]), (~excludes, "white")):
                ax.plot(estimate[mask], y[rows][mask], linestyle="none", marker=style["marker"],
                        color=style["color"], markerfacecolor=face, zorder=3)
        ax.set_yticks(y, df[label].tolist())
        ax.set_ylim(-0.7, len(df) - 0.3)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel(xlabel or value)
        if title:
            ax.set_title(title)
        if group:
            fig.legend(loc="outside lower center", ncols=min(4, len(names)), title=group)
    return fig


def _draw(table, args: argparse.Namespace):
    return plot_forest(table, label=args.label, value=args.value, low=args.low, high=args.high, group=args.group,
                       reference=args.reference, xlabel=args.xlabel, title=args.title)


def _columns(args: argparse.Namespace) -> list[tuple[str, ...]]:
    return [columns(args.label, args.value, args.low, args.high, args.group)]


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Forest plot: each row's estimate with its interval against a reference line; "
                           "filled markers where the interval excludes it.", FIGURE,
                           "LABEL, VALUE, LOW, HIGH[, GROUP] (names set by the flags below)")
    parser.add_argument("--label", default="label", help="column naming each row (default: label)")
    parser.add_argument("--value", default="estimate", help="column of the estimates (default: estimate)")
    parser.add_argument("--low", default=None, help="column of the interval's lower bound (default: VALUE_lo)")
    parser.add_argument("--high", default=None, help="column of the interval's upper bound (default: VALUE_hi)")
    parser.add_argument("--group", default=None, help="optional column colouring the rows (with a legend)")
    parser.add_argument("--reference", type=float, default=0.0, help="where the reference line is (default 0)")
    parser.add_argument("--xlabel", default=None, help="x axis label (default: the value column's name)")
    return parser


main = figure_main(build_parser(), _draw, _columns)

if __name__ == "__main__":
    raise SystemExit(main())
