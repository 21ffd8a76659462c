"""One layer's causal attention, recomputed (`models.attention`) from post-RoPE queries and keys in chunks of rows.

The survey never asks a model for all its attention maps at once (``output_attentions`` holds every layer's
``[heads, T, T]`` map in memory). Instead each layer's map is rebuilt here a block of query rows at a time and
reduced on the fly to what the statistics need: the attention every query gives to position 0, and the logits of
the few query rows the Jaccard statistic samples. Peak memory is ``heads x chunk x T`` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention import attention_logits, visible_by_position


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

    queries ``[q_head, T, d]`` and keys ``[kv_head, T, d]`` are post-RoPE, at positions ``0..T-1``; the logits,
    grouping and masks are `models.attention`'s. `sampled` ``[n]`` lists the query rows whose logits are kept.
    """
    n_q, n_tokens, _ = queries.shape
    device = queries.device
    first_column = torch.empty(n_q, n_tokens, device=device)
    sampled_logits = torch.full((n_q, len(sampled), n_tokens), float("-inf"), device=device)
    sampled = sampled.to(device)
    positions = torch.arange(n_tokens, device=device)[None]
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)  # causal: rows < stop never see keys >= stop
        visible = visible_by_position(positions[:, start:stop], positions[:, :stop], window)
        logits = attention_logits(queries[None, :, start:stop], keys[None, :, :stop], scaling=scaling, softcap=softcap,
                                  visible=visible)[0]  # [q_head, rows, stop]
        first_column[:, start:stop] = (logits[..., 0] - logits.logsumexp(dim=-1)).exp()
        in_chunk = (sampled >= start) & (sampled < stop)
        sampled_logits[:, in_chunk, :stop] = logits[:, sampled[in_chunk] - start]
    return LayerAttention(first_column, sampled_logits)
