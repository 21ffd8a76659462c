"""A linear datamodel: how much keeping each unit of the cache raises the answer's log-probability, estimated from
random keep-sets (the joint labels, `labeling.joint`). Pure numpy, on hand-made data in the tests.

Each of M draws keeps a random subset of the trace's U units and records ``y``, the reference answer's teacher-forced
log-probability from the pruned cache. ``z[m, u]`` is the share of draw m's keep sets (one per KV head, or one shared)
that hold unit u. The datamodel is the least-squares fit

    y_m = a + sum_u beta_u z[m, u] + e_m

and ``beta_u`` is unit u's importance *given that the rest of the cache is evicted at the same rate*: the expected
gain in log-probability from keeping u, averaged over what else the draws keep (with independent draws this is the
Banzhaf-style value of u at the draw's keep rate, not a Shapley value). A fact stated twice shows as two positive
coefficients whose sum is about what losing both costs, where a single-window occlusion sees neither copy.

Intervals: heteroskedasticity-consistent (HC3) standard errors, since the spread of y depends on what a draw keeps;
the interval is ``beta +- t * se`` with M - U - 1 degrees of freedom. Convergence: the coefficients are refitted on
the even and on the odd draws, and the Spearman correlation of the two halves, stepped up to the full M by
Spearman-Brown (``2r / (1 + r)``), is the estimate's reliability; it rises towards 1 as M grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Datamodel:
    """A fitted datamodel: per unit its coefficient and interval; the intercept, R^2 and the split-half
    reliability (None when a half cannot be fitted)."""

    coef: np.ndarray  # [U]
    se: np.ndarray  # [U] HC3 standard errors
    lo: np.ndarray  # [U]
    hi: np.ndarray  # [U]
    intercept: float
    r2: float
    draws: int
    reliability: float | None


def _ols(z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coefficients with the intercept first, HC3 standard errors, residuals) of y on [1, z]."""
    x = np.column_stack([np.ones(len(y)), z])
    xtx_inv = np.linalg.pinv(x.T @ x)
    beta = xtx_inv @ x.T @ y
    residual = y - x @ beta
    leverage = np.einsum("ij,jk,ik->i", x, xtx_inv, x)
    scaled = residual / np.clip(1 - leverage, 1e-12, None)
    meat = (x * scaled[:, None] ** 2).T @ x
    cov = xtx_inv @ meat @ xtx_inv
    return beta, np.sqrt(np.clip(np.diag(cov), 0, None)), residual


def fit_datamodel(z: np.ndarray, y: np.ndarray, level: float = 0.95) -> Datamodel:
    """The datamodel of ``y [M]`` on ``z [M, U]`` (see the module docstring). Needs M > U + 1 draws."""
    z, y = np.asarray(z, dtype=float), np.asarray(y, dtype=float)
    draws, units = z.shape
    if y.shape != (draws,):
        raise ValueError(f"y has shape {y.shape}, z {z.shape}: one y per draw")
    if draws <= units + 1:
        raise ValueError(f"{draws} draws cannot fit {units} units and an intercept; give more than {units + 1}")
    beta, se, residual = _ols(z, y)
    half = stats.t.ppf(0.5 + level / 2, draws - units - 1)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((residual ** 2).sum()) / total if total > 0 else float("nan")
    return Datamodel(coef=beta[1:], se=se[1:], lo=beta[1:] - half * se[1:], hi=beta[1:] + half * se[1:],
                     intercept=float(beta[0]), r2=r2, draws=draws, reliability=split_half(z, y))


def split_half(z: np.ndarray, y: np.ndarray) -> float | None:
    """The Spearman-Brown stepped-up Spearman correlation between the coefficients fitted on the even and on the odd
    draws; None when a half has too few draws or no spread."""
    even, odd = (slice(0, None, 2), slice(1, None, 2))
    if min(len(y[even]), len(y[odd])) <= z.shape[1] + 1:
        return None
    a, b = _ols(z[even], y[even])[0][1:], _ols(z[odd], y[odd])[0][1:]
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    r = float(stats.spearmanr(a, b).statistic)
    return 2 * r / (1 + r) if r > -1 else None
