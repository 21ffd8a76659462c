"""Figure 8: prefill peak memory vs context length, fused kernels vs eager with output_attentions (EpiKV Fig. 1).

    python -m models.memory --model smollm2-135m --ctx 512 1024 2048 4096 --out runs/mem
    .venv/bin/python bench/prefill_memory.py --out runs/prefill-memory    # scoring setups, 8B-shaped, by depth
    python -m figures.prefill_memory --input runs/mem/prefill_memory.csv --out figs [--capacity-gb 80]

Series are the table's ``kernel`` names: kernels (`models.memory`) or kernel + policy scoring setups
(``eager+attentions+h2o``: "eager + output_attentions=True, H2O").
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator

from core.cli import positive_int
from core.errors import UsageError, unknown_choice
from figures.cli import figure_main, figure_parser
from figures.style import figure_style, kernel_label, memory_scale, new_figure, plain_log_axis, series_style
from figures.tables import as_bool, checked, in_order, require_unique

FIGURE = "prefill_memory"
COLUMNS = ("kernel", "ctx")  # and the memory column drawn (`MEMORY_COLUMNS`)
MEMORY_COLUMNS = {"peak_mem_mb": "Peak memory", "forward_mem_mb": "Forward's own peak memory"}
POLICY_LABELS = {"h2o": "H2O", "valuediff": "ValueDiff", "epikv": "EpiKV"}


def series_label(name: str) -> str:
    """A kernel's label, or for a scoring setup ``<kernel>+<policy>`` the kernel's label and the scoring policy."""
    if kernel_label(name) != name or "+" not in name:
        return kernel_label(name)
    kernel, policy = name.rsplit("+", 1)
    return f"{kernel_label(kernel)}, {POLICY_LABELS.get(policy, policy)}"


def plot_prefill_memory(data, *, memory: str = "peak_mem_mb", capacity_mb: float | None = None,
                        title: str | None = None, layers: int | None = None):
    """Peak memory of one prefill forward against context length, one line per attention kernel (log-log).

    Input columns (one row per kernel and context length; `models.memory.prefill_peak_memory` writes them):
        kernel       str    "sdpa", "flash_attention_2", "eager", "eager+attentions" or any other name
        ctx          int    context length in tokens
        peak_mem_mb  float  peak memory in MB (1 MB = 2**20 bytes), weights included; ignored (may be empty) where
                            oom is true
        forward_mem_mb float  optional: the forward's peak above what was allocated before it; drawn instead of
                            peak_mem_mb with memory="forward_mem_mb" (telling on CPU, where weights dominate)
        oom          bool   optional: the forward ran out of memory; drawn as an × on the top edge marked "OOM"
        layers       int    optional: the model depth of the row (`bench/prefill_memory.py` writes a shallow
                            measurement and its full-depth extrapolation); one depth is drawn, `layers` or the
                            deepest
        extrapolated bool   optional: the row is extrapolated rather than measured; drawn with hollow markers
    `capacity_mb` draws the device's memory as a dotted horizontal line. Returns a Figure with one Axes.
    """
    if memory not in MEMORY_COLUMNS:
        raise unknown_choice("memory column", memory, MEMORY_COLUMNS)
    df = checked(data, FIGURE, required=(*COLUMNS, memory), numeric=("ctx", memory, "layers"),
                 finite=("ctx", "layers"))
    df["kernel"] = df["kernel"].astype(str)
    df["oom"] = as_bool(df["oom"], "oom", FIGURE) if "oom" in df.columns else False
    df["extrapolated"] = as_bool(df["extrapolated"], "extrapolated", FIGURE) if "extrapolated" in df.columns else False
    if "layers" in df.columns:
        depths = sorted(int(d) for d in df["layers"].unique())
        depth = depths[-1] if layers is None else layers
        if depth not in depths:
            raise UsageError(f"{FIGURE}: no rows at {depth} layers; the table has {', '.join(map(str, depths))}")
        df = df[df["layers"] == depth].copy()
    elif layers is not None:
        raise UsageError(f"{FIGURE}: the table has no layers column to pick {layers} layers from")
    if (df["ctx"] <= 0).any():
        raise UsageError(f"{FIGURE}: context lengths must be positive, got {df.loc[df['ctx'] <= 0, 'ctx'].iloc[0]!r}")
    require_unique(df, ("kernel", "ctx"), FIGURE)
    fitted = df[~df["oom"]]
    bad = fitted[~np.isfinite(fitted[memory]) | (fitted[memory] <= 0)]
    if not bad.empty:
        raise UsageError(f"{FIGURE}: kernel {bad.iloc[0]['kernel']!r} at ctx {bad.iloc[0]['ctx']:g} has no positive "
                         f"{memory} and is not marked oom")
    if capacity_mb is not None and not capacity_mb > 0:
        raise UsageError(f"{FIGURE}: capacity must be positive, got {capacity_mb!r}")
    scale, unit = memory_scale([*fitted[memory], capacity_mb or 0.0])
    kernels = in_order(df["kernel"])

    with figure_style():
        fig, ax = new_figure()
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        values = fitted[memory] / scale
        top = max([*values, (capacity_mb or 0) / scale]) * 1.35  # the OOM marks sit on the top edge
        bottom = min(values) / 1.25 if not values.empty else top / 100
        for i, kernel in enumerate(kernels):
            style = series_style(i)
            part = df[df["kernel"] == kernel].sort_values("ctx")
            ok = part[~part["oom"]]
            ax.plot(ok["ctx"], ok[memory] / scale, label=series_label(kernel), **style)
            hollow = ok[ok["extrapolated"]]
            ax.plot(hollow["ctx"], hollow[memory] / scale, linestyle="none", marker=style.get("marker", "o"),
                    markerfacecolor="white", markeredgecolor=style["color"], zorder=4)
            failed = part[part["oom"]]
            if not failed.empty:
                ax.plot(failed["ctx"], np.full(len(failed), top), linestyle="none", marker="X", markersize=9,
                        color=style["color"], clip_on=False, zorder=5)
                ax.annotate("OOM", (failed["ctx"].iloc[0], top), xytext=(0, 7), textcoords="offset points",
                            ha="center", va="bottom", fontsize=9, color=style["color"], annotation_clip=False)
        if capacity_mb:
            ax.axhline(capacity_mb / scale, color="black", linestyle=":", linewidth=1.1,
                       label=f"device memory ({capacity_mb / scale:g} {unit})")
        ax.set_ylim(bottom, top)
        ticks = sorted(df["ctx"].unique())
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{t:g}" for t in ticks], rotation=45 if len(ticks) > 7 else 0)
        ax.set_xlabel("Context length (tokens)")
        ax.set_ylabel(f"{MEMORY_COLUMNS[memory]} ({unit}, log scale)")
        if title:
            ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        if df["oom"].any():
            handles.append(Line2D([], [], color="black", marker="X", linestyle="none", markersize=8))
            labels.append("out of memory")
        if df["extrapolated"].any():
            handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="none"))
            labels.append("extrapolated in depth")
        columns = 2 if max(map(len, labels)) > 24 else 3  # long labels in three columns run off the figure
        fig.legend(handles, labels, loc="outside lower center", ncols=min(columns, len(labels)))
    return fig


def _draw(table: pd.DataFrame, args: argparse.Namespace):
    capacity = args.capacity_gb * 1024 if args.capacity_gb is not None else None
    return plot_prefill_memory(table, memory=args.memory, capacity_mb=capacity, title=args.title, layers=args.layers)


def _columns(args: argparse.Namespace) -> list[tuple[str, ...]]:
    return [(*COLUMNS, args.memory)]


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Prefill peak memory against context length per attention kernel "
                           "(fused vs eager with output_attentions=True).", FIGURE,
                           "kernel, ctx, peak_mem_mb[, oom, layers, extrapolated] (models.memory or "
                           "bench/prefill_memory.py writes this table)")
    parser.add_argument("--capacity-gb", type=float, default=None,
                        help="device memory in GB (1 GB = 1024 MB) drawn as a dotted line, e.g. 80")
    parser.add_argument("--memory", default="peak_mem_mb", choices=sorted(MEMORY_COLUMNS),
                        help="peak_mem_mb (default: weights included, what a GPU must hold) or forward_mem_mb "
                        "(the forward's own peak above the weights)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="with a layers column: the model depth to draw (default: the deepest in the table)")
    return parser


main = figure_main(build_parser(), _draw, _columns)

if __name__ == "__main__":
    raise SystemExit(main())
