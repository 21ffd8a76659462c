"""Per-token, per-layer signals of a generated trace: hidden-state change, K/V statistics, attention scores.

Every signal is a `scoring.signal.TokenSignal` that a public module of this package defines with
``@register_signal("name")``; `SIGNALS` imports them all the first time it is read, so adding a signal is adding a
class (to the module of its kin, or a module of its own) and nothing else. `signals.extract` computes any of them
during decode or over a stored trace, `signals.traces` writes them as `core.schemas.Signal` records
(``python -m signals``). Signals are listed by what they read (the residual stream, the cache, the attention), then
by module name and definition order.

The score functions the signals are built on (`signals.kv`, `signals.attention`, `signals.hidden`) are shared with
the eviction policies (`evictor.policies`), which import them from here.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.errors import UsageError, unknown_choice
from scoring.registry import Registry
from scoring.signal import READS, TokenSignal

SIGNALS: Registry[TokenSignal] = Registry("signal", __name__, order=lambda cls: READS.index(cls.reads))
register_signal = SIGNALS.register


def check_signals(names: Iterable[str]) -> list[str]:
    """`names` without repeats, in the order given; an unknown name is a `UsageError` naming the nearest signal."""
    names = list(dict.fromkeys(names))
    for name in names:
        if name not in SIGNALS:
            raise unknown_choice("signal", name, SIGNALS)
    if not names:
        raise UsageError("no signal requested")
    return names


def default_signals() -> tuple[str, ...]:
    """The signals computed unless others are asked for: all but those that read attention, which recompute every
    query's attention row."""
    return tuple(name for name in SIGNALS if SIGNALS[name].reads != "attention")
