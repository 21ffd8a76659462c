"""The sampling settings every generator accepts: greedy at temperature 0, else softmax at `temperature` restricted
to the `top_p` nucleus (`tasks.generation.pick_tokens` draws by them). Here, without torch, so that a protocol's
settings are checked when a command line is read (`evictor.protocol.Sampling`)."""

from __future__ import annotations


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
