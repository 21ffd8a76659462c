"""A KV cache that evicts physically, per (sequence, layer, KV head), and plugs into HF attention modules.

Each layer holds preallocated storage ``[batch, kv_head, capacity, d_head]`` for keys and values and
``[batch, kv_head, capacity]`` for the absolute position of every slot (-1 = padding). Only the first ``slots``
entries are live. Attention modules call ``cache.update(k, v, layer_idx, ...)`` and attend over the returned views;
the engine tells the cache the true positions of the tokens a forward appends (`begin_forward`) and later compacts
each layer with a gather (`SlotLayer.compact`), so memory is bounded by the budget, not by the sequence length.

Invariants the engine relies on (and the tests check):

- within a (sequence, head), live slots are sorted by position and the valid ones are right-aligned (padding first);
- every head of a sequence has the same number of valid slots, in every layer, so one padding mask per sequence
  serves all full-attention layers (sliding-window layers get per-head masks from `position_mask`).

The cache subclasses transformers' `Cache` so HF's mask builders can size masks from it (`get_mask_sizes`,
`get_seq_length`); positions never come from the cache length -- the engine always passes `position_ids`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from core.errors import UsageError
from models.attention import layer_kinds, visible_by_position

SLIDING = "sliding_attention"
FULL = "full_attention"


class SlotLayer(CacheLayerMixin):
    """One layer's storage: keys, values, positions, plus named per-slot tensors compacted alongside.

    Extra per-slot tensors (`add_slot_tensor`) have the slot axis last, e.g. frozen scores ``[b, kv, cap]`` or
    attention rows ``[b, kv, rows, cap]``; new slots start at zero.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: EvictingCache, layer_idx: int, sliding_window: int | None) -> None:
        # CacheLayerMixin.__init__ would assign .keys/.values, which are read-only views here.
        self.owner = owner
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.is_initialized = False
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self.extra: dict[str, torch.Tensor] = {}

    # --- views -------------------------------------------------------------------------------------------------
    # CacheLayerMixin declares keys/values as plain attributes; here they are read-only views of the storage
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v[:, :, : self.length]

    @property
    def positions(self) -> torch.Tensor | None:
        """``[batch, kv_head, slots]`` int32 absolute position of each live slot, -1 on padding."""
        return None if self._pos is None else self._pos[:, :, : self.length]

    def slot_tensor(self, name: str) -> torch.Tensor:
        return self.extra[name][..., : self.length]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def nbytes(self, live: bool = False) -> int:
        tensors = [t for t in (self._k, self._v, self._pos, *self.extra.values()) if t is not None]
        if not live:
            return sum(t.numel() * t.element_size() for t in tensors)
        cap = max(self.capacity, 1)
        return sum(t.numel() * t.element_size() * self.length // cap for t in tensors)

    # --- HF Cache layer protocol -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, kv, _, d = key_states.shape
        cap = max(self.owner.capacity, key_states.shape[2])
        self.device = key_states.device
        self._k = key_states.new_empty((b, kv, cap, d))
        self._v = value_states.new_empty((b, kv, cap, value_states.shape[-1]))
        self._pos = torch.full((b, kv, cap), -1, dtype=torch.int32, device=self.device)
        for name, (rows, dtype) in self.owner.slot_tensor_specs.items():
            self.extra[name] = torch.zeros((b, kv, *rows, cap), dtype=dtype, device=self.device)
        self.is_initialized = True
        self.owner.note_allocation()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        start, end = self.length, self.length + n
        if end > self.capacity:
            self._resize(max(end, 2 * self.capacity))
        assert self._k is not None and self._v is not None and self._pos is not None  # allocated at the first update
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        pending = self.owner.pending_positions
        assert pending is not None  # the engine calls begin_forward before every forward
        self._pos[:, :, start:end] = pending[:, None, :]
        for tensor in self.extra.values():
            tensor[..., start:end] = 0
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    # --- eviction ----------------------------------------------------------------------------------------------
    def compact(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep, per (sequence, head), the slots `index` ``[b, kv, new_slots]`` (valid where `valid`), in that order."""
        new = index.shape[-1]
        # a round compacts a layer its forward already filled
        assert self._k is not None and self._v is not None and self._pos is not None
        assert self.keys is not None and self.values is not None and self.positions is not None
        d = self._k.shape[-1]
        keys = torch.gather(self.keys, 2, index[..., None].expand(-1, -1, -1, d))
        values = torch.gather(self.values, 2, index[..., None].expand(-1, -1, -1, self._v.shape[-1]))
        positions = torch.gather(self.positions, 2, index).masked_fill_(~valid, -1)
        extras = {}
        for name, tensor in self.extra.items():
            live = tensor[..., : self.length]
            idx = index.view(*index.shape[:2], *([1] * (live.dim() - 3)), new).expand(*live.shape[:-1], new)
            extras[name] = torch.gather(live, -1, idx)
        target = self.owner.capacity
        if self.capacity > 2 * max(target, new):  # give memory back after a long prefill or a budget change
            self._resize(max(target, new), copy=False)
        self._k[:, :, :new] = keys
        self._v[:, :, :new] = values
        self._pos[:, :, :new] = positions
        for name, tensor in extras.items():
            self.extra[name][..., :new] = tensor
        self.length = new

    def _resize(self, capacity: int, copy: bool = True) -> None:
        keep = min(self.length, capacity) if copy else 0
        assert self._k is not None and self._v is not None and self._pos is not None  # resized once allocated

        def moved(tensor: torch.Tensor, fill: float) -> torch.Tensor:
            fresh = torch.full((*tensor.shape[:-1], capacity), fill, dtype=tensor.dtype, device=tensor.device)
            if keep:
                fresh[..., :keep] = tensor[..., :keep]
            return fresh

        self._k = moved(self._k.transpose(2, 3), 0).transpose(2, 3).contiguous()
        self._v = moved(self._v.transpose(2, 3), 0).transpose(2, 3).contiguous()
        self._pos = moved(self._pos, -1)
        self.extra = {name: moved(t, 0) for name, t in self.extra.items()}
        self.owner.note_allocation()


class EvictingCache(Cache):
    """Per-layer `SlotLayer`s for a model config; `capacity` is the initial (and steady-state) slot capacity."""

    # every layer is a SlotLayer (built in __init__); transformers types the list as its own layer kinds
    layers: list[SlotLayer]  # type: ignore[assignment]

    def __init__(self, config, capacity: int,
                 slot_tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None):
        types = layer_kinds(config)
        unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
        if unknown:
            raise UsageError(f"layer types {unknown} are not supported by the evicting cache (only {FULL}, {SLIDING})")
        window = getattr(config, "sliding_window", None)
        self.capacity = max(1, capacity)
        self.slot_tensor_specs = dict(slot_tensors or {})
        self.pending_positions: torch.Tensor | None = None
        self.peak_allocated = 0
        super().__init__(layers=[SlotLayer(self, i, window if t == SLIDING else None) for i, t in enumerate(types)])

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Positions ``[batch, new]`` (int32, -1 = padding) of the tokens the next forward appends."""
        self.pending_positions = positions

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    @property
    def slots(self) -> int:
        return self.layers[0].length

    def nbytes(self, live: bool = False) -> int:
        return sum(layer.nbytes(live) for layer in self.layers)

    def note_allocation(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.nbytes())


def position_mask(
    key_positions: torch.Tensor, query_positions: torch.Tensor, window: int | None, n_rep: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive attention mask from absolute positions, ``[batch, kv_head * n_rep, queries, slots]``.

    Visibility is `models.attention.visible_by_position` (causal and sliding-window, in positions instead of slot
    indices). `key_positions` ``[b, kv, slots]``; `query_positions` ``[b, queries]``.
    """
    allowed = visible_by_position(query_positions, key_positions, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.repeat_interleave(n_rep, dim=1) if n_rep > 1 else mask
