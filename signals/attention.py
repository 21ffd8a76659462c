"""Scores read from attention probabilities: the signals of the attention-requiring eviction policies.

Shapes: ``attn [..., queries, keys]`` probabilities (in the engine ``[batch, kv_head, queries, candidates]``, GQA
group-averaged, queries ordered oldest to newest); per-key results are ``[..., keys]``, per-query ``[..., queries]``.
Masks ``[..., keys]`` are bool with False on padding slots.

The per-token signals of the attention (`ReceivedAttention`, `LastQueryAttention`, `AttentionEntropy`, at the end)
read ``blocks.{l}.attn.hook_pattern`` averaged over the query heads. ``h2o`` and ``tova`` read later queries by
definition, so they are not causal per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scoring.signal import AttentionSignal, CausalSignal, head_mean
from signals import register_signal

SNAPKV_WINDOW = 32  # FasterDecoding/SnapKV: observation window of 32 queries (init_snapkv's default)
SNAPKV_KERNEL = 5  # ... pooled with an average over 5 neighbouring keys
POOLINGS = ("avg", "max")


def group_max_probabilities(logits: torch.Tensor, n_kv: int) -> torch.Tensor:
    """R-KV's GQA aggregation: ``[b, q_head, Q, S]`` logits (-inf where a query does not see a key) ->
    ``[b, kv_head, Q, S]``, the softmax over the keys of the maximum logit of each KV head's query group
    (``compute_attention_scores(pooling="max")`` of Zefan-Cai/R-KV, then its softmax). A row that sees no key is 0."""
    b, n_q, n_queries, n_keys = logits.shape
    grouped = logits.float().view(b, n_kv, n_q // n_kv, n_queries, n_keys).amax(2)
    return torch.nan_to_num(grouped.softmax(-1), nan=0.0)


def cumulative_attention(attn: torch.Tensor) -> torch.Tensor:
    """H2O: attention each key received, summed over the given queries (every query since its entry, for H2O)."""
    return attn.float().sum(-2)


def window_attention(attn: torch.Tensor, window: int) -> torch.Tensor:
    """Attention each key received from the last `window` queries, summed."""
    return attn[..., -window:, :].float().sum(-2)


def last_query_attention(attn: torch.Tensor) -> torch.Tensor:
    """TOVA: the newest query's attention over the keys."""
    return attn[..., -1, :].float()


