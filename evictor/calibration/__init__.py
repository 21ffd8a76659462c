"""Per-model calibration files for the policies that need one (TriAttention, ThinKV), and the dense traces they
are computed from.

A calibration file is one JSON object ``{"kind": "<method>_calibration", "version": 1, "model": ..., ...}`` written
by ``python -m evictor.calibrate <method> --traces T --out FILE`` (`evictor.calibrate`). A policy takes the file's
path as its ``calibration`` parameter and refuses to run without it (`missing_calibration`). The statistics come
from teacher-forced forwards over dense traces (``tasks.run`` or ``evictor.run --policy full`` records): traces made
under eviction are refused, since their text was conditioned on a damaged cache.

The model-driven computations live in `evictor.calibration.triattention` and `evictor.calibration.thinkv`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from core.errors import UsageError
from core.schemas import Trace, read_records
from models.hooks import decoder_layers
from scoring.policy import Policy

VERSION = 1


def calibrate_command(method: str) -> str:
    return f"python -m evictor.calibrate {method} --model MODEL --traces TRACES.jsonl --out FILE"


def missing_calibration(policy: str, method: str, path: str | None = None) -> UsageError:
    """One line naming the command that writes the calibration file `policy` needs."""
    what = "needs a per-model calibration file" if path is None else f"calibration file {path!r} does not exist"
    return UsageError(f"policy {policy!r} {what}: write one with `{calibrate_command(method)}` and pass "
                      f"calibration=FILE (evictor.run --policy-config)")


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_calibration(path: str, method: str, policy: str) -> dict[str, Any]:
    """The JSON object of a calibration file of `method`, or a `UsageError` naming the file and the fix."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise missing_calibration(policy, method, path)
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(
            f"calibration file {path!r} is not valid JSON; rewrite it with `{calibrate_command(method)}`"
        ) from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind != f"{method}_calibration":
        raise UsageError(f"calibration file {path!r} is a {kind or 'non-calibration'} file, not a {method} "
                         f"calibration; write one with `{calibrate_command(method)}`")
    if data.get("version") != VERSION:
        raise UsageError(f"calibration file {path!r} has version {data.get('version')}, this kvscope reads version "
                         f"{VERSION}; rewrite it with `{calibrate_command(method)}`")
    return data


def check_depth(path: str, method: str, model: str, calibrated_layers: int, n_layers: int) -> None:
    """A calibration is per model: refuse one made for a model of another depth."""
    if calibrated_layers != n_layers:
        raise UsageError(f"calibration file {path!r} was made for {model} ({calibrated_layers} layers); this model "
                         f"has {n_layers} layers: recalibrate with `{calibrate_command(method)}`")


@dataclass
class CalibratedPolicy(Policy):
    """A policy that reads the per-model file ``python -m evictor.calibrate <method>`` wrote (its `calibration`
    path): constructible without one (so it can be listed), but `for_depth`, which the engine calls first, refuses
    to run without it and refuses a file made for a model of another depth. The file's sha256 is part of the
    policy's configuration, so runs with different calibrations never resume into each other."""

    calibration: str | None = None
    calibration_sha256: str | None = field(default=None, init=False)
    method: ClassVar[str] = ""

    def read_calibration(self, path: str) -> Any:
        """The loaded statistics of the file at `path` (with ``path``, ``model`` and ``n_layers`` attributes)."""
        raise NotImplementedError

    def load_calibration(self) -> None:
        self._stats = None
        if self.calibration is not None:
            self._stats = self.read_calibration(self.calibration)
            self.calibration_sha256 = file_sha256(self.calibration)

    def stats(self) -> Any:
        if getattr(self, "_stats", None) is None:
            raise missing_calibration(self.name, self.method)
        return self._stats

    def for_depth(self, n_layers: int) -> Policy:
        stats = self.stats()
        check_depth(stats.path, self.method, stats.model, stats.n_layers, n_layers)
        return self


def dense_traces(path: str | os.PathLike, limit: int | None = None) -> list[Trace]:
    """The first `limit` trace records of `path`, each a dense generation of at least two tokens."""
    traces = read_records(path, Trace)[:limit]
    for trace in traces:
        if trace.evicted:
            raise UsageError(f"{path}: trace {trace.id!r} was generated under eviction (policy {trace.policy!r}); "
                             "calibrate on dense traces (tasks.run or evictor.run --policy full)")
        if len(trace.token_ids) < 2:
            raise UsageError(f"{path}: trace {trace.id!r} has {len(trace.token_ids)} token(s); need at least 2")
    return traces


def trace_token_ids(traces: list[Trace], vocab_size: int, max_tokens: int | None) -> list[list[int]]:
    """``prompt_ids + generated_ids`` of each trace, cut at `max_tokens`; ids outside the vocabulary are refused."""
    token_lists = []
    for trace in traces:
        ids = trace.token_ids[:max_tokens]
        bad = [token for token in ids if not 0 <= token < vocab_size]
        if bad:
            raise UsageError(f"trace {trace.id!r} holds token id {bad[0]}, outside this model's vocabulary of "
                             f"{vocab_size}: the traces come from another tokenizer")
        token_lists.append(ids)
    return token_lists


def teacher_forced(lm, ids: list[int]) -> None:
    """One forward over `ids` from position 0, without a cache; hooks installed around it read what they need."""
    lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False, logits_to_keep=1)


@contextmanager
def attention_module_hooks(model, make_hook, *, pre: bool = False) -> Iterator[None]:
    """``make_hook(layer)`` on every layer's attention module (a forward pre-hook with kwargs when `pre`)."""
    handles = []
    try:
        for layer, block in enumerate(decoder_layers(model)):
            # nn.Module.__getattr__ types a submodule as Tensor | Module
            if pre:
                handles.append(block.self_attn.register_forward_pre_hook(  # type: ignore[union-attr]
                    make_hook(layer), with_kwargs=True))
            else:
                handles.append(block.self_attn.register_forward_hook(make_hook(layer)))  # type: ignore[union-attr]
        yield
    finally:
        for handle in handles:
            handle.remove()


def base_record(method: str, lm, traces: list[Trace], token_lists: list[list[int]]) -> dict[str, Any]:
    """The fields every calibration file starts with: what it is, the model and the traces it was computed from."""
    config = lm.model.config
    return {
        "kind": f"{method}_calibration",
        "version": VERSION,
        "model": lm.name,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads,
        "traces": [trace.id for trace in traces],
        "tokens": sum(len(ids) for ids in token_lists),
    }
