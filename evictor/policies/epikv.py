"""EpiKV's attention-free policies, scored once when a token is produced and then frozen (EpiKV §3.2-3.3).

Hidden-state family: ``g_l(t) = ||h_l(t) - h_l(t-1)||`` with h_l the paper's ``output_hidden_states[l]``, i.e. the
input of block l (``blocks.{l}.hook_resid_pre``; ``hidden_hook="hook_resid_post"`` selects the block's output
instead), smoothed causally and combined across two bands, Band A (positive, layer 10 of 32) minus Band B (negative,
layer 21 of 32).
KV-vector family: per-token variance of the key / value vector across the head dimension.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from core.errors import UsageError
from evictor.policies import register_policy
from evictor.policies._inputs import broadcast_frozen, require
from scoring.policy import DEFAULT_HIDDEN_HOOK, Needs, ObserveInputs, Policy, ScoreInputs
from signals.hidden import BandScore, RollingStats, check_hidden_hook, hidden_diffs
from signals.kv import DEFAULT_LAG_CHUNK, LagNormaliser, head_dim_variance

EPIKV = "EpiKV: epiphany-aware KV cache eviction"
WINDOW = 64  # EpiKV's rolling window w (eq. 1)
PAPER_DEPTH = 32  # DeepSeek-R1-Distill-Llama-8B, where the bands were measured
PAPER_BANDS = ((10,), (21,))
VALIDATE_BANDS = (
    "python -m signals (hidden_diff at every layer) and python -m labeling.occlusion (labels) on this model's "
    "traces, then python -m validation.layers --labels LABELS --signals SIGNALS --out DIR and "
    "evictor.run --policy-config DIR/policy.json (or the study, which runs these steps)"
)


def scaled_layer(layer: int, n_layers: int) -> int:
    """A layer of the 32-layer paper model moved to the same relative depth of an `n_layers` model (rounded)."""
    return min(n_layers - 1, int(layer * n_layers / PAPER_DEPTH + 0.5))


@dataclass
class _RollingVariance(Policy):
    """KV-key / KV-val: causal rolling-`window` mean of each token's variance across the head dimension."""

    window: int = WINDOW
    source: ClassVar[str] = "keys"
    deviations = (
        "Per KV head (the paper does not say whether heads are pooled); post-RoPE keys (the paper reports pre- vs "
        "post-RoPE as a null result, App. 10). The rolling mean runs over one stream per (sequence, head)."
    )
    default_protection = "prompt"
    defined_for = ("prompt",)
    defined_by = "EpiKV footnote 1 and App. 9: the hidden-state and KV-vector families keep the prompt"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UsageError(f"{self.name}: window must be >= 1, got {self.window}")

    @property
    def needs(self) -> Needs:
        return Needs(keys=self.source == "keys", values=self.source == "values")

    def observe(self, inputs: ObserveInputs) -> torch.Tensor:
        (vectors,) = require(self, inputs, self.source)
        batch, heads, new, _ = vectors.shape  # [batch, kv_head, new, d_head]
        stats = inputs.state.setdefault("stats", RollingStats(self.window))
        # Left padding (negative positions) becomes NaN, which the rolling mean skips as it skips the time before
        # a sequence starts, so a padded sequence scores exactly as it does alone.
        variance = head_dim_variance(vectors).masked_fill(inputs.positions[:, None, :] < 0, float("nan"))
        mean, _ = stats.add(variance.reshape(batch * heads, new))
        return mean.reshape(batch, heads, new)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return broadcast_frozen(self, inputs)


@register_policy("kv_key")
@dataclass
class KVKey(_RollingVariance):
    """KV-key: rolling-64 mean of the key vector's variance across the head dimension (EpiKV §3.3)."""

    citation = f"{EPIKV}, §3.3 (KV-key): rolling-mean variance of the key vector across head dimension"


@register_policy("kv_val")
@dataclass
class KVVal(_RollingVariance):
    """KV-val: rolling-64 mean of the value vector's variance across the head dimension (EpiKV §3.3)."""

    citation = f"{EPIKV}, §3.3 (KV-val): rolling-mean variance of the value vector across head dimension"
    source: ClassVar[str] = "values"