def candidate_attention(attn: torch.Tensor, window: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the last `window` queries of each query's attention renormalised over the real keys given.

    This is a softmax restricted to the scored keys, as R-KV (softmax over all keys but its observation window) and
    VaSE (softmax over the eviction candidates) compute it; a query that gives the keys no mass contributes 0.
    """
    a = attn[..., -window:, :].float()
    if mask is not None:
        a = a.masked_fill(~mask[..., None, :], 0.0)
    return (a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)).mean(-2)


def pool_keys(
    scores: torch.Tensor, kernel: int, mask: torch.Tensor | None = None, pooling: str = "avg"
) -> torch.Tensor:
    """Pool each key's score over its `kernel` neighbours in slot order (odd kernel, centred).

    Padding slots (and the edges) count as 0, and "avg" always divides by `kernel`, as ``F.avg_pool1d`` does with
    its default ``count_include_pad=True`` in SnapKV and VaSE. Scores are non-negative, so a padding slot never
    raises a real neighbour's max.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be a positive odd number, got {kernel}")
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; valid choices: {', '.join(POOLINGS)}")
    if mask is not None:
        scores = scores.masked_fill(~mask, 0.0)
    flat = scores.float().reshape(-1, 1, scores.shape[-1])
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    return pool(flat, kernel, stride=1, padding=kernel // 2).reshape(scores.shape)


def snapkv_scores(
    attn: torch.Tensor,
    window: int = SNAPKV_WINDOW,
    kernel: int = SNAPKV_KERNEL,
    mask: torch.Tensor | None = None,
    pooling: str = "avg",
) -> torch.Tensor:
    """SnapKV: attention from the last `window` queries, summed, then pooled over neighbouring keys (average over 5
    in the original repository, ``SnapKVCluster.update_kv``)."""
    return pool_keys(window_attention(attn, window), kernel, mask, pooling)


def attention_entropy(attn: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each query's attention distribution -> ``[..., queries]``; 0 log 0 = 0."""
    a = attn.float()
    return -torch.special.xlogy(a, a).sum(-1)


def received_attention_entropy(attn: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of how each key's received attention spreads over the queries -> ``[..., keys]``.

    The column is renormalised to a distribution over queries; a key no query attends to has entropy 0.
    """
    a = attn.float()
    p = a / a.sum(-2, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    return -torch.special.xlogy(p, p).sum(-2)


def r_kv_scores(importance: torch.Tensor, redundancy: torch.Tensor, lam: float) -> torch.Tensor:
    """R-KV's final score, ``lam * importance - (1 - lam) * redundancy`` (``R1KV.update_kv``).

    Both terms are distributions over the scored keys (pooled attention; a softmax of the redundancy,
    `signals.kv.rkv_redundancy`), so they share a scale of 1/N and lam weighs them as the authors intend.
    """
    return lam * importance.float() - (1.0 - lam) * redundancy.float()


def fastcaote_scores(alpha: torch.Tensor, value_distance: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FastCAOTE (ValueDiff eq. A.11): ``alpha_j / (1 - alpha_j) * ||v_j - v_bar||``."""
    alpha = alpha.float()
    return alpha / (1.0 - alpha).clamp_min(eps) * value_distance


def raas_timestamps(
    attn: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, threshold: torch.Tensor | float
) -> torch.Tensor:
    """RaaS LRU timestamps: the position of the newest query that gave the key attention above `threshold`, or the
    key's own position (its entry) when none did or when that is later.

    `query_positions` ``[..., queries]`` broadcasts against attn's leading axes; `threshold` is a float or a tensor
    broadcastable to ``[..., queries, keys]``. Returns float ``[..., keys]``.
    """
    refreshed = attn.float() > threshold
    stamps = torch.where(refreshed, query_positions[..., :, None].float(), float("-inf")).amax(-2)
    return torch.maximum(stamps, key_positions.float())


def longflow_contribution(alpha: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """LongFlow: the L1 norm of each key's contribution to the attention output, ``||alpha_j v_j||_1``."""
    return alpha.float() * values.float().abs().sum(-1)


def vase_scores(
    value_range: torch.Tensor,
    weights: torch.Tensor,
    n_large: int,
    uniform: torch.Tensor,
    mask: torch.Tensor,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """VaSE as one score per key, so that a plain top-K reproduces its two-stage selection.

    The `n_large` real keys with the largest value range, `pinned` keys first (VaSE's sinks), score ``1 + range``
    (above everything else); the others score ``log(u) / w`` with ``u ~ Uniform(0, 1]`` given in `uniform` and w
    their attention weight, which is <= 0: the top-k of these keys is a sample of k without replacement with
    probability proportional to w (Efraimidis-Spirakis), and a weight of 0 ranks below every positive weight.
    """
    n_large = min(int(n_large), value_range.shape[-1])
    ranges = value_range.float()
    large = torch.zeros_like(mask)
    if n_large > 0:
        rank = ranges if pinned is None else ranges.masked_fill(pinned, float("inf"))
        top = rank.masked_fill(~mask, float("-inf")).topk(n_large, dim=-1).indices
        large = large.scatter(-1, top, True) & mask
    sampled = torch.log(uniform.float()) / weights.float().clamp_min(1e-30)
    return torch.where(large, 1.0 + ranges, sampled)


# --- per-token signals -------------------------------------------------------------------------------------------
@register_signal("h2o")
class ReceivedAttention(AttentionSignal):
    """The attention each position received, summed over every query forwarded so far: at the end of a
    teacher-forced pass, over every later position of the trace (the H2O accumulator without eviction)."""

    def __init__(self) -> None:
        super().__init__()
        self._received: torch.Tensor | None = None  # [batch, seen]

    def update(self, rows: torch.Tensor) -> None:
        received = cumulative_attention(self.by_position(rows))
        if self._received is not None:
            received[:, : self._received.shape[1]] += self._received
        self._received = received

    def result(self) -> torch.Tensor:
        assert self._received is not None, "result() after at least one add()"
        return self._received.cpu()


@register_signal("tova")
class LastQueryAttention(AttentionSignal):
    """The attention the last forwarded query gives each position (TOVA's score; 0 on a position it does not see)."""

    def __init__(self) -> None:
        super().__init__()
        self._last_row: torch.Tensor | None = None  # [batch, seen]

    def update(self, rows: torch.Tensor) -> None:
        self._last_row = last_query_attention(self.by_position(rows))

    def result(self) -> torch.Tensor:
        assert self._last_row is not None, "result() after at least one add()"
        return self._last_row.cpu()


@register_signal("attention_entropy")
class AttentionEntropy(CausalSignal):
    """The entropy (nats) of position t's own query distribution over the positions it sees."""

    reads = "attention"

    def values(self, probs: torch.Tensor) -> torch.Tensor:
        return attention_entropy(head_mean(probs))
