"""What a request is checked against before any work starts: the model's context and vocabulary, and the machine.

A request that cannot succeed is refused at once, in one line naming the limit ("ruler length 10000000 exceeds
smollm2-135m's context of 8192 tokens"), instead of after a haystack is built, a model loaded or an hour of decoding.

`ModelLimits` holds the sizes a model's config states (`models.loading.model_limits` reads them without loading the
weights); a size the config does not state is None and checks nothing. The machine's limit is its CPU cores
(`cpu_count`): threads and local workers beyond them are refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import UsageError


@dataclass(frozen=True)
class ModelLimits:
    """The sizes of one model that bound a request: its context (``max_position_embeddings``), vocabulary and
    depth."""

    model: str  # as the user named it, for the messages
    context: int | None = None
    vocab_size: int | None = None
    layers: int | None = None

    @classmethod
    def from_config(cls, model: str, config: Any) -> ModelLimits:
        """The limits of a transformers config (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config

        def size(name: str) -> int | None:
            value = getattr(text, name, None)
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

        return cls(model, size("max_position_embeddings"), size("vocab_size"), size("num_hidden_layers"))

    def check_tokens(self, what: str, tokens: float, why: str = "") -> None:
        """Refuse `tokens` positions of one sequence (``what`` names them: "--max-new-tokens 100000") beyond the
        context the model was trained for; `why` says what that would mean, when it is not plain."""
        if self.context is not None and tokens > self.context:
            raise UsageError(f"{what} exceeds {self.model}'s context of {self.context} tokens" +
                             (f": {why}" if why else ""))

    def check_flags(self, sizes: Mapping[str, int | None]) -> None:
        """Refuse each token-count flag (``{"--window": 32}``; None: not given) beyond the context: no sequence the
        model reads is that long, so the setting is a mistake (a window that never fits, a cap never reached)."""
        for flag, value in sizes.items():
            if value is not None:
                self.check_tokens(f"{flag} {value}", value)

    def check_token_ids(self, ids: Iterable[int], where: str) -> None:
        """Refuse a token id outside the vocabulary (an embedding lookup would fail deep in the model)."""
        if self.vocab_size is None:
            return
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise UsageError(f"{where}: token id {token} is outside {self.model}'s vocabulary of "
                                 f"{self.vocab_size} tokens (0..{self.vocab_size - 1}); were these made with "
                                 "another model?")

    def check_traces(self, traces: Iterable[Any], where: str) -> None:
        """Refuse traces (`core.schemas.Trace`) this model cannot read: a token id outside its vocabulary, or more
        tokens than its context."""
        for trace in traces:
            ids = trace.token_ids
            self.check_token_ids(ids, f"{where}: trace {trace.id!r}")
            self.check_tokens(f"{where}: trace {trace.id!r} of {len(ids)} tokens", len(ids))

    def check_layers(self, flag: str, layers: Iterable[int]) -> None:
        """Refuse a layer index the model does not have."""
        if self.layers is None:
            return
        for layer in layers:
            if not 0 <= layer < self.layers:
                raise UsageError(f"{flag}: layer {layer} does not exist; {self.model} has layers 0..{self.layers - 1}")


def machine_memory() -> int:
    """This machine's memory in bytes."""
    import psutil

    return psutil.virtual_memory().total


def check_memory(what: str, nbytes: float) -> None:
    """Refuse a request whose data alone (`nbytes`, a lower bound: what it must at least hold) exceeds this machine's
    memory; `what` names the request ("--n-boot 10000000000 over 40 traces")."""
    have = machine_memory()
    if nbytes > have:
        raise UsageError(f"{what} needs at least {nbytes / 2**30:,.0f} GiB of memory; this machine has "
                         f"{have / 2**30:,.0f} GiB")


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the system has one, else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpus(flag: str, wanted: float, what: str = "threads") -> None:
    """Refuse asking for more cores than the machine has (`flag` names the request: "--threads 64")."""
    have = cpu_count()
    if wanted > have:
        raise UsageError(f"{flag} asks for {wanted:g} {what} but this machine has {have} CPU core"
                         f"{'s' if have != 1 else ''}")
