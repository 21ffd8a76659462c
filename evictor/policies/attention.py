"""Attention-requiring policies: they read ``ScoreInputs.attention [batch, kv_head, queries, candidates]`` (GQA
group-averaged probabilities over the whole resident cache, queries oldest to newest), so they need the attention
weights of the eager kernel or a recomputation of them.

Each policy notes which choices of its original implementation it follows (checked against the released code where
there is one) and where it departs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import UsageError, unknown_choice
from evictor.policies._inputs import require, uniform
from evictor.policy import Needs, Policy, ScoreInputs, register_policy
from probes.signals import attention as att
from probes.signals.kv import distance_to_mean, rkv_redundancy, value_range

RANDOM_ATTENTION = "Random Attention notes §3.1 baselines table"
SCORE_DECIDES = "No protection by default: the score alone decides about the prompt, as in the paper's main grid."
GROUP_MEAN = "GQA: the query heads of a KV head are averaged after the softmax."


def _check_window(policy: Policy, window: int, kernel: int | None = None, pooling: str | None = None) -> None:
    if window < 1:
        raise UsageError(f"{policy.name}: window must be >= 1, got {window}")
    if kernel is not None and (kernel < 1 or kernel % 2 == 0):
        raise UsageError(f"{policy.name}: kernel must be a positive odd number, got {kernel}")
    if pooling is not None and pooling not in att.POOLINGS:
        raise unknown_choice(f"{policy.name} pooling", pooling, att.POOLINGS)


@register_policy("h2o")
@dataclass
class H2O(Policy):
    """H2O heavy hitters: attention each candidate received, accumulated over every query since its entry."""

    citation = f"Zhang et al. 2023, H2O (NeurIPS); {RANDOM_ATTENTION}: s_i = sum_(t'=i..t) alpha_i^(t')"
    deviations = (
        "Follows FMInference/H2O (H2OKVCache_LayerWise): per-head sums of the probabilities every query gave the "
        "key since it entered. Sinks + the recent window are protected, as EpiKV App. 9 runs it (the original keeps "
        "heavy hitters + a recent window, no sinks); scored at the engine's eviction rounds. " + GROUP_MEAN
    )
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
    """TOVA: keep the candidates the newest query attends to most, averaged over all heads of the layer, so every
    head keeps the same tokens (Oren et al., EMNLP 2024)."""

    citation = "Oren et al. 2024, Transformers are multi-state RNNs (TOVA); ValueDiff §2.1: s_i = last query's alpha_i"
    deviations = (
        "Follows schwartz-lab-NLP/TOVA (TOVACache.reduce): the last query's attention averaged over the query heads, "
        "one keep set for the layer; evaluated at the engine's eviction rounds rather than at every step."
    )
    shared_across_heads = True
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=1)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        # KV heads have equal query groups, so the mean of group means is the mean over every query head.
        return att.last_query_attention(attn).mean(1, keepdim=True).expand(inputs.positions.shape)


@register_policy("snapkv")
@dataclass
class SnapKV(Policy):
    """SnapKV: attention from the last `window` queries (the observation window, 32), summed, averaged over
    `kernel` (5) neighbouring candidates."""

    window: int = att.SNAPKV_WINDOW
    kernel: int = att.SNAPKV_KERNEL
    pooling: str = "avg"
    citation = f"Li et al. 2024, SnapKV (NeurIPS); {RANDOM_ATTENTION}: s_i = sum over the last w queries, pooled"
    deviations = (
        "Follows FasterDecoding/SnapKV (SnapKVCluster.update_kv, init_snapkv): window 32, avg_pool1d kernel 5 "
        "(divisor 5 at the edges), probabilities over the whole cache summed over the window. Applied at every "
        "decode-time eviction round (SnapKV compresses the prompt once); pooling neighbours are adjacent candidate "
        "slots. Random Attention's engine averages the 64 buffered queries' attention renormalised over the "
        "candidates (window=64 comes closest). " + GROUP_MEAN + " " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel, self.pooling)

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        return att.snapkv_scores(attn, self.window, self.kernel, inputs.candidate_mask, self.pooling)


@register_policy("r_kv")
@dataclass
class RKV(Policy):
    """R-KV: ``lam * importance_i - (1 - lam) * redundancy_i`` (Cai et al. 2025), both terms distributions over the
    candidates: importance = the last `window` (8) queries' attention renormalised over the candidates, averaged,
    max-pooled over `kernel` (7) neighbours; redundancy = softmax of each key's mean cosine to the other candidate
    keys, where each key's most recent duplicate (cosine > `threshold`) is exempt (`probes.signals.kv.rkv_redundancy`).
    lam = 0.1 as the authors recommend; Random Attention's tables use lam = 0.5."""

    lam: float = 0.1
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    threshold: float = 0.5
    citation = (
        "Cai et al. 2025, R-KV: redundancy-aware KV cache compression for reasoning models (Zefan-Cai/R-KV, "
        "R1KV.update_kv): s_i = lam maxpool(a)_i - (1 - lam) softmax(c)_i; written lam s_snap_i + (1 - lam)(1 - c_i) "
        f"in the {RANDOM_ATTENTION}"
    )
    deviations = (
        "Follows the authors' repository: window 8, max_pool1d kernel 7, softmax of the attention over the scored "
        "keys, threshold 0.5 with the newest duplicate exempt, softmax of the mean similarity, lam 0.1 (README). "
        "Departures: the authors max-pool the GQA group's logits before the softmax, here the group's probabilities "
        "are averaged; the similarity matrix and its softmax run over the candidates (as Random Attention's audited "
        "port does) rather than also over R-KV's 8 observation-window keys. Random Attention's own R-KV column is a "
        "different port (64-query mean, avg-pool 5, no duplicate exemption, lam 0.5). " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel, self.pooling)
        if not 0.0 <= self.lam <= 1.0:
            raise UsageError(f"{self.name}: lam must be in [0, 1], got {self.lam}")
        if not -1.0 <= self.threshold <= 1.0:
            raise UsageError(f"{self.name}: threshold is a cosine, in [-1, 1]; got {self.threshold}")

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, keys = require(self, inputs, "attention", "keys")
        mask = inputs.candidate_mask
        attention = att.candidate_attention(attn, self.window, mask)
        importance = att.pool_keys(attention, self.kernel, mask, self.pooling)
        return att.r_kv_scores(importance, rkv_redundancy(keys, mask, self.threshold), self.lam)


