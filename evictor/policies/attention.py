"""Attention-requiring policies: they read ``ScoreInputs.attention [batch, kv_head, queries, candidates]`` (GQA
group-averaged probabilities over the whole resident cache, queries oldest to newest), so they need the attention
weights of the eager kernel or a recomputation of them.

Each policy notes which choices of its original implementation it follows (checked against the released code where
there is one) and where it departs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.errors import UsageError, unknown_choice
from evictor.policies import register_policy
from evictor.policies._inputs import require, uniform
from scoring.policy import Needs, Policy, ScoreInputs
from signals import attention as att
from signals.kv import distance_to_mean, rkv_redundancy, value_range

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
        "key since it entered. Protection is EpiKV's variant (App. 9): 4 sinks + the engine's buffer / recency "
        "window; the original splits K into heavy hitters and its own recent window, no sinks (h2o_split). Scored "
        "at the engine's eviction rounds. kvpress's ObservedAttentionPress is not this score: it divides each key's "
        "sum by the number of queries that saw it (bench/kvpress_compare.py kept shows the kept sets differ). "
        + GROUP_MEAN
    )
    default_protection = "sinks"
    signal = "h2o"

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=0)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        return att.cumulative_attention(attn)


@register_policy("h2o_split")
@dataclass
class H2OSplit(H2O):
    """H2O with its own protocol: the budget split into a recent window of ``floor(recent_share * K)`` newest
    tokens, kept by the policy under every protocol (`kept_recent`), and heavy hitters (the highest accumulated
    attention) for the rest; no sinks. `h2o` is EpiKV's variant (sinks + the engine's buffer)."""

    recent_share: float = 0.5
    deviations = (
        "Follows FMInference/H2O (H2OKVCache_LayerWise: hh_size heavy hitters + recent_size recent tokens, equal "
        "shares in the paper's runs, recent_share = 0.5): the recent window is the policy's own protection, inside "
        "K; the engine's buffer, when the protocol has one, keeps the newest tokens on top of K as well. Scored at "
        "the engine's eviction rounds (H2O evicts one token per step). " + GROUP_MEAN
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_share < 1.0:
            raise UsageError(f"{self.name}: recent_share must be in [0, 1), got {self.recent_share}")

    def kept_recent(self, budget: int) -> int:
        return math.floor(self.recent_share * budget)


@register_policy("tova")
@dataclass
class TOVA(Policy):
    """TOVA: keep the candidates the newest query attends to most, averaged over all heads of the layer, so every
    head keeps the same tokens (Oren et al., EMNLP 2024)."""

    citation = "Oren et al. 2024, Transformers are multi-state RNNs (TOVA); ValueDiff §2.1: s_i = last query's alpha_i"
    deviations = (
        "Follows schwartz-lab-NLP/TOVA (TOVACache.reduce): the last query's attention averaged over the query heads, "
        "one keep set for the layer; evaluated at the engine's eviction rounds rather than at every step. The "
        "newest token is scored like any other, as in TOVACache; kvpress's TOVAPress always keeps it, the one "
        "difference between the two kept sets (bench/kvpress_compare.py kept: with a recency window of 1, "
        "tova_newest, they are identical)."
    )
    shared_across_heads = True
    default_protection = "none"
    signal = "tova"

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
    `kernel` (5) neighbouring candidates. The observation window itself is always kept, under every protocol
    (`kept_recent`): it is SnapKV's own protection, inside the budget."""

    window: int = att.SNAPKV_WINDOW
    kernel: int = att.SNAPKV_KERNEL
    pooling: str = "avg"
    citation = f"Li et al. 2024, SnapKV (NeurIPS); {RANDOM_ATTENTION}: s_i = sum over the last w queries, pooled"
    deviations = (
        "Follows FasterDecoding/SnapKV (SnapKVCluster.update_kv, init_snapkv): window 32, avg_pool1d kernel 5 "
        "(divisor 5 at the edges), probabilities over the whole cache summed over the window, the window's 32 "
        "tokens kept inside K (the policy's own protection, not the engine buffer's, so it holds under every "
        "protocol; the engine's buffer, when larger, keeps them already). Applied at every decode-time eviction "
        "round (SnapKV compresses the prompt once); pooling neighbours are adjacent candidate slots. Random "
        "Attention's engine averages the 64 buffered queries' attention renormalised over the candidates "
        "(window=64 comes closest). " + GROUP_MEAN + " (averaging the pooled scores of the group, as kvpress "
        "does, is the same: average pooling is linear) " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel, self.pooling)

    def kept_recent(self, budget: int) -> int:
        return self.window

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=self.window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        return att.snapkv_scores(attn, self.window, self.kernel, inputs.candidate_mask, self.pooling)


