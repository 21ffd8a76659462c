"""Figure 10: concurrent requests that fit on one GPU vs context length, with and without a KV budget (EpiKV App. 14).

    python -m figures.projection --out figs                      # EpiKV's setting: R1-Distill-Llama-8B, 80 GB GPU
    python -m figures.projection --out figs --budgets 1024 2048 --gpu-mem-gb 141 --overhead-gb 0

Pure KV-cache arithmetic, no model is run. A request of `n` cached tokens holds 2 (K and V) x layers x KV heads x
head dim x bytes per element x n bytes; the GPU holds floor(free memory / that) requests. With a budget the cache
stops growing at the budget. Memory is in binary gigabytes (1 GB = 2**30 bytes), as GPU memory is quoted.

Reproducing EpiKV's numbers (§4.4: "a 2048-token budget supports 224 concurrent 32,768-token requests ... against
14 without eviction"): the 8B Llama stores 2 x 32 x 8 x 128 x 2 bytes = 128 KiB per token, so a 2048-token request
holds 256 MiB and a 32,768-token one 4 GiB. 224 and 14 both follow from exactly 56 GiB of free memory
(224 x 0.25 = 56, 14 x 4 = 56 < 60), which is an 80 GiB GPU less 16 GiB of bf16 weights (8 B parameters x 2 bytes)
less 8 GiB held back; 8 GiB is 10% of the card, what a serving engine keeps in reserve by default (vLLM's
gpu_memory_utilization = 0.9). Without the reserve the same arithmetic gives 256 and 16. `EPIKV_SETTING` holds these
assumptions.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

import numpy as np
import pandas as pd
from matplotlib.ticker import FixedLocator, NullLocator

from core.cli import atomic_write, main_guard, non_negative_float, positive_int
from core.errors import UsageError
from figures.cli import check_figure_flags, figure_parser, output_directory
from figures.save import save_figure
from figures.style import DENSE_COLOUR, figure_style, new_figure, plain_log_axis, series_style
from figures.tables import checked

FIGURE = "projection"
GIB = 2**30
# DeepSeek-R1-Distill-Llama-8B on an 80 GB GPU, the assumptions that reproduce EpiKV's 224 vs 14 (module docstring).
EPIKV_SETTING = {
    "gpu_mem_gb": 80.0, "weight_gb": 16.0, "overhead_gb": 8.0,
    "n_layers": 32, "n_kv_heads": 8, "d_head": 128, "bytes_per_elem": 2,
}
NO_EVICTION = "no eviction"


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, d_head: int, bytes_per_elem: float) -> float:
    """Bytes one token occupies in the KV cache: keys and values of every layer and KV head."""
    return 2 * n_layers * n_kv_heads * d_head * bytes_per_elem


def concurrent_requests(
    gpu_mem_gb: float,
    weight_gb: float,
    n_layers: int,
    n_kv_heads: int,
    d_head: int,
    bytes_per_elem: float,
    ctx: int,
    budget: int | None = None,
    overhead_gb: float = 0.0,
) -> int:
    """floor((gpu_mem - weights - overhead) / (2 L H d bytes min(ctx, budget or ctx))); 0 when nothing fits.

    Memory arguments are in GB of 2**30 bytes. `budget` None means no eviction: the cache holds all `ctx` tokens.
    """
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("d_head", d_head),
                        ("bytes_per_elem", bytes_per_elem), ("ctx", ctx), ("gpu_mem_gb", gpu_mem_gb)):
        if not value > 0:
            raise UsageError(f"{name} must be positive, got {value!r}")
    for name, value in (("weight_gb", weight_gb), ("overhead_gb", overhead_gb)):
        if not value >= 0:
            raise UsageError(f"{name} must be >= 0, got {value!r}")
    if budget is not None and not budget > 0:
        raise UsageError(f"budget must be positive, got {budget!r}")
    for name, value in (("gpu_mem_gb", gpu_mem_gb), ("weight_gb", weight_gb), ("overhead_gb", overhead_gb)):
        if value * GIB >= 2**63:
            raise UsageError(f"{name} {value:g} is more memory than any machine has")
    free = (gpu_mem_gb - weight_gb - overhead_gb) * GIB
    per_request = kv_bytes_per_token(n_layers, n_kv_heads, d_head, bytes_per_elem) * min(ctx, budget or ctx)
    return max(0, math.floor(free / per_request))


def projection_table(ctx_lengths: Iterable[int], budgets: Iterable[int | None] = (None, 2048),
                     **setting) -> pd.DataFrame:
    """Columns ctx, budget (None = no eviction), requests: `concurrent_requests` over every ctx and budget.

    `setting` holds the other arguments of `concurrent_requests` (see `EPIKV_SETTING`).
    """
    return pd.DataFrame([
        {"ctx": int(ctx), "budget": budget, "requests": concurrent_requests(ctx=int(ctx), budget=budget, **setting)}
        for budget in budgets for ctx in ctx_lengths
    ])


def plot_projection(data, *, annotate_ctx: int | None = None, setting_note: str | None = None,
                    title: str | None = None):
    """Concurrent requests against context length (log-log), one line per budget.

    Input columns (`projection_table` writes them):
        ctx       int    context length of every request, in tokens
        budget    int    KV cache budget in tokens; empty / NaN = no eviction (drawn black, dashed)
        requests  int    requests that fit; rows with 0 are not drawn (nothing fits)
    `annotate_ctx` prints each line's value at that context length (e.g. 32768 for EpiKV's 224 vs 14);
    `setting_note` (e.g. "80 GB GPU − 16 GB weights") is printed under the legend title, so the assumptions travel
    with the figure. Returns a Figure with one Axes.
    """
    df = checked(data, FIGURE, required=("ctx", "budget", "requests"), numeric=("ctx", "budget", "requests"),
                 finite=("ctx", "requests"))
    if (df["ctx"] <= 0).any() or (df["requests"] < 0).any() or (df["budget"] <= 0).any():
        raise UsageError(f"{FIGURE}: ctx and budget must be positive and requests non-negative")
    df["setting"] = [NO_EVICTION if np.isnan(b) else f"budget {b:g}" for b in df["budget"]]
    shown = df[df["requests"] > 0]
    empty = sorted(set(df["setting"]) - set(shown["setting"]))
    if empty:
        raise UsageError(f"{FIGURE}: no request fits at any context length for {', '.join(empty)}; "
                         "nothing to draw on a log axis")
    budgets = sorted(df["budget"].dropna().unique())
    settings = ([NO_EVICTION] if df["budget"].isna().any() else []) + [f"budget {b:g}" for b in budgets]

    with figure_style():
        fig, ax = new_figure()
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        index = 0
        for setting in settings:
            part = shown[shown["setting"] == setting].sort_values("ctx")
            if setting == NO_EVICTION:
                # On top: below the budget the two lines coincide, and the dashes keep both visible.
                style = {"color": DENSE_COLOUR, "linestyle": "--", "marker": "o", "zorder": 3}
            else:
                style, index = series_style(index), index + 1
            ax.plot(part["ctx"], part["requests"], label=setting, **style)
            at = part[part["ctx"] == annotate_ctx]
            if not at.empty:
                ax.annotate(f"{int(at['requests'].iloc[0])}", (annotate_ctx, at["requests"].iloc[0]),
                            xytext=(6, 4), textcoords="offset points", fontsize=10, fontweight="bold",
                            color=style["color"])
        ax.set_ylim(top=ax.get_ylim()[1] * 1.4)  # room for the printed counts above the highest line
        ticks = sorted(df["ctx"].unique())
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{t:g}" for t in ticks], rotation=45 if len(ticks) > 7 else 0)
        ax.set_xlabel("Context length per request (tokens)")
        ax.set_ylabel("Concurrent requests per GPU")
        if title:
            ax.set_title(title)
        legend = ax.legend(loc="lower left", title="KV cache" + (f"\n{setting_note}" if setting_note else ""),
                           frameon=True, facecolor="white", edgecolor="none", framealpha=0.9)
        legend.get_title().set_multialignment("left")
    return fig


def gigabytes(text: str) -> float:
    """argparse type for an amount of memory in GB of 2**30 bytes: a finite number >= 0 that a machine can have."""
    value = non_negative_float(text)
    if value * GIB >= 2**63:
        raise argparse.ArgumentTypeError(f"{text} GB is more memory than any machine has")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = figure_parser(FIGURE, "Concurrent requests that fit on one GPU against context length, with and "
                           "without a KV budget (EpiKV App. 14). Defaults reproduce EpiKV's setting.", FIGURE, None)
    defaults = EPIKV_SETTING
    parser.add_argument("--gpu-mem-gb", type=gigabytes, default=defaults["gpu_mem_gb"],
                        help=f"GPU memory in GB of 2**30 bytes (default {defaults['gpu_mem_gb']:g})")
    parser.add_argument("--weights-gb", type=gigabytes, default=defaults["weight_gb"],
                        help=f"model weights in GB (default {defaults['weight_gb']:g}: 8B parameters in bf16)")
    parser.add_argument("--overhead-gb", type=gigabytes, default=defaults["overhead_gb"],
                        help=f"memory held back for activations and the runtime, in GB (default "
                        f"{defaults['overhead_gb']:g} = 10%% of 80 GB)")
    # --n-layers, not --layers: elsewhere in kvscope --layers selects layers (indices in python -m signals and
    # planted_fact, a depth among the table's in prefill_memory); here it is the size of a model that need not exist.
    parser.add_argument("--n-layers", type=positive_int, default=defaults["n_layers"],
                        help=f"number of decoder layers (default {defaults['n_layers']})")
    parser.add_argument("--kv-heads", type=positive_int, default=defaults["n_kv_heads"],
                        help=f"KV heads per layer (default {defaults['n_kv_heads']})")
    parser.add_argument("--head-dim", type=positive_int, default=defaults["d_head"],
                        help=f"head dimension (default {defaults['d_head']})")
    parser.add_argument("--bytes-per-elem", type=float, default=defaults["bytes_per_elem"],
                        help=f"bytes per cached element (default {defaults['bytes_per_elem']}: bf16)")
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[2048],
                        help="KV budgets in tokens drawn next to the no-eviction line (default 2048)")
    parser.add_argument("--ctx-min", type=positive_int, default=1024, help="shortest context (default 1024)")
    parser.add_argument("--ctx-max", type=positive_int, default=131072, help="longest context (default 131072)")
    parser.add_argument("--annotate-ctx", type=positive_int, default=32768,
                        help="context length whose request counts are printed on the lines (default 32768)")
    return parser


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_figure_flags(args)
    if args.ctx_min > args.ctx_max:
        raise UsageError(f"--ctx-min {args.ctx_min} is larger than --ctx-max {args.ctx_max}")
    lengths = [2**k for k in range(math.ceil(math.log2(args.ctx_min)), math.floor(math.log2(args.ctx_max)) + 1)]
    if not lengths:
        raise UsageError(f"no power of two lies in [{args.ctx_min}, {args.ctx_max}]")
    setting = {"gpu_mem_gb": args.gpu_mem_gb, "weight_gb": args.weights_gb, "overhead_gb": args.overhead_gb,
               "n_layers": args.n_layers, "n_kv_heads": args.kv_heads, "d_head": args.head_dim,
               "bytes_per_elem": args.bytes_per_elem}
    table = projection_table(lengths, [None, *sorted(set(args.budgets))], **setting)
    per_token_kib = kv_bytes_per_token(args.n_layers, args.kv_heads, args.head_dim, args.bytes_per_elem) / 1024
    note = (f"{args.gpu_mem_gb:g} GB GPU − {args.weights_gb:g} GB weights − {args.overhead_gb:g} GB reserve,\n"
            f"{per_token_kib:g} KiB of KV per token")
    fig = plot_projection(table, annotate_ctx=args.annotate_ctx, setting_note=note, title=args.title)
    with output_directory(args.out) as out:
        paths = save_figure(fig, out, args.stem)
        csv_path = out / f"{args.stem}.csv"
        with atomic_write(csv_path) as handle:
            table.to_csv(handle, index=False, lineterminator="\n")
    for path in (*paths, csv_path):
        print(path)
    at = table[table["ctx"] == args.annotate_ctx]
    for row in at.itertuples():
        setting_name = NO_EVICTION if row.budget is None or pd.isna(row.budget) else f"budget {int(row.budget)}"
        print(f"ctx {args.annotate_ctx}: {setting_name}: {row.requests} concurrent requests")
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
