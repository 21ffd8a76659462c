"""Figure 7: time and peak memory vs KV cache budget per eviction policy, two panels (EpiKV Fig. 4, Tables 5–7).

    python -m figures.cost_budget --input cost.csv --out figs [--time wall_s|tokens_per_s] [--dense full]

The input has one row per trace: `evictor.run`'s `core.schemas.Trace` records give ``timings.wall_s``,
``timings.tokens_per_s`` and ``eviction.peak_cache_bytes`` (the notebook ``speed_memory`` builds the table from them).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from core.errors import UsageError, unknown_choice
from figures.budgets import DENSE_POLICY, budget_axis, dense_line, dodged, split_dense
from figures.cli import figure_main, figure_parser
from figures.style import figure_style, memory_scale, new_figure, series_style
from figures.tables import as_frame, checked, in_order

FIGURE = "cost_budget"
TIME_COLUMNS = {"wall_s": "Wall-clock time per run (s)", "tokens_per_s": "Decode throughput (tokens/s)"}


def columns(time: str) -> tuple[str, ...]:
    """The columns drawn with the time column `time`."""
    return ("policy", "budget", time, "peak_mem_mb")


def summarise(df: pd.DataFrame, column: str) -> pd.DataFrame:
    """Median and interquartile range of `column` per (policy, budget); several rows are repeats (e.g. problems)."""
    grouped = df.groupby(["policy", "budget"], sort=False, dropna=False)[column]
    return pd.DataFrame({
        "median": grouped.median(),
        "q1": grouped.quantile(0.25),
        "q3": grouped.quantile(0.75),
        "n": grouped.size(),
    }).reset_index()


def plot_cost_vs_budget(data, *, time: str | None = None, dense: str = DENSE_POLICY, title: str | None = None):
    """Left: time (wall seconds or tokens/s) vs budget; right: peak memory vs budget; one line per policy.

    Input columns (one or more rows per policy and budget):
        policy       str    policy name; rows named `dense` (default "full") are the no-eviction baseline
        budget       int    cache budget in tokens (ignored for the dense rows)
        wall_s       float  wall-clock seconds of the run (e.g. per problem), or
        tokens_per_s float  decode throughput; `time` picks the column (default: wall_s if present)
        peak_mem_mb  float  peak memory of the run in MB (1 MB = 2**20 bytes)
    Several rows for one (policy, budget) are repeats (problems, repetitions): the median is drawn with the
    interquartile range as error bars. The dense baseline is a dashed horizontal line in both panels.
    Returns a Figure with two Axes.
    """
    data = as_frame(data, FIGURE)
    if time is None:
        time = next((c for c in TIME_COLUMNS if c in data.columns), "wall_s")
    elif time not in TIME_COLUMNS:
        raise unknown_choice("time column", time, TIME_COLUMNS)
    df = checked(data, FIGURE, required=columns(time), numeric=(time, "peak_mem_mb"), finite=(time, "peak_mem_mb"))
    if (df[[time, "peak_mem_mb"]] < 0).any().any():
        raise UsageError(f"{FIGURE}: {time} and peak_mem_mb must be non-negative")
    rows, dense_rows = split_dense(df, dense, FIGURE)
    policies = in_order(rows["policy"])
    scale, unit = memory_scale(df["peak_mem_mb"])

    with figure_style():
        fig, (left, right) = new_figure(1, 2, size=(7.6, 3.8))
        for ax, column, ylabel, factor in ((left, time, TIME_COLUMNS[time], 1.0),
                                           (right, "peak_mem_mb", f"Peak memory ({unit})", scale)):
            dense_value = float(dense_rows[column].median()) / factor if not dense_rows.empty else 0.0
            if not dense_rows.empty:
                dense_line(ax, dense_value, label=f"{dense} (no eviction)")
            stats = summarise(rows, column)
            for i, policy in enumerate(policies):
                part = stats[stats["policy"] == policy].sort_values("budget")
                error = np.vstack([part["median"] - part["q1"], part["q3"] - part["median"]]) / factor
                ax.errorbar(dodged(part["budget"], i, len(policies)), part["median"].to_numpy(float) / factor,
                            yerr=error.astype(float), label=policy, **series_style(i))
            budget_axis(ax, rows["budget"])
            ax.set_ylabel(ylabel)
            ax.set_ylim(0, max(ax.get_ylim()[1], 1.06 * dense_value))  # a horizontal line does not autoscale
        if title:
            fig.suptitle(title)
        repeated = summarise(rows, time)["n"].max() > 1
        handles, labels = left.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)),
                   title="median, bars: interquartile range" if repeated else None)
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_cost_vs_budget(table, time=args.time, dense=args.dense, title=args.title)


def _columns(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """With --time, its column; without, either time column will do."""
    return [columns(time) for time in ([args.time] if args.time else TIME_COLUMNS)]


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Time and peak memory against the KV cache budget per eviction policy "
                           "(medians over repeated rows, interquartile error bars).", FIGURE,
                           "policy, budget, wall_s or tokens_per_s, peak_mem_mb")
    parser.add_argument("--time", default=None, choices=sorted(TIME_COLUMNS),
                        help="time column for the left panel (default: wall_s if the table has it, else tokens_per_s)")
    parser.add_argument("--dense", default=DENSE_POLICY,
                        help=f"policy name of the no-eviction baseline, one of the table's policies (default "
                        f"{DENSE_POLICY!r}, drawn where the table has it)")
    return parser


main = figure_main(build_parser(), _draw, _columns)

if __name__ == "__main__":
    raise SystemExit(main())
