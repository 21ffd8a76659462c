"""ThinKV's per-model calibration: the attention-sparsity thresholds that split thoughts into three types.

ThinKV (Ramachandran et al. 2025) observes that the attention sparsity of a reasoning trace's queries separates its
thoughts into reasoning (R), execution (E) and transition (T) segments, and classifies each segment with thresholds
calibrated offline. Here, per layer:

- the sparsity of one query is the fraction of the keys it may see that get less than the uniform share ``1/n``
  of its (GQA group-averaged) attention (`attention_sparsity`), over the whole causal row;
- the statistic classified is the mean sparsity of a block of ``tau`` consecutive queries (ThinKV refreshes the
  classification every ``tau`` = 128 tokens), so the thresholds are computed on the rolling ``tau``-means of the
  calibration traces;
- the two thresholds are the minima of a Gaussian kernel density estimate between its three highest modes, or the
  tertiles when the density has fewer than three modes (`kde_thresholds`; the file records which);
- the three bands, from least to most sparse, are mapped to thought types by ``band_order`` (default R, E, T).

The sparsity definition, the block statistic, the valley rule and the default band order are this implementation's
choices (the paper's text was not available to check them); they are recorded in the file and listed in the
policy's deviations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.errors import UsageError
from core.schemas import Trace
from evictor.calibration import (
    base_record,
    read_calibration,
    teacher_forced,
    trace_token_ids,
)
from models.attention import group_mean, visible_by_position
from models.hooks import capture, hook_name, layer_specs

METHOD = "thinkv"
TYPES = ("R", "E", "T")  # reasoning, execution, transition
DEFAULT_BAND_ORDER = ("R", "E", "T")  # thought type of the low, middle and high sparsity band
DEFAULT_TAU = 128
KDE_GRID = 512


@dataclass(frozen=True)
class ThinKVStats:
    """A loaded ThinKV calibration."""

    path: str
    model: str
    n_layers: int
    tau: int
    thresholds: torch.Tensor  # [layer, 2] low / high sparsity threshold
    band_types: tuple[int, int, int]  # index into TYPES of the low, middle and high band


def check_band_order(order: tuple[str, ...] | list[str]) -> tuple[str, str, str]:
    if sorted(order) != sorted(TYPES):
        raise UsageError(f"band order {','.join(order)!r} must name each of {', '.join(TYPES)} once")
    return tuple(order)  # type: ignore[return-value]


def load_thinkv(path: str, policy: str) -> ThinKVStats:
    data = read_calibration(path, METHOD, policy)
    low, middle, high = check_band_order(data["band_order"])
    return ThinKVStats(path=path, model=data["model"], n_layers=data["n_layers"], tau=data["tau"],
                       thresholds=torch.tensor(data["thresholds"], dtype=torch.float32),
                       band_types=(TYPES.index(low), TYPES.index(middle), TYPES.index(high)))


def attention_sparsity(attn: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``[..., Q, K]`` probabilities and the keys each query may see -> ``[..., Q]``: the fraction of visible keys
    that get less than their uniform share of the visible mass, ``sum_visible(p) / n_visible`` (``1 / n`` for a
    whole row); NaN for a query that sees no key. Renormalising over the visible keys keeps the measure comparable
    when only part of a row is at hand (the eviction candidates)."""
    attn = attn.float().where(visible, 0.0)
    n_visible = visible.sum(-1, keepdim=True)
    below = (attn * n_visible < attn.sum(-1, keepdim=True)) & visible
    return below.sum(-1) / n_visible[..., 0].where(n_visible[..., 0] > 0, torch.nan)


def rolling_means(values: np.ndarray, tau: int) -> np.ndarray:
    """Means of every `tau` consecutive values (the whole mean when fewer than `tau`)."""
    if len(values) < tau:
        return np.array([values.mean()])
    sums = np.cumsum(np.concatenate([[0.0], values]))
    return (sums[tau:] - sums[:-tau]) / tau


