"""What a request is checked against before any work starts: the model's context and vocabulary, and the machine.

A request that cannot succeed is refused at once, in one line naming the limit ("ruler length 10000000 exceeds
smollm2-135m's context of 8192 tokens"), instead of after a haystack is built, a model loaded or an hour of decoding.

`ModelLimits` holds the sizes a model's config states (`models.loading.model_limits` reads them without loading the
weights); a size the config does not state is None and checks nothing. The machine's limits are its CPU cores
(`cpu_count`: threads and local workers beyond them are refused) and the memory of the device the work runs on
(`MemoryLimit`: this machine's RAM for the CPU, the GPU's own memory for CUDA, or less with ``--max-memory``). A
request's memory is a `Footprint`, its estimated peak by part (`models.footprint` makes them from a model's config),
refused by `Footprint.check` when it exceeds the limit: the message names the estimate, the limit and the flags that
shrink it (docs/limits.md gives the estimate's error against measured peaks).
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
        """Refuse traces (`core.schemas.Trace`) this model cannot read: no token at all, a token id outside its
        vocabulary, or more tokens than its context."""
        for trace in traces:
            ids = trace.token_ids
            if not ids:
                raise UsageError(f"{where}: trace {trace.id!r} holds no tokens (its prompt_ids and generated_ids are "
                                 "empty); is it a trace of a run that failed?")
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


_UNITS = {"": None, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"24GiB"`` -> bytes. KiB / MiB / GiB / TiB and K / M / G / T are powers of 1024, KB / MB / GB / TB powers of
    1000 (as ``free`` and Slurm's ``--mem`` read them); the unit is required, so ``24`` is never taken for bytes when
    gigabytes were meant. A `ValueError` says what is wrong."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower()
    if unit not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use KiB, MiB, GiB or TiB (or KB, MB, GB, TB)")
    scale = _UNITS[unit]
    if scale is None:
        raise ValueError(f"{text!r} has no unit; write it with one, e.g. {number}GiB")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not an amount of memory (e.g. 16GiB)") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive amount of memory, got {text!r}")
    nbytes = value * scale
    if nbytes >= 2**63:
        raise ValueError(f"{text!r} is more memory than any machine has")
    return max(1, round(nbytes))


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1, three significant digits: ``1.34TiB``."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        assert scale is not None
        if nbytes >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{nbytes:.0f}B"


@dataclass(frozen=True)
class MemoryLimit:
    """The memory a request may use: the device's (`device_memory`), or less when the user says so."""

    nbytes: int
    source: str  # how the limit reads in a message: "cuda:0's 79.1GiB", "--max-memory 8GiB"

    @classmethod
    def of(cls, device: str | None, max_memory: int | None = None) -> MemoryLimit:
        """The limit on `device` (None: where `models.loading` puts a model, cuda when there is one); `max_memory`
        (``--max-memory``, bytes) lowers it, for a machine shared with other work. A `max_memory` above what the
        device has is refused: planning for memory that does not exist is how a run gets killed mid-way."""
        have, where = device_memory(device)
        if max_memory is None:
            return cls(have, f"{where}'s {format_bytes(have)}")
        if max_memory > have:
            raise UsageError(f"--max-memory {format_bytes(max_memory)} is more than {where} has "
                             f"({format_bytes(have)}); give at most that")
        return cls(max_memory, f"--max-memory {format_bytes(max_memory)}")


def device_memory(device: str | None) -> tuple[int, str]:
    """(bytes, the device in words) of the memory the work on `device` lives in: this machine's RAM for the CPU (and
    for MPS, which shares it), the GPU's own memory for CUDA."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    parsed = torch.device(device)
    if parsed.type == "cuda":
        index = parsed.index if parsed.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}"
    return machine_memory(), "this machine"


MODEL_PARTS = ("weights", "runtime")  # the parts of a `Footprint` that hold whatever the request asks


@dataclass(frozen=True)
class Footprint:
    """The estimated peak memory of a request, by part (``(("weights", 538_000_000), ("KV cache", ...))``); parts are
    held at once, so the peak is their sum."""

    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes in self.parts)

    def __add__(self, other: Footprint) -> Footprint:
        merged: dict[str, int] = {}
        for name, nbytes in (*self.parts, *other.parts):
            merged[name] = merged.get(name, 0) + nbytes
        return Footprint(tuple(merged.items()))

    def times(self, copies: int) -> Footprint:
        """`copies` processes each holding this footprint (local Ray workers, each with its own model), its parts
        named ``"4 x weights"``."""
        return Footprint(tuple((f"{copies} x {name}", nbytes * copies) for name, nbytes in self.parts))

    def describe(self) -> str:
        """``1.34TiB (weights 513MiB + KV cache 1.34TiB + ...)``, parts of at least 1% of the total only."""
        shown = [f"{name} {format_bytes(nbytes)}" for name, nbytes in self.parts if nbytes >= self.total / 100]
        return f"{format_bytes(self.total)} ({' + '.join(shown)})"

    def check(self, what: str, limit: MemoryLimit, remedy: str) -> None:
        """Refuse the request `what` ("smollm2-135m decoding 4096 sequences of 7120 tokens") when this footprint
        exceeds `limit`, saying what to change (`remedy`: "lower --batch-size or --max-new-tokens"); when the
        model alone (its weights and the runtime) does not fit, no setting of the request helps, and the message
        says so."""
        if self.total <= limit.nbytes:
            return
        model = sum(nbytes for name, nbytes in self.parts if name in MODEL_PARTS)
        if model > limit.nbytes:
            remedy = "the model alone does not fit: load it in a smaller --dtype or run on a device with more memory"
        raise UsageError(f"{what} needs about {self.describe()} of memory, more than {limit.source}; {remedy}")


def check_memory(what: str, nbytes: float, limit: MemoryLimit | None = None, remedy: str = "") -> None:
    """Refuse a request whose data alone (`nbytes`, a lower bound: what it must at least hold) exceeds `limit`
    (default: this machine's memory); `what` names the request ("--n-boot 10000000000 over 40 traces")."""
    limit = limit or MemoryLimit(machine_memory(), f"this machine's {format_bytes(machine_memory())}")
    if nbytes > limit.nbytes:
        raise UsageError(f"{what} needs at least {format_bytes(nbytes)} of memory, more than {limit.source}"
                         + (f"; {remedy}" if remedy else ""))


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
