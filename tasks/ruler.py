"""RULER-style synthetic long-context tasks, generated offline and deterministically from a seed.

RULER (Hsieh et al., 2024, "RULER: What's the real context size of your long-context language models?") probes
retrieval and tracking over a haystack of controlled length; ValueDiff §4.1 evaluates eviction on it at 8k context.
kvscope generates five of its task kinds in its own wording, as `tasks` datasets named ``ruler_<task>[@<tokens>]``:

==================  ==========================================================================================
``niah_single``     one needle "The special number for <key> is <7 digits>." in a prose haystack; asked for it
``niah_multikey``   four needles with four keys; asked for one key's number (the other three are distractors)
``niah_multivalue`` one key with four numbers at four depths; asked for all of them
``vt``              variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... (4 hops) and a distractor
                    chain in filler text; asked for every variable holding the chain's value
``cwe``             common-word extraction: a numbered word list where 10 words occur often and the others 3 times
                    each (more, evenly, once the vocabulary runs out); asked for the 10 most common
==================  ==========================================================================================

**Length.** ``@<tokens>`` sets the context length (``@4096`` or ``@4k``; default 2048). It is measured in a model's
tokens: the question text (instructions, haystack, query; no chat template, no special tokens) is made as long as
possible without exceeding the target, counted with ``len(tokenizer(question, add_special_tokens=False)
.input_ids)``. The tokenizer is the one passed to `generate` (or to `tasks.datasets.load_problems`), a model name,
or by default the default model's (SmolLM2-135M: 8192 positions, so ``@8k`` leaves no room for the chat template
and the answer; use ``@7680`` or less with it). The chat template adds a few tens of tokens on top. Each problem
records the measured length in ``meta["ruler"]["tokens"]``.

**Determinism.** Problem ``i`` of ``ruler_<task>@<n>`` is drawn with Python's `random.Random` seeded by
`core.seeds.derive_seed` of (seed, name, i), so it is the same on every run and machine, whatever ``limit`` is; the
tokenizer decides only how much filler fits (and, in ``cwe``, how often the common words occur).

**Haystack source.** No outside text: the prose haystack is sentences drawn from twelve templates filled with the
words of `tasks.ruler_words` (written for kvscope, Apache-2.0 like the project); the variable-tracking filler is a
fixed five-sentence cycle (RULER's "noise" haystack, in kvscope's words); the word lists come from the same
vocabulary. The haystack contains no digits, so the needles' values are the only numbers in a NIAH context.

**Grading** (`grade`): exact match over the answer, read from the last ``\\boxed{}`` when there is one, else the
whole output. The items of the task's kind found there (7-digit numbers for NIAH; variable names or list words
that occur in the context for vt / cwe) must equal the gold set: every gold value, nothing else (so a multi-key
answer that lists the distractors too is wrong). ``score`` is the fraction of gold values found (RULER's
string-match-all), kept beside the exact-match ``correct``.

Deviations from RULER: own instructions and templates; a generated prose haystack instead of Paul Graham's essays;
a distractor chain in ``vt`` (RULER's default has one chain) so that naming every variable is wrong; in ``cwe`` each
common word occurs as often as lets the ten fill about 40% of the context, between 4 and RULER's 30 times, so that
the list fits short contexts; 4 keys / 4 values for the multi-needle tasks; exact match instead of partial credit.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import UsageError, unknown_choice
from core.seeds import derive_seed
from models.registry import DEFAULT_MODEL
from tasks.ruler_words import ADJECTIVES, NOUNS, VERBS

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
PREFIX = "ruler_"
NAMES = tuple(PREFIX + task for task in TASKS)
DEFAULT_CONTEXT_TOKENS = 2048
MIN_CONTEXT_TOKENS = 256
DEFAULT_COUNT = 100  # problems when no limit is given
# Part of every problem's provenance: change it whenever a seed would generate different text.
GENERATOR = "kvscope-ruler-1"

NEEDLES = 4  # keys of niah_multikey, values of niah_multivalue
HOPS = 4  # vt: a chain of HOPS + 1 variables
COMMON_WORDS = 10
UNCOMMON_REPEATS = 3
COMMON_SHARE = 0.4  # of the cwe context taken by the common words

_TEMPLATES = (
    "The {a} {n} {v} the {n} beside the {n}.",
    "Each {n} {v} the {a} {n} after the {n} grew quiet.",
    "Near the {a} {n}, the {n} {v} the {n}.",
    "That morning the {n} {v} the {a} {n}.",
    "Nobody saw how the {n} {v} the {n} under the {a} {n}.",
    "The {n} by the {n} was {a}, and the {n} {v} it twice.",
    "Later, the {a} {n} {v} every {n} in the {n}.",
    "The {n} {v} the {n}, and the {n} {v} the {a} {n}.",
    "Some say the {n} was {a} when the {n} {v} the {n}.",
    "In the {a} {n}, the {n} {v} the {n} slowly.",
    "Before the {n} left, the {a} {n} {v} the {n}.",
    "The {a} {n} and the {a} {n} {v} the {n} together.",
)
_NOISE = ("The sky is clear.", "The field is wide.", "The river runs on.", "Here we rest.", "Then we walk again.")
_NUMBER = re.compile(r"(?<!\d)\d{7}(?!\d)")
_VARIABLE = re.compile(r"\b[A-Z]{5}\b")
_WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class RulerConfig:
    """One RULER-style dataset: a task, the context length in tokens, and the seed its problems are drawn from."""

    task: str
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise unknown_choice("RULER task", self.task, TASKS)
        if isinstance(self.context_tokens, bool) or not isinstance(self.context_tokens, int) or \
                self.context_tokens < MIN_CONTEXT_TOKENS:
            raise UsageError(f"RULER context length must be an integer >= {MIN_CONTEXT_TOKENS} tokens, "
                             f"got {self.context_tokens!r}")

    @property
    def name(self) -> str:
        """The canonical dataset name, length included: ``ruler_vt@4096``."""
        return f"{PREFIX}{self.task}@{self.context_tokens}"


def parse_name(name: str, seed: int = 0) -> RulerConfig | None:
    """``ruler_<task>[@<tokens>]`` as a `RulerConfig` (``@4096`` or ``@4k``); None for a name outside RULER."""
    base, at, length = name.partition("@")
    if not base.startswith(PREFIX):
        return None
    if base not in NAMES:
        raise unknown_choice("dataset", base, NAMES)
    if not at:
        return RulerConfig(base.removeprefix(PREFIX), seed=seed)
    match = re.fullmatch(r"(\d+)([kK]?)", length)
    if match is None:
        raise UsageError(f"dataset {name!r}: context length {length!r} is not a number of tokens; write e.g. "
                         f"{base}@4096 or {base}@4k")
    tokens = int(match.group(1)) * (1024 if match.group(2) else 1)
    return RulerConfig(base.removeprefix(PREFIX), tokens, seed)


def tokenizer_name(tokenizer: Any) -> str:
    """How a tokenizer is named in a dataset's provenance: the model name given, or the tokenizer's own path."""
    if tokenizer is None:
        return DEFAULT_MODEL
    if isinstance(tokenizer, str):
        return tokenizer
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def source(config: RulerConfig, tokenizer: Any = None) -> str:
    """The provenance string of a generated dataset (what a run's identity records instead of a file path)."""
    return f"generated:{config.name} seed={config.seed} tokenizer={tokenizer_name(tokenizer)} {GENERATOR}"


@functools.lru_cache(maxsize=4)
def _named_tokenizer(name: str):
    from models.loading import load_model

    return load_model(name, device="cpu").tokenizer


def _counter(tokenizer: Any) -> Callable[[str], int]:
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = _named_tokenizer(tokenizer_name(tokenizer))
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def generate(config: RulerConfig, count: int = DEFAULT_COUNT, tokenizer: Any = None) -> list[dict[str, Any]]:
    """The first `count` problems of `config` as records (id, question, answer, ruler) for `tasks.datasets`.

    `tokenizer`: a tokenizer object, a model name (`models.loading.load_model` names), or None for the default
    model's. ``ruler`` holds what `grade` needs (task, gold values, candidate vocabulary) and the provenance
    (measured tokens, depths of the inserted statements, tokenizer, seed, generator).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"count must be a positive integer, got {count!r}")
    count_tokens = _counter(tokenizer)
    builder = _BUILDERS[config.task]
    records = []
    for index in range(count):
        rng = random.Random(derive_seed(config.seed, (config.name, index)))
        sample = builder(rng, count_tokens, config.context_tokens)
        units = _fit(sample, count_tokens, config)
        question = sample.build(units)
        ruler = {
            "task": config.task, "context_tokens": config.context_tokens, "tokens": count_tokens(question),
            "values": sample.values, "candidates": sample.candidates, "tokenizer": tokenizer_name(tokenizer),
            "seed": config.seed, "generator": GENERATOR, **sample.info,
        }
        records.append({"id": f"{config.name}-{index}", "question": question, "answer": ", ".join(sample.values),
                        "ruler": ruler})
    return records


# --- grading -------------------------------------------------------------------------------------------------------
def grade(text: str, problem: Any) -> dict[str, Any]:
    """Exact-match grade of a model output for a RULER problem (see the module docstring).

    Returns the keys of `tasks.grading.grade` (answer, correct, no_answer, extracted_by) plus ``score``, the
    fraction of gold values the answer holds.
    """
    from tasks.grading import extract_answer_with_rule

    info = problem.meta["ruler"]
    boxed, rule = extract_answer_with_rule(text)
    if rule == "boxed":
        assert boxed is not None  # the boxed rule comes with the box's contents
        region, where = boxed, "boxed"
    else:
        region, where = text, "text"
    found = list(dict.fromkeys(answer_items(region, info["task"], info.get("candidates"))))
    gold = set(info["values"])
    return {
        "answer": ", ".join(found) or None,
        "correct": set(found) == gold,
        "no_answer": not found,
        "extracted_by": where if found else None,
        "score": len(gold & set(found)) / len(gold),
    }


def answer_items(text: str, task: str, candidates: list[str] | None = None) -> list[str]:
    """The answer items of `task`'s kind in `text`, in order: 7-digit numbers for NIAH, else the `candidates`
    (variable names, list words) that occur in it."""
    if task.startswith("niah"):
        return _NUMBER.findall(text)
    allowed = set(candidates or ())
    if task == "vt":
        return [name for name in _VARIABLE.findall(text) if name in allowed]
    return [word for word in _WORD.findall(text.lower()) if word in allowed]


# --- generation ----------------------------------------------------------------------------------------------------
@dataclass
class _Sample:
    """One problem before its length is fitted: `build(n)` is the question with `n` filler units."""

    values: list[str]
    candidates: list[str] | None
    build: Callable[[int], str]
    info: dict[str, Any] = field(default_factory=dict)
    max_units: int | None = None  # None: the filler never runs out


# (the problem's generator, a token counter, the target length) -> a sample
_Builder = Callable[[random.Random, Callable[[str], int], int], _Sample]


def _fit(sample: _Sample, count_tokens: Callable[[str], int], config: RulerConfig) -> int:
    """A filler count whose question fits in ``config.context_tokens``, by exponential then binary search: the
    largest one where length grows with the count (prose, noise), one within a unit or two of it for cwe, whose
    reshuffled lists may tokenize a token longer or shorter."""
    target = config.context_tokens
    fixed = count_tokens(sample.build(0))
    if fixed > target:
        raise UsageError(f"dataset {config.name!r}: {target} tokens cannot hold the task's own text ({fixed} "
                         "tokens); use a longer context")
    limit = sample.max_units
    good, bad = 0, 64 if limit is None else min(64, limit)
    while count_tokens(sample.build(bad)) <= target:
        if bad == limit:  # the filler ran out first: the question stays shorter than asked (meta records it)
            return bad
        good, bad = bad, 2 * bad if limit is None else min(2 * bad, limit)
    while bad - good > 1:
        middle = (good + bad) // 2
        if count_tokens(sample.build(middle)) <= target:
            good = middle
        else:
            bad = middle
    return good


class _Stream:
    """An endless, reproducible sequence of filler units: `first(n)` is always the same for the same seed."""

    def __init__(self, make: Callable[[random.Random, int], str], seed: int):
        self.make = make
        self.rng = random.Random(seed)
        self.units: list[str] = []

    def first(self, n: int) -> list[str]:
        while len(self.units) < n:
            self.units.append(self.make(self.rng, len(self.units)))
        return self.units[:n]


def _sentence(rng: random.Random, _: int) -> str:
    template = rng.choice(_TEMPLATES)
    text = re.sub(r"\{(\w)\}", lambda m: rng.choice({"a": ADJECTIVES, "n": NOUNS, "v": VERBS}[m.group(1)]), template)
    return text[0].upper() + text[1:]


def _noise(_: random.Random, index: int) -> str:
    return _NOISE[index % len(_NOISE)]


def _with_inserts(units: list[str], inserts: list[tuple[float, str]]) -> str:
    """Filler units joined by spaces, each insert placed before unit ``round(depth * len(units))`` (stable order)."""
    slots: dict[int, list[str]] = {}
    for depth, text in sorted(inserts, key=lambda item: item[0]):
        slots.setdefault(round(depth * len(units)), []).append(text)
    out: list[str] = []
    for position in range(len(units) + 1):
        out.extend(slots.get(position, ()))
        if position < len(units):
            out.append(units[position])
    return " ".join(out)


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    return [str(value) for value in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def _niah(kind: str) -> _Builder:
    def build_sample(rng: random.Random, _count: Callable[[str], int], _target: int) -> _Sample:
        n_keys = NEEDLES if kind == "multikey" else 1
        n_values = NEEDLES if kind == "multivalue" else 1
        keys = _keys(rng, n_keys)
        values = _numbers(rng, n_keys * n_values, 7)
        depths = [rng.random() for _ in values]
        query = keys[0]
        if kind == "multivalue":
            needles = [f"One of the special numbers for {query} is {value}." for value in values]
            gold = values
            intro = ("Special numbers are hidden in the text below; one name has several of them. Remember them: "
                     "you will be asked for them at the end.")
            ask = (f"What are all the special numbers for {query}? Answer with the numbers only, separated by "
                   "commas.")
        else:
            needles = [f"The special number for {key} is {value}." for key, value in zip(keys, values)]
            gold = values[:1]
            intro = ("Several special numbers are hidden in the text below, each for a different name. Remember "
                     "them: you will be asked for one at the end." if kind == "multikey" else
                     "A special number is hidden in the text below. Remember it: you will be asked for it at the end.")
            ask = f"What is the special number for {query}? Answer with the number only."
        stream = _Stream(_sentence, rng.getrandbits(63))
        inserts = list(zip(depths, needles))
        info = {"query": query, "keys": keys, "depths": depths}
        return _Sample(gold, None, lambda n: f"{intro}\n\n{_with_inserts(stream.first(n), inserts)}\n\n{ask}", info)

    return build_sample


def _variable_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def _variable_tracking(rng: random.Random, _count: Callable[[str], int], _target: int) -> _Sample:
    names = _variable_names(rng, 2 * (HOPS + 1))
    chains = [names[: HOPS + 1], names[HOPS + 1 :]]
    values = _numbers(rng, 2, 5)
    inserts, depths = [], []
    for chain, value in zip(chains, values):
        statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        chain_depths = sorted(rng.random() for _ in statements)  # a variable is defined before it is copied
        inserts += list(zip(chain_depths, statements))
        depths.append(chain_depths)
    intro = ("Variables are assigned in the text below, some to a number and some to another variable. Remember "
             "the assignments: you will be asked to trace them at the end.")
    ask = (f"Which variables hold the value {values[0]}, directly or through other variables? Answer with the "
           "variable names only, separated by commas.")
    stream = _Stream(_noise, 0)
    info = {"query": values[0], "distractor_chain": chains[1], "depths": depths[0], "distractor_depths": depths[1]}
    return _Sample(chains[0], names, lambda n: f"{intro}\n\n{_with_inserts(stream.first(n), inserts)}\n\n{ask}", info)


def _common_words(rng: random.Random, count_tokens: Callable[[str], int], target: int) -> _Sample:
    pool = list(dict.fromkeys(NOUNS + ADJECTIVES + VERBS))
    rng.shuffle(pool)
    common, uncommon = pool[:COMMON_WORDS], pool[COMMON_WORDS:]
    shuffle_seed = rng.getrandbits(63)
    intro = "Below is a numbered list of words. Some of them appear many times."
    ask = (f"Which {COMMON_WORDS} words appear most often in the list above? Answer with the {COMMON_WORDS} words "
           "only, separated by commas.")

    def build(n: int, repeats: int) -> str:
        words = [w for w in common for _ in range(repeats)] + _uncommon(uncommon, n)
        random.Random(shuffle_seed + n).shuffle(words)
        listing = "\n".join(f"{i}. {word}" for i, word in enumerate(words, start=1))
        return f"{intro}\n\n{listing}\n\n{ask}"

    # The common words fill about COMMON_SHARE of the context, at most RULER's 30 repeats each.
    sample_entries = "\n".join(f"{i}. {word}" for i, word in enumerate(pool[:100], start=100))
    per_entry = count_tokens(sample_entries) / 100
    room = target - count_tokens(build(0, 0))
    repeats = min(30, max(UNCOMMON_REPEATS + 1, int(COMMON_SHARE * room / (COMMON_WORDS * per_entry))))
    info = {"common_repeats": repeats}
    return _Sample(common, common + uncommon, lambda n: build(n, repeats), info, len(uncommon) * (repeats - 1))


def _uncommon(words: list[str], n: int) -> list[str]:
    """`n` list entries from `words`, each word UNCOMMON_REPEATS times while the vocabulary lasts, then evenly more
    often (`max_units` keeps that below the common words' count)."""
    repeats = max(UNCOMMON_REPEATS, -(-n // len(words)))
    return [words[i // repeats] for i in range(n)]


_BUILDERS: dict[str, _Builder] = {
    "niah_single": _niah("single"),
    "niah_multikey": _niah("multikey"),
    "niah_multivalue": _niah("multivalue"),
    "vt": _variable_tracking,
    "cwe": _common_words,
}

