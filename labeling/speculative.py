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

Rows start separately: each is prefilled from its own cache (only the tokens that differ from its trace's shared
prefix) together with its reference's first tokens as a draft, then joins the batch, whatever trace it comes from.
The batch is refilled as rows finish (continuous batching), so a few rows that run to the length limit do not
leave the machine computing small batches while other rows wait. Rows have different lengths and accept different
numbers of tokens, so the batch cache is ragged: short rows are padded, every row gets the same number of new
slots per step, padding and the slots of rejected draft tokens stay in the cache masked out by a 4D attention
mask, and explicit position ids keep each row's positions contiguous; when masked slots outnumber the longest
row's real ones, every row's real slots are gathered to the front. Sliding-window layers index their window by
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


@torch.no_grad()
def speculative_greedy(model, caches: Sequence[Callable[[], DynamicCache]], tails: Sequence[Sequence[int]],
                       contexts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
                       references: Sequence[Sequence[int] | None] | None = None, draft_len: int = 4,
                       reference_draft_len: int = 32, batch_size: int | None = None,
                       progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of rows: row b feeds ``tails[b]`` after the single-row cache ``caches[b]()`` returns.

    Rows may come from different traces and have different lengths. `contexts[b]` is row b's whole context
    (cached prefix and tail, what lookup searches); `references[b]` its expected continuation (a draft, or None).
    At most `batch_size` rows (default: all) decode together; a row's cache is made only when the row joins, so
    memory holds the live rows alone. `progress(1)` is called as each row finishes. Returns the new tokens of each
    row, ending at a stop token (kept) or after `max_new_tokens`.
    """
    device = next(model.parameters()).device
    stops = set(stop_ids)
    references = references if references is not None else [None] * len(caches)
    rows = [_Row(list(context), list(reference or [])[:max_new_tokens], draft_len)
            for context, reference in zip(contexts, references)]
    limit = batch_size or len(rows)

    def finished(row: _Row) -> bool:
        return bool(row.out) and (row.out[-1] in stops or len(row.out) >= max_new_tokens)

    def draft(row: _Row) -> list[int]:
        out, reference = row.out, row.reference
        room = max_new_tokens - len(out) - 1  # tokens still to decide after the pending one
        if out == reference[: len(out)] and len(reference) > len(out):
            return reference[len(out): len(out) + min(reference_draft_len, room)]
        return row.lookup.draft(min(row.k, room))

    def accept(row: _Row, proposal: list[int], predicted: list[int]) -> int:
        """Decide the agreeing draft prefix and one more token; returns how many draft tokens were accepted."""
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == predicted[accepted]:
            accepted += 1
        before = len(row.out)
        for token in [*proposal[:accepted], predicted[accepted]]:
            row.out.append(token)
            if finished(row):
                break
        row.lookup.extend(row.out[before:])
        row.k = min(2 * row.k, reference_draft_len) if proposal and accepted == len(proposal) else max(1, accepted + 1)
        return accepted

    def start(index: int) -> tuple[DynamicCache, list[bool]] | None:
        """Prefill a row from its own cache with its reference's first tokens as its first draft."""
        row, cache = rows[index], caches[index]()
        if has_sliding_layers(cache):
            raise ValueError("speculative_greedy needs full-attention cache layers (no sliding window)")
        first_draft = row.reference[:reference_draft_len]
        feed = torch.tensor([[*tails[index], *first_draft]], device=device)
        logits = model(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=len(first_draft) + 1).logits
        accepted = accept(row, first_draft, logits[0].argmax(-1).tolist())
        if finished(row):
            if progress:
                progress(1)
            return None
        return cache, [True] * (cache.get_seq_length() - len(first_draft) + accepted) + [False] * (
            len(first_draft) - accepted)

    waiting = iter(range(len(rows)))
    live: list[int] = []
    cache: DynamicCache | None = None
    valid: torch.Tensor | None = None  # [live, slots]: the slots each live row attends to
    blocked = torch.finfo(model.dtype).min
    while True:
        joining: list[tuple[int, DynamicCache, list[bool]]] = []
        while len(live) + len(joining) < limit and (index := next(waiting, None)) is not None:
            if (started := start(index)) is not None:
                joining.append((index, *started))
        if joining:
            cache, valid = _join(cache if live else None, valid if live else None, [c for _, c, _ in joining],
                                 [v for _, _, v in joining])
            live += [index for index, _, _ in joining]
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
            new_valid[i, : accept(rows[index], d, predicted[i]) + 1] = True  # the fed token and accepted drafts
        valid = torch.cat([valid, new_valid], dim=1)
        keep = [i for i, index in enumerate(live) if not finished(rows[index])]
        if len(keep) < len(live):
            if progress:
                progress(len(live) - len(keep))
            live = [live[i] for i in keep]
            if keep:
                selected = torch.tensor(keep, device=device)
                cache.batch_select_indices(selected)
                valid = valid[selected]
    return [row.out for row in rows]
