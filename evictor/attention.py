"""Attention probabilities for attention-requiring policies, exact under every attention kernel.

At every forward (a prefill block or one decode step) and for every layer, the new queries' attention over the
resident cache is recomputed (`models.attention`) from their post-RoPE queries (``attn.hook_rot_q``) and the keys
the cache holds (already post-RoPE), with the masks the engine's kernel applied: causal and sliding-window by
absolute position, padding slots excluded. That is the row each query really saw, whatever the kernel (eager, SDPA,
FlashAttention-2), at a cost of one ``[q_head, slots]`` row per query and layer. The rows are GQA group-averaged to
``[b, kv_head, queries, slots]`` (or, with ``Needs.attention_group = "max_logits"``, the softmax of each group's
maximum logit, R-KV's aggregation) and reduced at once into per-slot tensors of the cache, so compaction keeps them:

- ``queries_window == 0`` (H2O: "every query since entry"): the running sum ``attn_sum [b, kv, slots]`` of
  the attention each slot received from every query since it entered the cache;
- ``queries_window == W``: the rows of the last ``W`` queries, ``attn_rows [b, kv, W, slots]`` (a ring shared by
  every layer); a slot that entered after a query holds 0 in that query's row, as the query never saw it;
- with ``Needs.refresh_threshold = c`` (RaaS), also ``attn_refreshed [b, kv, slots]``: the position of the newest
  query whose probability on the slot exceeded ``c / n``, n the number of keys that query saw (its uniform share),
  or the slot's own position when none did (`signals.attention.raas_timestamps`, applied to every query as
  it runs, so the value is exact however many queries ago the refresh happened).

No ``[queries, queries]`` matrix is ever kept. FA-compatible policies never get a feed: `AttentionFeed` instances
exist only for policies with ``needs.attention``, and each delivery increments `requests`, which tests assert stays
0 otherwise.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from evictor.cache import EvictingCache
from evictor.instrument import SpanTimer
from models.attention import attention_logits, attention_probabilities, group_mean, visible_by_position
from models.hooks import capture, hook_name, layer_specs
from signals.attention import group_max_probabilities, raas_timestamps


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


class AttentionFeed:
    """Accumulates each forward's attention rows per slot and hands `ScoreInputs.attention` to the engine."""

    SUM, ROWS, REFRESHED = "attn_sum", "attn_rows", "attn_refreshed"

    @staticmethod
    def slot_tensors(window: int, refresh: float | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
        if window == 0:
            tensors = {AttentionFeed.SUM: ((), torch.float32)}
        else:
            tensors = {AttentionFeed.ROWS: ((window,), torch.float32)}
        if refresh is not None:
            tensors[AttentionFeed.REFRESHED] = ((), torch.float32)  # positions, exact in float32 below 2**24
        return tensors

    def __init__(self, model, cache: EvictingCache, window: int, batch: int, device: torch.device,
                 refresh: float | None = None, group: str = "mean") -> None:
        self.model = model
        self.cache = cache
        self.window = window  # 0 = every query since entry
        self.refresh = refresh  # RaaS's refresh threshold, in uniform shares; None: no timestamps kept
        self.group = group  # `Needs.attention_group`: "mean" or "max_logits"
        self.n_kv = model.config.num_key_value_heads
        self.specs = layer_specs(model)
        self.ring = _QueryRing(batch, window, device) if window else None
        self.latest: torch.Tensor | None = None  # [b, 1] newest query position (since-entry mode)
        self.requests = 0
        self.timer = SpanTimer(device)  # the recomputation runs inside every forward, not in the rounds

    def install(self, stack: ExitStack) -> None:
        names = {hook_name(layer, "attn.hook_rot_q"): layer for layer in range(len(self.specs))}
        stack.enter_context(capture(self.model, list(names), callback=lambda name, q: self._add(names[name], q)))

    def _add(self, layer: int, queries: torch.Tensor) -> None:
        with self.timer.span("attention"):
            self._accumulate(layer, queries)

    def _accumulate(self, layer: int, queries: torch.Tensor) -> None:
        """Called once the layer's attention has run: its cache holds the new keys, `queries` are post-RoPE."""
        store = self.cache.layers[layer]
        spec = self.specs[layer]
        positions = self.cache.pending_positions  # [b, Q], -1 = padding
        # inside the forward: the engine gave its positions (begin_forward) and the layer's update filled the cache
        assert positions is not None and store.positions is not None and store.keys is not None
        visible = visible_by_position(positions, store.positions, store.sliding_window)  # [b, kv_head, Q, slots]
        if self.group == "max_logits":
            logits = attention_logits(queries, store.keys, scaling=spec.scaling, softcap=spec.softcap, visible=visible)
            rows = group_max_probabilities(logits, self.n_kv)
        else:
            probs = attention_probabilities(queries, store.keys, scaling=spec.scaling, softcap=spec.softcap,
                                            sinks=spec.sinks, visible=visible)
            rows = group_mean(probs, self.n_kv)  # [b, kv_head, Q, slots]; padding queries' rows are 0
        slots = rows.shape[-1]
        if self.window == 0:
            store.extra[self.SUM][..., :slots] += rows.sum(2)
        else:
            assert self.ring is not None  # a feed with a query window keeps a ring
            ring = self.ring.slots_for(rows.shape[2]).to(rows.device)
            store.extra[self.ROWS][:, :, ring, :slots] = rows[:, :, -ring.numel():]
        if self.refresh is not None:
            share = 1.0 / visible.sum(-1, keepdim=True).clamp_min(1)  # [b, kv, Q, 1]; a padding query sees no key
            stamps = raas_timestamps(rows, positions[:, None, :], store.positions, self.refresh * share)
            seen = store.extra[self.REFRESHED][..., :slots]
            torch.maximum(seen, stamps, out=seen)

    def end_forward(self, positions: torch.Tensor) -> None:
        """After every layer has run on the queries at `positions` ``[b, Q]``."""
        if self.ring is not None:
            self.ring.advance(positions)
        else:
            self.latest = positions[:, -1:]

    def refreshed(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """``[b, kv, hi - lo]``: each slot's newest refresh position, or its own position (RaaS timestamps)."""
        return self.cache.layers[layer].slot_tensor(self.REFRESHED)[..., lo:hi]

    def rows(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([b, kv, queries, hi - lo], [b, queries])``: probabilities over slots ``lo:hi`` (oldest query first) and
        the queries' positions; since entry, one row holding the per-slot sums and the newest query's position."""
        self.requests += 1
        store = self.cache.layers[layer]
        if self.window == 0:
            assert self.latest is not None  # set by end_forward, and a round follows a forward
            return store.slot_tensor(self.SUM)[:, :, None, lo:hi], self.latest
        assert self.ring is not None  # a feed with a query window keeps a ring
        order = self.ring.order().to(store.extra[self.ROWS].device)
        return store.slot_tensor(self.ROWS)[:, :, order, lo:hi], self.ring.positions[:, order]
