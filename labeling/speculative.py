"""Exact greedy decoding of many rows with drafted tokens verified in one forward (speculative decoding without a
draft model), for models whose cache layers all attend to the full past.

Each step feeds every row its last decided token plus a draft of likely next tokens; the row's own greedy argmax
at each position accepts the longest agreeing draft prefix and decides one more token, so the output is exactly
the greedy continuation (up to floating-point summation order). Drafts come from

- the reference continuation, while the row's output still equals its beginning (most occlusions change nothing);
- otherwise prompt lookup: the tokens that followed the latest earlier occurrence of the row's last n tokens in
  its context, the reference continuation and its own output (reasoning text repeats itself).

Each row's draft length adapts: it doubles after a fully accepted draft and drops to what was accepted otherwise,
so rows whose drafts keep failing stop paying for them; a step's drafts are cut to their median length.

Rows start from their own caches (only the tokens that differ from their trace's shared prefix), prefilled
together with their references' first tokens as drafts, then join the batch, whatever trace they come from (each
tail right-aligned to the longest, so one `logits_to_keep` covers every row's draft). The batch is refilled as rows
finish (continuous batching), so a few rows that run to the length limit do not leave the machine computing small
batches while other rows wait. Rows have different lengths and accept different numbers of tokens, so the batch
cache is ragged: short rows are padded, every row gets the same number of new slots per step, padding and the slots
of rejected draft tokens stay in the cache masked out by a 4D attention mask, and explicit position ids keep each
row's positions contiguous; when masked slots outnumber the longest row's real ones, every row's real slots are
gathered to the front. Sliding-window layers index their window by
slot, not position, so models with them must use the other engines (`labeling.regenerate` chooses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from tasks.generation import COMPACT_DEAD_RATIO, COMPACT_MIN_DEAD, has_sliding_layers
from tasks.generation import compact_rows as _compact
from tasks.generation import join_rows as _join

LOOKUP_ORDERS = (3, 2, 1)
_SEPARATOR = -1  # joins lookup corpora; never a token id, so no n-gram spans two corpora and no draft crosses one


class NgramLookup:
    """A growing token sequence that proposes what followed the latest earlier occurrence of its last n tokens."""

    def __init__(self, tokens: Sequence[int] = (), orders: Sequence[int] = LOOKUP_ORDERS):
        self.seq: list[int] = []
        self._follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sorted(orders, reverse=True)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.seq)
            # Register the n-gram ending just before `end` only now, so a lookup of the current suffix finds an
            # earlier occurrence, never itself.
            for n, follow in self._follow.items():
                if end >= n:
                    follow[tuple(self.seq[end - n:end])] = end
            self.seq.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest matching suffix (longest order first); [] if none matches."""
        for n, follow in self._follow.items():
            if len(self.seq) >= n and (start := follow.get(tuple(self.seq[-n:]))) is not None:
                proposal = self.seq[start:start + k]
                return proposal[: proposal.index(_SEPARATOR)] if _SEPARATOR in proposal else proposal
        return []


class _Row:
    def __init__(self, context: list[int], reference: list[int], draft_len: int):
        self.out: list[int] = []  # decided tokens; the last one is not yet fed
        self.reference = reference
        self.lookup = NgramLookup([*context, _SEPARATOR, *reference, _SEPARATOR])
        self.k = draft_len


# Joining rows are prefilled together in forwards of at most this many fed tokens (rows x the widest feed), and only
# while padding adds at most this share to their real tokens: their feeds are padded to one width, a forward's work
# is its padded size (on a CPU padding costs as much as real tokens), and a few long tails must not make one
# forward's activations huge. Rows come in window order, so neighbours have tails of similar length.
JOIN_TOKENS = 8192
JOIN_PADDING = 0.25


