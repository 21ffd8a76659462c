"""Figure 4: BOS key cosine vs sigma_V / sigma_K, coloured by a method gap such as ValueDiff − KeyDiff (Fig. 2).

    python -m figures.bos_ratio --input models.csv --out figs --gap-label "ValueDiff − KeyDiff accuracy (points)"

The input is `geometry.survey`'s ``model.csv`` with a `gap` column added per model (the survey measures geometry,
not accuracy: the gap comes from an `evictor.run` sweep of the two policies).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from matplotlib.colors import TwoSlopeNorm
from matplotlib.lines import Line2D

from figures.cli import figure_main, figure_parser
from figures.labels import label_points
from figures.reference import VALUEDIFF_TABLE5_LABEL, valuediff_reference
from figures.sink_ratio import RATIO_LABEL, mark_ratio_one, model_ratios, whole_models, with_ratio
from figures.style import DIVERGING_CMAP, REFERENCE_GREY, REFERENCE_TEXT, figure_style, new_figure
from figures.tables import checked, require_range

FIGURE = "bos_ratio"
COLUMNS = ("model", "bos_cos", "gap")
DEFAULT_GAP_LABEL = "ValueDiff − KeyDiff accuracy (points)"


def plot_bos_vs_ratio(data, *, gap_label: str = DEFAULT_GAP_LABEL, reference: bool = True,
                      title: str | None = None):
    """BOS key cosine similarity against sigma_V / sigma_K, each model coloured by `gap` on a diverging scale.

    Input columns (one row per model):
        model        str    label drawn next to the point
        bos_cos      float  cosine between the BOS key and the mean of the other keys, in [-1, 1]
        sigma_ratio  float  sigma_V / sigma_K (or `sigma_k` and `sigma_v` columns to compute it)
        gap          float  the method gap the colour encodes (e.g. ValueDiff − KeyDiff accuracy); 0 is the white
                            middle
        scope        str    optional: only the rows with scope "all" (the whole model) are drawn
    Dashed lines at ratio 1 and cosine 0 split the plane into ValueDiff's four quadrants (KeyDiff leads only in
    III: cosine < 0, ratio < 1). `reference=True` adds ValueDiff's 11 models (Table 4 ratio, Table 5 cosine) as grey
    hollow points; the paper gives no single gap per model, so they carry no colour. Returns a Figure with two Axes
    (the plot and its colour bar).
    """
    df = checked(data, FIGURE, required=COLUMNS,
                 numeric=("bos_cos", "gap", "sigma_ratio", "sigma_k", "sigma_v"), finite=("bos_cos", "gap"))
    df = whole_models(df, FIGURE)
    require_range(df, "bos_cos", -1.0, 1.0, FIGURE)
    df = model_ratios(df, FIGURE)
    ref = valuediff_reference() if reference else None
    limit = float(np.abs(df["gap"]).max()) or 1.0  # symmetric, so equal gaps of opposite sign look equally strong

    with figure_style():
        fig, ax = new_figure()
        mark_ratio_one(ax)
        ax.axhline(0.0, color="black", linestyle="--", linewidth=0.9, zorder=1)
        handles = [Line2D([], [], color="white", marker="o", markeredgecolor="black", linestyle="none",
                          markersize=8, label="measured (kvscope), colour = gap")]
        if ref is not None:
            ax.scatter(ref["sigma_ratio"], ref["bos_cos"], s=36, facecolor="white", edgecolor=REFERENCE_GREY,
                       linewidth=1.3, zorder=2)
            handles.append(Line2D([], [], color=REFERENCE_GREY, marker="o", markerfacecolor="white",
                                  linestyle="none", markeredgewidth=1.3, label=f"{VALUEDIFF_TABLE5_LABEL}, no gap"))
        points = ax.scatter(df["sigma_ratio"], df["bos_cos"], c=df["gap"], cmap=DIVERGING_CMAP,
                            norm=TwoSlopeNorm(0.0, -limit, limit), s=80, edgecolor="black", linewidth=0.8, zorder=3)
        ratios = pd.concat([df["sigma_ratio"], ref["sigma_ratio"]]) if ref is not None else df["sigma_ratio"]
        cosines = pd.concat([df["bos_cos"], ref["bos_cos"]]) if ref is not None else df["bos_cos"]
        ax.set_xlim(min(0.9, ratios.min()) - 0.15, max(1.1, ratios.max()) + 0.25)
        ax.set_ylim(min(-0.1, cosines.min()) - 0.1, max(0.1, cosines.max()) + 0.12)
        for x, y, numeral, ha, va in ((0.99, 0.98, "I", "right", "top"), (0.01, 0.98, "II", "left", "top"),
                                      (0.01, 0.02, "III", "left", "bottom"), (0.99, 0.02, "IV", "right", "bottom")):
            ax.text(x, y, numeral, transform=ax.transAxes, ha=ha, va=va, fontsize=10, fontweight="bold",
                    color="#444444")
        ax.set_xlabel(RATIO_LABEL)
        ax.set_ylabel("BOS key cosine to mean key")
        colourbar = fig.colorbar(points, ax=ax, pad=0.02)
        colourbar.set_label(gap_label)
        if title:
            ax.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
        labels = [(r.sigma_ratio, r.bos_cos, r.model, {"fontsize": 9, "color": "black", "fontweight": "bold"})
                  for r in df.itertuples()]
        if ref is not None:
            labels += [(r.sigma_ratio, r.bos_cos, r.model, REFERENCE_TEXT) for r in ref.itertuples()]
        label_points(ax, labels, avoid_x=(1.0,), avoid_y=(0.0,))
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_bos_vs_ratio(table, gap_label=args.gap_label, reference=not args.no_reference, title=args.title)


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "BOS key cosine against sigma_V/sigma_K per model, coloured by a method gap "
                           "(ValueDiff Fig. 2).", FIGURE,
                           "model, bos_cos, gap, sigma_ratio (or sigma_k and sigma_v)[, scope]")
    parser.add_argument("--gap-label", default=DEFAULT_GAP_LABEL,
                        help=f"colour-bar label naming the gap and its unit (default: {DEFAULT_GAP_LABEL!r})")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave out the grey ValueDiff Table 4/5 reference points")
    return parser


main = figure_main(build_parser(), _draw, with_ratio(COLUMNS))

if __name__ == "__main__":
    raise SystemExit(main())
