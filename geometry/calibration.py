"""A deterministic, offline calibration set: prompts of exactly `ctx` tokens in five content categories.

ValueDiff (Appendix C) measures KV geometry on 20 prompts spanning narrative, QA, code, math and retrieval text at
context length 2048. Everything here comes from what is on the machine, so the set is the same on every run of a
given Python install and data directory:

- narrative: expository prose of the Python install: the history section of its LICENSE.txt, the Zen of Python
  (the `this` module, decoded), the essay ``heapq.__about__``, long module docstrings and the language-reference
  topics pydoc ships (``pydoc_data.topics``);
- qa: GSM8K questions with their worked answers (calculator annotations ``<<...>>`` removed);
- code: ``inspect.getsource`` of pure-Python standard-library modules;
- math: MATH-500 problems and solutions, every fourth piece an AIME-2024 problem and solution;
- retrieval: a key-value table (random hex keys with numbers, invented people with cities and years, builtins with
  their one-line docs, or pydoc topics with their first sentence cut at 120 characters) followed by a lookup
  question about a key that appears in the table.

Prompt i has category ``CATEGORIES[i % 5]`` and variant ``i // 5``; a variant starts its category's source list at
a different place, so any number of prompts can be drawn. Pieces are joined with blank lines (table rows with
newlines) and the token ids cut at `ctx`; the tokenizer's own special tokens are kept, so position 0 is a BOS token
exactly when the tokenizer adds one.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib
import inspect
import io
import itertools
import json
import random
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.errors import UsageError
from tasks.datasets import load_problems

CATEGORIES = ("narrative", "qa", "code", "math", "retrieval")
PROSE_MODULES = ("statistics", "wave", "argparse", "csv", "timeit", "copy", "uuid", "sched", "random", "tokenize")
CODE_MODULES = (
    "heapq", "textwrap", "fractions", "statistics", "functools", "string", "difflib", "json.decoder", "json.encoder",
    "csv", "random", "shlex", "fnmatch", "glob", "queue", "colorsys", "calendar", "argparse", "dataclasses", "enum",
    "graphlib", "ipaddress", "pprint", "tokenize", "ast", "copy", "contextlib", "operator", "base64", "gettext",
)
Piece = tuple[str, str]  # (source name, text)


@dataclass(frozen=True)
class CalibrationPrompt:
    id: str
    category: str
    input_ids: tuple[int, ...]
    sources: tuple[str, ...]  # the pieces the prompt was packed from, in order

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(list(self.input_ids)).encode()).hexdigest()


def calibration_prompts(tokenizer, n_prompts: int = 20, ctx: int = 2048) -> list[CalibrationPrompt]:
    """`n_prompts` prompts of exactly `ctx` token ids each, cycling through `CATEGORIES`."""
    if n_prompts < 1 or ctx < 2:
        raise UsageError(f"need at least 1 prompt and 2 tokens per prompt, got {n_prompts} prompts of {ctx} tokens")
    prompts = []
    for index in range(n_prompts):
        category, variant = CATEGORIES[index % len(CATEGORIES)], index // len(CATEGORIES)
        if category == "retrieval":
            ids, sources = _retrieval_prompt(tokenizer, variant, ctx)
        else:
            ids, sources = _pack(tokenizer, _SOURCES[category](variant), ctx)
        prompts.append(CalibrationPrompt(f"{category}-{variant}", category, tuple(ids), tuple(sources)))
    return prompts


def calibration_digest(prompts: list[CalibrationPrompt]) -> str:
    """One hash of every prompt's token ids: a resumed survey must see the same calibration set."""
    return hashlib.sha256("".join(p.sha256 for p in prompts).encode()).hexdigest()


def _pack(tokenizer, pieces: Iterator[Piece], ctx: int, separator: str = "\n\n") -> tuple[list[int], list[str]]:
    """Join pieces until the text tokenizes to at least `ctx` ids; return the first `ctx` ids and the piece names."""
    texts, names, estimate = [], [], 0
    for name, text in pieces:
        texts.append(text)
        names.append(name)
        estimate += len(tokenizer(text, add_special_tokens=False).input_ids)
        if estimate >= ctx:
            ids = tokenizer(separator.join(texts)).input_ids
            if len(ids) >= ctx:
                return ids[:ctx], names
    raise AssertionError("calibration sources are infinite cycles")


def _rotated(pieces: list[Piece], variant: int, step: int) -> Iterator[Piece]:
    if not pieces:
        raise UsageError("a calibration category has no source text in the installed packages")
    start = (variant * step) % len(pieces)
    return itertools.cycle(pieces[start:] + pieces[:start])


