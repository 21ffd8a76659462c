"""One record schema per artefact, shared by the stage that writes it and every stage that reads it.

=========  ======================================  =============================================  ==========
kind       written by                              read by                                        id
=========  ======================================  =============================================  ==========
trace      tasks.run, evictor.run (one per problem) labeling, signals, evictor (replay,              problem id
                                                   --reference), validation.compare, study
label      labeling.occlusion (one per trace)      validation, study, figures                     problem id
signal     signals, evictor.replay                 validation, study, figures                     problem id
cell       evictor.run summary (one per cell)      validation.compare, figures, study             cell label
probe_row  probes.planted_fact / probes.passcode   figures, study                                 condition
=========  ======================================  =============================================  ==========

Every record carries ``kind`` and ``id``; a file of one kind handed to a reader of another is refused with one line
naming the file, the record and both kinds. Fields a reader does not know are kept in ``extra`` and written back,
so a newer writer's records survive an older reader. Intervals are always ``<name>_lo`` / ``<name>_hi``
(``ci_lo``/``ci_hi`` for an accuracy), the same in JSONL, CSV and figures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from core.errors import UsageError
from core.records import read_jsonl

R = TypeVar("R", bound="Record")


@dataclass(kw_only=True)
class Record:
    KIND: ClassVar[str] = ""
    # Older field names still accepted on reading: {old: new}.
    RENAMED: ClassVar[dict[str, str]] = {}

    id: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = {"kind": self.KIND}
        for f in dataclasses.fields(self):
            if f.name != "extra":
                data[f.name] = getattr(self, f.name)
        return {**data, **self.extra}

    @classmethod
    def required(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any], where: str = "record") -> R:
        kind = data.get("kind")
        if kind is not None and kind != cls.KIND:
            raise UsageError(f"{where} is a {kind} record, not a {cls.KIND} record")
        data = {cls.RENAMED.get(key, key): value for key, value in data.items() if key != "kind"}
        missing = [name for name in cls.required() if name not in data]
        if missing:
            raise UsageError(f"{where} has no {', '.join(missing)}: not a {cls.KIND} record")
        if isinstance(data["id"], bool) or not isinstance(data["id"], str | int):
            raise UsageError(f"{where}: id {_shown(data['id'])} is not a string or an integer")
        check_field_types(cls, {k: v for k, v in data.items() if k != "id"}, where)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        record = cls(**{k: v for k, v in data.items() if k in known},
                     extra={k: v for k, v in data.items() if k not in known})
        record.id = str(record.id)
        record.check(where)
        return record

    def check(self, where: str) -> None:
        """Refuse a record whose fields do not fit together (each field's type is checked before)."""


@dataclass(kw_only=True)
class Trace(Record):
    """One generation for one problem: dense (`policy` "full") or under eviction (the eviction fields set)."""

    KIND: ClassVar[str] = "trace"

    dataset: str | None
    model: str
    prompt_ids: list[int]
    generated_ids: list[int]
    text: str = ""
    answer: str | None = None
    extracted_by: str | None = None
    gold: str | None = None
    correct: bool | None = None
    finish_reason: str = "length"
    empty_output: bool = False
    no_answer: bool = False
    timings: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0, "top_p": 1.0})
    policy: str = "full"
    policy_config: dict[str, Any] | None = None
    budget: float | None = None  # as asked: tokens, or a fraction of the reference length
    budget_tokens: int | None = None  # the effective K of this problem
    protocol: dict[str, Any] | None = None
    eviction: dict[str, Any] | None = None  # rounds, peak slots per head, timings of the rounds

    @property
    def evicted(self) -> bool:
        """True when the generation ran with eviction (its cache lost tokens): not a dense trace."""
        return self.policy != "full" and bool((self.eviction or {}).get("rounds"))

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.generated_ids)


