"""What the trace viewer can colour tokens by: the per-token quantities of label records, of signal records and of a
known-answer trace, each turned into a `Layer` (one value per token of the trace, NaN where it has none).

**Label kinds are declared, not coded.** A `LabelKind` names where its records live in a study (a stage and a file
pattern inside that stage's directory) and which of their fields are per-token quantities (`TokenField`): a list
aligned with the record's ``positions`` (``per="position"``), or a key of each entry of its ``windows``
(``per="window"``, spread over the window's tokens ``[start, end)``). Adding a kind of label, or a new quantity of
an existing kind, is one declaration in `LABEL_KINDS`; a kind whose stage or file a study lacks, and a field its
records do not carry, simply give no layer. Cache-level and joint labels (``labeling.occlusion --intervention cache``
or ``joint``; the study's ``cache_labels`` and ``joint_labels`` stages) are label records of the same form, each
window (a joint label's unit) with its ``effect``, declared like token occlusion's.

A label set is named after the intervention its records state and the filler they used (`label_set_name`); hovering
a token lists every scalar field of the windows over it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from core.schemas import Signal

# How a layer is coloured: binary 0/1; signed around zero (a change in log-probability); sequential (any real number,
# with its rank among the trace's tokens); categorical (an index into the layer's categories).
Scale = Literal["binary", "signed", "sequential", "categorical"]


@dataclass(frozen=True)
class TokenField:
    """One per-token quantity a label record carries (see the module docstring)."""

    name: str  # as the selector shows it
    field: str  # the record's list (per="position") or each window's key (per="window")
    per: Literal["position", "window"]
    scale: Scale
    description: str
    # Categorical fields: the categories in order; on a token covered by several windows the one listed last wins,
    # so list the most telling last. Values outside the list follow it, in order of appearance.
    categories: tuple[str, ...] = ()


@dataclass(frozen=True)
class LabelKind:
    """Where one kind of label lives in a study directory, and its per-token fields."""

    name: str
    stage: str  # the study stage whose directory holds the files (`study.pipeline.STAGES`)
    pattern: str  # glob inside the stage directory; each matching file is one label set
    fields: tuple[TokenField, ...]
    # The record's fields bounding the span its labels test, ``[start, end)``: tokens outside it carry no label
    # (the occlusion labeller calls every prompt token important by convention, without testing it).
    tested: tuple[str, str] | None = ("reasoning_start", "answer_start")


OCCLUSION_FIELDS = (
    TokenField("flipped", "labels", "position", "binary",
               "1 where a window covering the token changed the answer when occluded (the label the study validates "
               "scorers against; no label where the no-answer rule leaves the token out)"),
    TokenField("window outcome", "outcome", "window", "categorical",
               "what the regenerated answer did when the window covering the token was occluded",
               categories=("same", "no_answer", "degenerate", "different")),
    TokenField("effect", "effect", "window", "signed",
               "the change in log-probability of the reference answer when the window covering the token is occluded "
               "(mean over covering windows)"),
)

JOINT_FIELDS = (
    TokenField("important", "labels", "position", "binary",
               "1 where evicting the token's unit, with the rest of the cache evicted at the joint budget, lowers the "
               "answer's log-probability significantly (its effect's interval lies below zero)"),
    TokenField("effect", "effect", "window", "signed",
               "the change in log-probability of the reference answer when the token's unit is evicted, given the "
               "rest of the cache is evicted at the joint budget (minus the datamodel's coefficient)"),
)

LABEL_KINDS: tuple[LabelKind, ...] = (
    LabelKind("token occlusion", "labels", "labels.jsonl", OCCLUSION_FIELDS),
    LabelKind("token occlusion", "agreement", "*/labels.jsonl", OCCLUSION_FIELDS),  # the other fillers
    LabelKind("cache occlusion", "cache_labels", "labels.jsonl", OCCLUSION_FIELDS),
    LabelKind("joint labels", "joint_labels", "labels.jsonl", JOINT_FIELDS),
)


@dataclass
class Layer:
    """One per-token quantity of one trace, as the viewer shows it."""

    group: str  # the selector's group: a label set, "scores", "signals (raw)", "known answer"
    name: str
    values: np.ndarray  # float, one per token; NaN where the token has no value
    layer: str | None = None  # the model layer ("agg", "0", "1", ...) of a per-layer quantity
    scale: Scale = "sequential"
    categories: tuple[str, ...] = ()
    description: str = ""
    ranked: bool = False  # show each token's rank among the trace's values (a scorer: 1 = kept first)

    def to_json(self) -> dict[str, Any]:
        from figures.viewer.encode import floats

        return {"group": self.group, "name": self.name, "layer": self.layer, "scale": self.scale,
                "categories": list(self.categories), "description": self.description, "ranked": self.ranked,
                "values": floats(self.values)}


def _number(value: Any) -> float:
    """A JSON value as a float: booleans as 0/1, anything that is not a finite number as NaN."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return math.nan