@register_policy("lag_kv")
@dataclass
class LagKV(Policy):
    """Lag-KV: key and value vectors normalised per channel by the previous chunk's range, then
    ``score = var_d(k~) + var_d(v~)`` (EpiKV §3.3; LagKV with the previous chunk instead of the next)."""

    chunk: int = DEFAULT_LAG_CHUNK
    citation = f"{EPIKV}, §3.3 (Lag-KV), after LagKV: previous-chunk per-channel range normalisation, then variance"
    deviations = (
        "The chunk size (64) is ours: the paper does not state it. Tokens of the first chunk, which has no previous "
        "chunk, are normalised by the range of the tokens seen so far. Key and value variances are summed, per KV "
        "head, with no rolling mean."
    )
    default_protection = "prompt"
    defined_for = ("prompt",)
    defined_by = "EpiKV footnote 1 and App. 9: the hidden-state and KV-vector families keep the prompt"

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise UsageError(f"{self.name}: chunk must be >= 1, got {self.chunk}")

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, values=True)

    def observe(self, inputs: ObserveInputs) -> torch.Tensor:
        keys, values = require(self, inputs, "keys", "values")  # [batch, kv_head, new, d_head]
        # Chunks count each sequence's own tokens, so every sequence has its own normalisers, fed only its real
        # tokens: left padding (negative positions, always leading) would shift the chunk boundaries.
        normalisers = inputs.state.setdefault(
            "lag", [(LagNormaliser(self.chunk), LagNormaliser(self.chunk)) for _ in range(keys.shape[0])])
        scores = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)  # [batch, kv_head, new]
        for row, (key_lag, value_lag) in enumerate(normalisers):
            first = int((inputs.positions[row] < 0).sum())
            if first < keys.shape[2]:
                scores[row, :, first:] = (head_dim_variance(key_lag.add(keys[row, :, first:]))
                                          + head_dim_variance(value_lag.add(values[row, :, first:])))
        return scores

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return broadcast_frozen(self, inputs)


