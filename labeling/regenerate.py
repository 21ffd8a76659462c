"""Greedy answer regeneration from many occluded copies of a context: the naive way and the fast way.

Every occluded context of a trace is ``ids[:s] + filler + ids[e:answer_start]`` for a window ``[s, e)``; the part
before the window is the trace's own prefix. Both ways return the greedy continuation of each context, stopping
at a stop token (kept in the output) or after `max_new_tokens`.

- `regenerate_naive`: one from-scratch prefill and token-by-token decode per context: the reference the fast
  way must match.
- `regenerate_rows`, three savings, none of which changes what greedy decoding computes:

  1. Prefix reuse (`PrefixCache`). Windows are processed in order of start. One cache per trace holds its prefix
     and is only ever extended, never recomputed; each row deep-copies it at its window's start and feeds only
     the rest. Copying, not cropping a full-context cache, keeps sliding-window layers (which store only their
     last window) correct.
  2. Batching. Rows (of one trace or, for full-attention models, of several) decode together; a finished row
     leaves the batch and, for full-attention models, the next row takes its place.
  3. Drafts verified, not decoded. Most windows do not change the continuation, so each row is fed likely next
     tokens and checked against its own greedy argmax at each position, as in speculative decoding: an agreeing
     draft costs one forward instead of one decode step per token. The unoccluded continuation drafts every window;
     the trace's own answer span drafts the unoccluded continuation. Full-attention models use
     `labeling.speculative.speculative_greedy` (per-row acceptance in a ragged batch, plus prompt-lookup drafts
     after a row diverges); models with sliding-window layers use `greedy_extend_with_draft` (chunked verification
     of the reference, then plain decoding from the batch's earliest divergence; sliding layers record their past
     until the cache is cropped back to it).

The two ways differ only in floating-point summation order (chunked prefix, batched, padded and multi-token
forwards), so in fp32 their greedy continuations agree except at exact near-ties of the top two logits; labels
compare extracted answers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from transformers import DynamicCache

from labeling.speculative import has_sliding_layers, speculative_greedy

Progress = Callable[[int], None] | None


def _device(model) -> torch.device:
    return next(model.parameters()).device


Complete = Callable[[int, list[int]], bool] | None  # (row, its tokens so far) -> has its forced answer closed?
ReferenceLogits = Callable[[int, torch.Tensor], None] | None  # (row, logits [len(reference), vocab])


def _decode(model, cache: DynamicCache, next_ids: torch.Tensor, outputs: list[list[int]], active: list[int],
            steps: int, stops: torch.Tensor, complete: Complete = None) -> None:
    """Append `next_ids [active]` to each active row's output, then decode up to `steps` more tokens greedily.

    Rows leave the batch (and the cache) at a stop token, or once ``complete(row, output)`` holds. argmax breaks ties
    by the lowest id in every engine.
    """
    for step in range(steps + 1):
        for row, token in zip(active, next_ids.tolist()):
            outputs[row].append(token)
        if step == steps:
            return
        keep = ~torch.isin(next_ids, stops)
        if complete is not None:
            keep &= torch.tensor([not complete(row, outputs[row]) for row in active], device=keep.device)
        if not bool(keep.any()):
            return
        if not bool(keep.all()):
            index = keep.nonzero().squeeze(1)
            cache.batch_select_indices(index)
            active = [active[i] for i in index.tolist()]
            next_ids = next_ids[index]
        logits = model(input_ids=next_ids[:, None], cache=cache, use_cache=True, logits_to_keep=1).logits
        next_ids = logits[:, -1].argmax(-1)


def _cut_at_completion(tokens: list[int], row: int, complete: Complete) -> tuple[list[int], bool]:
    """`tokens` up to the one after which the row's forced answer is complete, and whether it is."""
    if complete is not None:
        for end in range(1, len(tokens) + 1):
            if complete(row, tokens[:end]):
                return tokens[:end], True
    return tokens, False


