"""Hidden-state change g_l(t) and the causal smoothers EpiKV builds on it (EpiKV §3.2, eqs. 1-2, Appendix 10).

Definitions used throughout kvscope:

- ``h_l(t)`` is, by default (`scoring.policy.DEFAULT_HIDDEN_HOOK`), the canonical hook ``blocks.{l}.hook_resid_pre``
  at position t: the input of decoder layer l, which is HF's ``output_hidden_states[l]`` and so EpiKV's h_l (layer 0
  reads the embeddings; the last layer's output is never read). ``hook_resid_post`` (the output of layer l, before
  any final norm, i.e. ``output_hidden_states[l + 1]``, one layer deeper than the paper's h_l) is the other
  convention, selectable wherever a hook is taken.
- ``g_l(t) = ||h_l(t) - h_l(t-1)||_2``, computed in float32 whatever the model dtype. Position 0 of a sequence has no
  predecessor: per-position arrays keep it, as NaN, so index i is always token position i.
- Every smoother is causal: its value at t reads only positions <= t, so a token's score is frozen the step it is
  produced and never changes when later tokens are appended. NaN inputs (the first position) are skipped by the
  statistics but still occupy their slot of the window, which counts positions, not valid values.

The streaming classes share one interface: ``add(values[batch, new]) -> [batch, new]`` (RollingStats returns a
(mean, std) pair), ``state_dict()`` and ``load_state_dict()``; feeding a sequence in any chunking gives the same values.
`HiddenDiff`, at the end, is the per-token signal ``hidden_diff``: g_l of the default h_l, unsmoothed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core.errors import unknown_choice
from models.hooks import RESID_HOOKS, hook_name
from scoring.policy import DEFAULT_HIDDEN_HOOK
from scoring.signal import CausalSignal
from signals import register_signal

# EpiKV's two bands: Band A (positive rho) is read at layer 10, Band B (negative rho) at layer 21 (eq. 1).
DEFAULT_BAND_LAYERS = (10, 21)
DEFAULT_WINDOW = 64
DEFAULT_EPS = 1e-6
SMOOTHINGS = ("raw", "mean", "ema", "z")


def check_hidden_hook(hook: str) -> str:
    if hook not in RESID_HOOKS:
        raise unknown_choice("hidden-state hook", hook, RESID_HOOKS)
    return hook


def hidden_state_name(layer: int, hook: str = DEFAULT_HIDDEN_HOOK) -> str:
    """The hook name whose output is h_l: ``blocks.{layer}.hook_resid_pre`` by default."""
    return hook_name(layer, check_hidden_hook(hook))


def hidden_diff(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """``||cur - prev||_2`` over the last axis, in float32: ``[..., d]`` x ``[..., d]`` -> ``[...]``."""
    return torch.linalg.vector_norm(cur.float() - prev.float(), dim=-1)


def hidden_diffs(hidden: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
    """g over a block of consecutive positions: ``hidden [batch, pos, d]`` -> ``[batch, pos]``.

    `prev` ``[batch, d]`` is the state just before the block (the last position of the previous block); without it
    the first position has no predecessor and is NaN.
    """
    first = hidden[:, :1] if prev is None else prev[:, None].to(hidden.dtype)
    shifted = torch.cat([first, hidden[:, :-1]], dim=1)
    g = hidden_diff(shifted, hidden)
    if prev is None:
        g[:, 0] = float("nan")
    return g


class RollingStats:
    """Causal rolling mean and (population) standard deviation over the trailing `window` positions.

    ``add(x[batch, new])`` returns ``(mean, std)``, each ``[batch, new]``: entry j covers the `window` positions ending
    at (and including) new value j. NaN values are skipped; a window with no finite value gives NaN. Statistics are
    computed in float64 and returned in x's floating dtype.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, eps: float = DEFAULT_EPS):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.eps = float(eps)
        self._tail: torch.Tensor | None = None  # [batch, window - 1] last values seen, NaN-padded on the left

    def add(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:
            raise ValueError(f"RollingStats.add expects [batch, new], got shape {tuple(x.shape)}")
        values = x.to(torch.float64)
        batch = values.shape[0]
        if self._tail is None:
            self._tail = values.new_full((batch, self.window - 1), float("nan"))
        elif self._tail.shape[0] != batch:
            raise ValueError(f"batch size changed from {self._tail.shape[0]} to {batch}")
        full = torch.cat([self._tail.to(values.device), values], dim=1)
        windows = full.unfold(1, self.window, 1)  # [batch, new, window]
        valid = ~torch.isnan(windows)
        count = valid.sum(-1)
        filled = torch.where(valid, windows, 0.0)
        mean = filled.sum(-1) / count  # 0/0 -> NaN for an all-NaN window
        var = (torch.where(valid, windows - mean[..., None], 0.0) ** 2).sum(-1) / count
        self._tail = full[:, full.shape[1] - (self.window - 1):]
        dtype = x.dtype if x.is_floating_point() else torch.float32
        return mean.to(dtype), var.clamp_min(0).sqrt().to(dtype)

    def zscore(self, x: torch.Tensor) -> torch.Tensor:
        """EpiKV eq. 2: ``(x - mu) / (sigma + eps)`` with mu, sigma over the window ending at each new value."""
        mean, std = self.add(x)
        return (x - mean) / (std + self.eps)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "eps": self.eps, "tail": None if self._tail is None else self._tail.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window, self.eps = int(state["window"]), float(state["eps"])
        self._tail = None if state["tail"] is None else state["tail"].clone()


class EMA:
    """Causal exponential moving average: ``s(t) = alpha * s(t-1) + (1 - alpha) * x(t)``, ``s(first) = x(first)``.

    `alpha` is the weight kept on the past (EpiKV's alpha = 0.9 compares this against a 64-token window). NaN inputs
    leave the state unchanged and give NaN until the first finite value.
    """

    def __init__(self, alpha: float = 0.9):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        self.alpha = float(alpha)
        self._state: torch.Tensor | None = None  # [batch] float64, NaN until a finite value arrives

    def add(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"EMA.add expects [batch, new], got shape {tuple(x.shape)}")
        values = x.to(torch.float64)
        if self._state is None:
            self._state = values.new_full((values.shape[0],), float("nan"))
        out = torch.empty_like(values)
        state = self._state.to(values.device)
        for j in range(values.shape[1]):
            v = values[:, j]
            blended = torch.where(torch.isnan(state), v, self.alpha * state + (1 - self.alpha) * v)
            state = torch.where(torch.isnan(v), state, blended)
            out[:, j] = state
        self._state = state
        return out.to(x.dtype if x.is_floating_point() else torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "state": None if self._state is None else self._state.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        self._state = None if state["state"] is None else state["state"].clone()


class Smoother:
    """One of the smoothings by name: "raw" (identity), "mean" (rolling mean), "ema", "z" (rolling z-score)."""

    def __init__(self, kind: str = "mean", window: int = DEFAULT_WINDOW, alpha: float = 0.9, eps: float = DEFAULT_EPS):
        if kind not in SMOOTHINGS:
            raise ValueError(f"unknown smoothing {kind!r}; valid choices: {', '.join(SMOOTHINGS)}")
        self.kind = kind
        self._impl = EMA(alpha) if kind == "ema" else RollingStats(window, eps) if kind in ("mean", "z") else None

    def add(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "raw":
            return x
        if self.kind == "ema":
            assert isinstance(self._impl, EMA)  # __init__ makes one for "ema"
            return self._impl.add(x)
        assert isinstance(self._impl, RollingStats)  # __init__ makes one for "mean" and "z"
        if self.kind == "z":
            return self._impl.zscore(x)
        return self._impl.add(x)[0]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "impl": None if self._impl is None else self._impl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"state is for smoothing {state['kind']!r}, this smoother is {self.kind!r}")
        if self._impl is not None:
            self._impl.load_state_dict(state["impl"])


def band_difference(positive: Sequence[Any], negative: Sequence[Any]) -> Any:
    """EpiKV's two-band combination, the one place it is written: ``mean(positive) - mean(negative)``, each side the
    per-layer values of one band (tensors or arrays of one shape, already smoothed); an empty side contributes 0 (a
    one-band score). Eq. 1 is ``positive = [mean-smoothed g_10]``, ``negative = [mean-smoothed g_21]``; eq. 2 the
    same with rolling z-scores; a band of several layers averages them (the "band mean" variant)."""
    if not positive and not negative:
        raise ValueError("a band score needs at least one layer")

    def side(values: Sequence[Any]) -> Any:
        return sum(values[1:], values[0]) / len(values) if values else 0.0

    return side(list(positive)) - side(list(negative))


class BandScore:
    """EpiKV's two-band score, streamed: each layer's g smoothed causally (smoothing="mean": eq. 1, "z": eq. 2), then
    `band_difference` of the two bands.

    ``add(positive, negative) -> [batch, new]``: each side one ``[batch, new]`` tensor (a one-layer band) or a
    sequence of them (one per layer of the band, the same layers in the same order at every call); high scores mark
    tokens to keep. NaN inputs (a sequence's first position, left padding) are skipped by the smoothers.
    """

    def __init__(self, smoothing: str = "z", window: int = DEFAULT_WINDOW, alpha: float = 0.9,
                 eps: float = DEFAULT_EPS):
        self.settings = (smoothing, window, alpha, eps)
        Smoother(*self.settings)  # refuse a bad smoothing now, not at the first add
        self.smoothers: dict[tuple[str, int], Smoother] = {}  # (band, index in the band) -> that layer's smoother

    def add(self, positive: torch.Tensor | Sequence[torch.Tensor],
            negative: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        bands = {"positive": _layers_of(positive), "negative": _layers_of(negative)}
        smoothed = {band: [self._smoother(band, i).add(g) for i, g in enumerate(values)]
                    for band, values in bands.items()}
        return band_difference(smoothed["positive"], smoothed["negative"])

    def _smoother(self, band: str, index: int) -> Smoother:
        key = (band, index)
        if key not in self.smoothers:
            self.smoothers[key] = Smoother(*self.settings)
        return self.smoothers[key]

    def state_dict(self) -> dict[str, Any]:
        return {f"{band}.{index}": smoother.state_dict() for (band, index), smoother in self.smoothers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            band, index = name.split(".")
            self._smoother(band, int(index)).load_state_dict(value)


def _layers_of(values: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [values] if isinstance(values, torch.Tensor) else list(values)


def smooth(x: torch.Tensor, kind: str = "mean", window: int = DEFAULT_WINDOW, alpha: float = 0.9,
           eps: float = DEFAULT_EPS) -> torch.Tensor:
    """A whole ``[batch, pos]`` (or ``[pos]``) sequence through a fresh `Smoother`."""
    flat = x[None] if x.dim() == 1 else x
    out = Smoother(kind, window, alpha, eps).add(flat)
    return out[0] if x.dim() == 1 else out


def band_score(positive: torch.Tensor | Sequence[torch.Tensor], negative: torch.Tensor | Sequence[torch.Tensor],
               smoothing: str = "z", window: int = DEFAULT_WINDOW, alpha: float = 0.9,
               eps: float = DEFAULT_EPS) -> torch.Tensor:
    """`BandScore` over whole sequences: each side one g tensor ``[batch, pos]`` (or ``[pos]``) or a sequence of
    them, one per layer of the band."""
    pos, neg = _layers_of(positive), _layers_of(negative)
    one_dim = (pos or neg)[0].dim() == 1
    batched = [[g[None] if one_dim else g for g in side] for side in (pos, neg)]
    out = BandScore(smoothing, window, alpha, eps).add(*batched)
    return out[0] if one_dim else out


@register_signal("hidden_diff")
class HiddenDiff(CausalSignal):
    """g_l(t) over the positions forwarded so far (position 0 NaN): the last h_l of each forward is kept, so the
    first position of a decode step is differenced against the previous step, not dropped."""

    reads = "hidden"

    def __init__(self) -> None:
        super().__init__()
        self._last: torch.Tensor | None = None  # [batch, d]

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        g = hidden_diffs(hidden, self._last)
        self._last = hidden[:, -1]
        return g
