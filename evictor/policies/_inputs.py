"""Checks and draws shared by the built-in policies."""

from __future__ import annotations

from typing import Any

import torch

from scoring.policy import Policy, ScoreInputs


def require(policy: Policy, inputs: Any, *fields: str) -> tuple[torch.Tensor, ...]:
    """The named input tensors, or a clear error naming the first one the engine did not supply."""
    found = []
    for name in fields:
        value = getattr(inputs, name)
        if value is None:
            kind = type(inputs).__name__
            raise ValueError(f"policy {policy.name!r} needs {kind}.{name}, which was not supplied (see its `needs`)")
        found.append(value)
    return tuple(found)


def uniform(policy: Policy, inputs: ScoreInputs, shape: tuple[int, ...]) -> torch.Tensor:
    """I.i.d. Uniform(0, 1] draws from the run's seeded generator, on the candidates' device.

    (0, 1] rather than [0, 1) so that log(u) is finite.
    """
    if inputs.generator is None:
        raise ValueError(
            f"policy {policy.name!r} draws random numbers: ScoreInputs.generator must be the run's seeded generator"
        )
    draws = torch.rand(shape, generator=inputs.generator, device=inputs.generator.device)
    return (1.0 - draws).to(inputs.positions.device)


def broadcast_frozen(policy: Policy, inputs: ScoreInputs) -> torch.Tensor:
    """The scores `observe` froze for the candidates, as ``[batch, kv_head, candidates]``."""
    (frozen,) = require(policy, inputs, "frozen")
    return frozen.float().expand(inputs.positions.shape)
