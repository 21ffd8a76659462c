"""What the per-budget figures (accuracy, time, memory vs cache budget) share: the dense row and the budget axis."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FixedLocator, NullLocator

from core.errors import UsageError, unknown_choice
from figures.style import DENSE_COLOUR
from figures.tables import in_order

DENSE_POLICY = "full"
DODGE_OCTAVES = 0.06  # horizontal offset between policies on the log2 budget axis, so error bars do not overlap


def split_dense(df: pd.DataFrame, dense: str, figure: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(evicting policies' rows, the dense rows); budgets of evicting rows must be positive and finite.

    The dense run has no budget (EpiKV runs it once and copies it across budgets), so its budget is ignored. A table
    may lack the default dense policy (a sweep run without one: no baseline is drawn), but a `dense` named otherwise
    must be one of the table's policies: a misspelt name would draw the baseline as an evicting policy, or fail on
    its missing budget with a message that does not say why.
    """
    df = df.assign(policy=df["policy"].astype(str))
    policies = in_order(df["policy"])
    if dense != DENSE_POLICY and dense not in policies:
        raise unknown_choice("dense policy", dense, policies)
    dense_rows = df[df["policy"] == dense]
    rows = df[df["policy"] != dense]
    if rows.empty:
        raise UsageError(f"{figure}: no eviction policy besides the dense baseline {dense!r}; nothing to plot "
                         "against the budget")
    budget = pd.to_numeric(rows["budget"], errors="coerce")
    bad = rows[~np.isfinite(budget) | (budget <= 0)]
    if not bad.empty:
        raise UsageError(f"{figure}: policy {bad.iloc[0]['policy']!r} has budget {bad.iloc[0]['budget']!r}; "
                         "budgets must be positive numbers (tokens, or fractions of the reference length)")
    return rows.assign(budget=budget.astype(float)), dense_rows


def dodged(budgets: pd.Series, index: int, count: int) -> np.ndarray:
    """Budgets shifted by a fraction of an octave per series, centred on the true value."""
    shift = (index - (count - 1) / 2) * DODGE_OCTAVES
    return budgets.to_numpy(dtype=float) * 2.0 ** shift


def budget_axis(ax, budgets) -> None:
    """Log2 budget axis with a tick at each budget, labelled in plain tokens (or fractions, see below)."""
    ticks = sorted(set(float(b) for b in budgets))
    # A budget written as a number in (0, 1] is a fraction of each problem's reference length, one >= 2 a token count
    # (evictor.protocol.Budget).
    unit = "fraction of the reference length" if ticks[-1] <= 1 else "tokens"
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.set_xlabel(f"KV cache budget ({unit})")
    ax.grid(axis="x", visible=False)


def dense_line(ax, value: float, low: float | None = None, high: float | None = None,
               label: str = "full (no eviction)") -> None:
    """The dense baseline as a horizontal line, with its interval as a band when given."""
    ax.axhline(value, color=DENSE_COLOUR, linestyle="--", linewidth=1.2, label=label, zorder=1)
    if low is not None and high is not None and np.isfinite(low) and np.isfinite(high):
        ax.axhspan(low, high, color=DENSE_COLOUR, alpha=0.08, linewidth=0, zorder=0)
