"""Per-token statistics of cached key and value vectors: the scores of the attention-free eviction policies.

Shapes: vectors ``x [..., n, d]`` (in the engine ``[batch, kv_head, pos, d_head]``), masks ``[..., n]`` bool with False
on padding slots. Every function returns one value per vector, ``[..., n]``, computed in float32 (float64 inputs stay
float64) whatever the cache dtype, so fp16/bf16 caches do not lose the small differences the rankings depend on.

Which paper score each function is:

- `vector_norm` of keys: KeyNorm (Devoto et al. 2024; keep LOW norms); of values: ValueDiff-Norm (ValueDiff §3.2).
- `distance_to_mean` of keys: ManifoldKV (Euclidean distance from the key centroid); of values: ValueDiff (eq. 4).
- `cosine_to_mean` of keys with ``unit_mean``: KeyDiff (cosine to the mean of the normalised keys; keep LOW);
  `cosine_distance_to_mean` of values: ValueDiff-Dir (§3.2, 1 - cos to the plain mean).
- `rkv_redundancy` of keys: R-KV's redundancy (softmax of the mean cosine to the other keys, newest duplicate exempt).
- `head_dim_variance`: EpiKV's KV-key / KV-val statistic (§3.3, before the rolling mean).
- `value_range`: VaSE's max_j v_ij - min_j v_ij (Random Attention notes §3.1 table).
- `LagNormaliser` / `lag_normalised_variance`: EpiKV's Lag-KV (§3.3), the causal form of LagKV's normalisation.

The per-token signals of the cache (`KeyNorm` ... `ValueDistanceToMean`, at the end) score each key and value when
the cache stores it, with these functions, averaged over the KV heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from scoring.signal import KVSignal
from signals import register_signal

DEFAULT_LAG_CHUNK = 64
DEFAULT_EPS = 1e-6


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x [..., n, d]`` over the n axis, counting only ``mask [..., n]`` True slots -> ``[..., d]``."""
    x = _as_float(x)
    if mask is None:
        return x.mean(-2)
    weight = mask.to(x.dtype)[..., None]
    return (x * weight).sum(-2) / weight.sum(-2).clamp_min(1)


def vector_norm(x: torch.Tensor) -> torch.Tensor:
    """``||x_j||_2`` per vector."""
    return torch.linalg.vector_norm(_as_float(x), dim=-1)