@register_policy("vase")
@dataclass
class VaSE(Policy):
    """VaSE: keep the ``n_large = keep // 4`` candidates with the largest value range (the first `sinks` tokens
    forced among them), fill the rest by sampling without replacement proportionally to the observed attention (the
    last `window` = 64 queries' attention renormalised over the candidates, averaged, average-pooled over `kernel`
    = 5 neighbours), expressed as one score per candidate (`probes.signals.attention.vase_scores`)."""

    large_fraction: float = 0.25
    window: int = 64
    kernel: int = 5
    sinks: int = 4
    citation = (
        "Chang 2026, VaSE (terarachang/VaSE, mode range_sink_sample_attn --smooth); "
        f"{RANDOM_ATTENTION}: n_large = K/4 largest max_j v_ij - min_j v_ij, rest sampled prop. to s_snap"
    )
    deviations = (
        "Follows VaSE's cache_utils (range_sink_sample_attn with --smooth, n_large = K/4 as in Random Attention): the "
        "buffer's 64 queries, softmax over the candidates, avg_pool1d kernel 5, sinks pinned in the large set. "
        "Sampling uses the Efraimidis-Spirakis keys log(u)/w so the engine's top-K draws the sample; the split reads "
        "ScoreInputs.keep. " + GROUP_MEAN + " " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel)
        if not 0.0 <= self.large_fraction <= 1.0:
            raise UsageError(f"{self.name}: large_fraction must be in [0, 1], got {self.large_fraction}")
        if self.sinks < 0:
            raise UsageError(f"{self.name}: sinks must be >= 0, got {self.sinks}")

    @property
    def needs(self) -> Needs:
        return Needs(values=True, attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, values = require(self, inputs, "attention", "values")
        mask = inputs.candidate_mask
        weights = att.pool_keys(att.candidate_attention(attn, self.window, mask), self.kernel, mask)
        n_large = int(inputs.keep * self.large_fraction)
        draws = uniform(self, inputs, tuple(inputs.positions.shape))
        return att.vase_scores(value_range(values), weights, n_large, draws, mask, inputs.positions < self.sinks)


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
    """RaaS: attention-refreshed LRU timestamps (Hu et al., ACL Findings 2025). Every query that gives a token more
    than `threshold` x its uniform share ``1 / n`` (n = the keys that query saw) refreshes the token's timestamp to
    the query's position; a token never refreshed keeps its own position. The newest timestamps are kept (LRU), and
    the prefill is protected."""

    threshold: float = 1.0
    citation = "Hu et al. 2025, RaaS (ACL Findings); EpiKV §2: attention-refreshed LRU timestamp, prefill kept"
    deviations = (
        "Token-level, not page-level (RaaS scores pages by representative keys). The refresh threshold is expressed "
        "relative to each query's uniform share 1/n of the keys it saw, 1 by default: RaaS's own constant could not "
        "be checked against its text here. The engine's attention feed applies the rule to every query as it runs "
        "(exact under every kernel), per KV head on the GQA group-averaged probabilities."
    )
    default_protection = "prompt"

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise UsageError(f"{self.name}: threshold must be >= 0, got {self.threshold}")

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=0, refresh_threshold=self.threshold)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (refreshed,) = require(self, inputs, "refreshed")
        return refreshed.float()


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