def _tested(kind: LabelKind, record: Mapping[str, Any], n_tokens: int) -> tuple[int, int]:
    if kind.tested is None:
        return 0, n_tokens
    start, end = (record.get(name) for name in kind.tested)
    return (start if isinstance(start, int) else 0), (end if isinstance(end, int) else n_tokens)


def label_layers(kind: LabelKind, group: str, record: Mapping[str, Any], n_tokens: int) -> list[Layer]:
    """The layers of one label record of `kind` over a trace of `n_tokens` tokens; a field the record lacks gives
    none (a skipped record gives none at all)."""
    start, end = _tested(kind, record, n_tokens)
    layers = []
    for spec in kind.fields:
        if spec.per == "position":
            values = _position_values(record, spec.field, n_tokens)
            categories: tuple[str, ...] = ()
        elif spec.scale == "categorical":
            values, categories = _window_categories(record, spec, n_tokens)
        else:
            values, categories = _window_numbers(record, spec.field, n_tokens), ()
        if values is None:
            continue
        values[:start] = np.nan
        values[end:] = np.nan
        if np.isnan(values).all():
            continue
        layers.append(Layer(group, spec.name, values, scale=spec.scale, categories=categories,
                            description=spec.description))
    return layers


def _position_values(record: Mapping[str, Any], name: str, n_tokens: int) -> np.ndarray | None:
    positions, values = record.get("positions"), record.get(name)
    if not isinstance(positions, list) or not isinstance(values, list) or len(positions) != len(values):
        return None
    out = np.full(n_tokens, np.nan)
    for position, value in zip(positions, values):
        if isinstance(position, int) and 0 <= position < n_tokens:
            out[position] = _number(value)
    return out


def windows(record: Mapping[str, Any], n_tokens: int) -> list[dict[str, Any]]:
    """The record's windows that lie in the trace, each with its scalar fields (what the viewer shows on hover)."""
    found = []
    for window in record.get("windows") or []:
        if not isinstance(window, dict):
            continue
        start, end = window.get("start"), window.get("end")
        if isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= n_tokens:
            found.append({key: value for key, value in window.items()
                          if value is None or isinstance(value, str | int | float | bool)})
    return found


def _window_numbers(record: Mapping[str, Any], name: str, n_tokens: int) -> np.ndarray | None:
    total, count = np.zeros(n_tokens), np.zeros(n_tokens)
    for window in windows(record, n_tokens):
        value = _number(window.get(name))
        if not math.isnan(value):
            total[window["start"]:window["end"]] += value
            count[window["start"]:window["end"]] += 1
    if not count.any():
        return None
    with np.errstate(invalid="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _window_categories(record: Mapping[str, Any], spec: TokenField,
                       n_tokens: int) -> tuple[np.ndarray | None, tuple[str, ...]]:
    found = [w for w in windows(record, n_tokens) if isinstance(w.get(spec.field), str)]
    if not found:
        return None, ()
    categories = list(spec.categories)
    categories += list(dict.fromkeys(w[spec.field] for w in found if w[spec.field] not in categories))
    order = {category: index for index, category in enumerate(categories)}
    out = np.full(n_tokens, np.nan)
    for window in found:
        span = out[window["start"]:window["end"]]
        index = order[window[spec.field]]
        span[np.isnan(span) | (span < index)] = index
    return out, tuple(categories)


# --------------------------------------------------------------------------------------------------- signals
SCORES = "scores"  # the selector group of a replay's records
SCORE_DESCRIPTION = ("the score the policy gives each reasoning token at the answer boundary, replayed "
                     "(evictor.replay; higher = kept first): its aggregate over layers and KV heads, or one layer's "
                     "mean over KV heads")
