"""The eviction-policy contract and the policy registry.

A policy is a small dataclass that turns what it declared it needs into one score per candidate slot,
``[batch, kv_head, candidates]``, higher = keep. It never sees the protected prompt, the recent buffer or the
budget: the engine removes those from the candidate set, keeps the top-scoring candidates, and compacts the cache.

Two hooks exist:

- ``score(inputs)`` (required) is called at every eviction round for every layer.
- ``observe(inputs)`` (optional, only for policies whose score is *frozen when the token is produced*, as EpiKV's
  hidden-state and KV-vector families are) is called on every forward for the new tokens and returns their
  per-(layer, head) scores; the engine stores them by absolute position and hands them back in
  ``ScoreInputs.frozen``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from core.errors import unknown_choice


@dataclass(frozen=True)
class Needs:
    """What a policy reads. FA-compatible policies never set ``attention``."""

    keys: bool = False
    values: bool = False
    hidden_layers: tuple[int, ...] = ()  # residual streams (blocks.{l}.hook_resid_post) read when tokens are produced
    attention: bool = False  # attention probabilities of (recent) queries over the cached keys
    # ScoreInputs.cache_keys / cache_values (every resident slot, for cache means) of the kinds set by keys / values
    cache: bool = False
    queries_window: int = 0  # how many recent queries the attention must cover (0 = every query since entry)

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
    hidden: dict[int, torch.Tensor]  # layer -> [batch, new, d_model] residual stream (resid_post) of the new tokens
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
    attention: torch.Tensor | None = None  # [batch, kv_head, queries, candidates] probabilities, GQA group-averaged
    query_positions: torch.Tensor | None = None  # [batch, queries] absolute positions of the attention's queries
    frozen: torch.Tensor | None = None  # [batch, kv_head, candidates] scores `observe` returned for these tokens
    state: dict[str, Any] = field(default_factory=dict)  # same per-(policy, layer) state `observe` saw
    keep: int = 0  # how many candidates per (sequence, head) survive this round (VaSE splits it; most ignore it)
    generator: torch.Generator | None = None  # the run's seeded generator: random policies must use it


class Policy:
    """Base class of eviction policies. Subclasses are dataclasses registered with `register_policy`."""

    name: ClassVar[str] = ""
    citation: ClassVar[str] = ""  # paper and equation
    deviations: ClassVar[str] = ""  # where this implementation departs from the paper, and why
    shared_across_heads: ClassVar[bool] = False  # one keep set for all KV heads of a layer
    # `observe` reads nothing layer-specific (e.g. only the residual stream): the engine calls it once per forward
    # instead of once per layer and gives every layer the same frozen scores.
    layer_independent: ClassVar[bool] = False
    scores_nothing: ClassVar[bool] = False  # `full`: the engine never evicts
    # What the engine protects from eviction unless the run overrides it: "prompt" (whole prompt, the default of
    # Random Attention and EpiKV's hidden-state/KV families), "sinks" (first few tokens, StreamingLLM / H2O) or "none".
    default_protection: ClassVar[str] = "prompt"

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


POLICIES: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def decorate(cls: type[Policy]) -> type[Policy]:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return decorate


def get_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy; unknown names fail with a did-you-mean hint."""
    _load_builtin_policies()
    if name not in POLICIES:
        raise unknown_choice("policy", name, POLICIES)
    return POLICIES[name](**params)


def policy_names() -> list[str]:
    _load_builtin_policies()
    return list(POLICIES)


def _load_builtin_policies() -> None:
    import evictor.policies  # noqa: F401  (registers the built-in policies)
