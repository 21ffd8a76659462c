"""Figure 6: accuracy vs KV cache budget per eviction policy, dense as a horizontal line (EpiKV Fig. 3).

    python -m figures.accuracy_budget --input runs/sweep/summary.csv --out figs [--dense full]

The input is a table of `core.schemas.Cell` rows: the ``summary.csv`` of an `evictor.run` sweep draws as is, and so
does the ``accuracy.csv`` of `validation.compare` (one run's cells).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from core.errors import UsageError
from figures.budgets import DENSE_POLICY, budget_axis, dense_line, dodged, split_dense
from figures.cli import figure_main, figure_parser
from figures.style import figure_style, new_figure, series_style
from figures.tables import checked, in_order, require_ci, require_range, require_unique

FIGURE = "accuracy_budget"
COLUMNS = ("policy", "budget", "accuracy", "ci_lo", "ci_hi")


def plot_accuracy_vs_budget(data, *, dense: str = DENSE_POLICY, ci_level: float = 0.95,
                            ylabel: str = "Accuracy (%)", title: str | None = None):
    """Accuracy per policy against the cache budget (log2 axis) with interval error bars.

    Input columns (one row per policy and budget):
        policy   str    policy name; rows named `dense` (default "full") are the no-eviction baseline
        budget   int    cache budget in tokens (ignored for the dense rows)
        accuracy float  fraction correct, in [0, 1] (drawn in percent)
        ci_lo, ci_hi  float  the `ci_level` interval of the accuracy, fractions (NaN: no error bar)
        outside_protocol  str  optional: non-empty where the cell ran outside its policy's protocol
                      (`core.schemas.Cell.outside_protocol`); such points are circled and the legend says so
    The dense baseline is a dashed horizontal line with its interval as a grey band; if it appears at several
    budgets (copied across budgets) every copy must have the same accuracy. Returns a Figure with one Axes.
    """
    df = checked(data, FIGURE, required=COLUMNS, numeric=("accuracy", "ci_lo", "ci_hi"), finite=("accuracy",))
    for column in ("accuracy", "ci_lo", "ci_hi"):
        require_range(df, column, 0.0, 1.0, FIGURE)
    require_ci(df, "accuracy", FIGURE, low="ci_lo", high="ci_hi")
    rows, dense_rows = split_dense(df, dense, FIGURE)
    require_unique(rows, ("policy", "budget"), FIGURE)
    if dense_rows["accuracy"].nunique() > 1:
        raise UsageError(f"{FIGURE}: the dense policy {dense!r} has different accuracies "
                         f"{sorted(dense_rows['accuracy'].unique())}; it must be one value (it has no budget)")
    policies = in_order(rows["policy"])

    with figure_style():
        fig, ax = new_figure()
        if not dense_rows.empty:
            first = dense_rows.iloc[0]
            dense_line(ax, 100 * first["accuracy"], 100 * first["ci_lo"], 100 * first["ci_hi"],
                       label=f"{dense} (no eviction)")
        for i, policy in enumerate(policies):
            style = series_style(i)
            part = rows[rows["policy"] == policy].sort_values("budget")
            error = 100 * np.vstack([part["accuracy"] - part["ci_lo"], part["ci_hi"] - part["accuracy"]])
            x, y = dodged(part["budget"], i, len(policies)), 100 * part["accuracy"].to_numpy(float)
            outside = outside_protocol(part)
            label = f"{policy} (circled: outside its protocol)" if outside.any() else policy
            ax.errorbar(x, y, yerr=np.where(np.isfinite(error), error, 0.0), label=label, **style)
            if outside.any():
                ax.scatter(np.asarray(x)[outside], y[outside], marker="o", s=160, facecolors="none",
                           edgecolors="black", linewidths=1.2, zorder=5)
        budget_axis(ax, rows["budget"])
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
        if title:
            ax.set_title(title)
        fig.legend(loc="outside right upper", title=f"policy (bars: {ci_level:.0%} CI)")
    return fig


def outside_protocol(rows: pd.DataFrame) -> np.ndarray:
    """Per row, whether the cell ran outside its policy's protocol (a non-empty ``outside_protocol``)."""
    if "outside_protocol" not in rows:
        return np.zeros(len(rows), dtype=bool)
    return rows["outside_protocol"].fillna("").astype(str).str.strip().ne("").to_numpy()


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_accuracy_vs_budget(table, dense=args.dense, title=args.title)


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Accuracy against the KV cache budget per eviction policy, with interval error "
                           "bars and the dense baseline as a horizontal line.", FIGURE,
                           "policy, budget, accuracy, ci_lo, ci_hi (fractions; an evictor.run summary.csv draws as is)")
    parser.add_argument("--dense", default=DENSE_POLICY,
                        help=f"policy name of the no-eviction baseline, one of the table's policies (default "
                        f"{DENSE_POLICY!r}, drawn where the table has it)")
    return parser


main = figure_main(build_parser(), _draw, (COLUMNS,))

if __name__ == "__main__":
    raise SystemExit(main())
