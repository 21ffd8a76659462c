"""Score-free baselines: no eviction, recency windows and Random Attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from evictor.policies import register_policy
from evictor.policies._inputs import uniform
from scoring.policy import Policy, ScoreInputs


@register_policy("full")
@dataclass
class Full(Policy):
    """No eviction: the uncapped cache every comparison is measured against (the accuracy ceiling)."""

    citation = "Full attention, no eviction (the 'Full' column of Random Attention notes §4 and EpiKV Table 2)"
    scores_nothing = True
    shared_across_heads = True
    default_protection = "none"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return torch.zeros(inputs.positions.shape, device=inputs.positions.device)


@register_policy("recency")
@dataclass
class Recency(Policy):
    """Recency + prompt: keep the prompt and the most recent trace positions (score = absolute position).

    Random Attention notes §3.1 table, 'Recency+prompt'; with the prompt rule removed it is the 'Recency window' row
    of Table 2.
    """

    citation = "Random Attention notes §3.1 table (Recency+prompt): s_i = i"
    shared_across_heads = True  # a per-position rule: every head keeps the same positions
    default_protection = "prompt"
    defined_for = ("prompt",)
    defined_by = "Random Attention notes §3.1 table: Recency+prompt"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.positions.float()


@register_policy("streaming_llm")
@dataclass
class StreamingLLM(Recency):
    """StreamingLLM: a few attention-sink tokens plus a recent window (Xiao et al., ICLR 2024).

    The sinks are the engine's "sinks" protection; scoring by position makes the budget a sliding window.
    """

    citation = "Xiao et al. 2024, Efficient streaming language models with attention sinks (Random Attention §3.1)"
    deviations = (
        "4 sinks (the original's start_size, the engine's n_sinks). The recent window is the budget K plus the "
        "engine's unscored buffer, refreshed each eviction round; tokens keep their true positions (the original "
        "re-numbers positions inside the cache)."
    )
    default_protection = "sinks"
    defined_for = ("sinks",)
    defined_by = "Xiao et al. 2024: attention sinks + a recent window"


@register_policy("random")
@dataclass
class RandomAttention(Policy):
    """Random Attention: the prompt is protected, every trace position gets an i.i.d. Uniform score, drawn
    independently per KV head and redrawn at every eviction (Random Attention notes §3.2)."""

    citation = "Random Attention (arXiv 2609.03430) §3.2: s_i ~ Uniform(0,1) per KV head, prompt s_i = +inf"
    deviations = (
        "Follows the released engine (SalesforceAIResearch/Random-Attention, mode random_pp): a fresh torch.rand per "
        "KV head at every round, the prompt forced in. Draws come from the run's seeded generator, on (0, 1]."
    )
    default_protection = "prompt"
    defined_for: ClassVar[tuple[str, ...] | None] = ("prompt",)  # None in a variant without the prompt rule
    defined_by = "Random Attention §3.2: prompt s_i = +inf; random_unprotected is the method without the rule"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return uniform(self, inputs, tuple(inputs.positions.shape))


@register_policy("random_unprotected")
@dataclass
class RandomUnprotected(RandomAttention):
    """Random Attention with the prompt rule removed (Random Attention notes Table 2, score-alone column)."""

    citation = "Random Attention (arXiv 2609.03430) Table 2: Random Attention without the prompt rule"
    default_protection = "none"
    defined_for = None


@register_policy("random_shared")
@dataclass
class RandomShared(RandomAttention):
    """Random Attention with one draw shared by every KV head of a layer (Random Attention notes, Takeaway B2)."""

    citation = "Random Attention (arXiv 2609.03430) Takeaway B2: shared draw (same random set in every head)"
    shared_across_heads = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        batch, _, candidates = inputs.positions.shape
        return uniform(self, inputs, (batch, 1, candidates)).expand(inputs.positions.shape)
