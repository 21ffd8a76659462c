"""Figure 5: per-layer sigma_K, sigma_V and sink rate, full-attention layers marked (ValueDiff Figs. 4–5).

    python -m figures.layer_geometry --input runs/geometry/smollm2-135m/layers.csv --out figs

The input is `geometry.survey`'s ``layers.csv`` (one row per layer) or any table with the same column names.
"""

from __future__ import annotations

import argparse

import pandas as pd
from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from core.errors import UsageError
from figures.cli import figure_main, figure_parser
from figures.style import OKABE_ITO, figure_style, new_figure
from figures.tables import checked, require_range, require_unique

FIGURE = "layer_geometry"
COLUMNS = ("layer", "sigma_k", "sigma_v", "sink_rate")
LAYER_KINDS = {"sliding": "sliding", "sliding_attention": "sliding", "full": "full", "full_attention": "full"}
FULL_SHADE = "#D9D9D9"


def plot_layer_geometry(data, *, title: str | None = None):
    """Two stacked panels over layers: sigma_K and sigma_V (top), sink rate (bottom).

    Input columns (one row per layer):
        layer       int    layer index
        sigma_k, sigma_v  float  std over tokens of the L2 distance of keys / values from their mean (mean over heads)
        sink_rate   float  fraction of this layer's heads whose leading-token weight exceeds the threshold, in [0, 1]
        layer_type  str    optional: "sliding" / "full" (or transformers' "sliding_attention" / "full_attention");
                           when both kinds occur, full-attention layers are shaded grey in both panels and drawn
                           with filled markers, sliding-window layers with hollow ones
    Returns a Figure with two Axes sharing the layer axis.
    """
    df = checked(data, FIGURE, required=COLUMNS, numeric=COLUMNS, finite=COLUMNS)
    if not (df["layer"] == df["layer"].round()).all():
        raise UsageError(f"{FIGURE}: column 'layer' must hold integer layer indices")
    df["layer"] = df["layer"].astype(int)
    require_unique(df, ("layer",), FIGURE)
    require_range(df, "sink_rate", 0.0, 1.0, FIGURE)
    if "layer_type" in df.columns:
        unknown = sorted({str(k) for k in df["layer_type"] if str(k) not in LAYER_KINDS})
        if unknown:
            raise UsageError(f"{FIGURE}: unknown layer_type {unknown[0]!r}; valid: {', '.join(LAYER_KINDS)}")
        df["kind"] = df["layer_type"].astype(str).map(LAYER_KINDS)
    else:
        df["kind"] = "full"
    df = df.sort_values("layer")
    mixed = df["kind"].nunique() > 1
    full = df["kind"] == "full"

    with figure_style():
        fig, (top, bottom) = new_figure(2, 1, size=(6.4, 5.2), sharex=True)
        series = ((top, "sigma_k", r"$\sigma_K$ (keys)", OKABE_ITO["blue"], "o"),
                  (top, "sigma_v", r"$\sigma_V$ (values)", OKABE_ITO["vermillion"], "s"),
                  (bottom, "sink_rate", "sink rate", OKABE_ITO["green"], "^"))
        for ax, column, label, colour, marker in series:
            ax.plot(df["layer"], df[column], color=colour, label=label)
            for mask, face in ((full, colour), (~full, "white")):
                ax.plot(df["layer"][mask], df[column][mask], linestyle="none", marker=marker, color=colour,
                        markerfacecolor=face)
        if mixed:
            for ax in (top, bottom):
                for layer in df["layer"][full]:
                    ax.axvspan(layer - 0.5, layer + 0.5, color=FULL_SHADE, linewidth=0, zorder=0)
        top.set_ylabel("Spread σ\n(std of L2 distance to mean)")
        bottom.set_ylabel("Sink rate\n(fraction of heads)")
        bottom.set_ylim(-0.03, 1.03)
        bottom.set_xlabel("Layer index")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        handles: list[Artist] = [Line2D([], [], color=c, marker=m, label=lab) for _, _, lab, c, m in series]
        if mixed:
            handles += [Patch(color=FULL_SHADE, label="full-attention layer (filled marker)"),
                        Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="none",
                               label="sliding-window layer")]
        if title:
            top.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", ncols=3)
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_layer_geometry(table, title=args.title)


def build_parser() -> argparse.ArgumentParser:
    return figure_parser(FIGURE, "Per-layer key/value spread (sigma_K, sigma_V) and sink rate, full-attention "
                         "layers marked.", FIGURE,
                         "layer, sigma_k, sigma_v, sink_rate[, layer_type] (a geometry.survey layers.csv)")


main = figure_main(build_parser(), _draw, (COLUMNS,))

if __name__ == "__main__":
    raise SystemExit(main())
