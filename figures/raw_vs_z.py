"""Figure 2: raw vs causally z-scored signal, Spearman rho per layer as paired bars (EpiKV §3.2, Eq. 2).

    python -m figures.raw_vs_z --input layers.csv --out figs --raw hidden_diff.mean64 --z hidden_diff.z64
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from core.errors import UsageError, unknown_choice
from figures.cli import figure_main, figure_parser
from figures.layer_rho import add_stat_flag, as_layer_table, validation_columns
from figures.style import OKABE_ITO, figure_style, new_figure
from figures.tables import checked, in_order, require_ci, require_unique

FIGURE = "raw_vs_z"
COLUMNS = ("layer", "signal", "rho")
BAR_WIDTH = 0.4


def plot_raw_vs_z(
    data,
    *,
    raw: str = "raw",
    z: str = "z",
    labels: tuple[str, str] = ("raw signal", "causal rolling z-score"),
    ylabel: str = "Spearman ρ with occlusion label",
    title: str | None = None,
):
    """Paired bars per layer: rho of the raw signal next to rho of its z-scored variant.

    Input columns (one row per signal and layer):
        layer   int    layer index
        signal  str    series name; the rows whose signal is `raw` and `z` are drawn, others ignored
        rho     float  Spearman rho (NaN rows are not drawn)
        rho_lo, rho_hi  float  optional interval, drawn as error bars when present
    `labels` are the legend texts of the raw and z bars. Returns a Figure with one Axes.
    """
    df = checked(data, FIGURE, required=COLUMNS, numeric=("layer", "rho", "rho_lo", "rho_hi"),
                 finite=("layer", "rho"))
    df["signal"] = df["signal"].astype(str)
    available = in_order(df["signal"])
    for name in (raw, z):
        if name not in available:
            raise unknown_choice("signal", name, available)
    if raw == z:
        raise UsageError(f"{FIGURE}: the raw and z signals must differ, both are {raw!r}")
    df = df[df["signal"].isin([raw, z])]
    require_unique(df, ("signal", "layer"), FIGURE)
    has_ci = {"rho_lo", "rho_hi"} <= set(df.columns)
    if has_ci:
        require_ci(df, "rho", FIGURE)

    with figure_style():
        fig, ax = new_figure()
        # Light and dark blue: the pair stays distinguishable in greyscale.
        for offset, name, label, colour in ((-0.5, raw, labels[0], OKABE_ITO["sky"]),
                                            (0.5, z, labels[1], OKABE_ITO["blue"])):
            rows = df[df["signal"] == name].sort_values("layer")
            x = rows["layer"].to_numpy() + offset * BAR_WIDTH
            err = None
            if has_ci:
                err = np.vstack([rows["rho"] - rows["rho_lo"], rows["rho_hi"] - rows["rho"]])
                err = np.where(np.isfinite(err), err, 0.0)
            ax.bar(x, rows["rho"], width=BAR_WIDTH, color=colour, edgecolor="black", linewidth=0.4,
                   label=label if name in label else f"{label} ({name})", yerr=err,
                   error_kw={"elinewidth": 0.8, "capsize": 1.5})
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("Layer index")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="x", visible=False)
        if title:
            ax.set_title(title)
        # Below the panel: bars of either sign fill the axes, so no corner inside it is reliably free.
        fig.legend(loc="outside lower center", ncols=2, title="error bars: 95% CI" if has_ci else None)
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_raw_vs_z(as_layer_table(table, args.stat), raw=args.raw, z=args.z, title=args.title)


def _columns(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """This figure's columns, or --stat's of a validation.layers layers.csv (`as_layer_table`)."""
    return [COLUMNS, validation_columns(args.stat)]


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Per-layer Spearman rho of the raw signal and of its causal rolling z-score, "
                           "as paired bars (EpiKV temporal-trend correction).", FIGURE,
                           "layer, signal, rho[, rho_lo, rho_hi] (or a validation.layers layers.csv)")
    parser.add_argument("--raw", default="raw", help="signal name of the raw variant (default 'raw'; for a "
                        "validation table e.g. 'hidden_diff.mean64')")
    parser.add_argument("--z", default="z", help="signal name of the z-scored variant (default 'z'; for a "
                        "validation table e.g. 'hidden_diff.z64')")
    add_stat_flag(parser)
    return parser


main = figure_main(build_parser(), _draw, _columns)

if __name__ == "__main__":
    raise SystemExit(main())
