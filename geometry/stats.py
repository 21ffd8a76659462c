"""Pure tensor statistics of KV geometry and attention (ValueDiff §3.1, §4.4, Appendices C and D).

Every function takes plain tensors and returns plain tensors; nothing here knows about models. Conventions:

- Dispersion ``sigma(x) = std_i ||x_i - mean(x)||_2`` over the token axis, population std (divide by n).
- ``bos_cosine(k) = cos(k_0, mean_{i>=1} k_i)``: position 0 against the mean of the other keys.
- ``leading_token_attention``: alpha_BOS, the mean over query positions t >= 1 of the attention weight alpha_{t,0}
  that query t gives to position 0 (t = 0 is excluded: it can only attend to itself). In a sliding-window layer
  queries t >= window cannot see position 0 at all; they are excluded too, so alpha_BOS measures how strongly the
  queries that *can* reach the leading token use it rather than the window size.
- ``sink_rate``: the fraction of heads whose alpha_BOS exceeds tau (ValueDiff's tau = 0.3).
- ``jaccard_stability``: Appendix D's top-k attention ranking stability with the shared-prefix rule.
- ``first_token_kept``: whether a score ranks position 0 among the top ``ceil(f n)`` of n tokens; with
  ``distances_to_mean`` of the values (ValueDiff's eq. 4 score, the whole context as the cache) it tells whether
  ValueDiff keeps the leading token (the attention sink) at a budget of a fraction f of the context.
"""

from __future__ import annotations

import math

import torch

JACCARD_MARGIN = 32  # Appendix D: the first query needs a KV prefix of at least k + 32 tokens


FIRST_KEPT_FRACTIONS = (0.25, 0.5)  # budgets, as fractions of the context, of the first-token statistic


def distances_to_mean(x: torch.Tensor) -> torch.Tensor:
    """``||x_i - mean(x)||_2`` per vector of ``x [..., n, d]`` -> ``[..., n]``: of the values, ValueDiff's score
    (eq. 4) with every token of the context in the cache (`signals.kv.distance_to_mean` without a ref)."""
    return (x - x.mean(dim=-2, keepdim=True)).norm(dim=-1)


def dispersion(x: torch.Tensor) -> torch.Tensor:
    """``std_i ||x_i - mean(x)||_2`` for ``x`` of shape ``[..., n, d]``; returns ``[...]``."""
    return distances_to_mean(x).std(dim=-1, correction=0)


