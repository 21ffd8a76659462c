"""What a probe instance is: a scripted token sequence with a fact in it, run through the eviction engine.

An instance goes through `evictor.engine` as

    [ stub | lead filler | fact box | gap filler | question box | value ]
      prefill  ------------- teacher-forced through Session.step, one token per step -------------

Only the stub (a short chat-template turn, or plain text for base models) is prefilled, so only it is protected by
prompt protection; every later token goes through the decode path and is scored and evicted exactly like a
generated token (Random Attention notes, Step 5: "23-token prefilled stub, scripted body fed through the true decode
path, 16-token fact box"). The fact box holds the fact sentence followed by the continuing filler; the question box
holds filler followed by the question, right-aligned. Every segment has a fixed size, so all instances of a run
share one layout and batch without padding (and share one eviction schedule, `probes.schedule`, which sets the gap).

Filler is real reasoning text: the reference solutions of a benchmark (default MATH-500) or the model's own dense
traces (a `tasks.run` / `evictor.run` generations.jsonl). Each instance reads consecutive texts from its own random
starting point, and draws its variable name and value so that neither occurs in its filler.

The value is a 4-digit number (1000..9999, chance of a blind guess 1/9000) and its digit tokens are the target:
the tokenizer's leading space token is moved into the question, so log p(value) sums over the digits only.
Retrieval = every digit is the argmax under teacher forcing, which is exactly "greedy decoding reproduces the value"
(greedy decoding walks the teacher-forced path for as long as it agrees with it).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UsageError
from core.records import read_jsonl
from tasks.prompts import uses_chat_template

STUB_TEXT = "Read the following working and answer the question at the end."


VALUES = (1000, 10000)  # 4-digit values, drawn uniformly from [1000, 10000)


CHANCE = 1.0 / (VALUES[1] - VALUES[0])


# Two-letter variable names, minus words and symbols that real maths text uses as words (the filler check below
# also rejects any name that occurs in an instance's own filler).
_COMMON = {"am", "an", "as", "at", "be", "by", "do", "go", "he", "if", "in", "is", "it", "me", "my", "no", "of",
           "on", "or", "so", "to", "up", "us", "we", "ok", "pi", "ln", "lg", "dx", "dy", "dt", "cm", "km", "mm", "kg",
           "th", "st", "nd", "rd", "eq", "id", "ie", "eg", "vs", "mi", "ft", "hr", "cd", "ab", "bc", "ac"}


VARIABLES = tuple(a + b for a in string.ascii_lowercase for b in string.ascii_lowercase if a + b not in _COMMON)


@dataclass(frozen=True)
class Script:
    """The wording of a probe: a fact sentence and a question, with ``{var}`` / ``{value}`` placeholders."""

    fact: str  # e.g. "\nLet {var} = {value}."
    question: str  # e.g. "\nWhat is the value of {var}? {var} =" -- the value's tokens follow it


@dataclass(frozen=True)
class Layout:
    """Token counts of every segment; identical for every instance of a run."""

    stub: int
    lead: int
    box: int
    gap: int
    question: int  # the question box
    value: int  # digit tokens of the value

    @property
    def box_start(self) -> int:
        return self.stub + self.lead

    @property
    def box_end(self) -> int:
        return self.box_start + self.box

    @property
    def value_start(self) -> int:
        return self.box_end + self.gap + self.question

    @property
    def total(self) -> int:
        return self.value_start + self.value

    def positions(self) -> dict[str, int]:
        """Absolute positions of the segment boundaries (for records)."""
        return {"box_start": self.box_start, "box_end": self.box_end,
                "question_start": self.box_end + self.gap, "value_start": self.value_start, "end": self.total}


@dataclass(frozen=True)
class Instance:
    id: str
    index: int
    var: str | None
    value: int
    body: tuple[int, ...]  # every token after the stub, ending with the value's digit tokens
    watch: tuple[int, ...]  # absolute positions of the value's digits inside the fact sentence
    filler_ids: tuple[str, ...]  # ids of the texts the filler was cut from


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stub_ids(tokenizer) -> list[int]:
    """The prefilled prompt: one user turn through the chat template, or plain text (with BOS) for base models."""
    if uses_chat_template(tokenizer):
        text = tokenizer.apply_chat_template([{"role": "user", "content": STUB_TEXT}], tokenize=False,
                                             add_generation_prompt=True)
        return encode(tokenizer, text)
    return list(tokenizer(STUB_TEXT + "\n\n")["input_ids"])


def split_value(tokenizer, value: int) -> tuple[list[int], list[int]]:
    """Tokens of ``" <value>"`` split into (leading tokens without a digit, the rest = the target)."""
    ids = encode(tokenizer, f" {value}")
    first = next(i for i, t in enumerate(ids) if any(c.isdigit() for c in tokenizer.decode([t])))
    return ids[:first], ids[first:]


def value_positions(tokenizer, fact_ids: Sequence[int]) -> list[int]:
    """Offsets of the tokens of a fact sentence that carry a digit of its value."""
    return [i for i, t in enumerate(fact_ids) if any(c.isdigit() for c in tokenizer.decode([t]))]


def base_layout(tokenizer, script: Script, stub: int, lead: int, box: int) -> Layout:
    """The layout before the gap is known: the question box fits the longest question over every variable name."""
    fact = max(len(encode(tokenizer, script.fact.format(var=v, value=VALUES[1] - 1))) for v in VARIABLES)
    if fact > box:
        raise UsageError(f"--box {box} is too small: the fact sentence takes up to {fact} tokens with this tokenizer")
    lead_tokens, digits = split_value(tokenizer, 4729)
    question = max(len(encode(tokenizer, script.question.format(var=v))) for v in VARIABLES) + len(lead_tokens)
    return Layout(stub=stub, lead=lead, box=box, gap=0, question=question, value=len(digits))


def check_filler_dataset(dataset: str) -> None:
    """Refuse, before any problem is built, a --dataset without reference solutions: the generated tasks (RULER,
    known-answer) have none, and building a long haystack only to find that out can take minutes."""
    from tasks.datasets import SOURCES, check_dataset

    check_dataset(dataset)
    if dataset not in SOURCES:
        raise UsageError(f"--dataset {dataset!r} has no reference solutions to use as filler; choose "
                         f"{', '.join(SOURCES)}, or pass --filler with a generations.jsonl of the model's own traces")


def filler_texts(filler: str | None, dataset: str, data_file: str | None) -> tuple[list[tuple[str, str]], str]:
    """(id, text) pairs of real reasoning text and where they came from."""
    if filler is not None:
        path = Path(filler).expanduser()
        path = path / "generations.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise UsageError(f"--filler {filler!r}: no such generations.jsonl (file or run directory)")
        pairs = [(str(r.get("id", i)), r["text"]) for i, r in enumerate(read_jsonl(path))
                 if isinstance(r.get("text"), str) and r["text"].strip()]
        if not pairs:
            raise UsageError(f"--filler {path}: no record has a non-empty 'text' field")
        return pairs, str(path)
    from tasks.datasets import load_problems, resolve_source

    problems = load_problems(dataset, data_file=data_file)
    pairs = [(p.id, p.meta["solution"]) for p in problems if str(p.meta.get("solution") or "").strip()]
    if not pairs:
        raise UsageError(f"dataset {dataset!r} has no reference solutions to use as filler; pass --filler with a "
                         "generations.jsonl of the model's own traces")
    return pairs, resolve_source(dataset, data_file)


class InstanceBuilder:
    """Builds the instances of a run: instance i depends only on (seed, i), the texts and the layout."""

    SEPARATOR = "\n\n"

    def __init__(self, tokenizer, script: Script, texts: Sequence[tuple[str, str]], layout: Layout, seed: int,
                 uses_var: bool):
        self.tokenizer = tokenizer
        self.script = script
        self.texts = list(texts)
        self.layout = layout
        self.seed = seed
        self.uses_var = uses_var
        self.separator = encode(tokenizer, self.SEPARATOR)
        self._tokens: dict[int, list[int]] = {}

    def _text_tokens(self, k: int) -> list[int]:
        if k not in self._tokens:
            self._tokens[k] = encode(self.tokenizer, self.texts[k][1]) + self.separator
        return self._tokens[k]

    def _stream(self, start: int, need: int) -> tuple[list[int], list[str]]:
        tokens: list[int] = []
        ids: list[str] = []
        k = start
        while len(tokens) < need:  # every text contributes at least the separator
            tokens += self._text_tokens(k % len(self.texts))
            ids.append(self.texts[k % len(self.texts)][0])
            k += 1
        return tokens[:need], ids

    def build(self, index: int) -> Instance:
        lay = self.layout
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(len(self.texts)))
        for _ in range(1000):
            var = str(rng.choice(VARIABLES)) if self.uses_var else None
            value = int(rng.integers(*VALUES))
            fact = encode(self.tokenizer, self.script.fact.format(var=var, value=value))
            lead_tokens, digits = split_value(self.tokenizer, value)
            question = encode(self.tokenizer, self.script.question.format(var=var)) + lead_tokens
            if len(digits) != lay.value or len(fact) > lay.box or len(question) > lay.question:
                continue  # a tokenizer that merges digits: keep the run's value length
            pad_box, pad_question = lay.box - len(fact), lay.question - len(question)
            filler, ids = self._stream(start, lay.lead + pad_box + lay.gap + pad_question)
            text = self.tokenizer.decode(filler)
            if (var is not None and re.search(rf"\b{var}\b", text)) or str(value) in text:
                continue
            body = filler[: lay.lead] + fact + filler[lay.lead:] + question + digits
            watch = tuple(lay.box_start + i for i in value_positions(self.tokenizer, fact))
            return Instance(f"i{index:05d}", index, var, value, tuple(body), watch, tuple(ids))
        raise UsageError(f"instance {index}: no variable/value pair fits the layout and avoids the filler")