@dataclass(kw_only=True)
class Label(Record):
    """Counterfactual occlusion labels of one trace (EpiKV App. 8); `status` "skipped" records carry `reason`.

    ``labels[i]`` is the label of absolute position ``positions[i]``; a position the no-answer rule leaves unlabelled
    is absent from both (`labeling.windows.rule_labels`).
    """

    KIND: ClassVar[str] = "label"
    RENAMED: ClassVar[dict[str, str]] = {"trace_id": "id"}

    dataset: str | None
    model: str
    status: str
    reason: str | None = None
    correct: bool | None = None
    trace_answer: str | None = None
    gold: str | None = None
    n_tokens: int | None = None
    reasoning_start: int | None = None
    answer_start: int | None = None
    boundary: str | None = None
    replacement: dict[str, Any] | None = None  # {"spec": "neutral", "token_id": 13, "text": "."}
    token_ids: list[int] | None = None
    positions: list[int] | None = None
    labels: list[int] | None = None
    reference_answer: str | None = None
    reference_text: str | None = None
    windows: list[dict[str, Any]] | None = None  # each: start, end, outcome, flipped, answers, continuation
    important_fraction: float | None = None  # over the labelled reasoning positions (None: none labelled)
    forced_cue: dict[str, Any] | None = None  # forced-answer labelling: the cue appended to every context
    no_answer_rule: str | None = None  # how no-answer windows label positions (None: records made before the rule)
    outcome_counts: dict[str, int] | None = None  # windows per outcome: same, different, no_answer, degenerate
    reference_matches_gold: bool | None = None  # the reference answer equals the gold one (None: no gold answer)
    # graded labels (`labeling.answer`): the reference answer's tokens and its score after the unoccluded context;
    # each window then carries its own score and its effect (None: not graded)
    graded: dict[str, Any] | None = None
    # which intervention made the labels: "token" occlusion (None in records made before there were others),
    # "cache" (a window's keys and values removed) or "joint" (random keep-sets at a budget, `labeling.joint`)
    intervention: str | None = None
    # joint labels: the budget, units and draws, the datamodel's fit and every draw (kept units per head, its score)
    joint: dict[str, Any] | None = None

    @property
    def labelled(self) -> bool:
        return self.status == "labelled"

    def check(self, where: str) -> None:
        if self.labels is not None and self.positions is not None and len(self.labels) != len(self.positions):
            raise UsageError(f"{where}: {len(self.labels)} labels for {len(self.positions)} positions; each label "
                             "is the label of one position")


@dataclass(kw_only=True)
class Signal(Record):
    """Per-token signals of one trace: ``signals[name][layer]`` is one value per position (None where undefined).

    Layer keys are strings of layer indices, or ``"agg"`` for a policy's own aggregate over layers and heads.
    """

    KIND: ClassVar[str] = "signal"
    RENAMED: ClassVar[dict[str, str]] = {"trace_id": "id"}

    model: str
    dataset: str | None = None
    n_tokens: int
    n_prompt: int
    positions: list[int]
    signals: dict[str, dict[str, list[float | None]]]
    layers: list[int] = field(default_factory=list)
    smoothing: str | None = None
    band_score: list[float | None] | None = None

    def check(self, where: str) -> None:
        n = len(self.positions)
        for name, by_layer in self.signals.items():
            for layer, values in by_layer.items():
                if len(values) != n:
                    raise UsageError(f"{where}: signal {name} at layer {layer} has {len(values)} values for {n} "
                                     "positions")
        if self.band_score is not None and len(self.band_score) != n:
            raise UsageError(f"{where}: band_score has {len(self.band_score)} values for {n} positions")


@dataclass(kw_only=True)
class Cell(Record):
    """One (policy, budget) cell of an eviction sweep: accuracy with its interval, cost, and cache size."""

    KIND: ClassVar[str] = "cell"

    policy: str
    budget: float | None
    problems: int
    correct: int
    accuracy: float
    ci_lo: float | None = None
    ci_hi: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    protocol: dict[str, Any] | None = None
    no_answer: int = 0
    empty_output: int = 0
    truncated: int = 0
    mean_generated: float | None = None
    median_tokens_per_s: float | None = None
    mean_rounds: float | None = None
    # problems with at least one eviction round while they were generating (None: the cell never evicts); the rest
    # decoded as dense, so a budget that bites few problems compares little
    evicted: int | None = None
    mean_round_ms: float | None = None
    mean_round_share: float | None = None
    max_peak_slots: int | None = None  # the most cache slots any KV head held (the equal-cache comparison key)
    max_peak_cache_bytes: int | None = None
    max_peak_memory_bytes: int | None = None
    # Why some of the cell's problems ran outside its policy's protocol (`scoring.policy.Policy.outside_protocol`),
    # "<n> of <N> problems: <reason>"; None when every problem ran inside it. Such a cell measures a variant, not
    # the method, and tables and figures say so.
    outside_protocol: str | None = None


