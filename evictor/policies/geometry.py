"""Attention-free scores from the geometry of the cached keys and values (ValueDiff §3.2 and its baselines §5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evictor.policies import register_policy
from evictor.policies._inputs import require
from scoring.policy import Needs, Policy, ScoreInputs
from signals.kv import cosine_distance_to_mean, cosine_to_mean, distance_to_mean, vector_norm

VALUEDIFF = "Park, Choi, Lee, ValueDiff: value-geometric KV cache eviction for sink-suppressed LLMs"
NO_PROMPT_RULE = (
    "The paper evicts prompt tokens too (block prompt processing); here the engine's protection rule applies, "
    "'none' by default so the score alone decides, as in the paper."
)


@register_policy("keynorm")
@dataclass
class KeyNorm(Policy):
    """KeyNorm: keep the keys with the LOWEST L2 norm (Devoto et al. 2024), score = -||k_j||."""

    citation = "Devoto et al. 2024, A simple and effective L2 norm-based strategy for KV cache compression"
    deviations = "Post-RoPE keys: RoPE rotates pairs of channels, so the norm is the pre-RoPE one. " + NO_PROMPT_RULE
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(keys=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (keys,) = require(self, inputs, "keys")
        return -vector_norm(keys)


@register_policy("keydiff")
@dataclass
class KeyDiff(Policy):
    """KeyDiff: keep the keys least similar to the anchor, the mean of the L2-normalised keys of the resident cache:
    ``s_j = -cos(k_j, mean_i k_i / ||k_i||)``."""

    citation = "Park et al. 2025, KeyDiff (NeurIPS), §3: s_j = -cos(k_j, anchor), anchor = mean of normalised keys"
    deviations = (
        "Follows the authors' scorer as contributed to NVIDIA/kvpress (KeyDiffPress.score): normalise, average, "
        "negative cosine; the anchor runs over every resident key (protected and buffered included), post-RoPE; "
        "kept sets identical to KeyDiffPress's at prefill (bench/kvpress_compare.py kept). kvpress's BlockPress "
        "scores all blocks from one full-prompt forward, where the block prefill here computes each block over the "
        "compressed cache (ValueDiff §2.2), so the two agree only in layer 0. "
        "ValueDiff §5 describes it loosely as the cosine distance to the mean key. " + NO_PROMPT_RULE
    )
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, cache=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        keys, cache, mask = require(self, inputs, "keys", "cache_keys", "cache_mask")
        return -cosine_to_mean(keys, cache, mask, unit_mean=True)


@register_policy("manifoldkv")
@dataclass
class ManifoldKV(Policy):
    """ManifoldKV: keep the keys with the largest Euclidean distance from the key centroid of the resident cache."""

    citation = "Datta et al. 2026, ManifoldKV (arXiv 2602.08343); ValueDiff §5: s_j = ||k_j - mean k||"
    deviations = NO_PROMPT_RULE
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, cache=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        keys, cache, mask = require(self, inputs, "keys", "cache_keys", "cache_mask")
        return distance_to_mean(keys, cache, mask)


@register_policy("valuediff")
@dataclass
class ValueDiff(Policy):
    """ValueDiff: keep the values farthest from the per-head mean of the whole resident cache,
    ``s_j = ||v_j - v_bar||`` (ValueDiff eq. 4)."""

    citation = f"{VALUEDIFF}, §3.2 eq. 4: s_j = ||v_j - v_bar||, v_bar = mean over the n cached values"
    deviations = NO_PROMPT_RULE
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(values=True, cache=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        values, cache, mask = require(self, inputs, "values", "cache_values", "cache_mask")
        return distance_to_mean(values, cache, mask)


@register_policy("valuediff_dir")
@dataclass
class ValueDiffDir(ValueDiff):
    """ValueDiff-Dir: the direction-only endpoint, ``1 - cos(v_j, v_bar)`` (ValueDiff §3.2, after eq. 5)."""

    citation = f"{VALUEDIFF}, §3.2 (ValueDiff-Dir): s_j = 1 - cos(v_j, v_bar)"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        values, cache, mask = require(self, inputs, "values", "cache_values", "cache_mask")
        return cosine_distance_to_mean(values, cache, mask)


@register_policy("valuediff_norm")
@dataclass
class ValueDiffNorm(Policy):
    """ValueDiff-Norm: the magnitude-only endpoint, keep the LARGEST value norms, ``||v_j||`` (ValueDiff §3.2)."""

    citation = f"{VALUEDIFF}, §3.2 (ValueDiff-Norm): s_j = ||v_j||"
    deviations = NO_PROMPT_RULE
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(values=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (values,) = require(self, inputs, "values")
        return vector_norm(values)
