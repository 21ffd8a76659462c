"""What fills an occluded window: the replacement token, chosen so the occlusion removes content and nothing else.

EpiKV (App. 8) fills each window with the padding id. That is harmless only when the pad token is a dedicated
filler. Many chat models reuse a structural token as their pad: SmolLM2's pad is ``<|im_end|>`` (its end of turn and
end of sequence), Qwen's is ``<|endoftext|>``. Thirty-two of them in a row end the assistant's turn many times over,
so a flipped answer may report a broken conversation rather than lost content.

Specs (``--replacement``):

- ``auto`` (default): the pad token when it is harmless, otherwise a *neutral* token. The pad token is harmful when
  it is the end-of-sequence or beginning-of-sequence token, a stop token of generation (`tasks.generation.
  stop_token_ids`), or appears in the chat template (turn markers). The neutral token is a single space, which
  carries no content and no structure, and is one token in byte-level BPE vocabularies (GPT-2 style: SmolLM2,
  Qwen, Llama 3) and SentencePiece ones ("▁"); where " " is not exactly one token, "." is used, and where neither
  is, `auto` asks for an explicit token id.
- ``pad``, ``space``, ``dot``: that token, whatever it is (``pad`` reproduces the paper's protocol literally).
- ``delete``: remove the window; the context gets shorter, so positions after it shift.
- a token id: that token.

Every label record and run configuration stores the resolved choice (`Replacement.to_json`), so results made with
different fillers are never confused; `labeling.agreement` compares label sets made with different fillers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from core.errors import UsageError, unknown_choice

REPLACEMENTS = ("auto", "pad", "space", "dot", "delete")
NEUTRAL_TEXT = {"space": " ", "dot": "."}  # auto's fallbacks when the pad token is harmful, in order of preference


@dataclass(frozen=True)
class Replacement:
    """A resolved replacement: `spec` as asked, `chosen` what it became ("pad", "space", "dot", "delete" or "id"),
    the token id and its text (None for deletion), and `note`: why the pad token is harmful, when it is."""

    spec: str
    chosen: str
    token_id: int | None
    text: str | None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"spec": self.spec, "chosen": self.chosen, "token_id": self.token_id, "text": self.text}
        return {**data, "note": self.note} if self.note else data


def check_spec(spec: str) -> str:
    """`spec` if it names a replacement (without a tokenizer, so bad input is refused before a model loads)."""
    if spec in REPLACEMENTS or spec.isdigit():
        return spec
    raise unknown_choice("replacement", spec, (*REPLACEMENTS, "<token id>"))


def pad_problem(tokenizer, stop_ids: Iterable[int] = ()) -> str | None:
    """Why the tokenizer's pad token would break a conversation when repeated in it; None when it is harmless."""
    pad = tokenizer.pad_token_id
    if pad is None:
        return "the tokenizer has no pad token"
    name = f"the pad token {tokenizer.convert_ids_to_tokens(pad)!r}"
    if pad == tokenizer.eos_token_id:
        return f"{name} is the end-of-sequence token"
    if pad == tokenizer.bos_token_id:
        return f"{name} is the beginning-of-sequence token"
    if pad in set(stop_ids):
        return f"{name} is a stop token of generation"
    if tokenizer.pad_token in (getattr(tokenizer, "chat_template", None) or ""):
        return f"{name} marks turns in the chat template"
    return None


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def resolve_replacement(tokenizer, spec: str, stop_ids: Iterable[int] = ()) -> Replacement:
    """The replacement `spec` names for this tokenizer (see the module docstring); a `UsageError` when it cannot."""
    check_spec(spec)
    stop_ids = list(stop_ids)
    if spec == "delete":
        return Replacement(spec, "delete", None, None)
    if spec.isdigit():
        if int(spec) >= len(tokenizer):
            raise UsageError(f"--replacement {spec}: token id out of range 0..{len(tokenizer) - 1}")
        return Replacement(spec, "id", int(spec), tokenizer.decode([int(spec)]))
    problem = pad_problem(tokenizer, stop_ids)
    if spec == "pad" or (spec == "auto" and problem is None):
        if tokenizer.pad_token_id is None:
            raise UsageError("--replacement pad: the tokenizer has no pad token; use auto, space, dot, delete or a "
                             "token id")
        return Replacement(spec, "pad", int(tokenizer.pad_token_id), tokenizer.pad_token, problem)
    candidates = list(NEUTRAL_TEXT) if spec == "auto" else [spec]
    for name in candidates:
        if (token_id := _single_token(tokenizer, NEUTRAL_TEXT[name])) is not None:
            return Replacement(spec, name, token_id, NEUTRAL_TEXT[name], problem)
    if spec == "auto":
        raise UsageError(f"--replacement auto: {problem}, and neither ' ' nor '.' is a single token; "
                         "pass --replacement <token id>")
    raise UsageError(f"--replacement {spec}: {NEUTRAL_TEXT[spec]!r} is not a single token; use a token id")