@register_policy("r_kv")
@dataclass
class RKV(Policy):
    """R-KV as its authors compute it: ``lam * importance_i - (1 - lam) * redundancy_i`` (Cai et al. 2025).
    importance = the last `window` (8) queries' attention, each KV head's query group reduced to its maximum logit
    before the softmax, renormalised over the candidates, averaged over the queries, max-pooled over `kernel` (7)
    neighbours; redundancy = softmax over every resident key of its mean cosine to the other resident keys, each
    key's most recent duplicate (cosine > `threshold`) exempt (`signals.kv.rkv_redundancy`), read at the
    candidates. The `window` observation tokens are always kept (`kept_recent`), inside K. lam = 0.1 as the authors
    recommend; Random Attention's tables use lam = 0.5. `r_kv_mean` is the earlier kvscope variant."""

    lam: float = 0.1
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    threshold: float = 0.5
    citation = (
        "Cai et al. 2025, R-KV: redundancy-aware KV cache compression for reasoning models (Zefan-Cai/R-KV, "
        "R1KV.update_kv, compute_attention_scores, cal_similarity): s_i = lam maxpool(a)_i - (1 - lam) softmax(c)_i; "
        f"written lam s_snap_i + (1 - lam)(1 - c_i) in the {RANDOM_ATTENTION}"
    )
    deviations = (
        "Follows the authors' repository: the group's maximum logit before the softmax (compute_attention_scores, "
        "pooling='max'), softmax over the scored keys, the mean of the 8 observation queries, max_pool1d kernel 7; "
        "the similarity matrix and its softmax over every resident key (observation window included) read at the "
        "candidates, threshold 0.5 with the newest duplicate exempt; the 8 observation tokens kept inside K; lam "
        "0.1 (README; the repository's command-line default is 0.07). Departures: a key with no duplicate exempts "
        "nothing (the repository then zeroes its similarity to slot 0); the repository's staging buffer (compress "
        "every 128 generated tokens, scoring all but the 8 newest) is the protocol's trigger and buffer, not the "
        "policy's; protected tokens (none by default) are never candidates. Random Attention's own R-KV column is "
        "a different port (64-query mean, avg-pool 5, no duplicate exemption, lam 0.5). " + SCORE_DECIDES
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        _check_window(self, self.window, self.kernel, self.pooling)
        if not 0.0 <= self.lam <= 1.0:
            raise UsageError(f"{self.name}: lam must be in [0, 1], got {self.lam}")
        if not -1.0 <= self.threshold <= 1.0:
            raise UsageError(f"{self.name}: threshold is a cosine, in [-1, 1]; got {self.threshold}")

    def kept_recent(self, budget: int) -> int:
        return self.window

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, cache=True, attention=True, queries_window=self.window, attention_group="max_logits")

    def redundancy(self, inputs: ScoreInputs) -> torch.Tensor:
        """The redundancy of each candidate, computed over every resident key and read at the candidates."""
        cache, mask, cache_positions = require(self, inputs, "cache_keys", "cache_mask", "cache_positions")
        every = rkv_redundancy(cache, mask, self.threshold)  # [b, kv, slots]
        # Slots are sorted by position (padding, -1, first), so a candidate's slot is found by its position.
        slot = torch.searchsorted(cache_positions.contiguous(), inputs.positions.contiguous())
        return every.gather(-1, slot.clamp_max(every.shape[-1] - 1))

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        (attn,) = require(self, inputs, "attention")
        mask = inputs.candidate_mask
        attention = att.candidate_attention(attn, self.window, mask)
        importance = att.pool_keys(attention, self.kernel, mask, self.pooling)
        return att.r_kv_scores(importance, self.redundancy(inputs), self.lam)


@register_policy("r_kv_mean")
@dataclass
class RKVMean(RKV):
    """R-KV as kvscope first ported it: the query group's probabilities averaged after the softmax, the redundancy's
    similarity matrix and softmax over the candidates only, and no kept observation window (the protocol's buffer
    decides about the newest tokens). Kept to restate findings measured with it (the old value of P2)."""

    citation = RKV.citation
    deviations = (
        "The authors max the GQA group's logits before the softmax; here the group's probabilities are averaged. "
        "The similarity matrix and its softmax run over the candidates (as Random Attention's audited port does) "
        "rather than over every resident key. The observation window is not kept by the policy. Otherwise as r_kv."
    )

    def kept_recent(self, budget: int) -> int:
        return 0

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, attention=True, queries_window=self.window)

    def redundancy(self, inputs: ScoreInputs) -> torch.Tensor:
        (keys,) = require(self, inputs, "keys")
        return rkv_redundancy(keys, inputs.candidate_mask, self.threshold)


@register_policy("vase")
@dataclass
class VaSE(Policy):
    """VaSE: keep the ``n_large = keep // 4`` candidates with the largest value range (the first `sinks` tokens
    forced among them), fill the rest by sampling without replacement proportionally to the observed attention (the
    last `window` = 64 queries' attention renormalised over the candidates, averaged, average-pooled over `kernel`
    = 5 neighbours), expressed as one score per candidate (`signals.attention.vase_scores`)."""

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
    defined_for = ("prompt",)
    defined_by = "RaaS and EpiKV App. 9: the prefill is kept"

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
