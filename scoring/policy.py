"""The eviction-policy contract: what a policy declares it reads, what it is given, and the base class it fills in.

A policy is a small dataclass that turns what it declared it needs into one score per candidate slot,
``[batch, kv_head, candidates]``, higher = keep. It never sees the protected prompt, the recent buffer or the
budget: the engine removes those from the candidate set, keeps the top-scoring candidates, and compacts the cache.

Protection has two sources, both listed by ``python -m evictor.policies``: the engine's (``default_protection``:
the prompt, the first sinks or nothing, which a run may override, plus the protocol's buffer and recency window) and
the method's own (``kept_recent``: the newest tokens the method always keeps, e.g. SnapKV's observation window, which
the engine keeps under every protocol). ``defined_for`` names the protections a method is defined for; a run with
another one is marked outside its protocol (``outside_protocol``), never reported as a score of the method.

Keep sets: one per (sequence, layer, KV head) by default; ``shared_across_heads`` makes the engine average a layer's
per-head scores into one keep set for every head of the layer, ``shared_across_layers`` makes it average one round's
per-layer scores into one keep set per KV head applied to every layer (both: one set for the whole cache). The scores
a round computes for each layer are what `evictor.replay` reports, before any layer average.

Two hooks exist:

- ``score(inputs)`` (required) is called at every eviction round for every layer.
- ``observe(inputs)`` (optional, only for policies whose score is *frozen when the token is produced*, as EpiKV's
  hidden-state and KV-vector families are) is called on every forward for the new tokens and returns their
  per-(layer, head) scores; the engine stores them by absolute position and hands them back in
  ``ScoreInputs.frozen``.

Every registered scorer is a policy the engine can run, so the eviction traits (protection, keep-set sharing,
citation and deviations) are part of this one base class. The registry of the built-in policies is
`evictor.policies`; the score functions they share with the per-token signals are in `signals`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

ATTENTION_GROUPS = ("mean", "max_logits")
DEFAULT_HIDDEN_HOOK = "hook_resid_pre"  # EpiKV §3.2: h_l = output_hidden_states[l], the input of block l


@dataclass(frozen=True)
class Needs:
    """What a policy reads. FA-compatible policies never set ``attention``."""

    keys: bool = False
    values: bool = False
    hidden_layers: tuple[int, ...] = ()  # residual streams read when tokens are produced, at the hook below
    # Which residual stream of block l is h_l: "hook_resid_pre" (its input, HF output_hidden_states[l], EpiKV's h_l)
    # or "hook_resid_post" (its output); the engine captures blocks.{l}.<hidden_hook> for every hidden layer.
    hidden_hook: str = DEFAULT_HIDDEN_HOOK
    attention: bool = False  # attention probabilities of (recent) queries over the cached keys
    # ScoreInputs.cache_keys / cache_values (every resident slot, for cache means) of the kinds set by keys / values
    cache: bool = False
    queries_window: int = 0  # how many recent queries the attention must cover (0 = every query since entry)
    # ScoreInputs.refreshed: per slot, the position of the newest query whose attention on it exceeded this multiple
    # of that query's uniform share 1 / (keys it saw) (RaaS's refresh rule); needs `attention` (the feed computes it)
    refresh_threshold: float | None = None
    # How the feed turns a KV head's query group into one row: "mean" of the query heads' probabilities (after the
    # softmax), or "max_logits", the softmax of the group's maximum logit (R-KV's compute_attention_scores)
    attention_group: str = "mean"

    def __post_init__(self) -> None:
        if self.refresh_threshold is not None and not self.attention:
            raise ValueError("refresh timestamps are computed from the attention feed: set attention=True")
        if self.attention_group not in ATTENTION_GROUPS:
            raise ValueError(f"unknown attention_group {self.attention_group!r}; valid: {', '.join(ATTENTION_GROUPS)}")

    @property
    def fa_compatible(self) -> bool:
        return not self.attention


@dataclass
class ObserveInputs:
    """The tokens one forward just appended, for policies that freeze a score at generation time."""

    layer: int
    positions: torch.Tensor  # [batch, new] absolute positions of the new tokens
    keys: torch.Tensor | None  # [batch, kv_head, new, d_head] post-RoPE keys of the new tokens
    values: torch.Tensor | None  # [batch, kv_head, new, d_head]
    hidden: dict[int, torch.Tensor]  # layer -> [batch, new, d_model] residual stream (Needs.hidden_hook) of new tokens
    state: dict[str, Any]  # per-(policy, layer) streaming state owned by the policy; starts empty per sequence batch


@dataclass
class ScoreInputs:
    """Everything a policy may read at one eviction round for one layer.

    Candidate tensors are padded to the same count per sequence; ``candidate_mask`` marks real candidates
    (padding scores are ignored by the engine, so a policy need not mask them).
    """

    layer: int
    step: int  # decode step (0 = end of prefill / prefill block)
    positions: torch.Tensor  # [batch, kv_head, candidates] absolute position of each candidate slot
    candidate_mask: torch.Tensor  # [batch, kv_head, candidates] bool
    keys: torch.Tensor | None = None  # [batch, kv_head, candidates, d_head] post-RoPE cached keys
    values: torch.Tensor | None = None  # [batch, kv_head, candidates, d_head]
    cache_keys: torch.Tensor | None = None  # [batch, kv_head, slots, d_head] every resident slot (for cache means)
    cache_values: torch.Tensor | None = None
    cache_mask: torch.Tensor | None = None  # [batch, kv_head, slots] bool, False on padding slots
    cache_positions: torch.Tensor | None = None  # [batch, kv_head, slots] absolute positions, -1 on padding
    # [batch, kv_head, queries, candidates] probabilities, GQA group-averaged (or group-max, Needs.attention_group)
    attention: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None  # [batch, queries] absolute positions of the attention's queries
    # [batch, kv_head, candidates] newest refreshing query's position, else the slot's own (Needs.refresh_threshold)
    refreshed: torch.Tensor | None = None
    next_positions: torch.Tensor | None = None  # [batch] position of each sequence's next token (= tokens produced)
    frozen: torch.Tensor | None = None  # [batch, kv_head, candidates] scores `observe` returned for these tokens
    state: dict[str, Any] = field(default_factory=dict)  # same per-(policy, layer) state `observe` saw
    keep: int = 0  # how many candidates per (sequence, head) survive this round (VaSE splits it; most ignore it)
    generator: torch.Generator | None = None  # the run's seeded generator: random policies must use it


class Policy:
    """Base class of eviction policies. Subclasses are dataclasses registered with `evictor.policies.register_policy`
    (a module of that package that defines one needs nothing else to be found)."""

    name: ClassVar[str] = ""
    citation: ClassVar[str] = ""  # paper and equation
    deviations: ClassVar[str] = ""  # where this implementation departs from the paper, and why
    shared_across_heads: ClassVar[bool] = False  # one keep set for all KV heads of a layer
    # one keep set per KV head for every layer, from the mean of the round's per-layer scores (read on the instance:
    # a policy may make it a property of its parameters)
    shared_across_layers: ClassVar[bool] = False
    # `observe` reads nothing layer-specific (e.g. only the residual stream): the engine calls it once per forward
    # instead of once per layer and gives every layer the same frozen scores.
    layer_independent: ClassVar[bool] = False
    scores_nothing: ClassVar[bool] = False  # `full`: the engine never evicts
    # The registered per-token signal (`signals`) that is this policy's score at the end of a dense trace, averaged
    # over heads: without eviction the two are one quantity (H2O's accumulated attention, TOVA's last row), so a study
    # that replays the policy does not compute the signal too. tests/test_policies_contract.py checks that they agree.
    signal: ClassVar[str] = ""
    # What the engine protects from eviction unless the run overrides it: "prompt" (whole prompt, the default of
    # Random Attention and EpiKV's hidden-state/KV families), "sinks" (first few tokens, StreamingLLM / H2O) or "none".
    default_protection: ClassVar[str] = "prompt"
    # The protections the method is defined for (None: any), and the passage that defines it: a run with another one
    # (an explicit --protect, or the long-prompt fallback to sinks) is outside the method's protocol.
    defined_for: ClassVar[tuple[str, ...] | None] = None
    defined_by: ClassVar[str] = ""

    def kept_recent(self, budget: int) -> int:
        """How many of the newest tokens the method itself keeps at every round, whatever the protocol, in a
        sequence whose budget (as given, in tokens) is `budget`: the observation window its scores are computed from
        (SnapKV, R-KV) or its own recent share of K (H2O's heavy/recent split). The engine keeps them unscored and
        inside K, as the recency window (`evictor.protocol.sequence_budgets`: the window becomes at least this many
        tokens minus the buffer, which keeps the newest already); 0 leaves the newest tokens to the protocol."""
        return 0

    def outside_protocol(self, protect: str) -> str | None:
        """Why a sequence run with protection `protect` ("prompt", "sinks" or "none", after any long-prompt
        fallback) is outside the protocol this method is defined for (`defined_for`), or None when it is inside.
        Such a run measures a variant, never the method: `evictor.run` marks its cell (``Cell.outside_protocol``)."""
        if self.defined_for is None or protect in self.defined_for:
            return None
        return (f"{self.name} is defined with protection {' or '.join(self.defined_for)} ({self.defined_by}); "
                f"this run protected {protect!r}")

    @property
    def needs(self) -> Needs:
        return Needs()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, inputs: ObserveInputs) -> torch.Tensor | None:
        """Scores frozen at generation time, ``[batch, kv_head, new]``; None for policies that do not freeze.

        A head axis of size 1 (a per-token score, e.g. from hidden states) broadcasts to every KV head.
        """
        return None

    def for_depth(self, n_layers: int) -> Policy:
        """This policy for a model with `n_layers` decoder layers; the engine calls it before reading `needs`.

        Depth-free policies return themselves; those whose layers are fractions of the depth (EpiKV) resolve them.
        """
        return self

    def config(self) -> dict[str, Any]:
        from dataclasses import asdict, is_dataclass

        return {"name": self.name, **(asdict(self) if is_dataclass(self) else {})}