@dataclass
class _HiddenBands(Policy):
    """Band A minus Band B of a causally smoothed hidden-state change, frozen when the token is produced.

    The score is `signals.hidden.BandScore` (the one implementation validation ranks too) fed g_l of each
    band's layers. Layers: `positive_layers` / `negative_layers` (tuples; each band's smoothed g is averaged over its
    layers; one band may be empty, contributing 0). Left unset they are layers 10 and 21 of the paper's 32-layer
    model moved to the same relative depth of an `n_layers`-layer model (`for_depth`, which the engine calls with the
    model's depth; 30 layers -> 9 and 20), a guess nothing validated on that model: `for_depth` warns and names the
    commands that validate bands.
    h_l is read at `hidden_hook` (default ``hook_resid_pre``, the paper's ``output_hidden_states[l]``; bands
    validated on ``hook_resid_post`` signals must be run with that hook).
    Position 0 of a sequence has no predecessor (g undefined) and scores 0; it is a prompt token, protected by default.
    Left padding of a batch is skipped, so a padded sequence scores exactly as it does alone.
    """

    positive_layers: tuple[int, ...] | None = None
    negative_layers: tuple[int, ...] | None = None
    window: int = WINDOW
    n_layers: int = PAPER_DEPTH
    hidden_hook: str = DEFAULT_HIDDEN_HOOK
    shared_across_heads = True  # one score per token, read from the residual stream
    layer_independent = True
    default_protection = "prompt"
    defined_for = ("prompt",)
    defined_by = "EpiKV footnote 1 and App. 9: the hidden-state and KV-vector families keep the prompt"
    smoothing: ClassVar[str] = ""  # `signals.hidden.SMOOTHINGS`: "mean" (eq. 1) or "z" (eq. 2)

    def __post_init__(self) -> None:
        if self.window < 1 or self.n_layers < 1:
            raise UsageError(f"{self.name}: window and n_layers must be >= 1, got {self.window}, {self.n_layers}")
        check_hidden_hook(self.hidden_hook)
        for band in ("positive_layers", "negative_layers"):
            layers = getattr(self, band)
            if layers is None:
                continue
            layers = (layers,) if isinstance(layers, int) else tuple(int(layer) for layer in layers)
            if any(not 0 <= layer < self.n_layers for layer in layers):
                raise UsageError(f"{self.name}: {band} {layers} must be layers in [0, {self.n_layers})")
            setattr(self, band, layers)
        positive, negative = self.bands
        if not positive and not negative:
            raise UsageError(f"{self.name}: positive_layers and negative_layers are both empty; give at least one")
        if set(positive) & set(negative):
            raise UsageError(f"{self.name}: layers {sorted(set(positive) & set(negative))} are in both bands")

    @property
    def bands(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        default = [tuple(scaled_layer(layer, self.n_layers) for layer in band) for band in PAPER_BANDS]
        positive = self.positive_layers if self.positive_layers is not None else default[0]
        negative = self.negative_layers if self.negative_layers is not None else default[1]
        return positive, negative

    @property
    def rescaled_bands(self) -> bool:
        """Some band is the paper's layer moved to this depth rather than one given (validated) for the model."""
        return self.positive_layers is None or self.negative_layers is None

    def for_depth(self, n_layers: int) -> Policy:
        policy = replace(self, n_layers=n_layers)
        if policy.rescaled_bands:
            # warnings' default filter shows this once per process for each depth and band pair.
            warnings.warn(
                f"{self.name}: bands {policy.bands} are layers 10 and 21 of EpiKV's 32-layer model rescaled to "
                f"{n_layers} layers, a guess not validated on this model. Validate them with {VALIDATE_BANDS}.",
                UserWarning,
                stacklevel=2,
            )
        return policy

    @property
    def needs(self) -> Needs:
        positive, negative = self.bands
        return Needs(hidden_layers=tuple(sorted({*positive, *negative})), hidden_hook=self.hidden_hook)

    def observe(self, inputs: ObserveInputs) -> torch.Tensor:
        previous = inputs.state.setdefault("previous", {})  # layer -> [batch, d_model] h_l of the last token seen
        score = inputs.state.setdefault("score", BandScore(self.smoothing, self.window))
        g = {}
        for layer in self.needs.hidden_layers:
            if layer not in inputs.hidden:
                raise ValueError(f"policy {self.name!r} needs ObserveInputs.hidden[{layer}] (see its `needs`)")
            hidden = inputs.hidden[layer]  # [batch, new, d_model]
            # A sequence's first token (position 0) has no predecessor, and left padding (negative positions) is
            # not one: NaN there, which the rolling statistics skip.
            g[layer] = hidden_diffs(hidden, previous.get(layer)).masked_fill(inputs.positions <= 0, float("nan"))
            previous[layer] = hidden[:, -1].clone()  # not a view: it would keep the whole block alive
        positive, negative = self.bands
        bands = score.add([g[layer] for layer in positive], [g[layer] for layer in negative])
        return torch.nan_to_num(bands, nan=0.0)[:, None, :]  # [batch, 1, new]: the same score for every head

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return broadcast_frozen(self, inputs)


BAND_DEVIATIONS = (
    "No public implementation. Layers 10/21 of 32 are rescaled to other depths unless bands are given (a warning "
    "says so); h_l = output_hidden_states[l] = blocks.{l}.hook_resid_pre as in the paper, hook_resid_post selectable."
)


@register_policy("epikv_raw")
@dataclass
class EpiKVRaw(_HiddenBands):
    """EpiKV raw band score, eq. 1: ``s(t) = mean_w g_10(t) - mean_w g_21(t)``, causal rolling mean over w = 64."""

    citation = f"{EPIKV}, §3.2 eq. 1: s(t) = g_bar_10(t) - g_bar_21(t), causal rolling mean over w = 64"
    deviations = BAND_DEVIATIONS
    smoothing: ClassVar[str] = "mean"


@register_policy("epikv")
@dataclass
class EpiKV(_HiddenBands):
    """EpiKV, eq. 2: ``z_10(t) - z_21(t)`` with ``z_l(t) = (g_l(t) - mu_l(t)) / (sigma_l(t) + eps)`` over the
    trailing window (causal rolling z-score; removes the positional trend of eq. 1)."""

    citation = f"{EPIKV}, §3.2 eq. 2: z_10(t) - z_21(t), causal rolling z-score over w = 64"
    deviations = BAND_DEVIATIONS
    smoothing: ClassVar[str] = "z"
