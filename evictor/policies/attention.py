"""Attention-requiring policies: they read ``ScoreInputs.attention [batch, kv_head, queries, candidates]`` (GQA
group-averaged probabilities, queries oldest to newest), so they need the eager attention kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evictor.policies._inputs import require, uniform
from evictor.policy import Needs, Policy, ScoreInputs, register_policy
from core.errors import UsageError
from probes.signals import attention as att
from probes.signals.kv import distance_to_mean, mean_cosine_to_others, value_range

RANDOM_ATTENTION = "Random Attention notes §3.1 baselines table"
SCORE_DECIDES = "No protection by default: the score alone decides about the prompt, as in the paper's main grid."


def _check_window(policy: Policy, window: int, kernel: int | None = None) -> None:
    if window < 1:
        raise UsageError(f"{policy.name}: window must be >= 1, got {window}")
    if kernel is not None and (kernel < 1 or kernel % 2 == 0):
        raise UsageError(f"{policy.name}: kernel must be a positive odd number, got {kernel}")


@register_policy("h2o")
@dataclass
class H2O(Policy):
    """H2O heavy hitters: attention each candidate received, accumulated over every query since its entry."""

    citation = f"Zhang et al. 2023, H2O (NeurIPS); {RANDOM_ATTENTION}: s_i = sum_(t'=i..t) alpha_i^(t')"
    deviations = "Sinks + recent buffer are protected (EpiKV App. 9) and the rest is scored at each eviction round."
    default_protection = "sinks"

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=0)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        return att.cumulative_attention(attn)


@register_policy("tova")
@dataclass
class TOVA(Policy):
    """TOVA: keep the candidates the newest query attends to most (Oren et al., EMNLP 2024)."""

    citation = "Oren et al. 2024, Transformers are multi-state RNNs (TOVA); ValueDiff §2.1: s_i = last query's alpha_i"
    deviations = (
        "Each KV head ranks by its own GQA group-averaged attention (per-head eviction), evaluated at the engine's "
        "eviction rounds rather than at every step."
    )
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=1)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        return att.last_query_attention(attn)


@register_policy("snapkv")
@dataclass
class SnapKV(Policy):
    """SnapKV: attention from the last `window` queries (observation window, 32), summed, max-pooled over
    `kernel` (7) neighbouring candidates."""

    window: int = att.SNAPKV_WINDOW
    kernel: int = att.SNAPKV_KERNEL
    citation = f"Li et al. 2024, SnapKV (NeurIPS); {RANDOM_ATTENTION}: s_i = sum over the last w queries, max-pooled"
    deviations = (
        "Applied at every decode-time eviction round (SnapKV compresses the prompt once); neighbours for the pooling "
        "are adjacent candidate slots. " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel)

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        return att.snapkv_scores(attn, self.window, self.kernel, inputs.candidate_mask)


@register_policy("r_kv")
@dataclass
class RKV(Policy):
    """R-KV: ``lam * s_snap + (1 - lam) * (1 - c_i)``, c_i = mean cosine of key i to the other resident keys, so that
    restated content is penalised (lam = 0.1 by default; the Random Attention runs use 0.5)."""

    lam: float = 0.1
    window: int = att.SNAPKV_WINDOW
    kernel: int = att.SNAPKV_KERNEL
    citation = f"R-KV; {RANDOM_ATTENTION}: s_i = lam s_snap_i + (1 - lam)(1 - c_i), c_i = mean_(j!=i) cos(k_i, k_j)"
    deviations = (
        "s_snap is the SnapKV score divided by the number of window queries (a mean, in [0, 1]) so both terms share a "
        "scale; c_i runs over every resident key, not only the candidates. " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel)
        if not 0.0 <= self.lam <= 1.0:
            raise UsageError(f"{self.name}: lam must be in [0, 1], got {self.lam}")

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, cache=True, attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, keys, cache, mask = require(self, inputs, "attention", "keys", "cache_keys", "cache_mask")
        importance = att.snapkv_scores(attn, self.window, self.kernel, inputs.candidate_mask)
        importance = importance / min(self.window, attn.shape[-2])
        return att.r_kv_scores(importance, mean_cosine_to_others(keys, cache, mask), self.lam)


@register_policy("vase")
@dataclass
class VaSE(Policy):
    """VaSE: keep the ``n_large = keep // 4`` candidates with the largest value range, fill the rest by sampling
    without replacement proportionally to the SnapKV score, expressed as one score per candidate
    (`probes.signals.attention.vase_scores`)."""

    large_fraction: float = 0.25
    window: int = att.SNAPKV_WINDOW
    kernel: int = att.SNAPKV_KERNEL
    citation = f"VaSE; {RANDOM_ATTENTION}: n_large = K/4 largest max_j v_ij - min_j v_ij, rest sampled prop. to s_snap"
    deviations = (
        "Sampling uses the Efraimidis-Spirakis keys log(u)/w so the engine's top-K draws the sample; the split reads "
        "ScoreInputs.keep. " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel)
        if not 0.0 <= self.large_fraction <= 1.0:
            raise UsageError(f"{self.name}: large_fraction must be in [0, 1], got {self.large_fraction}")

    @property
    def needs(self) -> Needs:
        return Needs(values=True, attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, values = require(self, inputs, "attention", "values")
        weights = att.snapkv_scores(attn, self.window, self.kernel, inputs.candidate_mask)
        n_large = int(inputs.keep * self.large_fraction)
        draws = uniform(self, inputs, tuple(inputs.positions.shape))
        return att.vase_scores(value_range(values), weights, n_large, draws, inputs.candidate_mask)


@register_policy("fastcaote")
@dataclass
class FastCAOTE(Policy):
    """FastCAOTE: ``alpha_j / (1 - alpha_j) * ||v_j - v_bar||`` (ValueDiff eq. A.11, CAOTE eq. 23), alpha the
    attention of the last `window` queries (averaged), v_bar the mean value of the resident cache."""

    window: int = 1
    citation = "Goel et al. 2025, CAOTE eq. 23; ValueDiff App. A eq. A.11: s_j = a_j / (1 - a_j) * ||v_j - v_bar||"
    deviations = "With window > 1, alpha is the mean attention of the last `window` queries. " + SCORE_DECIDES
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window)

    @property
    def needs(self) -> Needs:
        return Needs(values=True, cache=True, attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, values, cache, mask = require(self, inputs, "attention", "values", "cache_values", "cache_mask")
        alpha = attn[..., -self.window :, :].float().mean(-2)
        return att.fastcaote_scores(alpha, distance_to_mean(values, cache, mask))


@register_policy("raas")
@dataclass
class RaaS(Policy):
    """RaaS: attention-refreshed LRU timestamps (Hu et al., ACL Findings 2025). A candidate's timestamp is the newest
    query that attended to it above `threshold` x the uniform share ``1 / (real candidates)``, or its entry position;
    the newest timestamps are kept, and the prefill is protected."""

    threshold: float = 1.0
    citation = "Hu et al. 2025, RaaS (ACL Findings); EpiKV §2: attention-refreshed LRU timestamp, prefill kept"
    deviations = (
        "The refresh threshold is relative to uniform attention over the candidates (our choice: RaaS's own constant "
        "is not reproduced); token-level, not page-level."
    )
    default_protection = "prompt"

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise UsageError(f"{self.name}: threshold must be >= 0, got {self.threshold}")

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=0)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, query_positions = require(self, inputs, "attention", "query_positions")
        uniform_share = 1.0 / inputs.candidate_mask.sum(-1).clamp_min(1)  # [batch, kv_head]
        return att.raas_timestamps(
            attn, query_positions[:, None, :], inputs.positions, self.threshold * uniform_share[..., None, None]
        )


@register_policy("longflow")
@dataclass
class LongFlow(Policy):
    """LongFlow: each candidate's contribution to the newest query's attention output, ``||alpha_j v_j||_1``."""

    citation = "LongFlow; EpiKV §2: score = ||softmax(scores) V||_1 per token contribution"
    deviations = "Evaluated at the engine's eviction rounds with the newest query. " + SCORE_DECIDES
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(values=True, attention=True, queries_window=1)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, values = require(self, inputs, "attention", "values")
        return att.longflow_contribution(att.last_query_attention(attn), values)