def kde_thresholds(samples: np.ndarray) -> tuple[float, float, str]:
    """Two thresholds splitting `samples` into three bands: the density minima between the three highest modes of
    a Gaussian KDE (``"kde"``), else the tertiles (``"tertiles"``)."""
    samples = samples[np.isfinite(samples)]
    if len(samples) == 0:
        raise UsageError("no attention-sparsity samples: the calibration traces are too short")
    tertiles = np.quantile(samples, [1 / 3, 2 / 3])
    if len(np.unique(samples)) < 3:
        return float(tertiles[0]), float(tertiles[1]), "tertiles"
    grid = np.linspace(samples.min(), samples.max(), KDE_GRID)
    from scipy.stats import gaussian_kde  # scipy.stats takes seconds to import; only calibrating needs it

    density = gaussian_kde(samples)(grid)
    peaks = [i for i in range(1, KDE_GRID - 1) if density[i - 1] < density[i] >= density[i + 1]]
    if len(peaks) < 3:
        return float(tertiles[0]), float(tertiles[1]), "tertiles"
    top = sorted(sorted(peaks, key=lambda i: density[i])[-3:])
    valleys = [start + int(np.argmin(density[start:stop + 1])) for start, stop in zip(top, top[1:])]
    return float(grid[valleys[0]]), float(grid[valleys[1]]), "kde"


def token_sparsity(lm, ids: list[int]) -> list[np.ndarray]:
    """Per layer, the sparsity of every position's query (mean over KV heads) in one teacher-forced forward, from the
    canonical ``attn.hook_pattern`` (exact under any kernel)."""
    model = lm.model
    config = model.config
    positions = torch.arange(len(ids), device=lm.device)[None]
    specs = layer_specs(model)
    names = [hook_name(layer, "attn.hook_pattern") for layer in range(config.num_hidden_layers)]
    with torch.inference_mode(), capture(model, names) as patterns:
        teacher_forced(lm, ids)
    found = []
    for layer, name in enumerate(names):
        visible = visible_by_position(positions, positions, specs[layer].window)  # [1, 1, Q, K]
        per_head = attention_sparsity(group_mean(patterns[name].float(), config.num_key_value_heads), visible)
        found.append(per_head.mean(1)[0].cpu().numpy())  # [Q]
    return found


def calibrate_thinkv(lm, traces: list[Trace], *, tau: int = DEFAULT_TAU,
                     band_order: tuple[str, ...] = DEFAULT_BAND_ORDER, max_tokens: int | None = None,
                     progress: Callable[[Any], Any] = iter) -> dict[str, Any]:
    """The calibration record (JSON-ready) of `lm`: per layer, the thresholds of the rolling `tau`-mean sparsity."""
    if tau < 1:
        raise UsageError(f"tau must be >= 1, got {tau}")
    band_order = check_band_order(band_order)
    token_lists = trace_token_ids(traces, lm.model.config.vocab_size, max_tokens)
    n_layers = lm.model.config.num_hidden_layers
    samples: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
    for ids in progress(token_lists):
        # Position 0 sees only itself: its sparsity is 0 by construction, not a property of the thought.
        for layer, sparsity in enumerate(token_sparsity(lm, ids)):
            samples[layer].append(rolling_means(sparsity[1:], tau))
    thresholds, methods = [], []
    for layer_samples in samples:
        low, high, method = kde_thresholds(np.concatenate(layer_samples))
        thresholds.append([low, high])
        methods.append(method)
    return {
        **base_record(METHOD, lm, traces, token_lists),
        "tau": tau,
        "band_order": list(band_order),
        "sparsity": "fraction of visible keys below their uniform share of the visible attention, GQA "
                    "group-averaged, mean over KV heads",
        "statistic": f"rolling mean over {tau} consecutive queries",
        "thresholds": thresholds,
        "threshold_method": methods,
    }
