"""Figure 1: per-layer Spearman rho with 95% intervals, bands whose interval excludes zero shaded (EpiKV §3.2, App. 6).

    python -m figures.layer_rho --input layers.csv --out figs [--band-signal hidden_diff.mean64] [--stat within]

The input is either the plain table documented in `plot_layer_rho`, or the `layers.csv` written by
`validation.layers` (one row per signal ``{family}.l{layer}.{transform}``, with columns `family`, `layer`,
`transform`, `{stat}_rho`, `{stat}_lo`, `{stat}_hi`, `{stat}_p_adj`), which `from_validation_table` converts.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from core.cli import open_unit_interval
from core.errors import UsageError, unknown_choice
from figures.cli import figure_main, figure_parser
from figures.style import NEGATIVE_SHADE, POSITIVE_SHADE, figure_style, new_figure, series_style
from figures.tables import as_frame, checked, in_order, require_ci, require_unique

FIGURE = "layer_rho"
COLUMNS = ("layer", "signal", "rho", "rho_lo", "rho_hi")
VALIDATION_STATS = ("within", "pooled")


def validation_columns(stat: str) -> tuple[str, ...]:
    """The columns of `validation.layers`' layers.csv that `from_validation_table` reads for the statistic `stat`."""
    return ("family", "transform", "layer", f"{stat}_rho", f"{stat}_lo", f"{stat}_hi")


def from_validation_table(data, stat: str = "within") -> pd.DataFrame:
    """Convert `validation.layers`' layers.csv rows into this figure's columns.

    One series per (family, transform) ("hidden_diff.mean64"); `rho`, `rho_lo`, `rho_hi`, `p_adj` come from the
    `{stat}_*` columns (`within`: mean within-trace rho with Fisher-z interval on n_eff traces; `pooled`: all tokens).
    Layerless signals (no layer index) are dropped.
    """
    if stat not in VALIDATION_STATS:
        raise unknown_choice("statistic", stat, VALIDATION_STATS)
    df = checked(data, FIGURE, required=validation_columns(stat), numeric=("layer",))
    df = df[df["layer"].notna()]
    if df.empty:
        raise UsageError(f"{FIGURE}: the validation table has no layered signals")
    out = pd.DataFrame({
        "layer": df["layer"].astype(int),
        "signal": df["family"].astype(str) + "." + df["transform"].astype(str),
        "rho": df[f"{stat}_rho"],
        "rho_lo": df[f"{stat}_lo"],
        "rho_hi": df[f"{stat}_hi"],
    })
    if f"{stat}_p_adj" in df.columns:
        out["p_adj"] = df[f"{stat}_p_adj"]
    return out.reset_index(drop=True)


def significant_runs(layers, rho_lo, rho_hi) -> list[tuple[int, int, int]]:
    """Maximal runs of adjacent layers whose interval excludes zero on the same side: (sign, first, last).

    Layers are adjacent when their indices differ by one; a NaN bound never counts as excluding zero.
    """
    order = np.argsort(np.asarray(layers))
    layers = np.asarray(layers)[order]
    low, high = np.asarray(rho_lo, dtype=float)[order], np.asarray(rho_hi, dtype=float)[order]
    signs = np.where(low > 0, 1, np.where(high < 0, -1, 0))
    runs: list[tuple[int, int, int]] = []
    for layer, sign in zip(layers.tolist(), signs.tolist()):
        if sign and runs and runs[-1][0] == sign and runs[-1][2] == layer - 1:
            runs[-1] = (sign, runs[-1][1], layer)
        elif sign:
            runs.append((sign, layer, layer))
    return runs


