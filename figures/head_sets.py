"""Figure 9: planted-fact retrieval by the set of KV heads that keep the fact (random-attention notes, Fig. 3a).

The input is the probe's own table (`core.schemas.ProbeRow` columns): ``summary.csv`` of `probes.planted_fact`
draws as is; its dense row ``full`` (no head count) is left out.

    python -m figures.head_sets --input runs/planted_fact/<run>/summary.csv --out figs
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from core.errors import UsageError
from figures.cli import figure_main, figure_parser
from figures.style import OKABE_ITO, SEQUENTIAL_CMAP, figure_style, new_figure
from figures.tables import checked, in_order, require_ci, require_range, require_unique

FIGURE = "head_sets"
COLUMNS = ("condition", "n_heads", "retrieval", "retrieval_lo", "retrieval_hi")


def plot_head_set_retrieval(data, *, ci_level: float = 0.95, title: str | None = None):
    """Retrieval of a planted fact per head set, as bars with the intervals the probe reports, ordered by set size.

    Input columns (one row per head set; the probe's `ProbeRow` names):
        condition  str    label of the set of KV heads that keep the fact, e.g. "2,3", "5", "all"
        n_heads    int    how many heads are in the set (bar colour; bars are ordered by it, then as given); rows
                          without one (the dense run) are left out
        retrieval  float  fraction of instances whose greedy decode reproduces the planted value, in [0, 1]
        retrieval_lo, retrieval_hi  float  `ci_level` interval of retrieval
        R          float  optional: graded recall of the value, drawn as a diamond on each bar
    Returns a Figure with one Axes.
    """
    df = checked(data, FIGURE, required=COLUMNS,
                 numeric=("n_heads", "retrieval", "retrieval_lo", "retrieval_hi", "R"), finite=("n_heads", "retrieval"))
    df["condition"] = df["condition"].astype(str)
    require_unique(df, ("condition",), FIGURE)
    if not ((df["n_heads"] >= 0) & (df["n_heads"] == df["n_heads"].round())).all():
        raise UsageError(f"{FIGURE}: n_heads must be non-negative integers (0 = the fact deleted from every head)")
    df["n_heads"] = df["n_heads"].astype(int)
    # Graded recall is a ratio of log-prob gaps and may legitimately leave [0, 1]; retrieval may not.
    for column in ("retrieval", "retrieval_lo", "retrieval_hi"):
        require_range(df, column, 0.0, 1.0, FIGURE)
    require_ci(df, "retrieval", FIGURE)
    df["order"] = range(len(df))
    df = df.sort_values(["n_heads", "order"]).reset_index(drop=True)
    sizes = in_order(df["n_heads"])
    has_recall = "R" in df.columns and df["R"].notna().any()

    with figure_style():
        fig, ax = new_figure(size=(6.4, 3.8))
        cmap = colormaps[SEQUENTIAL_CMAP]
        colour_of = {n: cmap(0.15 + 0.7 * i / max(1, len(sizes) - 1)) for i, n in enumerate(sizes)}
        ticks = np.arange(len(df))
        # With recall diamonds, bars move left so each diamond sits in the gap to its bar's right, clear of the value
        # printed above the bar.
        x = ticks - 0.08 if has_recall else ticks
        error = np.vstack([df["retrieval"] - df["retrieval_lo"], df["retrieval_hi"] - df["retrieval"]])
        ax.bar(x, df["retrieval"], width=0.64 if has_recall else 0.7, color=[colour_of[n] for n in df["n_heads"]],
               edgecolor="black", linewidth=0.5, yerr=np.where(np.isfinite(error), error, 0.0),
               error_kw={"elinewidth": 1.0})
        for xi, value, high in zip(x, df["retrieval"], df["retrieval_hi"]):
            above = high if np.isfinite(high) else value
            ax.annotate(f"{value:.2f}", (xi, above), xytext=(0, 3), textcoords="offset points", ha="center",
                        va="bottom", fontsize=9)
        handles: list[Artist] = [Patch(facecolor=colour_of[n], edgecolor="black",
                                       label=f"{n} head{'' if n == 1 else 's'}") for n in sizes]
        if has_recall:
            ax.plot(ticks + 0.36, df["R"], linestyle="none", marker="D", markersize=6,
                    color=OKABE_ITO["vermillion"], markeredgecolor="black", zorder=4)
            handles.append(Line2D([], [], linestyle="none", marker="D", color=OKABE_ITO["vermillion"],
                                  markeredgecolor="black", label="graded recall R"))
        ax.set_xticks(ticks, df["condition"], rotation=30 if len(df) > 8 else 0)
        ax.set_xlabel("KV heads holding the planted fact")
        ax.set_ylabel("Retrieval (fraction of instances)")
        top = max(1.12, float(df["R"].max()) + 0.1) if has_recall else 1.12
        bottom = min(0.0, float(df["R"].min()) - 0.05) if has_recall else 0.0
        ax.set_ylim(bottom, top)
        ax.grid(axis="x", visible=False)
        if title:
            ax.set_title(title)
        fig.legend(handles=handles, loc="outside right upper", title=f"bars: {ci_level:.0%}\ninterval")
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_head_set_retrieval(table, title=args.title)


def build_parser() -> argparse.ArgumentParser:
    return figure_parser(FIGURE, "Planted-fact retrieval per set of KV heads keeping the fact, with "
                         "intervals, from the probe's summary.csv.", FIGURE,
                         "condition, n_heads, retrieval, retrieval_lo, retrieval_hi[, R]")


main = figure_main(build_parser(), _draw, (COLUMNS,))

if __name__ == "__main__":
    raise SystemExit(main())
