"""Does an offline measure predict deployment? Its validity, measured across scorers and budgets and within problems.

A scorer is picked offline (its within-trace rho with labels, its teacher-forced accuracy, ...) and then deployed. An
offline measure is *valid* for that use when the scorers it ranks higher lose less against random when deployed. This
module measures that, for any number of offline measures at once, on one `Table`:

- ``deployed[s, b, p]``: whether scorer s answered problem p at budget b when deployed (0/1; NaN: not run), and
  ``random[b, p]`` the same for random eviction, the reference;
- ``offline[m][s, b, p]``: measure m of scorer s on problem p's trace (at budget b, or the same at every budget for a
  measure that has no budget, such as a rho with labels), NaN where undefined, with how the measure averages over
  problems (`Measure.average`: a plain mean, or a Fisher-z mean for a correlation).

For each measure (`validity`):

- **across scorers and budgets**: the points are (scorer, budget) pairs; x = the measure averaged over problems,
  y = deployed accuracy minus random's on the same problems. Spearman's rho over every point; its p-value by
  permuting which scorer each offline value belongs to (the same permutation at every budget, so a scorer's budgets
  move together; `n_perm` random permutations, p = (count + 1) / (n_perm + 1)); its interval by a percentile bootstrap
  over problems (problems resampled, x and y recomputed from them), since problems are what is sampled;
- **within problems**: for each problem and budget, every pair of scorers whose deployed outcomes differ; the pair is
  concordant when the scorer that kept the answer has the higher offline value on that problem (a tie counts one
  half). The concordance rate (0.5 is chance) with a bootstrap over problems: does the measure on a problem predict
  that problem's deployed outcome?
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import UsageError, unknown_choice

AVERAGES = ("mean", "fisher")
DEFAULT_N_PERM = 10_000
DEFAULT_N_BOOT = 2_000


@dataclass(frozen=True)
class Measure:
    """An offline measure: its values ``[scorers, budgets, problems]`` and how they average over problems."""

    values: np.ndarray
    average: str = "mean"

    def __post_init__(self) -> None:
        if self.average not in AVERAGES:
            raise unknown_choice("average", self.average, AVERAGES)


@dataclass
class Table:
    """Deployed outcomes and offline measures on one set of scorers, budgets and problems (see the module
    docstring)."""

    scorers: list[str]
    budgets: list[Any]
    problems: list[str]
    deployed: np.ndarray  # [S, B, P]
    random: np.ndarray  # [B, P]
    offline: dict[str, Measure] = field(default_factory=dict)

    def check(self) -> None:
        shape = (len(self.scorers), len(self.budgets), len(self.problems))
        if self.deployed.shape != shape or self.random.shape != shape[1:]:
            raise UsageError(f"deployed {self.deployed.shape} and random {self.random.shape} do not match "
                             f"{shape} scorers x budgets x problems")
        for name, measure in self.offline.items():
            if measure.values.shape != shape:
                raise UsageError(f"measure {name!r} has shape {measure.values.shape}, not {shape}")


def _average(values: np.ndarray, average: str, weights: np.ndarray) -> np.ndarray:
    """The weighted mean over the last axis (problems), NaN ignored; Fisher-z for a correlation."""
    data = np.arctanh(np.clip(values, -0.9999, 0.9999)) if average == "fisher" else values
    ok = np.isfinite(data) & (weights > 0)
    total = np.where(ok, weights, 0).sum(axis=-1)
    mean = np.where(ok, data * weights, 0).sum(axis=-1) / np.where(total > 0, total, np.nan)
    return np.tanh(mean) if average == "fisher" else mean


def points(table: Table, measure: Measure, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) ``[S, B]``: the measure averaged over problems, and deployed accuracy minus random's over the problems
    both ran (`weights` [P]: how often each problem counts, a bootstrap's resample)."""
    w = np.ones(len(table.problems)) if weights is None else weights
    x = _average(measure.values, measure.average, w)
    both = np.isfinite(table.deployed) & np.isfinite(table.random)[None]
    diff = np.where(both, table.deployed - table.random[None], 0.0)
    count = np.where(both, w, 0).sum(axis=-1)
    y = (diff * w).sum(axis=-1) / np.where(count > 0, count, np.nan)
    return x, y


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho over the pairs both define; NaN with fewer than 3 of them or a constant side."""
    from scipy import stats

    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan")
    return float(stats.spearmanr(x[ok], y[ok]).statistic)


def across_scorers(x: np.ndarray, y: np.ndarray, n_perm: int = DEFAULT_N_PERM,
                   rng: np.random.Generator | None = None) -> tuple[float, float]:
    """Spearman's rho of ``x [S, B]`` (an offline value per scorer and budget) with ``y [S, B]`` (deployed minus
    random) over every point, and its two-sided p by permuting which scorer each offline row belongs to: exactly,
    over all S! permutations, when there are no more than `n_perm` of them, else `n_perm` random ones with
    p = (count + 1) / (n_perm + 1)."""
    import itertools
    import math

    rho = spearman(x.ravel(), y.ravel())
    if not np.isfinite(rho):
        return rho, float("nan")
    scorers = x.shape[0]
    if math.factorial(scorers) <= n_perm:
        orders = [list(order) for order in itertools.permutations(range(scorers))]
        count = sum(abs(spearman(x[order].ravel(), y.ravel())) >= abs(rho) - 1e-12 for order in orders)
        return rho, count / len(orders)
    rng = rng or np.random.default_rng(0)
    count = sum(abs(spearman(x[rng.permutation(scorers)].ravel(), y.ravel())) >= abs(rho) - 1e-12
                for _ in range(n_perm))
    return rho, (count + 1) / (n_perm + 1)


@dataclass(frozen=True)
class Validity:
    """One measure's validity: Spearman across (scorer, budget) points with its permutation p and problem-bootstrap
    interval, and the within-problem concordance with its interval."""

    measure: str
    rho: float
    p: float
    lo: float
    hi: float
    points: int
    concordance: float
    concordance_lo: float
    concordance_hi: float
    pairs: int

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("measure", "rho", "p", "lo", "hi", "points", "concordance",
                                              "concordance_lo", "concordance_hi", "pairs")}


def concordance(table: Table, measure: Measure) -> tuple[np.ndarray, np.ndarray]:
    """Per problem: (concordant pairs, pairs) over budgets, the pairs of scorers whose deployed outcomes differ on it
    and whose offline values are both defined (a tie in offline value counts one half)."""
    d, v = table.deployed, measure.values  # [S, B, P]
    kept_minus = d[:, None] - d[None, :]  # [S, S, B, P]: +1 where the first kept the answer and the second did not
    higher = np.sign(v[:, None] - v[None, :])
    ok = np.isfinite(kept_minus) & np.isfinite(higher) & (kept_minus > 0)
    agree = np.where(ok, (higher > 0) + 0.5 * (higher == 0), 0.0)
    return agree.sum(axis=(0, 1, 2)), ok.sum(axis=(0, 1, 2)).astype(float)


def validity(table: Table, name: str, n_perm: int = DEFAULT_N_PERM, n_boot: int = DEFAULT_N_BOOT,
             level: float = 0.95, seed: int = 0) -> Validity:
    """`Validity` of measure `name` of `table` (see the module docstring)."""
    table.check()
    measure = table.offline[name]
    rng = np.random.default_rng(seed)
    x, y = points(table, measure)
    rho, p = across_scorers(x, y, n_perm, rng)
    problems = len(table.problems)
    agree, pairs = concordance(table, measure)
    rhos, rates = [], []
    for _ in range(n_boot):
        weights = np.bincount(rng.integers(0, problems, problems), minlength=problems).astype(float)
        bx, by = points(table, measure, weights)
        rhos.append(spearman(bx.ravel(), by.ravel()))
        total = (pairs * weights).sum()
        rates.append((agree * weights).sum() / total if total else np.nan)
    tail = (1 - level) / 2
    lo, hi = (np.nanquantile(rhos, [tail, 1 - tail]) if np.isfinite(rhos).any() else (np.nan, np.nan))
    c_lo, c_hi = (np.nanquantile(rates, [tail, 1 - tail]) if np.isfinite(rates).any() else (np.nan, np.nan))
    points_used = int((np.isfinite(x) & np.isfinite(y)).sum())
    return Validity(name, rho, float(p), float(lo), float(hi), points_used,
                    float(agree.sum() / pairs.sum()) if pairs.sum() else float("nan"), float(c_lo), float(c_hi),
                    int(pairs.sum()))


def validity_table(table: Table, n_perm: int = DEFAULT_N_PERM, n_boot: int = DEFAULT_N_BOOT, level: float = 0.95,
                   seed: int = 0) -> list[dict[str, Any]]:
    """One `Validity` row per offline measure of `table`, best rho first."""
    rows = [validity(table, name, n_perm, n_boot, level, seed).to_json() for name in table.offline]
    return sorted(rows, key=lambda r: -np.nan_to_num(r["rho"], nan=-2))


def graded_importance(windows: Sequence[Mapping[str, Any]], reasoning: range) -> dict[int, float]:
    """Per reasoning position, how much the answer needs it by a label set's graded effects: minus the mean effect
    of the windows (or units, or per-head windows) covering it, so higher is more important for every label kind;
    positions no window with an effect covers are left out. Windows labelled before effects were recorded count
    their outcome instead (effect -1 where the answer flipped, else 0)."""
    sums: dict[int, list[float]] = {}
    for window in windows:
        effect = window.get("effect")
        if effect is None and window.get("flipped") is not None:
            effect = -float(window["flipped"])
        if effect is None:
            continue
        for position in range(max(int(window["start"]), reasoning.start), min(int(window["end"]), reasoning.stop)):
            sums.setdefault(position, []).append(float(effect))
    return {position: -float(np.mean(effects)) for position, effects in sorted(sums.items())}