SIGNAL_DESCRIPTION = "a per-layer signal (python -m signals)"


def signal_layers(record: Signal, group: str, n_tokens: int, *, heads: bool = False) -> list[Layer]:
    """The layers of a `core.schemas.Signal` record: one per signal name and model layer (``signals[name][layer]``),
    each token ranked among the trace's; the per-KV-head scores of a replay (``name.h<k>``) only with `heads`, as
    they multiply the page's size."""
    positions = np.asarray(record.positions, dtype=np.int64)
    inside = (positions >= 0) & (positions < n_tokens)
    layers = []
    for name, by_layer in record.signals.items():
        if not heads and is_head_signal(name):
            continue
        for layer, values in by_layer.items():
            out = np.full(n_tokens, np.nan)
            column = np.array([np.nan if v is None else v for v in values], dtype=float)
            out[positions[inside]] = column[inside]
            out[~np.isfinite(out)] = np.nan
            if not np.isnan(out).all():
                layers.append(Layer(group, name, out, layer=layer, ranked=True,
                                    description=SCORE_DESCRIPTION if group == SCORES else SIGNAL_DESCRIPTION))
    return layers


def signal_group(record: Signal) -> str:
    """The selector group of a signal record: a replay's scores (its records name the policies they replayed) are the
    scorers'; the rest are per-layer signals, by smoothing."""
    if "policies" in record.extra:
        return SCORES
    window = record.extra.get("window")
    smoothing = record.smoothing or "raw"
    return f"signals ({smoothing}{window if smoothing != 'raw' and window else ''})"


def is_head_signal(name: str) -> bool:
    """Whether a signal name is one KV head's scores of a replayed policy (``name.h<k>``, `evictor.replay`)."""
    stem, _, head = name.rpartition(".h")
    return bool(stem) and head.isdigit()


# --------------------------------------------------------------------------------------------------- known answer
KNOWN_CLASSES = ("filler", "decoy note", "decoy value", "key", "planted")
KNOWN_DESCRIPTION = ("the planted facts of a known-answer trace: planted = the needed value (the answer copies it), "
                     "key = the rest of the needed note, decoy = notes of the same form that are not needed, filler = "
                     "the rest of the reasoning")


def known_layer(trace, n_tokens: int) -> Layer | None:
    """The planted / key / decoy / filler class of each reasoning token of a known-answer trace, from the spans its
    record states (``trace.extra["known_answer"]``, written by `tasks.known_answer`: absolute ``[start, end)`` of
    each needed and decoy note and of its value); None for any other trace."""
    info = trace.extra.get("known_answer")
    if not isinstance(info, dict) or not isinstance(info.get("answer_start"), int):
        return None
    order = {name: index for index, name in enumerate(KNOWN_CLASSES)}
    out = np.full(n_tokens, np.nan)
    out[len(trace.prompt_ids):info["answer_start"]] = order["filler"]
    # later marks win: a note's value lies inside the note
    for notes, part, name in (("decoys", "note", "decoy note"), ("decoys", "value", "decoy value"),
                              ("needed", "note", "key"), ("needed", "value", "planted")):
        for note in info.get(notes) or []:
            span = note.get(part) if isinstance(note, dict) else None
            if isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span):
                out[max(span[0], 0):min(span[1], n_tokens)] = order[name]
    return Layer("known answer", "fact class", out, scale="categorical", categories=KNOWN_CLASSES,
                 description=KNOWN_DESCRIPTION)


@dataclass
class LabelSet:
    """The label records of one kind read from one file: their name in the selector and the records by trace id."""

    kind: LabelKind
    name: str
    records: dict[str, dict[str, Any]] = field(default_factory=dict)


def label_set_name(kind: LabelKind, record: Mapping[str, Any], fallback: str | None = None) -> str:
    """A label set's name: what its records say they occluded (``intervention``: token, cache, joint; the kind's name
    for records that do not say) and the filler their windows were occluded with (`fallback` when the record does
    not say; none without one)."""
    intervention = record.get("intervention")
    name = f"{intervention} occlusion" if isinstance(intervention, str) else kind.name
    replacement = record.get("replacement") or {}
    filler = replacement.get("chosen") or replacement.get("spec") or fallback
    return f"{name} ({filler})" if filler else name
