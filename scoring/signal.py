"""The per-token signal contract: what a signal reads from each forward, and how that becomes one value per position.

A signal is a small class registered by name with `signals.register_signal`; a module of the `signals` package that
defines one needs nothing else to be found, and `signals.extract` computes every registered signal the same way,
during decode or over a stored trace. One instance follows one layer of one batch of sequences over any sequence of
forwards (a prefill block, then one decode step at a time; or one forward over a whole trace): `add` receives what
the signal reads for the positions the forward appended, and `result` returns ``[batch, pos]`` in float32 on the CPU
over every position forwarded so far, NaN where undefined. Feeding the same positions in other chunks gives the same
values up to floating-point summation order.

What a signal reads (`reads`, one of `READS`, which is also the order signals are listed and written in), at the
forward of some new positions through layer l:

- ``"hidden"``: their residual stream h_l, ``[batch, new, d_model]``, at ``blocks.{l}.<DEFAULT_HIDDEN_HOOK>``
  (`scoring.policy.DEFAULT_HIDDEN_HOOK`: EpiKV's h_l, the input of block l);
- ``"kv"``: the post-RoPE keys and the values the cache stores for them, two ``[batch, kv_head, new, d_head]``;
- ``"attention"``: their queries' attention probabilities ``[batch, q_head, new, keys]`` over the last `keys`
  positions (a sliding-window layer sees fewer), recomputed by `models.attention`, so any attention kernel serves.

Every K/V and attention signal is a mean over heads (`KVSignal`, `head_mean`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

READS = ("hidden", "kv", "attention")


def head_mean(probs: torch.Tensor) -> torch.Tensor:
    """The attention rows a signal reads: ``[batch, q_head, new, keys]`` probabilities averaged over the query heads,
    in float32, ``[batch, new, keys]``."""
    return probs.float().mean(1)


class TokenSignal:
    """Base class of per-token signals; one instance per (layer, batch of sequences), made with no arguments."""

    name: ClassVar[str] = ""
    reads: ClassVar[str] = ""  # one of READS

    def add(self, *tensors: Any) -> None:
        """Take one forward's tensors: what `reads` names, in the order the module docstring lists them.

        A subclass names them as its parameters (``add(self, probs)``); here, where their number is not known, they
        are typed `Any`, which every such override matches."""
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """``[batch, pos]`` over every position forwarded so far (float32, on the CPU)."""
        raise NotImplementedError


class CausalSignal(TokenSignal):
    """A signal whose value at a position is fixed by the forward that appends it: `values` turns one forward's
    tensors into ``[batch, new]``, and the result is their concatenation."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def values(self, *tensors: Any) -> torch.Tensor:  # typed as `TokenSignal.add`: a subclass names its tensors
        raise NotImplementedError

    def add(self, *tensors: Any) -> None:
        self._parts.append(self.values(*tensors).cpu())

    def result(self) -> torch.Tensor:
        return torch.cat(self._parts, dim=1)


class KVSignal(CausalSignal):
    """A signal of the cached keys and values: `per_head` turns them into ``[batch, kv_head, new]``, averaged over
    the KV heads."""

    reads = "kv"

    def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def values(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.per_head(keys, values).mean(1)


class AttentionSignal(TokenSignal):
    """A signal of the attention every position has received so far, which later queries change: `update` takes one
    forward's `head_mean` rows ``[batch, new, keys]``, whose keys are the last `keys` of the `seen` positions."""

    reads = "attention"

    def __init__(self) -> None:
        self.seen = 0  # positions forwarded so far

    def update(self, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def add(self, probs: torch.Tensor) -> None:
        rows = head_mean(probs)
        self.seen += rows.shape[1]
        self.update(rows)

    def by_position(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` over every position seen so far, ``[batch, new, seen]``: 0 on the keys a query did not see."""
        batch, new, keys = rows.shape
        padded = rows.new_zeros(batch, new, self.seen)
        padded[..., self.seen - keys:] = rows
        return padded
