"""Figure 3: attention-sink rate vs sigma_V / sigma_K per model, ValueDiff's Table 4 as reference (ValueDiff Fig. 1).

    python -m figures.sink_ratio --input runs/geometry/smollm2-135m/model.csv --out figs [--no-reference]

The input is `geometry.survey`'s ``model.csv`` (several models' files concatenated, for a comparison) or any table
with the same column names.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from core.errors import UsageError
from figures.cli import figure_main, figure_parser
from figures.labels import label_points
from figures.reference import VALUEDIFF_TABLE4_LABEL, valuediff_reference
from figures.style import OKABE_ITO, REFERENCE_GREY, REFERENCE_TEXT, figure_style, new_figure
from figures.tables import checked, require_range, require_unique

FIGURE = "sink_ratio"
COLUMNS = ("model", "sink_rate")
# sigma_V / sigma_K as a column, or the two spreads it is computed from (`model_ratios`).
RATIO_COLUMNS = (("sigma_ratio",), ("sigma_k", "sigma_v"))
RATIO_LABEL = r"$\sigma_V / \sigma_K$ (value spread / key spread)"
WHOLE_MODEL = "all"


def whole_models(df: pd.DataFrame, figure: str) -> pd.DataFrame:
    """One row per model: `geometry.survey` adds a row per layer type (``scope``) for models that mix sliding-window
    and full attention; the figure draws the whole-model row (scope "all")."""
    if "scope" in df.columns:
        df = df[df["scope"].astype(str) == WHOLE_MODEL].reset_index(drop=True)
        if df.empty:
            raise UsageError(f"{figure}: no row has scope {WHOLE_MODEL!r} (the whole-model row of geometry.survey)")
    df = df.assign(model=df["model"].astype(str))
    require_unique(df, ("model",), figure)
    return df


def with_ratio(columns: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The column sets of a figure drawing `columns` against sigma_V / sigma_K: one per way of giving the ratio."""
    return tuple((*columns, *ratio) for ratio in RATIO_COLUMNS)


def model_ratios(df: pd.DataFrame, figure: str) -> pd.DataFrame:
    """Fill `sigma_ratio` from sigma_v / sigma_k where the table has no such column; check it is positive."""
    if "sigma_ratio" not in df.columns:
        if not {"sigma_k", "sigma_v"} <= set(df.columns):
            raise UsageError(f"{figure}: input needs a 'sigma_ratio' column or both 'sigma_k' and 'sigma_v'")
        df = df.assign(sigma_ratio=df["sigma_v"] / df["sigma_k"])
    bad = df[~np.isfinite(df["sigma_ratio"]) | (df["sigma_ratio"] <= 0)]
    if not bad.empty:
        raise UsageError(f"{figure}: sigma_V/sigma_K of model {bad.iloc[0]['model']!r} is "
                         f"{bad.iloc[0]['sigma_ratio']!r}; it must be a positive number")
    return df


def mark_ratio_one(ax) -> None:
    """The sigma_V = sigma_K boundary between key-dominant and value-dominant geometry."""
    ax.axvline(1.0, color="black", linestyle="--", linewidth=0.9, zorder=1)
    for x, text, ha in ((0.985, "key-dominant ←", "right"), (1.015, "→ value-dominant", "left")):
        ax.text(x, 1.0, text, transform=ax.get_xaxis_transform(), ha=ha, va="bottom", fontsize=9)


def plot_sink_vs_ratio(data, *, reference: bool = True, title: str | None = None):
    """Sink rate against sigma_V / sigma_K: our models as labelled blue points, ValueDiff Table 4 as grey points.

    Input columns (one row per model):
        model        str    label drawn next to the point
        sink_rate    float  fraction of heads whose leading-token attention weight exceeds the threshold, in [0, 1]
        sigma_ratio  float  sigma_V / sigma_K; computed from `sigma_v` / `sigma_k` when the column is absent
        sigma_k, sigma_v  float  optional (needed only without `sigma_ratio`)
        scope        str    optional: only the rows with scope "all" (the whole model) are drawn
    `reference=True` adds ValueDiff's 11 reported models in grey, labelled "ValueDiff Table 4 (reported)".
    A dashed vertical line marks sigma_V / sigma_K = 1. Returns a Figure with one Axes.
    """
    df = checked(data, FIGURE, required=COLUMNS,
                 numeric=("sink_rate", "sigma_ratio", "sigma_k", "sigma_v"), finite=("sink_rate",))
    df = whole_models(df, FIGURE)
    require_range(df, "sink_rate", 0.0, 1.0, FIGURE)
    df = model_ratios(df, FIGURE)
    ref = valuediff_reference() if reference else None

    with figure_style():
        fig, ax = new_figure()
        mark_ratio_one(ax)
        handles = [Line2D([], [], color=OKABE_ITO["blue"], marker="o", linestyle="none", markersize=8,
                          markeredgecolor="black", label="measured (kvscope)")]
        if ref is not None:
            ax.scatter(ref["sigma_ratio"], ref["sink_rate"], s=36, facecolor="white", edgecolor=REFERENCE_GREY,
                       linewidth=1.3, zorder=2)
            handles.append(Line2D([], [], color=REFERENCE_GREY, marker="o", markerfacecolor="white",
                                  linestyle="none", markeredgewidth=1.3, label=VALUEDIFF_TABLE4_LABEL))
        ax.scatter(df["sigma_ratio"], df["sink_rate"], s=64, color=OKABE_ITO["blue"], edgecolor="black", linewidth=0.6,
                   zorder=3)
        ax.set_xlabel(RATIO_LABEL)
        ax.set_ylabel("Sink rate (fraction of heads)")
        ax.set_ylim(-0.05, 1.05)
        ratios = pd.concat([df["sigma_ratio"], ref["sigma_ratio"]]) if ref is not None else df["sigma_ratio"]
        ax.set_xlim(min(0.9, ratios.min()) - 0.15, max(1.1, ratios.max()) + 0.25)
        if title:
            ax.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
        ours = {"fontsize": 9, "color": OKABE_ITO["blue"], "fontweight": "bold"}
        labels = [(r.sigma_ratio, r.sink_rate, r.model, ours) for r in df.itertuples()]
        if ref is not None:
            labels += [(r.sigma_ratio, r.sink_rate, r.model, REFERENCE_TEXT) for r in ref.itertuples()]
        label_points(ax, labels, avoid_x=(1.0,))
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_sink_vs_ratio(table, reference=not args.no_reference, title=args.title)


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Attention-sink rate against sigma_V/sigma_K per model, with ValueDiff's "
                           "reported Table 4 values as grey reference points.", FIGURE,
                           "model, sink_rate, sigma_ratio (or sigma_k and sigma_v)[, scope] (a survey model.csv)")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave out the grey ValueDiff Table 4 reference points")
    return parser


main = figure_main(build_parser(), _draw, with_ratio(COLUMNS))

if __name__ == "__main__":
    raise SystemExit(main())
