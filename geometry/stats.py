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
"""

from __future__ import annotations

import torch

JACCARD_MARGIN = 32  # Appendix D: the first query needs a KV prefix of at least k + 32 tokens


def dispersion(x: torch.Tensor) -> torch.Tensor:
    """``std_i ||x_i - mean(x)||_2`` for ``x`` of shape ``[..., n, d]``; returns ``[...]``."""
    distances = (x - x.mean(dim=-2, keepdim=True)).norm(dim=-1)
    return distances.std(dim=-1, correction=0)


def bos_cosine(keys: torch.Tensor) -> torch.Tensor:
    """Cosine of the position-0 vector with the mean of positions >= 1; ``[..., n, d]`` -> ``[...]``."""
    return torch.nn.functional.cosine_similarity(keys[..., 0, :], keys[..., 1:, :].mean(dim=-2), dim=-1)


def top_singular_value(x: torch.Tensor) -> torch.Tensor:
    """Largest singular value of the (uncentred) stacked vectors ``[..., n, d]`` -> ``[...]``."""
    return torch.linalg.matrix_norm(x.double(), ord=2).to(x.dtype)


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
    ``[0, min(t_i, t_j))``; in a sliding-window layer the prefix also starts at ``max(t_i, t_j) - window + 1``.
    ``J = |A ∩ B| / |A ∪ B|``; pairs whose shared range holds fewer than k keys have no defined J and are skipped.
    Returns ``s[h, i] = mean_{j != i} J(t_i, t_j)`` over the defined pairs, NaN where a query has none.
    """
    heads, n, _ = scores.shape
    device = scores.device
    positions = positions.tolist()
    pair_sum = torch.zeros(heads, n, dtype=torch.float64, device=device)
    pair_count = torch.zeros(n, dtype=torch.float64, device=device)
    for i in range(n - 1):
        end = positions[i]  # the earlier query's position: the shared prefix stops just before it
        starts = [0 if window is None else max(0, t - window + 1) for t in positions[i + 1 :]]
        later = [i + 1 + offset for offset, start in enumerate(starts) if end - start >= k]
        if not later:
            continue
        starts = torch.tensor([starts[j - i - 1] for j in later], device=device)
        later = torch.tensor(later, device=device)
        first = int(starts.min())
        outside = torch.arange(first, end, device=device)[None, :] < starts[:, None]  # [n_later, width]: not shared
        earlier_rows = scores[:, i : i + 1, first:end]  # [heads, 1, width]
        later_rows = scores[:, later, first:end]  # [heads, n_later, width]
        if outside.any():
            earlier_rows = earlier_rows.masked_fill(outside, float("-inf"))
            later_rows = later_rows.masked_fill(outside, float("-inf"))
        shared = _top_k_members(earlier_rows, k) & _top_k_members(later_rows, k)
        overlap = shared.sum(dim=-1, dtype=torch.float64)  # [heads, n_later]
        jaccard = overlap / (2 * k - overlap)
        pair_sum[:, i] += jaccard.sum(dim=-1)
        pair_sum[:, later] += jaccard
        pair_count[i] += len(later)
        pair_count[later] += 1
    return (pair_sum / pair_count).float()


def _top_k_members(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean membership of each row's k largest entries (exactly k, ties broken by `torch.topk`)."""
    members = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    return members.scatter_(-1, rows.topk(k, dim=-1, sorted=False).indices, True)