def distance_to_mean(
    x: torch.Tensor, ref: torch.Tensor | None = None, ref_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``||x_j - mean(ref)||_2``: the mean is taken over `ref` (default: x itself), e.g. the whole resident cache."""
    anchor = masked_mean(x if ref is None else ref, ref_mask)
    return torch.linalg.vector_norm(_as_float(x) - anchor[..., None, :], dim=-1)


def cosine_to_mean(
    x: torch.Tensor, ref: torch.Tensor | None = None, ref_mask: torch.Tensor | None = None, *, unit_mean: bool = False
) -> torch.Tensor:
    """``cos(x_j, anchor)`` with anchor the mean of `ref` (default: x) over its real slots; with `unit_mean` the mean
    of the L2-normalised ref vectors (KeyDiff's anchor). A zero vector (no direction) has cosine 0."""
    ref = x if ref is None else ref
    anchor = masked_mean(F.normalize(_as_float(ref), dim=-1) if unit_mean else ref, ref_mask)
    return F.cosine_similarity(_as_float(x), anchor[..., None, :].expand_as(x), dim=-1, eps=1e-12)


def cosine_distance_to_mean(
    x: torch.Tensor, ref: torch.Tensor | None = None, ref_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``1 - cos(x_j, mean(ref))`` in [0, 2]; a zero vector (no direction) counts as orthogonal, distance 1."""
    return 1.0 - cosine_to_mean(x, ref, ref_mask)


def rkv_redundancy(keys: torch.Tensor, mask: torch.Tensor | None = None, threshold: float = 0.5) -> torch.Tensor:
    """R-KV's redundancy of each key among the N real ones given, ``[..., n, d] -> [..., n]``, a distribution.

    With ``C_ij = cos(k_i, k_j)`` (``C_ii = 0``), every key i exempts its most recent duplicate: the slot j != i
    with the largest index among those with ``C_ij > threshold`` gets ``C_ij = 0`` (so the newest copy of a
    restated thought is not penalised for i). Then ``c_j = (1/N) sum_i C_ij`` and the result is ``softmax_j(c)``
    over the real keys (0 on padding). Slots are in position order, so "largest index" is "most recent".
    This is ``cal_similarity(retain_direction="last")`` of the authors' repository (Zefan-Cai/R-KV), except that a
    key with no duplicate exempts nothing (the reference then zeroes its similarity to slot 0).
    """
    unit = F.normalize(_as_float(keys), dim=-1)
    sims = unit @ unit.transpose(-1, -2)  # [..., n, n]
    n = sims.shape[-1]
    pair = ~torch.eye(n, dtype=torch.bool, device=sims.device)
    if mask is not None:
        pair = pair & mask[..., :, None] & mask[..., None, :]
    sims = sims.masked_fill(~pair, 0.0)
    index = torch.arange(n, device=sims.device)
    newest = torch.where(pair & (sims > threshold), index, -1).amax(-1, keepdim=True)  # [..., n, 1], -1: none
    sims = sims.masked_fill((index == newest) & (newest >= 0), 0.0)
    count = torch.full_like(sims[..., 0, 0], n) if mask is None else mask.sum(-1).to(sims.dtype)
    column_mean = sims.sum(-2) / count.clamp_min(1)[..., None]
    if mask is not None:
        column_mean = column_mean.masked_fill(~mask, float("-inf"))
    return torch.nan_to_num(column_mean.softmax(-1))  # a sequence with no real key: all zeros


def head_dim_variance(x: torch.Tensor) -> torch.Tensor:
    """Population variance of each vector's entries across the head dimension."""
    return _as_float(x).var(-1, unbiased=False)


def value_range(x: torch.Tensor) -> torch.Tensor:
    """``max_j x_ij - min_j x_ij`` across the head dimension (VaSE's value range)."""
    x = _as_float(x)
    return x.amax(-1) - x.amin(-1)


class LagNormaliser:
    """Causal lag-relative normalisation of a stream of vectors (EpiKV §3.3 Lag-KV, after LagKV).

    Positions are split into chunks of `chunk` tokens. A vector of chunk c >= 1 is rescaled per channel by the range of
    chunk c-1: ``(x - lo) / (hi - lo + eps)`` with lo/hi the per-channel min/max of that (complete) previous chunk.
    Chunk 0 has no predecessor: its vectors use the range of the vectors seen so far, themselves included, so the
    first vector maps to 0. ``add(x[..., new, d])`` returns the normalised ``[..., new, d]`` (float32); the stream may
    be fed in any chunking (a prefill block, then one token per decode step) with identical results.
    """

    def __init__(self, chunk: int = DEFAULT_LAG_CHUNK, eps: float = DEFAULT_EPS):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = int(chunk)
        self.eps = float(eps)
        self.seen = 0
        self._cur: tuple[torch.Tensor, torch.Tensor] | None = None  # running (lo, hi) of the incomplete chunk
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None  # (lo, hi) of the last complete chunk

    def add(self, x: torch.Tensor) -> torch.Tensor:
        x = _as_float(x)
        pieces = []
        start = 0
        while start < x.shape[-2]:
            in_chunk = self.seen % self.chunk
            stop = min(x.shape[-2], start + self.chunk - in_chunk)
            piece = x[..., start:stop, :]
            lo, hi = piece.cummin(-2).values, piece.cummax(-2).values  # running range inside this piece
            if self._cur is not None:
                lo, hi = torch.minimum(lo, self._cur[0][..., None, :]), torch.maximum(hi, self._cur[1][..., None, :])
            if self.seen < self.chunk:  # chunk 0: the range so far
                ref_lo, ref_hi = lo, hi
            else:
                assert self._prev is not None  # past chunk 0: `seen` stopped at `chunk`, completing it
                ref_lo, ref_hi = self._prev[0][..., None, :], self._prev[1][..., None, :]
            pieces.append((piece - ref_lo) / (ref_hi - ref_lo + self.eps))
            self._cur = (lo[..., -1, :].clone(), hi[..., -1, :].clone())  # not views of the whole piece
            self.seen += stop - start
            if self.seen % self.chunk == 0:
                self._prev, self._cur = self._cur, None
            start = stop
        return torch.cat(pieces, dim=-2) if pieces else x

    def state_dict(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "eps": self.eps, "seen": self.seen, "cur": self._cur, "prev": self._prev}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chunk, self.eps, self.seen = int(state["chunk"]), float(state["eps"]), int(state["seen"])
        self._cur, self._prev = state["cur"], state["prev"]


def lag_normalised_variance(x: torch.Tensor, chunk: int = DEFAULT_LAG_CHUNK, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Head-dimension variance of each vector after causal lag normalisation, over a whole sequence ``[..., pos, d]``.

    Position 0 of `x` is the first position of the stream (chunks are counted from it).
    """
    return head_dim_variance(LagNormaliser(chunk, eps).add(x))


# --- per-token signals -------------------------------------------------------------------------------------------
class _RunningMean:
    """The mean of all vectors seen so far, per position: ``add(x[b, h, new, d]) -> [b, h, new, d]``."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # [b, h, d] float64 sum
        self.count = 0

    def add(self, x: torch.Tensor) -> torch.Tensor:
        sums = x.double().cumsum(-2)
        if self.total is not None:
            sums = sums + self.total[..., None, :]
        counts = torch.arange(self.count + 1, self.count + x.shape[-2] + 1, device=x.device, dtype=torch.float64)
        self.total, self.count = sums[..., -1, :], self.count + x.shape[-2]
        return (sums / counts[:, None]).to(torch.float32)


@register_signal("key_norm")
class KeyNorm(KVSignal):
    """``||k_t||_2`` of the cached (post-RoPE) key."""

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return vector_norm(keys)


@register_signal("key_variance")
class KeyVariance(KVSignal):
    """Variance of k_t across the head dimension (EpiKV's KV-key before its rolling mean; smooth it with
    `signals.hidden.smooth`)."""

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_dim_variance(keys)


@register_signal("value_variance")
class ValueVariance(KVSignal):
    """Variance of v_t across the head dimension (EpiKV's KV-val before its rolling mean)."""

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_dim_variance(values)


@register_signal("lag_key_variance")
class LagKeyVariance(KVSignal):
    """`key_variance` after causal lag normalisation (EpiKV's Lag-KV of the keys)."""

    def __init__(self) -> None:
        super().__init__()
        self._lag = LagNormaliser()

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_dim_variance(self._lag.add(keys))


@register_signal("lag_value_variance")
class LagValueVariance(KVSignal):
    """`value_variance` after causal lag normalisation (EpiKV's Lag-KV of the values)."""

    def __init__(self) -> None:
        super().__init__()
        self._lag = LagNormaliser()

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_dim_variance(self._lag.add(values))


@register_signal("key_cosine_to_mean")
class KeyCosineToMean(KVSignal):
    """KeyDiff's 1 - cos(k_t, mean of the keys at positions <= t). The mean is causal (the cache as it is when t
    enters it), so the score is fixed when the token is produced."""

    def __init__(self) -> None:
        super().__init__()
        self._mean = _RunningMean()

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        anchor = self._mean.add(keys)  # each position vs its own causal mean: [.., new, 1, d] twice
        return cosine_distance_to_mean(keys.float()[..., None, :], ref=anchor[..., None, :])[..., 0]


@register_signal("value_distance_to_mean")
class ValueDistanceToMean(KVSignal):
    """ValueDiff's ||v_t - mean of the values at positions <= t||_2, the mean causal as for `key_cosine_to_mean`."""

    def __init__(self) -> None:
        super().__init__()
        self._mean = _RunningMean()

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        anchor = self._mean.add(values)
        return distance_to_mean(values.float()[..., None, :], ref=anchor[..., None, :])[..., 0]
