"""ThinKV's thought-based eviction: segments classified by attention sparsity, a token budget per segment type.

Ramachandran et al. 2025, "ThinKV: Thought-Adaptive KV Cache Compression for Efficient Reasoning Models" (arXiv
2510.01290), as EpiKV (§2, §4.3, App. 9) runs it as its strongest attention-requiring baseline:

- every ``tau`` = 128 positions form a block; once a block is complete its queries' mean attention sparsity is
  compared with the calibrated thresholds (`evictor.calibration.thinkv`) and the block becomes a reasoning (R),
  execution (E) or transition (T) thought; consecutive blocks of one type are one segment (thought);
- each segment keeps at most ``budgets[type]`` tokens, {R: 64, E: 32, T: 8} (EpiKV App. 9), so the cache may hold
  fewer than K tokens; only a recency window is otherwise preserved (no prompt or sink protection).

As one score per candidate (`thinkv_scores`): a token within its segment's budget scores ``tier + a / (Q + 1)``
with tier R = 3, E = 2, T = 1 and ``a`` the attention it received from the last Q = tau queries (the tokens a
segment keeps are its most attended ones); every other token scores ``i / (t + 1)`` (position over the next
position), below every budgeted token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import UsageError
from evictor.calibration import CalibratedPolicy
from evictor.calibration.thinkv import DEFAULT_TAU, METHOD, TYPES, ThinKVStats, attention_sparsity, load_thinkv
from evictor.policies import register_policy
from evictor.policies._inputs import require
from scoring.policy import Needs, ScoreInputs

DEFAULT_BUDGETS = (64, 32, 8)  # tokens kept per R, E, T segment (EpiKV App. 9)
UNCLASSIFIED = -1
SPARSITY = "sparsity"


def record_sparsity(table: torch.Tensor | None, sparsity: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """The per-position sparsity table ``[b, positions]`` (NaN = never seen) with the queries `sparsity` ``[b, Q]``
    at `query_positions` ``[b, Q]`` (-1 = none) added; a position keeps the value of its first sighting, measured
    over the cache as it was when the query ran."""
    batch = sparsity.shape[0]
    width = int(query_positions.max().item()) + 1
    if table is None:
        table = torch.full((batch, 0), torch.nan, device=sparsity.device)
    if table.shape[1] < width:
        table = torch.cat([table, table.new_full((batch, width - table.shape[1]), torch.nan)], dim=1)
    rows, cols = torch.nonzero(query_positions >= 0, as_tuple=True)
    where = query_positions[rows, cols].long()
    current = table[rows, where]
    table[rows, where] = torch.where(current.isnan(), sparsity[rows, cols].float(), current)
    return table


def block_types(table: torch.Tensor, next_position: torch.Tensor, tau: int, thresholds: torch.Tensor,
                band_types: tuple[int, int, int], n_blocks: int) -> torch.Tensor:
    """``[b, n_blocks]``: the type (index into R, E, T) of each complete block of `tau` positions with a recorded
    sparsity, `UNCLASSIFIED` for a block still being generated or never seen. A block's band is low, middle or high
    as its mean sparsity is ``<= thresholds[0]``, in between, or ``> thresholds[1]``."""
    batch, width = table.shape
    padded = table.new_full((batch, n_blocks * tau), torch.nan)
    padded[:, : min(width, n_blocks * tau)] = table[:, : n_blocks * tau]
    mean = padded.view(batch, n_blocks, tau).nanmean(-1)
    thresholds = thresholds.to(mean.device)
    band = (mean > thresholds[0]).long() + (mean > thresholds[1]).long()
    kinds = torch.tensor(band_types, device=mean.device)[band]
    complete = (torch.arange(1, n_blocks + 1, device=mean.device) * tau)[None] <= next_position[:, None]
    return torch.where(complete & ~mean.isnan(), kinds, UNCLASSIFIED)


def segment_ids(types: torch.Tensor) -> torch.Tensor:
    """``[b, n_blocks]`` segment index of each block: a new segment starts where the type changes; an unclassified
    block is a segment of its own."""
    starts = torch.ones_like(types, dtype=torch.bool)
    starts[:, 1:] = (types[:, 1:] != types[:, :-1]) | (types[:, 1:] == UNCLASSIFIED)
    return starts.long().cumsum(1) - 1


def rank_in_segment(importance: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Per candidate, how many candidates of its segment are more important (ties: the older first)."""
    by_importance = torch.argsort(importance, dim=-1, descending=True, stable=True)
    by_segment = torch.argsort(segment.gather(-1, by_importance), dim=-1, stable=True)
    order = by_importance.gather(-1, by_segment)  # grouped by segment, most important first
    grouped = segment.gather(-1, order)
    index = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    new = torch.ones_like(grouped, dtype=torch.bool)
    new[..., 1:] = grouped[..., 1:] != grouped[..., :-1]
    first = torch.where(new, index, 0).cummax(-1).values
    return torch.empty_like(order).scatter_(-1, order, index - first)


