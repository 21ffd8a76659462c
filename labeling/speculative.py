"""Exact greedy decoding of a batch of rows with drafted tokens verified in one forward (speculative decoding
without a draft model), for caches whose layers all attend to the full past.

Each step feeds every row its last decided token plus a draft of likely next tokens; the row's own greedy argmax
at each position accepts the longest agreeing draft prefix and decides one more token, so the output is exactly
the greedy continuation (up to floating-point summation order). Drafts come from

- the reference continuation, while the row's output still equals its beginning (most occlusions change nothing);
- otherwise prompt lookup: the tokens that followed the latest earlier occurrence of the row's last n tokens
  in its own context and output (reasoning text repeats itself).

Rows accept different numbers of tokens, so the batch cache becomes ragged: every row gets the same number of new
slots per step, and the slots of rejected draft tokens stay in the cache, masked out by a 4D attention mask, while
explicit position ids keep each row's positions contiguous. Sliding-window layers index their window by slot, not
position, so models with them must use the other engines (`labeling.regenerate` chooses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

LOOKUP_ORDERS = (3, 2, 1)


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
                return self.seq[start:start + k]
        return []


def has_sliding_layers(cache: DynamicCache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in cache.layers)


@torch.no_grad()
def speculative_greedy(model, cache: DynamicCache, input_ids: torch.Tensor, contexts: Sequence[Sequence[int]],
                       max_new_tokens: int, stop_ids: Sequence[int], reference: Sequence[int] | None = None,
                       draft_len: int = 8, reference_draft_len: int = 32) -> list[list[int]]:
    """Greedy continuations of ``input_ids [batch, L]`` fed after `cache` (every row at one cached length).

    `contexts[b]` is row b's whole context (cached prefix and input), the text prompt lookup searches. Returns the
    new tokens of each row, ending at a stop token (kept) or after `max_new_tokens`. `cache` is consumed.
    """
    if has_sliding_layers(cache):
        raise ValueError("speculative_greedy needs full-attention cache layers (no sliding window)")
    batch, device = input_ids.shape[0], input_ids.device
    stops = set(stop_ids)
    reference = list(reference or [])
    blocked = torch.finfo(model.dtype).min
    cached = cache.get_seq_length()
    logits = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    outputs = [[token] for token in logits[:, -1].argmax(-1).tolist()]
    lookups = [NgramLookup(list(context) + out) for context, out in zip(contexts, outputs)]
    lengths = [cached + input_ids.shape[1]] * batch  # valid slots (= positions fed) per row
    valid = torch.ones(batch, lengths[0], dtype=torch.bool, device=device)  # [batch, slots]
    active = list(range(batch))

    def finished(row: int) -> bool:
        return outputs[row][-1] in stops or len(outputs[row]) >= max_new_tokens

    def drop_finished() -> None:
        nonlocal active, valid
        keep = [i for i, row in enumerate(active) if not finished(row)]
        if len(keep) < len(active):
            if keep:
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                valid = valid[index]
            active = [active[i] for i in keep]

    def draft(row: int) -> list[int]:
        out, room = outputs[row], max_new_tokens - len(outputs[row])
        if out == reference[: len(out)] and len(reference) > len(out):
            return reference[len(out): len(out) + min(reference_draft_len, room)]
        return lookups[row].draft(min(draft_len, room))

    drop_finished()
    while active:
        drafts = [draft(row) for row in active]
        width = 1 + max(len(d) for d in drafts)
        pad = outputs[active[0]][-1]  # any id: padded slots are never accepted
        inputs = torch.tensor([[outputs[row][-1], *d, *[pad] * (width - 1 - len(d))] for row, d in zip(active, drafts)],
                              device=device)  # [active, width]
        positions = torch.tensor([lengths[row] for row in active], device=device)[:, None] + torch.arange(width,
                                                                                                     device=device)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([valid[:, None, :].expand(-1, width, -1), causal.expand(len(active), -1, -1)], dim=2)
        mask = torch.zeros(allowed.shape, dtype=model.dtype, device=device).masked_fill(~allowed, blocked)[:, None]
        predicted = model(input_ids=inputs, position_ids=positions, attention_mask=mask, cache=cache,
                          use_cache=True).logits.argmax(-1).tolist()  # [active, width]
        new_valid = torch.zeros(len(active), width, dtype=torch.bool, device=device)
        for i, (row, d) in enumerate(zip(active, drafts)):
            accepted = 0
            while accepted < len(d) and d[accepted] == predicted[i][accepted]:
                accepted += 1
            new_valid[i, : accepted + 1] = True  # the fed last token and the accepted draft tokens
            lengths[row] += accepted + 1
            before = len(outputs[row])
            for token in [*d[:accepted], predicted[i][accepted]]:
                outputs[row].append(token)
                if finished(row):
                    break
            lookups[row].extend(outputs[row][before:])
        valid = torch.cat([valid, new_valid], dim=1)
        drop_finished()
    return outputs