@torch.no_grad()
def speculative_greedy(model, caches: Sequence[Callable[[], DynamicCache]], tails: Sequence[Sequence[int]],
                       contexts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
                       references: Sequence[Sequence[int] | None] | None = None, draft_len: int = 4,
                       reference_draft_len: int = 32, batch_size: int | None = None,
                       progress: Callable[[int], None] | None = None,
                       complete: Callable[[int, list[int]], bool] | None = None,
                       reference_logits: Callable[[int, torch.Tensor], None] | None = None) -> list[list[int]]:
    """Greedy continuations of rows: row b feeds ``tails[b]`` after the single-row cache ``caches[b]()`` returns.

    Rows may come from different traces and have different lengths. `contexts[b]` is row b's whole context
    (cached prefix and tail, what lookup searches); `references[b]` its expected continuation (a draft, or None).
    At most `batch_size` rows (default: all) decode together; a row's cache is made only when the row joins, so
    memory holds the live rows alone, and the rows that join at once are prefilled together. `progress(1)` is called
    as each row finishes. Returns the new tokens of each row, ending at a stop token (kept), after `max_new_tokens`,
    or at the token after which ``complete(b, tokens)`` first holds (a forced answer that has closed).

    With `reference_logits`, each row's first draft is its whole reference, and ``reference_logits(b, logits)`` gets
    the logits predicting each reference token (``[len(reference), vocab]``, from the forward that prefills the row):
    the teacher-forced score of the reference after the row's context, at no extra forward.
    """
    device = next(model.parameters()).device
    stops = set(stop_ids)
    references = references if references is not None else [None] * len(caches)
    rows = [_Row(list(context), list(reference or [])[:max_new_tokens], draft_len)
            for context, reference in zip(contexts, references)]
    limit = batch_size or len(rows)
    blocked = torch.finfo(model.dtype).min

    def finished(index: int) -> bool:
        out = rows[index].out
        return bool(out) and (out[-1] in stops or len(out) >= max_new_tokens
                              or (complete is not None and complete(index, out)))

    def draft(row: _Row) -> list[int]:
        out, reference = row.out, row.reference
        room = max_new_tokens - len(out) - 1  # tokens still to decide after the pending one
        if out == reference[: len(out)] and len(reference) > len(out):
            return reference[len(out): len(out) + min(reference_draft_len, room)]
        return row.lookup.draft(min(row.k, room))

    def accept(index: int, proposal: list[int], predicted: list[int]) -> int:
        """Decide the agreeing draft prefix and one more token; returns how many draft tokens were accepted."""
        row = rows[index]
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == predicted[accepted]:
            accepted += 1
        before = len(row.out)
        for token in [*proposal[:accepted], predicted[accepted]]:
            row.out.append(token)
            if finished(index):
                break
        row.lookup.extend(row.out[before:])
        row.k = min(2 * row.k, reference_draft_len) if proposal and accepted == len(proposal) else max(1, accepted + 1)
        return accepted

    def first_draft(row: _Row) -> list[int]:
        return row.reference if reference_logits is not None else row.reference[:reference_draft_len]

    def start(indices: list[int]) -> tuple[DynamicCache, torch.Tensor, list[int]]:
        """Prefill joining rows together, each from its own cache, its tail right-aligned to the others' and followed
        by its first draft, so one `logits_to_keep` covers every row's draft; returns the batch cache of the rows
        still running, their valid slots and their indices."""
        singles = [caches[index]() for index in indices]
        if any(has_sliding_layers(cache) for cache in singles):
            raise ValueError("speculative_greedy needs full-attention cache layers (no sliding window)")
        lengths = [cache.get_seq_length() for cache in singles]
        cache, valid = _join(None, None, singles, [[True] * n for n in lengths])
        drafts = [first_draft(rows[index]) for index in indices]
        tail_width = max(len(tails[index]) for index in indices)
        width = tail_width + max(map(len, drafts))
        inputs, real = [], []
        for index, d in zip(indices, drafts):
            pad = tail_width - len(tails[index])
            inputs.append([0] * pad + list(tails[index]) + d + [0] * (width - tail_width - len(d)))
            real.append([False] * pad + [True] * (len(tails[index]) + len(d)) + [False] * (width - tail_width - len(d)))
        fed = torch.tensor(real, dtype=torch.bool, device=device)  # [rows, width]: columns that hold a real token
        positions = torch.tensor(lengths, device=device)[:, None] + (fed.cumsum(1) - 1).clamp_min(0)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([valid[:, None, :].expand(-1, width, -1), causal[None] & fed[:, None, :]], dim=2)
        mask = torch.zeros(allowed.shape, dtype=model.dtype, device=device).masked_fill(~allowed, blocked)[:, None]
        keep = width - tail_width + 1
        logits = model(input_ids=torch.tensor(inputs, device=device), position_ids=positions, attention_mask=mask,
                       cache=cache, use_cache=True, logits_to_keep=keep).logits  # [rows, keep, vocab]
        predicted = logits.argmax(-1).tolist()
        new_valid = fed.clone()
        running = []
        for i, (index, d) in enumerate(zip(indices, drafts)):
            if reference_logits is not None and d:
                reference_logits(index, logits[i, : len(d)])
            accepted = accept(index, d, predicted[i])
            new_valid[i, tail_width + accepted:] = False  # rejected draft tokens stay in the cache, masked out
            if finished(index):
                if progress:
                    progress(1)
            else:
                running.append(i)
        valid = torch.cat([valid, new_valid], dim=1)
        if len(running) < len(indices):
            selected = torch.tensor(running, dtype=torch.long, device=device)
            cache.batch_select_indices(selected)
            valid = valid[selected]
        return cache, valid, [indices[i] for i in running]

    waiting = list(range(len(rows)))[::-1]  # a stack: the next row to join is last
    live: list[int] = []
    cache: DynamicCache | None = None
    valid: torch.Tensor | None = None  # [live, slots]: the slots each live row attends to
    while True:
        while len(live) < limit and waiting:
            group: list[int] = []
            widest = real = 0
            while waiting and len(live) + len(group) < limit:
                tail, draft_len = len(tails[waiting[-1]]), len(first_draft(rows[waiting[-1]]))
                padded = (len(group) + 1) * (max(widest, tail) + draft_len)  # the group's forward, roughly
                if group and (padded > JOIN_TOKENS or padded > (1 + JOIN_PADDING) * (real + tail + draft_len)):
                    break
                widest, real = max(widest, tail), real + tail + draft_len
                group.append(waiting.pop())
            joined, joined_valid, running = start(group)
            if running:
                cache, valid = _join(cache if live else None, valid if live else None, [joined],
                                     joined_valid.tolist())
                live += running
        if not live:
            break
        assert cache is not None and valid is not None  # set when the first rows joined
        longest = int(valid.sum(1).max())
        if valid.shape[1] - longest > max(COMPACT_MIN_DEAD, COMPACT_DEAD_RATIO * longest):
            valid = _compact(cache, valid)
        drafts = [draft(rows[index]) for index in live]
        # Every row pays for the longest draft fed, so drafts are cut to the median length: a few long drafts do
        # not make the whole batch compute mostly padding.
        cap = sorted(len(d) for d in drafts)[len(drafts) // 2]
        drafts = [d[:cap] for d in drafts]
        width = 1 + cap
        inputs = torch.tensor([[rows[index].out[-1], *d, *[0] * (width - 1 - len(d))]  # padding is never accepted
                               for index, d in zip(live, drafts)], device=device)  # [live, width]
        positions = valid.sum(1, keepdim=True) + torch.arange(width, device=device)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([valid[:, None, :].expand(-1, width, -1), causal.expand(len(live), -1, -1)], dim=2)
        mask = torch.zeros(allowed.shape, dtype=model.dtype, device=device).masked_fill(~allowed, blocked)[:, None]
        predicted = model(input_ids=inputs, position_ids=positions, attention_mask=mask, cache=cache,
                          use_cache=True).logits.argmax(-1).tolist()  # [live, width]
        new_valid = torch.zeros(len(live), width, dtype=torch.bool, device=device)
        for i, (index, d) in enumerate(zip(live, drafts)):
            new_valid[i, : accept(index, d, predicted[i]) + 1] = True  # the fed token and accepted drafts
        valid = torch.cat([valid, new_valid], dim=1)
        keep = [i for i, index in enumerate(live) if not finished(index)]
        if len(keep) < len(live):
            if progress:
                progress(len(live) - len(keep))
            live = [live[i] for i in keep]
            if keep:
                selected = torch.tensor(keep, device=device)
                cache.batch_select_indices(selected)
                valid = valid[selected]
    return [row.out for row in rows]
