"""Attention probabilities for attention-requiring policies, from one of two sources.

- ``"eager"``: the eager kernel's own attention weights. A forward hook on every attention module reads the weights
  the module returns ``[b, q_head, queries, slots]``, GQA-averages them to ``[b, kv_head, queries, slots]`` and keeps
  either the sum over every query since each key's entry (``queries_window == 0``, H2O) or the last ``W`` rows, both
  stored per slot in the cache so that eviction compacts them.
- ``"window"``: works with any kernel (SDPA, FlashAttention-2). The last ``W`` queries of every layer are captured
  (``attn.hook_q``, pre-RoPE), rotated with the model's own RoPE at their true positions (the cos/sin the attention
  module receives), and at an eviction round ``softmax(q K^T * scaling)`` is recomputed over the *current* cache
  (causal and sliding-window masks by position, GQA group-averaged). Keys evicted since a query ran are absent from
  its recomputed row, so this is an approximation of what the query saw.

FA-compatible policies never get a feed: `AttentionFeed` instances exist only for policies with
``needs.attention``, and each delivery increments `requests`, which tests assert stays 0 otherwise.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack

import torch

from evictor.cache import EvictingCache, position_mask
from core.errors import UsageError
from models.hooks import capture, decoder_layers, hook_name


def group_average(weights: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[b, q_head, queries, slots]`` -> ``[b, kv_head, queries, slots]``: mean over each KV head's query group
    (query head j belongs to KV head j // group, as in `repeat_kv`)."""
    b, n_q, q, s = weights.shape
    return weights.view(b, n_kv, n_q // n_kv, q, s).mean(2)


def recompute_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention probabilities of post-RoPE `queries` ``[b, q_head, Q, d]`` over `keys` ``[b, kv_head, S, d]``,
    GQA group-averaged: ``[b, kv_head, Q, S]`` float32. Rows of padding queries (position < 0) are zero."""
    b, n_q, n_queries, d = queries.shape
    n_kv = keys.shape[1]
    group = n_q // n_kv
    grouped = queries.float().reshape(b, n_kv, group * n_queries, d)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling  # [b, kv, group*Q, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    mask = position_mask(key_positions, query_positions, window, 1, torch.float32)  # [b, kv, Q, S]
    logits = logits.view(b, n_kv, group, n_queries, -1) + mask[:, :, None]
    probs = torch.softmax(logits, dim=-1).mean(2)
    return probs * (query_positions >= 0)[:, None, :, None]


class AttentionFeed:
    """Base: installs hooks for the session and hands `ScoreInputs.attention` rows to the engine."""

    source = ""

    def __init__(self, model, cache: EvictingCache, window: int) -> None:
        self.model = model
        self.cache = cache
        self.window = window  # 0 = streaming sum since entry (eager only)
        self.n_kv = model.config.num_key_value_heads
        self.requests = 0
        self.pending_positions: torch.Tensor | None = None

    def install(self, stack: ExitStack) -> None:
        raise NotImplementedError

    def begin_forward(self, positions: torch.Tensor) -> None:
        self.pending_positions = positions

    def end_forward(self) -> None:
        raise NotImplementedError

    def rows(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([b, kv, queries, hi - lo], [b, queries])``: probabilities over slots ``lo:hi`` and the queries' positions."""
        raise NotImplementedError


class _QueryRing:
    """The positions of the last `window` queries of the session (shared by every layer)."""

    def __init__(self, batch: int, window: int, device: torch.device) -> None:
        self.window = window
        self.positions = torch.full((batch, window), -1, dtype=torch.int32, device=device)
        self.filled = 0
        self.next = 0

    def slots_for(self, n: int) -> torch.Tensor:
        """Ring rows that the last ``min(n, window)`` queries of a forward of `n` queries go to."""
        take = min(n, self.window)
        return (self.next + torch.arange(take)) % self.window

    def advance(self, positions: torch.Tensor) -> None:
        take = min(positions.shape[1], self.window)
        rows = self.slots_for(positions.shape[1])
        self.positions[:, rows.to(self.positions.device)] = positions[:, -take:]
        self.next = (self.next + take) % self.window
        self.filled = min(self.window, self.filled + take)

    def order(self) -> torch.Tensor:
        """Ring rows oldest to newest."""
        if self.filled < self.window:
            return torch.arange(self.filled)
        return (self.next + torch.arange(self.window)) % self.window


class EagerFeed(AttentionFeed):
    """Attention weights returned by the eager kernel, accumulated per slot."""

    source = "eager"
    SUM, ROWS = "attn_sum", "attn_rows"

    @staticmethod
    def slot_tensors(window: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if window == 0:
            return {EagerFeed.SUM: ((), torch.float32)}
        return {EagerFeed.ROWS: ((window,), torch.float32)}

    def __init__(self, model, cache: EvictingCache, window: int, batch: int, device: torch.device) -> None:
        super().__init__(model, cache, window)
        self.ring = _QueryRing(batch, window, device) if window else None
        self.latest: torch.Tensor | None = None  # [b, 1] newest query position (streaming-sum mode)

    def install(self, stack: ExitStack) -> None:
        for index, block in enumerate(decoder_layers(self.model)):
            handle = block.self_attn.register_forward_hook(self._hook(index))
            stack.callback(handle.remove)

    def _hook(self, layer: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise UsageError(
                    "attention source 'eager' needs the eager attention kernel (load the model with "
                    "attn_implementation='eager' / --kernel eager) or use --attention-source window"
                )
            averaged = group_average(weights.detach().float(), self.n_kv)  # [b, kv, q, S]
            averaged = averaged * (self.pending_positions >= 0)[:, None, :, None]
            slots = averaged.shape[-1]
            store = self.cache.layers[layer]
            if self.window == 0:
                store.extra[self.SUM][..., :slots] += averaged.sum(2)
            else:
                rows = self.ring.slots_for(averaged.shape[2]).to(averaged.device)
                take = rows.numel()
                target = store.extra[self.ROWS]
                target[:, :, rows, :slots] = averaged[:, :, -take:]

        return hook

    def end_forward(self) -> None:
        if self.ring is not None:
            self.ring.advance(self.pending_positions)
        else:
            self.latest = self.pending_positions[:, -1:]

    def rows(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.requests += 1
        store = self.cache.layers[layer]
        if self.window == 0:
            return store.slot_tensor(self.SUM)[:, :, None, lo:hi], self.latest
        order = self.ring.order().to(store.extra[self.ROWS].device)
        rows = store.slot_tensor(self.ROWS)[:, :, order, lo:hi]
        return rows, self.ring.positions[:, order]


class WindowFeed(AttentionFeed):
    """Recomputed attention of the last `window` queries over the current cache (any kernel)."""

    source = "window"

    def __init__(self, model, cache: EvictingCache, window: int, batch: int, device: torch.device) -> None:
        super().__init__(model, cache, window)
        if window < 1:
            raise UsageError("the window attention source needs a query window >= 1")
        config = model.config
        self.n_q = config.num_attention_heads
        self.ring = _QueryRing(batch, window, device)
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [b, q_head, window, d] post-RoPE
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.modules = [block.self_attn for block in decoder_layers(model)]

    def install(self, stack: ExitStack) -> None:
        for index, module in enumerate(self.modules):
            handle = module.register_forward_pre_hook(self._rope_hook(index), with_kwargs=True)
            stack.callback(handle.remove)
        names = {hook_name(index, "attn.hook_q"): index for index in range(len(self.modules))}
        stack.enter_context(capture(self.model, list(names), callback=lambda name, q: self._store(names[name], q)))

    def _rope_hook(self, layer: int):
        def hook(module, args, kwargs):
            self.rope[layer] = kwargs["position_embeddings"]

        return hook

    def _store(self, layer: int, query: torch.Tensor) -> None:
        module = self.modules[layer]
        apply_rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
        cos, sin = self.rope[layer]
        take = min(query.shape[2], self.window)
        rotated, _ = apply_rope(query[:, :, -take:], query[:, :, -take:], cos[:, -take:], sin[:, -take:])
        if layer not in self.queries:
            b, n_q, _, d = query.shape
            self.queries[layer] = query.new_zeros((b, n_q, self.window, d))
        rows = self.ring.slots_for(query.shape[2]).to(query.device)
        self.queries[layer][:, :, rows] = rotated

    def end_forward(self) -> None:
        self.ring.advance(self.pending_positions)

    def rows(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.requests += 1
        module = self.modules[layer]
        store = self.cache.layers[layer]
        order = self.ring.order().to(store.keys.device)
        positions = self.ring.positions[:, order]
        probs = recompute_attention(
            self.queries[layer][:, :, order],
            positions,
            store.keys,
            store.positions,
            module.scaling,
            store.sliding_window,
            getattr(module, "attn_logit_softcapping", None),
        )
        return probs[..., lo:hi], positions
