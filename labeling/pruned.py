"""A trace's context prefilled once, then answered from copies of its cache with chosen entries removed: eviction's
own intervention, which cache-level and joint labels (`labeling.cache_labels`, `labeling.joint`) are made with.

Token occlusion replaces a window's text and recomputes every later token without it. Eviction does something else:
the keys and values of the tokens after the window were computed while the window was there, and only the window's
own entries leave the cache. `PrunedContext` does exactly that. The context up to the answer boundary is prefilled
once, densely (``[0, L)``, L its length); a row is a *keep mask* over those L positions, per KV head
(``[kv_head, L]``) or shared by every head (``[1, L]``), the same in every layer; the row's forced tokens (the answer
cue, then the answer) are fed after the cache at their true positions, attending to the kept entries and to each
other causally. Rows run in batches over copies of the one dense cache (an additive 4D mask per row, expanded from
KV heads to their query heads), so many pruned caches cost one forward of their forced tokens, never a re-prefill.

Only full-attention models: a sliding-window layer's cache holds its last window only, so the dense cache of a long
context cannot be kept whole (`UsageError`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from core.errors import UsageError
from labeling.answer import AnswerScore, score_answer
from models.attention import SLIDING_ATTENTION, layer_kinds


def check_full_attention(model) -> None:
    """Refuse a model with sliding-window layers (see the module docstring), naming why."""
    if SLIDING_ATTENTION in layer_kinds(model.config):
        raise UsageError(f"cache-level and joint labels remove entries from a dense cache prefilled once, which a "
                         f"sliding-window layer does not keep ({model.config.model_type} has them); use token "
                         "occlusion (--intervention token) on this model")


class PrunedContext:
    """The dense cache of `context` (token ids ``[0, L)``), prefilled once; `score` and `greedy` answer after copies
    of it from which each row's masked-out entries are removed."""

    def __init__(self, model, context: Sequence[int]):
        check_full_attention(model)
        self.model, self.length = model, len(context)
        self.device = next(model.parameters()).device
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.group = config.num_attention_heads // self.kv_heads
        self.cache = DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=torch.tensor([list(context)], device=self.device), cache=self.cache, use_cache=True,
                  logits_to_keep=1)

    def _batch_cache(self, rows: int) -> DynamicCache:
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(rows)
        return cache

    def _mask(self, keep: torch.Tensor, width: int, seen: int) -> torch.Tensor:
        """The additive mask ``[rows, heads, width, L + seen + width]`` of `width` new tokens after `seen` forced
        tokens already cached: each row's kept prefix entries (query heads read their KV head's mask), every forced
        token before, and the new tokens causally."""
        rows = keep.shape[0]
        heads = keep.shape[1] * (self.group if keep.shape[1] > 1 else 1)
        prefix = keep.repeat_interleave(self.group, dim=1) if keep.shape[1] > 1 else keep  # [rows, heads, L]
        allowed = torch.cat([prefix[:, :, None, :].expand(-1, -1, width, -1),
                             torch.ones(rows, heads, width, seen, dtype=torch.bool, device=self.device),
                             torch.ones(width, width, dtype=torch.bool, device=self.device).tril().expand(
                                 rows, heads, -1, -1)], dim=3)
        blocked = torch.finfo(self.model.dtype).min
        return torch.zeros(allowed.shape, dtype=self.model.dtype, device=self.device).masked_fill(~allowed, blocked)

    def _check(self, keep: torch.Tensor) -> torch.Tensor:
        if keep.ndim != 3 or keep.shape[2] != self.length or keep.shape[1] not in (1, self.kv_heads):
            raise ValueError(f"keep must be [rows, 1 or {self.kv_heads}, {self.length}], got {tuple(keep.shape)}")
        return keep.to(device=self.device, dtype=torch.bool)

    @torch.no_grad()
    def score(self, keep: torch.Tensor, cue: Sequence[int], answer: Sequence[int],
              batch_size: int = 16) -> list[AnswerScore]:
        """The teacher-forced `AnswerScore` of `answer` after the cue, per row of ``keep [rows, 1|kv_head, L]``."""
        keep = self._check(keep)
        feed = list(cue) + list(answer)[:-1]
        scores = []
        for first in range(0, keep.shape[0], batch_size):
            part = keep[first:first + batch_size]
            rows = part.shape[0]
            ids = torch.tensor([feed] * rows, device=self.device)  # [rows, cue + answer - 1]
            positions = torch.arange(self.length, self.length + len(feed), device=self.device).expand(rows, -1)
            logits = self.model(input_ids=ids, position_ids=positions, attention_mask=self._mask(part, len(feed), 0),
                                cache=self._batch_cache(rows), use_cache=True, logits_to_keep=len(answer)).logits
            scores += [score_answer(logits[row], answer) for row in range(rows)]
        return scores

    @torch.no_grad()
    def greedy(self, keep: torch.Tensor, cue: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
               complete: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
        """Greedy continuations after the cue, per row of `keep`: each ends at a stop token (kept), once `complete`
        holds, or after `max_new_tokens`."""
        keep = self._check(keep)
        rows = keep.shape[0]
        ids = torch.tensor([list(cue)] * rows, device=self.device)
        cache, seen, position = self._batch_cache(rows), 0, self.length
        outputs: list[list[int]] = [[] for _ in range(rows)]
        live = list(range(rows))
        stops = set(stop_ids)
        for _ in range(max_new_tokens):
            width = ids.shape[1]
            positions = torch.arange(position, position + width, device=self.device).expand(len(live), -1)
            logits = self.model(input_ids=ids, position_ids=positions, attention_mask=self._mask(keep, width, seen),
                                cache=cache, use_cache=True, logits_to_keep=1).logits
            seen, position = seen + width, position + width
            next_ids = logits[:, -1].argmax(-1).tolist()
            running = []
            for i, (row, token) in enumerate(zip(live, next_ids)):
                outputs[row].append(token)
                if token not in stops and not (complete and complete(outputs[row])):
                    running.append(i)
            if not running:
                break
            if len(running) < len(live):
                index = torch.tensor(running, device=self.device)
                cache.batch_select_indices(index)
                keep = keep[index]
                live = [live[i] for i in running]
            ids = torch.tensor([[outputs[row][-1]] for row in live], device=self.device)
        return outputs