def thinkv_scores(positions: torch.Tensor, importance: torch.Tensor, n_queries: int, types: torch.Tensor, tau: int,
                  next_position: torch.Tensor, budgets: tuple[int, int, int]) -> torch.Tensor:
    """Scores ``[b, kv_head, C]`` of candidates at `positions` with received attention `importance` (-inf on
    padding) from `n_queries` queries, blocks typed by `types` ``[b, n_blocks]`` (unclassified blocks count as R)."""
    batch = positions.shape[0]
    block = (positions.clamp_min(0) // tau).long()
    blocks = block.reshape(batch, -1)
    kind = types.gather(1, blocks).view_as(positions)
    segment = segment_ids(types).gather(1, blocks).view_as(positions)
    rank = rank_in_segment(importance, segment)
    kind = kind.clamp_min(0)  # an unclassified block keeps as much as a reasoning thought
    budget = torch.tensor(budgets, device=positions.device)[kind]
    tier = (len(TYPES) - kind).float()
    kept = tier + importance.clamp_min(0) / (n_queries + 1)
    filler = positions.float() / (next_position.float()[:, None, None] + 1)
    return torch.where(rank < budget, kept, filler)


@register_policy("thinkv")
@dataclass
class ThinKV(CalibratedPolicy):
    """ThinKV eviction: blocks of `tau` tokens typed R / E / T by their queries' attention sparsity against the
    calibrated thresholds, at most `budgets` = (64, 32, 8) tokens per R / E / T segment, recency window only.
    `calibration` is the file ``python -m evictor.calibrate thinkv`` wrote for this model (required)."""

    tau: int = DEFAULT_TAU
    budgets: tuple[int, int, int] = DEFAULT_BUDGETS
    method = METHOD

    citation = (
        "Ramachandran et al. 2025, ThinKV (arXiv 2510.01290): thought segments R/E/T by attention sparsity, "
        "refreshed every tau = 128 tokens; EpiKV App. 9: per-segment budgets {64, 32, 8}, recency window only"
    )
    deviations = (
        "Eviction only: ThinKV's thought-based quantization (per-type precision) and its Continuous Thinking kernel "
        "are out of scope. The engine always keeps K tokens, so where the segment budgets sum to less, the newest "
        "over-budget tokens fill the cache (ranked below every budgeted token; ThinKV keeps fewer than K, EpiKV "
        "App. 9: the engine gives every head of a sequence the same slot count, so one padding mask serves every "
        "layer and the fused kernels, and fewer slots in some heads would need per-head masks everywhere); where "
        "they sum to more, T tokens go first, then E, then R, least attended first. Within a segment the most "
        "attended tokens (last tau queries) are kept: our choice. Each layer classifies blocks from its own sparsity "
        "(ThinKV classifies once from a calibrated layer subset; the engine keeps no state shared across layers). "
        "Sparsity is read at the first round that sees a query, over the candidates only (renormalised; calibration "
        "reads full causal rows); blocks no round saw (before the first eviction) count as R, each its own segment. "
        "The sparsity measure, block-mean statistic, KDE-valley thresholds and band order (R least sparse, T most) are "
        "this implementation's choices, unverified against the paper's text."
    )
    default_protection = "none"

    def __post_init__(self) -> None:
        self.budgets = tuple(int(b) for b in self.budgets)  # type: ignore[assignment]  # a JSON config gives a list
        if len(self.budgets) != len(TYPES) or min(self.budgets) < 0:
            raise UsageError(f"{self.name}: budgets must be three token counts >= 0 (R, E, T), got {self.budgets}")
        if self.tau < 1:
            raise UsageError(f"{self.name}: tau must be >= 1, got {self.tau}")
        self.load_calibration()
        if self._stats is not None and self._stats.tau != self.tau:
            raise UsageError(f"{self.name}: calibration file {self.calibration!r} holds thresholds for tau = "
                             f"{self._stats.tau}, not {self.tau}; pass tau={self._stats.tau} or recalibrate with "
                             f"--tau {self.tau}")

    def read_calibration(self, path: str) -> ThinKVStats:
        return load_thinkv(path, self.name)

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=self.tau)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        attn, query_positions = require(self, inputs, "attention", "query_positions")
        stats = self.stats()
        positions, mask = inputs.positions, inputs.candidate_mask
        real = query_positions >= 0  # [b, Q]; rows of no query (an unfilled window) are not attention
        attn = attn.float().where(real[:, None, :, None], 0.0)
        visible = mask[:, :, None, :] & (positions[:, :, None, :] <= query_positions[:, None, :, None])
        sparsity = attention_sparsity(attn, visible & real[:, None, :, None]).nanmean(1)  # [b, Q]
        table = record_sparsity(inputs.state.get(SPARSITY), sparsity, query_positions)
        inputs.state[SPARSITY] = table
        next_position = (query_positions.max(-1).values + 1).clamp_min(0)
        n_blocks = max(table.shape[1], int(positions.max().item()) + 1) // self.tau + 1
        types = block_types(table, next_position, self.tau, stats.thresholds[inputs.layer], stats.band_types, n_blocks)
        importance = attn.sum(-2).where(mask, float("-inf"))
        return thinkv_scores(positions, importance, attn.shape[-2], types, self.tau, next_position, self.budgets)