@dataclass(kw_only=True)
class ProbeRow(Record):
    """One condition of a planted-fact or passcode probe: retrieval (Wilson interval), mean log p, graded recall."""

    KIND: ClassVar[str] = "probe_row"

    probe: str
    condition: str
    n: int
    retrieval: float
    retrieval_lo: float | None = None
    retrieval_hi: float | None = None
    mean_lp: float | None = None
    lp_lo: float | None = None
    lp_hi: float | None = None
    R: float | None = None
    R_lo: float | None = None
    R_hi: float | None = None
    held: float | None = None


KINDS: dict[str, type[Record]] = {cls.KIND: cls for cls in (Trace, Label, Signal, Cell, ProbeRow)}


def check_field_types(cls: type, values: Mapping[str, Any], where: str, *, finite: bool = False) -> None:
    """Refuse a value that does not fit the annotation of the field of dataclass `cls` it sets (a record read from
    JSON, a policy's parameters from a file), naming the field, the value and the type; with `finite`, a NaN or
    infinite number too. Names that are not fields are left to the caller."""
    hints = _field_types(cls)
    for name, value in values.items():
        if name in hints and not _conforms(value, hints[name]):
            raise UsageError(f"{where}: {name} {_shown(value)} is not {_describe(hints[name])}")
        if finite and isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{where}: {name} {value} is not a finite number")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"extra"}
    return {name: hint for name, hint in typing.get_type_hints(cls).items() if name in fields}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation: an int is not a bool, a float may be written as an int, a list
    holds elements of its type, a dict maps strings to values of its type."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is tuple:  # JSON has lists only
        items = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            return False
        if len(items) == 2 and items[1] is Ellipsis:
            return all(_conforms(v, items[0]) for v in value)
        return len(value) == len(items) and all(_conforms(v, item) for v, item in zip(value, items))
    if origin is dict:
        _, item = typing.get_args(hint)
        return isinstance(value, dict) and all(isinstance(k, str) and _conforms(v, item) for k, v in value.items())
    return isinstance(value, hint)


def _describe(hint: Any, plural: bool = False) -> str:
    """``list[int] | None`` -> "a list of integers or null"; `plural` for the elements of a container."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(option, plural) for option in typing.get_args(hint))
    if typing.get_origin(hint) is list or typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (...,):
        return ("lists" if plural else "a list") + " of " + _describe(typing.get_args(hint)[0], True)
    if typing.get_origin(hint) is tuple:
        items = typing.get_args(hint)
        return ("lists" if plural else "a list") + f" of {len(items)}: " + ", ".join(map(_describe, items))
    if typing.get_origin(hint) is dict:
        return ("objects" if plural else "an object") + " of " + _describe(typing.get_args(hint)[1], True)
    names = {str: ("a string", "strings"), int: ("an integer", "integers"), float: ("a number", "numbers"),
             bool: ("true or false", "booleans"), type(None): ("null", "nulls"), Any: ("a JSON value", "values")}
    single, many = names.get(hint, (getattr(hint, "__name__", str(hint)),) * 2)
    return many if plural else single


def _shown(value: Any, width: int = 60) -> str:
    """A JSON value as the error names it, cut to `width` characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def iter_records(path: str | os.PathLike, cls: type[R]) -> Iterator[R]:
    """The records of a JSONL file as `cls`; a record of another kind, or lacking a field, is a `UsageError`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    for number, data in enumerate(read_jsonl(path), start=1):
        yield cls.from_json(data, f"{path}: record {number}")


def read_records(path: str | os.PathLike, cls: type[R], *, unique: bool = True) -> list[R]:
    """All records of `path` as `cls`, refusing an empty file and (by default) an id that appears twice."""
    records = list(iter_records(path, cls))
    if not records:
        raise UsageError(f"{path} holds no {cls.KIND} records")
    if unique:
        seen: set[str] = set()
        for number, record in enumerate(records, start=1):
            if record.id in seen:
                raise UsageError(f"{path}: {cls.KIND} id {record.id!r} appears twice (record {number}); "
                                 "one run per file")
            seen.add(record.id)
    return records


def as_json(records: Iterable[Record]) -> list[dict[str, Any]]:
    return [record.to_json() for record in records]
