"""One look for every kvscope figure: print-sized fonts, a colour-blind-safe palette, markers that survive greyscale.

Nothing here touches matplotlib's global state: `new_figure` builds a `matplotlib.figure.Figure` (no pyplot
registry, so notebooks and tests never leak figures) inside `plt.rc_context`, which applies the style only while
the figure's artists are created.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.figure import Figure
from matplotlib.rcsetup import cycler
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

# Okabe & Ito (2008), the standard colour-blind-safe qualitative palette; yellow last, it is faint on white paper.
OKABE_ITO = {
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "green": "#009E73",
    "purple": "#CC79A7",
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "black": "#000000",
    "yellow": "#F0E442",
}
PALETTE = tuple(OKABE_ITO.values())
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
LINESTYLES = ("-", "--", "-.", ":")
REFERENCE_GREY = "#8C8C8C"
REFERENCE_TEXT = {"fontsize": 9, "color": "#555555"}  # darker than the points: grey text must stay legible in print
DENSE_COLOUR = "#000000"
# Band shading must not reuse a series colour: pale yellow (the palette's spare colour) and grey, told apart by text.
POSITIVE_SHADE = OKABE_ITO["yellow"]
NEGATIVE_SHADE = "#B0B0B0"
# ColorBrewer PuOr is diverging and colour-blind safe; its pale middle is why scatter points get a dark edge.
DIVERGING_CMAP = "PuOr"
SEQUENTIAL_CMAP = "cividis"

BASE_FONT_PT = 10
SMALL_FONT_PT = 9  # the floor: nothing in a kvscope figure is smaller
SINGLE_PANEL = (6.4, 4.0)  # inches; a full-width figure in a one-column paper

RC: dict[RcKeyType, Any] = {
    "font.size": BASE_FONT_PT,
    "axes.titlesize": BASE_FONT_PT + 1,
    "axes.labelsize": BASE_FONT_PT,
    "xtick.labelsize": SMALL_FONT_PT,
    "ytick.labelsize": SMALL_FONT_PT,
    "legend.fontsize": SMALL_FONT_PT,
    "legend.title_fontsize": SMALL_FONT_PT,
    "figure.titlesize": BASE_FONT_PT + 1,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": cycler(color=PALETTE),
    "lines.linewidth": 1.6,
    "lines.markersize": 5.5,
    "errorbar.capsize": 3,
    "legend.frameon": False,
    "pdf.fonttype": 42,  # TrueType in the PDF: text stays text, editable and searchable
    "ps.fonttype": 42,
    "savefig.bbox": "tight",
}

KERNEL_LABELS = {
    "sdpa": "SDPA",
    "flash_attention_2": "FlashAttention-2",
    "eager": "eager",
    "eager+attentions": "eager + output_attentions=True",
}


def series_style(index: int) -> dict:
    """Colour, marker and line style of the `index`-th series; marker and dash also tell series apart in greyscale."""
    return {
        "color": PALETTE[index % len(PALETTE)],
        "marker": MARKERS[index % len(MARKERS)],
        "linestyle": LINESTYLES[(index // len(PALETTE)) % len(LINESTYLES)],
    }


@contextlib.contextmanager
def figure_style() -> Iterator[None]:
    """kvscope's rc settings for the duration of the block only."""
    with matplotlib.rc_context(RC):
        yield


def new_figure(nrows: int = 1, ncols: int = 1, *, size: tuple[float, float] = SINGLE_PANEL, **subplot_kw):
    """A constrained-layout Figure and its axes (a single Axes, or a flat list for several panels).

    Call inside `figure_style()` so the axes pick up the style.
    """
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw).ravel().tolist()
    return fig, axes[0] if len(axes) == 1 else axes


def memory_scale(values_mb) -> tuple[float, str]:
    """Divide-by factor and unit for a memory axis: GB once values reach 10 GB, else MB (1 GB = 1024 MB)."""
    largest = max((float(v) for v in values_mb), default=0.0)
    return (1024.0, "GB") if largest >= 10 * 1024 else (1.0, "MB")


def plain_log_axis(axis) -> None:
    """Log-scale ticks at 1, 2, 5 x 10^k labelled as plain numbers ("20", not "2 x 10^1")."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def kernel_label(kernel: str) -> str:
    return KERNEL_LABELS.get(kernel, kernel)
