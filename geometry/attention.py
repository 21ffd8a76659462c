"""One layer's causal attention, recomputed from post-RoPE queries and keys in chunks of query rows.

The survey never asks a model for all its attention maps at once (``output_attentions`` holds every layer's
``[heads, T, T]`` map in memory). Instead each layer's map is rebuilt here a block of query rows at a time and
reduced on the fly to what the statistics need: the attention every query gives to position 0, and the logits of
the few query rows the Jaccard statistic samples. Peak memory is ``heads x chunk x T`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerAttention:
    first_column: torch.Tensor  # [q_head, T]: alpha_{t,0}, the weight query t gives to position 0
    sampled_logits: torch.Tensor  # [q_head, n_sampled, T]: masked logits of the sampled query rows (-inf = masked)


def layer_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scaling: float,
    sampled: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    chunk: int = 256,
) -> LayerAttention:
    """Causal (optionally sliding-window, soft-capped) attention of one sequence, reduced as described above.

    queries ``[q_head, T, d]`` and keys ``[kv_head, T, d]`` are post-RoPE; query head h reads KV head
    ``h // (q_head / kv_head)`` (grouped-query attention, as ``repeat_kv`` does). Logits are
    ``softcap * tanh(q.k * scaling / softcap)`` when `softcap` is set; query t sees keys s with
    ``t - window < s <= t`` (``s <= t`` without a window), matching transformers' masks. `sampled` ``[n]`` lists
    the query rows whose logits are kept.
    """
    n_q, n_tokens, d_head = queries.shape
    n_kv = keys.shape[0]
    group = n_q // n_kv
    grouped_queries = queries.float().view(n_kv, group, n_tokens, d_head)
    keys = keys.float()
    device = queries.device
    first_column = torch.empty(n_q, n_tokens, device=device)
    sampled_logits = torch.full((n_q, len(sampled), n_tokens), float("-inf"), device=device)
    sampled = sampled.to(device)
    key_pos = torch.arange(n_tokens, device=device)
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)  # causal: rows < stop never see keys >= stop
        query_pos = torch.arange(start, stop, device=device)
        logits = grouped_queries[:, :, start:stop] @ keys[:, None, :stop].transpose(-1, -2) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        hidden = key_pos[None, :stop] > query_pos[:, None]  # [rows, keys]
        if window is not None:
            hidden |= key_pos[None, :stop] <= query_pos[:, None] - window
        logits = logits.masked_fill(hidden, float("-inf")).view(n_q, stop - start, stop)
        first_column[:, start:stop] = (logits[..., 0] - logits.logsumexp(dim=-1)).exp()
        in_chunk = (sampled >= start) & (sampled < stop)
        sampled_logits[:, in_chunk, :stop] = logits[:, sampled[in_chunk] - start]
    return LayerAttention(first_column, sampled_logits)