def first_token_kept(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Whether position 0 is among the ``k = max(1, ceil(fraction * n))`` highest of ``scores [..., n]`` (higher =
    keep) -> bool ``[...]``: fewer than k other tokens score strictly higher (a tie is resolved for position 0)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    k = max(1, math.ceil(round(fraction * scores.shape[-1], 6)))
    return (scores > scores[..., :1]).sum(dim=-1) < k


def bos_cosine(keys: torch.Tensor) -> torch.Tensor:
    """Cosine of the position-0 vector with the mean of positions >= 1; ``[..., n, d]`` -> ``[...]``."""
    return torch.nn.functional.cosine_similarity(keys[..., 0, :], keys[..., 1:, :].mean(dim=-2), dim=-1)


def top_singular_value(x: torch.Tensor) -> torch.Tensor:
    """Largest singular value of the (uncentred) stacked vectors ``[..., n, d]`` -> ``[...]``.

    Computed as the square root of the top eigenvalue of the smaller Gram matrix (d x d or n x n), far cheaper than
    an SVD of the n x d matrix.
    """
    x = x.double()
    gram = x.transpose(-1, -2) @ x if x.shape[-2] >= x.shape[-1] else x @ x.transpose(-1, -2)
    return torch.linalg.eigvalsh(gram)[..., -1].clamp(min=0).sqrt().to(torch.float32)


def leading_token_attention(first_column: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """alpha_BOS from ``first_column[..., t] = alpha_{t,0}`` (``[..., T]``) -> ``[...]``.

    Averages over t in [1, T-1], or over t in [1, window-1] for a sliding-window layer (later queries cannot see
    position 0; see the module docstring).
    """
    stop = first_column.shape[-1] if window is None else min(window, first_column.shape[-1])
    if stop < 2:
        raise ValueError("alpha_BOS needs at least one query position t >= 1 that can see position 0")
    return first_column[..., 1:stop].mean(dim=-1)


def sink_mask(alpha_bos: torch.Tensor, tau: float) -> torch.Tensor:
    """Which heads are sinks: alpha_BOS strictly above ``tau``."""
    return alpha_bos > tau


def sink_rate(alpha_bos: torch.Tensor, tau: float) -> float:
    """Fraction of heads (all entries of ``alpha_bos``) that are sinks at threshold ``tau``."""
    return sink_mask(alpha_bos, tau).float().mean().item()


def query_positions(n_tokens: int, k: int, n_queries: int) -> torch.Tensor:
    """Up to `n_queries` distinct query positions evenly spaced over ``[k + 32, n_tokens - 1]`` (Appendix D).

    When the range holds fewer than `n_queries` positions, every position in it is used.
    """
    first, last = k + JACCARD_MARGIN, n_tokens - 1
    if last < first:
        raise ValueError(f"{n_tokens} tokens leave no query position in [k+{JACCARD_MARGIN}, T-1] for k={k}")
    return torch.linspace(first, last, n_queries).round().long().unique()


def jaccard_stability(scores: torch.Tensor, positions: torch.Tensor, k: int, window: int | None = None) -> torch.Tensor:
    """Positional stability s(t_i) of the top-k attended keys, per head and query (Appendix D).

    scores: ``[heads, n, T]`` attention logits (or probabilities: the ranking within a row is the same) of the
    query rows at ``positions`` (``[n]``, strictly increasing), over all key positions. For a pair (t_i, t_j) the two
    top-k sets are taken over the keys both queries can see and that precede both, i.e. the shared prefix
    ``[0, min(t_i, t_j))``; in a sliding-window layer the range also starts at ``max(t_i, t_j) - window + 1``.
    ``J = |A ∩ B| / |A ∪ B| = |A ∩ B| / (2k - |A ∩ B|)``; pairs whose shared range holds fewer than k keys have
    no defined J and are skipped. Returns ``s[h, i] = mean_{j != i} J(t_i, t_j)`` over the defined pairs, NaN where a
    query has none. Ties at the k-th value (measure zero for real logits) are broken arbitrarily.
    """
    if window is None or window > int(positions[-1]):  # the window never cuts a shared prefix
        overlap, defined = _prefix_overlaps(scores, positions, k)
    else:
        overlap, defined = _windowed_overlaps(scores, positions, k, window)
    overlap = overlap + overlap.transpose(-1, -2)  # J is symmetric; both helpers fill only i < j
    defined = defined | defined.T
    jaccard = (overlap / (2 * k - overlap)).masked_fill(~defined, 0.0)
    return (jaccard.sum(dim=-1) / defined.sum(dim=-1)).float()


def prefix_kth_largest(rows: torch.Tensor, ends: torch.Tensor, k: int) -> torch.Tensor:
    """``out[r, i]`` = the k-th largest of ``rows[r, :ends[i]]``; ``rows`` ``[R, T]``, increasing ``ends`` ``[n]``.

    One sort per row instead of one top-k per (row, prefix): after sorting, a count table over (prefix, block of
    ~sqrt(T) sorted positions) locates the block holding the k-th member of each prefix, and a scan inside that block
    finds it; O(R (T log T + n sqrt(T))) instead of O(R n T).
    """
    n_rows, n_tokens = rows.shape
    n_ends = len(ends)
    device = rows.device
    block = max(1, math.isqrt(n_tokens))
    n_blocks = -(-n_tokens // block)
    values, order = rows.sort(dim=-1, descending=True)  # [R, T]
    token_prefix = torch.searchsorted(ends.to(device), torch.arange(n_tokens, device=device), right=True)
    prefix_of = token_prefix[order]  # [R, T]: the sorted entry is in prefix i iff prefix_of <= i
    block_of = torch.arange(n_tokens, device=device) // block
    table = torch.zeros(n_rows, (n_ends + 1) * n_blocks, dtype=torch.int32, device=device)
    table.scatter_add_(1, prefix_of * n_blocks + block_of, torch.ones_like(order, dtype=torch.int32))
    # counts[r, i, b]: members of prefix i among the sorted positions < (b + 1) * block
    counts = table.view(n_rows, n_ends + 1, n_blocks)[:, :n_ends].cumsum(dim=1, dtype=torch.int32)
    counts = counts.cumsum(dim=2, dtype=torch.int32)
    target = torch.full((n_rows, n_ends, 1), k, dtype=counts.dtype, device=device)
    hit = torch.searchsorted(counts, target)  # [R, n, 1]: first block where the count reaches k
    before = counts.gather(-1, (hit - 1).clamp(min=0)).masked_fill(hit == 0, 0)
    slots = hit * block + torch.arange(block, device=device)  # [R, n, block]: sorted positions in that block
    member = prefix_of.gather(1, slots.view(n_rows, -1).clamp(max=n_tokens - 1)).view(slots.shape)
    member = (member <= torch.arange(n_ends, device=device)[:, None]) & (slots < n_tokens)
    offset = (member.cumsum(dim=-1) >= k - before).int().argmax(dim=-1, keepdim=True)
    return values.gather(1, (hit * block + offset).view(n_rows, n_ends)).view(n_rows, n_ends)


def _prefix_overlaps(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|A_i ∩ B_j| for i < j over the prefix [0, t_i), as ``[heads, n, n]`` (upper triangle) and the defined mask.

    B_j is the set of keys of row j at or above its k-th largest logit in the prefix, so |A_i ∩ B_j| is the number of
    row i's top-k keys whose row-j logit reaches that threshold: a gather of k values per pair.
    """
    heads, n, n_tokens = scores.shape
    thresholds = prefix_kth_largest(scores.reshape(heads * n, n_tokens), positions, k).view(heads, n, n)  # [h, j, i]
    overlap = torch.zeros(heads, n, n, dtype=torch.float64, device=scores.device)
    for i, end in enumerate(positions.tolist()[:-1]):
        top = scores[:, i, :end].topk(k, dim=-1, sorted=False).indices  # [heads, k]
        later = scores[:, i + 1 :].gather(-1, top[:, None, :].expand(-1, n - i - 1, -1))  # [heads, n_later, k]
        overlap[:, i, i + 1 :] = (later >= thresholds[:, i + 1 :, i, None]).sum(dim=-1)
    return overlap, torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(diagonal=1)


def _windowed_overlaps(
    scores: torch.Tensor, positions: torch.Tensor, k: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_prefix_overlaps` for a sliding window: each pair ranks its own range ``[t_j - window + 1, t_i)``.

    Pairs are few (only queries less than ``window - k`` apart share k keys) and ranges short, so each pair's two
    top-k sets are taken directly.
    """
    heads, n, _ = scores.shape
    device = scores.device
    times: list[int] = positions.tolist()
    overlap = torch.zeros(heads, n, n, dtype=torch.float64, device=device)
    defined = torch.zeros(n, n, dtype=torch.bool, device=device)
    for i in range(n - 1):
        end = times[i]
        window_starts = [max(0, t - window + 1) for t in times[i + 1 :]]
        later_ids = [i + 1 + offset for offset, start in enumerate(window_starts) if end - start >= k]
        if not later_ids:
            continue
        starts = torch.tensor([window_starts[j - i - 1] for j in later_ids], device=device)
        later = torch.tensor(later_ids, device=device)
        first = int(starts.min())
        outside = torch.arange(first, end, device=device)[None, :] < starts[:, None]  # [n_later, width]: not shared
        earlier_rows = scores[:, i : i + 1, first:end].masked_fill(outside, float("-inf"))  # [heads, n_later, width]
        later_rows = scores[:, later, first:end].masked_fill(outside, float("-inf"))
        shared = _top_k_members(earlier_rows, k) & _top_k_members(later_rows, k)
        overlap[:, i, later] = shared.sum(dim=-1).double()
        defined[i, later] = True
    return overlap, defined


def _top_k_members(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean membership of each row's k largest entries (exactly k, ties broken by `torch.topk`)."""
    members = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    return members.scatter_(-1, rows.topk(k, dim=-1, sorted=False).indices, True)