def plot_layer_rho(
    data,
    *,
    band_signal: str | None = None,
    alpha: float = 0.05,
    ci_level: float = 0.95,
    ylabel: str = "Spearman ρ with occlusion label",
    title: str | None = None,
):
    """Per-layer Spearman rho, one line per signal, interval ribbons, and the two-band anatomy shaded.

    Input columns (one row per signal and layer):
        layer    int    layer index
        signal   str    series name (e.g. "hidden_diff.mean64")
        rho      float  Spearman rho; rows with NaN rho are not drawn
        rho_lo, rho_hi  float  the `ci_level` interval of rho (NaN allowed: no ribbon there)
        p_adj    float  optional: multiplicity-corrected p; filled marker where p_adj < `alpha`, hollow otherwise
    Bands: maximal runs of adjacent layers of `band_signal` (default: the first signal) whose interval lies wholly
    above zero (green) or below zero (vermillion).
    Returns a matplotlib Figure with one Axes.
    """
    df = checked(data, FIGURE, required=COLUMNS, numeric=("layer", "rho", "rho_lo", "rho_hi", "p_adj"),
                 finite=("layer", "rho"))
    if not (df["layer"] == df["layer"].round()).all():
        raise UsageError(f"{FIGURE}: column 'layer' must hold integer layer indices")
    df["layer"] = df["layer"].astype(int)
    df["signal"] = df["signal"].astype(str)
    require_unique(df, ("signal", "layer"), FIGURE)
    require_ci(df, "rho", FIGURE)
    signals = in_order(df["signal"])
    band_signal = signals[0] if band_signal is None else band_signal
    if band_signal not in signals:
        raise unknown_choice("band signal", band_signal, signals)
    has_p = "p_adj" in df.columns and df["p_adj"].notna().any()
    band = df[df["signal"] == band_signal]
    runs = significant_runs(band["layer"], band["rho_lo"], band["rho_hi"])

    with figure_style():
        fig, ax = new_figure()
        for sign, first, last in runs:
            colour = POSITIVE_SHADE if sign > 0 else NEGATIVE_SHADE
            ax.axvspan(first - 0.5, last + 0.5, color=colour, alpha=0.3, linewidth=0, zorder=0)
            span = f"L{first}" if first == last else f"L{first}–{last}"
            ax.text((first + last) / 2, 0.985, f"{'+' if sign > 0 else '−'} {span}",
                    transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=9)
        ax.axhline(0.0, color="black", linewidth=0.8, zorder=1)
        handles: list[Artist] = []
        for i, signal in enumerate(signals):
            style = series_style(i)
            rows = df[df["signal"] == signal].sort_values("layer")
            ax.fill_between(rows["layer"], rows["rho_lo"], rows["rho_hi"], color=style["color"], alpha=0.18,
                            linewidth=0, zorder=2)
            ax.plot(rows["layer"], rows["rho"], color=style["color"], linestyle=style["linestyle"], zorder=3)
            significant = rows["p_adj"] < alpha if has_p else pd.Series(True, index=rows.index)
            for mask, face in ((significant, style["color"]), (~significant, "white")):
                ax.plot(rows["layer"][mask], rows["rho"][mask], linestyle="none", marker=style["marker"],
                        color=style["color"], markerfacecolor=face, zorder=4)
            handles.append(Line2D([], [], color=style["color"], linestyle=style["linestyle"], marker=style["marker"],
                                  label=signal))
        handles.append(Patch(color="grey", alpha=0.3, label=f"{ci_level:.0%} CI"))
        if any(s > 0 for s, _, _ in runs):
            handles.append(Patch(color=POSITIVE_SHADE, alpha=0.3, label=f"+ band: CI > 0 ({band_signal})"))
        if any(s < 0 for s, _, _ in runs):
            handles.append(Patch(color=NEGATIVE_SHADE, alpha=0.3, label=f"− band: CI < 0 ({band_signal})"))
        if has_p:
            handles += [Line2D([], [], color="black", linestyle="none", marker="o", label=f"p_adj < {alpha:g}"),
                        Line2D([], [], color="black", linestyle="none", marker="o", markerfacecolor="white",
                               label=f"p_adj ≥ {alpha:g}")]
        ax.set_xlabel("Layer index")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(df["layer"].min() - 0.7, df["layer"].max() + 0.7)
        if title:
            ax.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", ncols=min(3, len(handles)))
    return fig


def as_layer_table(table: pd.DataFrame, stat: str) -> pd.DataFrame:
    """The CLI accepts either this figure's columns or validation.layers' layers.csv."""
    table = as_frame(table, FIGURE)
    if "rho" not in table.columns and f"{stat}_rho" in table.columns:
        return from_validation_table(table, stat)
    return table


def add_stat_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stat", default="within", choices=VALIDATION_STATS,
                        help="for a validation.layers layers.csv input: which rho to draw, mean within-trace "
                        "('within', default) or pooled over all tokens ('pooled'); ignored for a plain table")


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    return plot_layer_rho(as_layer_table(table, args.stat), band_signal=args.band_signal, alpha=args.alpha,
                          title=args.title)


def _columns(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """This figure's columns, or --stat's of a validation.layers layers.csv (`as_layer_table`)."""
    return [COLUMNS, validation_columns(args.stat)]


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Per-layer Spearman rho with intervals; layers whose interval excludes zero "
                           "are shaded as bands (EpiKV two-band anatomy).", FIGURE,
                           "layer, signal, rho, rho_lo, rho_hi[, p_adj] (or a validation.layers layers.csv)")
    parser.add_argument("--band-signal", default=None, help="signal whose significant layers are shaded "
                        "(default: the first signal in the table)")
    parser.add_argument("--alpha", type=open_unit_interval, default=0.05,
                        help="p_adj threshold for filled (significant) markers (default 0.05)")
    add_stat_flag(parser)
    return parser


main = figure_main(build_parser(), _draw, _columns)

if __name__ == "__main__":
    raise SystemExit(main())