def _narrative(variant: int) -> Iterator[Piece]:
    pieces: list[Piece] = []
    license_file = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_file.is_file():
        history = license_file.read_text(encoding="utf-8").split("B. TERMS AND CONDITIONS")[0]
        pieces.append(("LICENSE.txt history", history.strip()))
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        this = importlib.import_module("this")
    pieces.append(("this (Zen of Python)", "".join(this.d.get(ch, ch) for ch in this.s)))
    pieces.append(("heapq.__about__", importlib.import_module("heapq").__about__.strip()))
    pieces.append(("sys.copyright", sys.copyright))
    pieces += [(f"{name} docstring", inspect.getdoc(importlib.import_module(name)) or "") for name in PROSE_MODULES]
    pieces += [(f"pydoc topic {name}", text.strip()) for name, text in sorted(_pydoc_topics().items())]
    return _rotated([p for p in pieces if p[1]], variant, 23)


def _qa(variant: int) -> Iterator[Piece]:
    problems = load_problems("gsm8k")
    def solution(problem) -> str:
        return re.sub(r"<<[^>]*>>", "", problem.meta.get("solution", problem.answer))

    pieces = [(f"gsm8k {p.id}", f"Question: {p.question}\nAnswer: {solution(p)}") for p in problems]
    return _rotated(pieces, variant, 97)


def _code(variant: int) -> Iterator[Piece]:
    pieces = []
    for name in CODE_MODULES:
        with contextlib.suppress(OSError, TypeError):  # an install may ship a module without its source
            pieces.append((f"source of {name}", inspect.getsource(importlib.import_module(name))))
    return _rotated(pieces, variant, 7)


def _math(variant: int) -> Iterator[Piece]:
    def piece(problem) -> Piece:
        return f"{problem.dataset} {problem.id}", f"Problem: {problem.question}\nSolution: {problem.meta['solution']}"

    math500 = _rotated([piece(p) for p in load_problems("math500")], variant, 61)
    aime = _rotated([piece(p) for p in load_problems("aime24")], variant, 7)
    return (next(aime) if turn % 4 == 3 else next(math500) for turn in itertools.count())


def _retrieval_prompt(tokenizer, variant: int, ctx: int) -> tuple[list[int], list[str]]:
    """A key-value table packed to `ctx` tokens, ending with a question about one of its keys."""
    rng = random.Random(f"kvscope-retrieval-{variant}")
    pairs = _retrieval_pairs(variant % 4, rng)
    header = ("header", "Below is a table of records, one per line as `key: value`. Read it; a question follows.")
    lines = ((key, f"{key}: {value}") for key, value in pairs)
    ids, keys = _pack(tokenizer, itertools.chain([header], lines), ctx, separator="\n")
    too_short = UsageError(f"a context of {ctx} tokens is too short for a retrieval prompt (table plus question)")
    if len(keys) < 3:  # the header and at least two rows
        raise too_short
    # Ask about a key from the first half of the table, which the question's few tokens never truncate away.
    key = keys[1 + rng.randrange((len(keys) - 1) // 2)]
    question = tokenizer(f"\n\nQuestion: what is the value recorded for the key {key}?\nAnswer:",
                         add_special_tokens=False).input_ids
    if len(question) >= ctx // 2:
        raise too_short
    return ids[: ctx - len(question)] + question, [f"retrieval style {variant % 4}", f"question about {key}"]


def _retrieval_pairs(style: int, rng: random.Random) -> Iterator[tuple[str, str]]:
    if style == 0:
        return ((f"{rng.getrandbits(32):08x}", str(rng.randrange(100000, 1000000))) for _ in itertools.count())
    if style == 1:
        syllables = ("ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "an", "qui", "bre", "zu", "ol", "fen")

        def word(parts: int) -> str:
            return "".join(rng.choice(syllables) for _ in range(parts)).capitalize()

        return (
            (f"{word(2)} {word(3)} #{serial}", f"lives in {word(3)}, born {rng.randrange(1900, 2010)}")
            for serial in itertools.count(1)
        )
    if style == 2:
        # Only the interpreter's own builtins: IPython and others add names that would change the prompt.
        table = vars(builtins)
        own = [name for name in sorted(table) if getattr(table[name], "__module__", None) == "builtins"]
        docs = [(name, inspect.getdoc(getattr(builtins, name)) or "") for name in own if not name.startswith("_")]
        docs = [(name, doc.splitlines()[0]) for name, doc in docs if doc.strip()]
        return ((f"{name}#{turn}", doc) for turn in itertools.count(1) for name, doc in docs)
    topics = [(name, re.split(r"(?<=\.)\s", " ".join(text.split()), maxsplit=1)[0][:120]) for name, text in
              sorted(_pydoc_topics().items())]
    return ((f"{name}#{turn}", first) for turn in itertools.count(1) for name, first in topics)


def _pydoc_topics() -> dict[str, str]:
    with contextlib.suppress(ImportError):
        return importlib.import_module("pydoc_data.topics").topics
    return {}


_SOURCES = {"narrative": _narrative, "qa": _qa, "code": _code, "math": _math}