def _stop_tensor(stop_ids: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(sorted(set(stop_ids)), device=device, dtype=torch.long)


@torch.no_grad()
def greedy_extend(model, cache: DynamicCache, input_ids: torch.Tensor, max_new_tokens: int,
                  stop_ids: Sequence[int], complete: Complete = None) -> list[list[int]]:
    """Feed ``input_ids [batch, L]`` after `cache` (every row at the same cached length) and decode greedily.

    Returns the new tokens of each row. `cache` is consumed.
    """
    logits = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    outputs: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    _decode(model, cache, logits[:, -1].argmax(-1), outputs, list(range(input_ids.shape[0])), max_new_tokens - 1,
            _stop_tensor(stop_ids, input_ids.device), complete)
    return outputs


@torch.no_grad()
def greedy_extend_with_draft(model, cache: DynamicCache, input_ids: torch.Tensor, draft: Sequence[int],
                             max_new_tokens: int, stop_ids: Sequence[int], chunk: int = 32, complete: Complete = None,
                             reference_logits: ReferenceLogits = None) -> list[list[int]]:
    """`greedy_extend`, verifying `draft` (the likely continuation) in chunks instead of decoding it token by token.

    Works with every cache layer type (sliding layers record their past until the crop); one divergence point per
    batch, so rows that diverge early make the others decode from there too (`speculative_greedy` does not). With
    `reference_logits`, the first chunk covers the whole draft and ``reference_logits(row, logits)`` gets each row's
    logits predicting the draft's tokens.
    """
    batch, device = input_ids.shape[0], input_ids.device
    stops = _stop_tensor(stop_ids, device)
    draft = list(draft)[:max_new_tokens]
    if reference_logits is not None:
        chunk = max(chunk, len(draft))
    # A finished draft (stop token or full length) needs no prediction after its last token; an open one does.
    finished = bool(draft) and (draft[-1] in stop_ids or len(draft) == max_new_tokens)
    to_feed = len(draft) - 1 if finished else len(draft)
    cache.activate_past_recording()  # sliding layers keep their past until the crop below
    draft_ids = torch.tensor(draft, device=device, dtype=torch.long)
    chunks: list[torch.Tensor] = []  # [batch, k] greedy predictions: column j is the row's greedy token j
    fed = 0
    agreeing = torch.ones(batch, dtype=torch.bool, device=device)
    feed = input_ids
    while True:
        take = min(chunk, to_feed - fed)
        feed = torch.cat([feed, draft_ids[fed:fed + take].expand(batch, -1)], dim=1)
        keep = take + 1 if fed == 0 else take
        logits = model(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=keep).logits
        if fed == 0 and reference_logits is not None and draft:
            for row in range(batch):
                reference_logits(row, logits[row, : len(draft)])
        step = logits.argmax(-1)
        done = sum(c.shape[1] for c in chunks)
        chunks.append(step)
        agreeing &= (step[:, : max(0, len(draft) - done)] == draft_ids[done:done + step.shape[1]]).all(1)
        fed += take
        if fed == to_feed or not bool(agreeing.any()):
            break
        feed = input_ids.new_empty(batch, 0)
    predicted = torch.cat(chunks, dim=1)  # [batch, fed + 1]
    checked = min(predicted.shape[1], len(draft))
    agree = predicted[:, :checked] == draft_ids[:checked]
    accepted = torch.where(agree.all(1), checked, (~agree).int().argmax(1)).tolist()
    outputs: list[list[int]] = [[] for _ in range(batch)]
    unfinished = []
    for row, a in enumerate(accepted):
        decided = draft[:] if a == len(draft) and finished else draft[:a] + [int(predicted[row, a])]
        outputs[row], closed = _cut_at_completion(decided, row, complete)
        if not (closed or decided == draft and finished or decided[-1] in stop_ids or len(decided) == max_new_tokens):
            unfinished.append(row)
    if unfinished:
        m = min(accepted[row] for row in unfinished)
        index = torch.tensor(unfinished, device=device)
        cache.batch_select_indices(index)
        cache.crop(-(fed - m))  # keep the context and the m agreed draft tokens
        for row in unfinished:
            outputs[row] = draft[:m]
        _decode(model, cache, predicted[index, m], outputs, unfinished, max_new_tokens - m - 1, stops, complete)
    return outputs


def regenerate_naive(model, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                     stop_ids: Sequence[int], progress: Progress = None, complete: Complete = None) -> list[list[int]]:
    """The greedy continuation of each context, each prefilled from scratch (stopping once ``complete(i, tokens)``
    holds for context i)."""
    results = []
    for index, context in enumerate(contexts):
        ids = torch.tensor([list(context)], dtype=torch.long, device=_device(model))
        row_complete = None if complete is None else (lambda _, tokens, i=index: complete(i, tokens))
        results.append(greedy_extend(model, DynamicCache(config=model.config), ids, max_new_tokens, stop_ids,
                                     row_complete)[0])
        if progress:
            progress(1)
    return results


class PrefixCache:
    """The KV cache of prefixes of `ids`, copied out at a requested position.

    Full-attention caches are computed once over all of `ids` and cut at any position (a cut full-attention cache
    is exactly the prefix's cache). Sliding-window layers keep only their last window, so for them the cache grows
    on demand and can be copied out only at or after the last position requested.
    """

    def __init__(self, model, ids: Sequence[int]):
        self.model, self.ids = model, list(ids)
        self.cache = DynamicCache(config=model.config)
        self.full_attention = not has_sliding_layers(self.cache)
        self.length = 0

    @torch.no_grad()
    def copy_at(self, position: int, repeats: int) -> DynamicCache:
        """A deep copy of the cache of ``ids[:position]``, repeated `repeats` times along the batch axis."""
        if not 0 <= position <= len(self.ids):
            raise ValueError(f"position {position} out of range 0..{len(self.ids)}")
        if position < self.length and not self.full_attention:
            raise ValueError(f"the prefix cache is at {self.length}; it cannot go back to {position}")
        target = len(self.ids) if self.full_attention else position
        if target > self.length:
            extension = torch.tensor([self.ids[self.length:target]], dtype=torch.long, device=_device(self.model))
            self.model(input_ids=extension, cache=self.cache, use_cache=True, logits_to_keep=1)
            self.length = target
        cache = copy.deepcopy(self.cache)
        if position < self.length:  # full attention only (checked above)
            cache.crop(position - self.length)
        cache.batch_repeat_interleave(repeats)
        return cache


@dataclass(frozen=True)
class Row:
    """A context to continue, ``prefix.ids[:start] + tail``, expected (not trusted) to continue like `reference`."""

    prefix: PrefixCache
    start: int
    tail: tuple[int, ...]
    reference: tuple[int, ...] | None = None

    @property
    def length(self) -> int:
        return self.start + len(self.tail)


def regenerate_rows(rows: Sequence[Row], max_new_tokens: int, stop_ids: Sequence[int], batch_size: int = 8,
                    progress: Progress = None, complete: Complete = None,
                    reference_logits: ReferenceLogits = None) -> list[list[int]]:
    """The greedy continuation of each row, in order. Rows may come from several traces (prefixes); each prefix's
    rows must be in nondecreasing start order, and no start may precede one already served by its prefix.

    `complete(i, tokens)` ends row i once its forced answer has closed; `reference_logits(i, logits)` receives row
    i's logits predicting each token of its reference, from the forward that verifies it (no extra forward).

    Full-attention models: rows from any traces share a `speculative_greedy` batch of up to `batch_size` rows,
    refilled as rows finish. Models with
    sliding-window layers: consecutive rows with one prefix, one context length and one reference share a batch,
    from their first start, verified with `greedy_extend_with_draft` (or decoded with `greedy_extend`).
    """
    results: list[list[int]] = []
    if not rows:
        return results
    model = rows[0].prefix.model
    if not any(has_sliding_layers(row.prefix.cache) for row in rows):
        starts = [min(row.start, row.length - 1) for row in rows]  # feed at least one token for its logits
        caches = [partial(row.prefix.copy_at, s, 1) for s, row in zip(starts, rows)]
        tails = [row.prefix.ids[s:row.start] + list(row.tail) for s, row in zip(starts, rows)]
        contexts = [row.prefix.ids[:row.start] + list(row.tail) for row in rows]
        return speculative_greedy(model, caches, tails, contexts, max_new_tokens, stop_ids,
                                  [row.reference for row in rows], batch_size=batch_size, progress=progress,
                                  complete=complete, reference_logits=reference_logits)
    device = _device(model)
    first = 0
    while first < len(rows):
        key = (id(rows[first].prefix), rows[first].length, rows[first].reference)
        batch = [rows[first]]
        while (first + len(batch) < len(rows) and len(batch) < batch_size
               and (id(rows[first + len(batch)].prefix), rows[first + len(batch)].length,
                    rows[first + len(batch)].reference) == key):
            batch.append(rows[first + len(batch)])
        prefix, reference = batch[0].prefix, batch[0].reference
        s0 = min(batch[0].start, batch[0].length - 1)
        cache = prefix.copy_at(s0, len(batch))
        inputs = torch.tensor([prefix.ids[s0:row.start] + list(row.tail) for row in batch],
                              dtype=torch.long, device=device)  # [batch, length - s0]
        offset = first
        batch_complete = None if complete is None else (lambda row, tokens, o=offset: complete(o + row, tokens))
        if reference is not None:
            batch_logits = None if reference_logits is None else (
                lambda row, logits, o=offset: reference_logits(o + row, logits))
            results.extend(greedy_extend_with_draft(model, cache, inputs, reference, max_new_tokens, stop_ids,
                                                    complete=batch_complete, reference_logits=batch_logits))
        else:
            results.extend(greedy_extend(model, cache, inputs, max_new_tokens, stop_ids, batch_complete))
        if progress:
            progress(len(batch))
        first += len(batch)
    return results
