"""Greedy answer regeneration from many occluded copies of one context: the naive way and the fast way.

Every occluded context of a trace is ``ids[:s] + filler + ids[e:answer_start]`` for a window ``[s, e)``; the part
before the window is the trace's own prefix. Both engines return the greedy continuation of each context, stopping
at a stop token (kept in the output) or after `max_new_tokens`.

- `regenerate_naive`: one from-scratch prefill and decode per context. The reference the fast engine must match.
- `regenerate_shared_prefix`: windows are processed in order of start in batches of `batch_size`. One base cache
  holds the trace's prefix and is only ever extended (never recomputed) up to the first window start of the next
  batch; each batch deep-copies it, repeats it once per row, feeds every row's remaining context (its window
  filler and the suffix after it; rows start at the same position and, as all windows have one size, have the
  same length, so no padding or mask is needed and all rows decode at the same positions) and decodes all rows
  together, dropping rows from the batch as they stop. The cache copy, never a crop, keeps sliding-window layers
  (which store only their last window) correct.

The two engines differ only in floating-point summation order (chunked prefix, batched matmuls), so in fp32 their
greedy continuations agree except at exact near-ties of the top two logits; labels compare extracted answers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache


@torch.no_grad()
def greedy_extend(model, cache: DynamicCache, input_ids: torch.Tensor, max_new_tokens: int,
                  stop_ids: Sequence[int]) -> list[list[int]]:
    """Feed ``input_ids [batch, L]`` after `cache` (every row at the same cached length) and decode greedily.

    Returns the new tokens of each row. `cache` is consumed (rows are dropped from it as they finish).
    """
    batch = input_ids.shape[0]
    stops = torch.tensor(sorted(set(stop_ids)), device=input_ids.device, dtype=torch.long)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    active = list(range(batch))
    logits = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    for step in range(max_new_tokens):
        next_ids = logits[:, -1].argmax(-1)  # [active]; argmax breaks ties by the lowest id in both engines
        for row, token in zip(active, next_ids.tolist()):
            outputs[row].append(token)
        if step == max_new_tokens - 1:
            break
        keep = ~torch.isin(next_ids, stops)
        if not bool(keep.all()):
            if not bool(keep.any()):
                break
            index = keep.nonzero().squeeze(1)
            cache.batch_select_indices(index)
            active = [active[i] for i in index.tolist()]
            next_ids = next_ids[index]
        logits = model(input_ids=next_ids[:, None], cache=cache, use_cache=True, logits_to_keep=1).logits
    return outputs


def _device(model) -> torch.device:
    return next(model.parameters()).device


def regenerate_naive(model, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                     stop_ids: Sequence[int], progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """The greedy continuation of each context, each prefilled from scratch."""
    results = []
    for context in contexts:
        ids = torch.tensor([list(context)], dtype=torch.long, device=_device(model))
        results.append(greedy_extend(model, DynamicCache(config=model.config), ids, max_new_tokens, stop_ids)[0])
        if progress:
            progress(1)
    return results


@torch.no_grad()
def regenerate_shared_prefix(model, prefix_ids: Sequence[int], rows: Sequence[tuple[int, Sequence[int]]],
                             max_new_tokens: int, stop_ids: Sequence[int], batch_size: int = 8,
                             progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """The greedy continuation of each context ``prefix_ids[:start] + tail`` for ``(start, tail)`` in `rows`.

    `rows` must be sorted by start (>= 1) and all contexts must have the same length. Returns continuations in the
    order of `rows`.
    """
    if not rows:
        return []
    if any(b[0] < a[0] for a, b in zip(rows, rows[1:])):
        raise ValueError("rows must be sorted by start")
    lengths = {start + len(tail) for start, tail in rows}
    if len(lengths) > 1:
        raise ValueError(f"all contexts must have one length, got {sorted(lengths)}")
    (length,) = lengths
    device = _device(model)
    base = DynamicCache(config=model.config)
    cached = 0
    results: list[list[int]] = []
    for first in range(0, len(rows), batch_size):
        batch = rows[first:first + batch_size]
        if batch[0][0] < 1:
            raise ValueError("a row must keep at least one prefix token")
        s0 = min(batch[0][0], length - 1)  # every row feeds at least one token, which yields its first logits
        if s0 > cached:
            extension = torch.tensor([list(prefix_ids[cached:s0])], dtype=torch.long, device=device)
            model(input_ids=extension, cache=base, use_cache=True, logits_to_keep=1)
            cached = s0
        cache = copy.deepcopy(base)
        cache.batch_repeat_interleave(len(batch))
        inputs = torch.tensor([list(prefix_ids[s0:start]) + list(tail) for start, tail in batch],
                              dtype=torch.long, device=device)  # [batch, context - s0]
        results.extend(greedy_extend(model, cache, inputs, max_new_tokens, stop_ids))
        if progress:
            progress(len(batch))
    return results
