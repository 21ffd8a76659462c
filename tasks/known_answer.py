"""Known-answer tasks: constructed reasoning traces whose answer depends on facts at positions known by construction.

Occlusion labels (`labeling.occlusion`) claim to say which reasoning tokens an answer depends on. These tasks make
that claim checkable: each problem carries its own reasoning text, which the study teacher-forces instead of letting
the model generate, so where the facts sit is known exactly, and the labeller's flips can be scored against them
(`validation.known_answer`).

**Names.** A dataset is ``known_facts[@<decoys>][+<trait>...]`` (0 to `MAX_DECOYS` decoys, default 1), read in one
place, `parse_name`, into a `KnownFactsConfig`. Each trait sets one field of it, so the cases combine freely; the
canonical name (`KnownFactsConfig.name`, which problem ids and provenance use) writes the decoys and every trait that
differs from the default, in this order:

==============  ============  =====================================================================================
trait           field         the reasoning
==============  ============  =====================================================================================
(none)                        one needed note, after every decoy note (the original task, ``known_facts@1``)
``first``       ``layout``    the needed note(s) before every decoy: a score that grows with position cannot win
``twice``       ``copies``    the needed note stated twice, word for word, at least `COPY_GAP_WORDS` words apart
``twohop``      ``hops``      the code reached in two steps, through a box (see *Two hops*)
``<tokens>``    ``length``    filler added until the text holds about that many tokens (``7500``, ``2k`` = 2048)
==============  ============  =====================================================================================

So ``known_facts`` is ``known_facts@1``; ``known_facts@2+first``, ``known_facts+twice``, ``known_facts+first+twohop``
and ``known_facts+first+7500`` are others (traits in any order, each at most once).

**One hop.** A problem asks for the four-digit code of a named person. The prompt names the person and states no
number; the constructed reasoning reads::

    <lead-in filler> The code for Hugo is 7305. <filler> The code for Elena is 4817. <filler>
    </think> So the code for Elena is \\boxed{4817}.

- the *needed* note, about the asked person: the only place its value appears before the answer (the prompt is never
  occluded, so a value it stated could be re-read, and none is in it); with ``twice`` it is stated a second time;
- `decoys` *decoy* notes of exactly the same form about other people, which the answer does not depend on;
- digit-free, name-free *filler* sentences: at least `MIN_GAP_WORDS` words after every note (`COPY_GAP_WORDS` between
  the copies of ``twice``, three windows), so that a 32-token occlusion window of any tokenizer that splits at
  whitespace (each word is at least one token) touches at most one note, and notes are at least two windows apart
  from each other and from the answer boundary;
- the answer boundary ``</think>`` (`labeling.windows.find_answer_boundary` takes the first ``</think>`` when there
  is one, else the last ``\\boxed{``), then the answer statement. The answer cue, from the boundary up to the answer
  itself, is ``</think> So the code for Elena is \\boxed{``: appended after an occluded context, it forces an answer.

**Two hops** (``twohop``). The code is found through a box: a *link* note (hop 1, ``Elena's code is in the blue
box.``, whose key is the name and whose value the box's colour) and a *box* note (hop 2, ``The blue box holds
4817.``, key the colour, value the code). Neither suffices alone: the link note states no code and the box note names
no person. Each hop has `decoys` decoy notes, other people's boxes (hop 1) and other boxes' codes (hop 2), shuffled
together. The hop-2 decoys alternate, starting with the first, between a box no link note names (an *orphan*) and the
box of a hop-1 decoy (a complete decoy chain), so that occluding the needed link's colour leaves at least two boxes
that no note assigns, the asked one and an orphan (the asked box cannot be found by elimination, only guessed), and,
from two decoys on, a decoy chain is as complete as the needed one (the name must be read to tell them apart).
Occluding the box note's code removes the code: it appears nowhere else before the answer. The prompt and the cue
name the person, never the box. Two hops need at least one decoy (with none, the only code stated needs no link).

**Why the statement lies after the boundary.** With the boundary at the statement's ``\\boxed{`` instead, the
statement "So the code for Elena is" is reasoning, and occluding it takes away what tells SmolLM2-135M to write the
code (measured on 24 traces under the forced cue ``\\boxed{``: all 24 windows flush with the boundary flipped with a
space filler, to an empty box or more spaces, and 22 of 24 with deletion, to answers like "1", "code" or "{}"; 29
and 28 of the 35 windows touching the statement flipped). The prompt states the name too, so those flips measure the
replacement, not a fact the reasoning holds; the statement therefore belongs to the answer, which is never occluded.

**Why the needed note comes last by default.** SmolLM2-135M mostly answers with the latest note's value rather than
looking the name up (measured on 24 problems with one decoy and the needed note first or last in turn: 18 answered
correctly unoccluded, and all 6 wrong ones had the needed note first; on the 6 needed-first traces it got right the
answer was fragile, so occluding decoy or filler windows flipped it: 3 of 17 decoy and 10 of 42 filler windows,
against 0 of 24 and 2 of 79 on needed-last traces, no-answer flips left out). So by default every decoy precedes the
needed note, and the needed note's depth varies instead through the lead-in filler (`LEAD_WORDS`, drawn) and the
filler after the last note (`MIN_GAP_WORDS` plus `TAIL_EXTRA_WORDS`, cycled over consecutive problems). A
consequence for scorers: a score that grows with position ranks the needed note above every decoy;
`validation.known_answer.scorer_auc` therefore also compares the needed tokens with the filler, most of which comes
after them. ``first`` removes that advantage, for a model that looks the name up (docs/labels.md gives the share of
these traces each installed model answers). Codes are four-digit numbers whose first digits all differ, so a partly
occluded value never reads as another note's value.

**Length** (``+<tokens>``). Filler sentences (the same ones) are added until the text holds about `tokens` tokens,
counted as words times `TOKENS_PER_WORD` (the filler's tokens per word in the SmolLM2 and Qwen2.5 tokenizers). The
added words are split over the lead-in and the gap after every note in drawn proportions, so the needed notes' depth
varies from problem to problem. A length that the notes and their minimum gaps may not fit into is refused
(`KnownFactsConfig.min_length`). The model must hold the prompt, the trace and the answer: `answer_traces` refuses a
trace whose forced answer would pass its context (SmolLM2-135M reads 8,192 positions, so ``+7500`` fits beside its
prompt of about 80 tokens).

**Determinism.** Problem ``i`` is drawn with `random.Random` seeded by `core.seeds.derive_seed` of (seed, name, i):
the same on every run and machine, whatever the limit, and independent of any tokenizer (the text is fixed; only its
tokenization, done once in `problem_trace`, depends on the model). A ``known_facts@<decoys>`` problem is the same,
byte for byte, as before the traits existed.

**Records.** ``Problem.meta["known_answer"]`` holds the reasoning text, the answer, the asked name, the character
spans ``[start, end)`` of each needed note (``needed``, in reading order) and of each decoy note (``decoys``), each
with its ``key`` and ``value`` sub-spans, the answer statement's span, where the cue (``cue``) and the answer
(``answer_char``) begin, the first needed note's depth (its start over the text's length), the number of decoys per
hop, the seed and the generator version. What a trait adds is written only where the trait is set, so a
``known_facts@<decoys>`` record is unchanged and a missing field means the default: ``layout``, ``copies``, ``hops``
and ``length`` when not the default; with two hops, every note's ``hop`` (1 or 2); with two copies, every needed
note's ``copy`` (1 or 2). `problem_trace` turns a problem into a `core.schemas.Trace` for a tokenizer: the prompt
from `tasks.prompts.build_prompt_ids` (the standard instruction: answer within ``\\boxed{}``), the generated ids from
tokenizing the reasoning text once with offsets (then the tokenizer's end-of-sequence token), and
``extra["known_answer"]`` with the same notes, their spans as absolute token positions ``[start, end)`` (every token
that overlaps the characters) and their ``hop`` / ``copy`` as in the problem. `answer_traces` checks with a loaded
model that the unoccluded trace is answered under the forced cue and sets ``answer`` / ``correct`` from what the
model says.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import UsageError, unknown_choice
from core.schemas import Trace
from core.seeds import derive_seed
from tasks.problem import Problem

NAME = "known_facts"
META = "known_answer"  # the key of a problem's meta and of a trace's extra
DEFAULT_DECOYS = 1
MAX_DECOYS = 8  # the first digits of the codes must all differ (1-9)
DEFAULT_COUNT = 24  # problems when no limit is given
LAYOUTS = ("last", "first")  # where the needed notes lie: after every decoy, or before every decoy
MAX_COPIES = 2
MAX_HOPS = 2
# Name trait -> (config field, value); a length is the other trait (`_length`).
TRAITS: dict[str, tuple[str, Any]] = {"first": ("layout", "first"), "twice": ("copies", 2), "twohop": ("hops", 2)}
# What the dataset listings show: the original task, each trait alone, and a long one.
NAMES = (NAME, *(f"{NAME}+{trait}" for trait in TRAITS), f"{NAME}+2k")
LEAD_WORDS = (0, 20, 40)  # the lead-in filler before the first note holds at least this many words (one drawn)
# Filler words after the last note beyond MIN_GAP_WORDS, cycled over consecutive problems so its depth varies.
TAIL_EXTRA_WORDS = (0, 32, 64)
MIN_GAP_WORDS = 64  # filler words between two notes, and between the last note and the answer statement
COPY_GAP_WORDS = 96  # filler words between the two copies of the needed notes: three 32-token windows
# Tokens per filler word in the SmolLM2-135M and Qwen2.5 tokenizers (both 1.136): how a length becomes words.
TOKENS_PER_WORD = 1.14
THINK_END = "</think>"  # the answer boundary (`labeling.windows.find_answer_boundary` looks for it first)
CUE = "\\boxed{"
# Part of every problem's provenance: change it whenever a seed would generate different text.
GENERATOR = "kvscope-known-facts-1"

# Who a code belongs to: names, not key materials ("the code for the silver key"), because SmolLM2-135M matches a name
# to its note more often (measured with one decoy, the needed note first or last in turn: 19 of 24 against 17 of 24).
KEYS = (
    "Anna", "Boris", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Irene", "Jonas", "Karl", "Laura",
    "Martin", "Nora", "Oscar", "Paula",
)
# The boxes of two-hop problems: the asked person's, one per hop-1 decoy and one per orphan (1 + 8 + 4 at most).
BOXES = (
    "red", "blue", "green", "yellow", "black", "white", "brown", "grey", "orange", "purple", "pink", "silver", "golden",
)
# Reasoning-like sentences with no digit, no name, no colour and no "code" or "box": occluding them removes nothing
# the answer needs, so a flip there is a false positive of the labeller.
FILLER = (
    "I will go through the notes one at a time.",
    "It helps to keep each detail apart from the others.",
    "Nothing here needs any arithmetic, only careful reading.",
    "I should not mix up one note with another.",
    "Let me slow down and read the next part with care.",
    "This part of the notes is only background.",
    "There is no trick here, just a careful lookup.",
    "I want to be sure before I write the final answer.",
    "So far everything seems consistent.",
    "The order of the notes does not matter for the question.",
    "Reading slowly avoids careless mistakes.",
    "I keep the question in mind while reading.",
    "Some of the notes are not relevant to the question.",
    "I will check my reading once more at the end.",
    "The wording of each note is very similar.",
    "That is worth remembering for later.",
    "Now I move on to the next note.",
    "Careful reading matters more than speed here.",
    "Each note says one thing and nothing more.",
    "I can set the unrelated notes aside.",
)
NOTE = "The code for {key} is {value}."
LINK_NOTE = "{key}'s code is in the {value} box."  # hop 1 of two: the box is the value
BOX_NOTE = "The {key} box holds {value}."  # hop 2: the box is the key
STATEMENT = "So the code for {key} is \\boxed{{{value}}}."
QUESTION = ("Several people each have a four-digit code, and your notes say whose is which. Go through the notes and "
            "report the code for {key}.")
TWO_HOP_QUESTION = ("Several people each keep a four-digit code in a box, and your notes say whose code is in which "
                    "box and which code each box holds. Go through the notes and report the code for {key}.")
SPAN_PARTS = ("note", "key", "value")  # the character spans of a note; its other fields (hop, copy) are numbers
_WORDS = re.compile(r"\S+")
_LENGTH = re.compile(r"(\d+)([kK]?)")


@dataclass(frozen=True)
class KnownFactsConfig:
    """One known-answer dataset: decoy notes per hop, the seed its problems are drawn from, and its traits: where the
    needed notes lie (`layout`), how often they are stated (`copies`), how many hops lead to the code (`hops`) and
    the text's length in tokens (`length`, None: the notes and their gaps only)."""

    decoys: int = DEFAULT_DECOYS
    seed: int = 0
    layout: str = "last"
    copies: int = 1
    hops: int = 1
    length: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.decoys) or not 0 <= self.decoys <= MAX_DECOYS:
            raise UsageError(f"known_facts decoys must be an integer in 0..{MAX_DECOYS}, got {self.decoys!r}")
        if not _is_int(self.seed):
            raise UsageError(f"known_facts seed must be an integer, got {self.seed!r}")
        if self.layout not in LAYOUTS:
            raise unknown_choice("known_facts layout", str(self.layout), LAYOUTS)
        for field, most in (("copies", MAX_COPIES), ("hops", MAX_HOPS)):
            value = getattr(self, field)
            if not _is_int(value) or not 1 <= value <= most:
                raise UsageError(f"known_facts {field} must be an integer in 1..{most}, got {value!r}")
        if self.hops > 1 and self.decoys < 1:
            raise UsageError(f"dataset {self.name!r}: two hops need a decoy; without one the only code stated needs no "
                             "link to be found")
        if self.length is not None and (not _is_int(self.length) or self.length < self.min_length):
            raise UsageError(f"dataset {self.name!r}: a length of {self.length!r} tokens cannot hold its notes and the "
                             f"filler between them; ask for at least {self.min_length} tokens, or leave the length "
                             "out")

    @property
    def name(self) -> str:
        """The canonical dataset name: the decoys, then each trait not at its default (``known_facts@2+first``)."""
        traits = [f"+{trait}" for trait, (field, value) in TRAITS.items() if getattr(self, field) == value]
        length = [f"+{self.length}"] if self.length is not None else []
        return f"{NAME}@{self.decoys}" + "".join(traits + length)

    @property
    def min_length(self) -> int:
        """The fewest tokens that every problem's notes, their minimum gaps and the answer statement fit into,
        whatever is drawn: a shorter `length` could not be met."""
        slot = _Note("", "needed", 1, 1)
        notes = _order(self, [slot] * self.hops, [dataclasses.replace(slot, role="decoy")] * self.hops * self.decoys)
        longest_note = max(_words(t.format(key="x", value="x")) for t in (NOTE, LINK_NOTE, BOX_NOTE))
        # each filler block may overrun its minimum by one sentence less a word
        overrun = (len(notes) + 1) * (max(_words(s) for s in FILLER) - 1)
        words = (max(LEAD_WORDS) + sum(_gaps(notes)) + max(TAIL_EXTRA_WORDS) + overrun + len(notes) * longest_note
                 + _words(_statement("x", "x")))
        return math.ceil(words * TOKENS_PER_WORD)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _words(text: str) -> int:
    return len(_WORDS.findall(text))


def parse_name(name: str, seed: int = 0) -> KnownFactsConfig | None:
    """``known_facts[@<decoys>][+<trait>...]`` (traits: ``first``, ``twice``, ``twohop``, a length in tokens such as
    ``7500`` or ``2k``) as a `KnownFactsConfig`; None for a name outside this family."""
    head, *traits = name.split("+")
    base, at, decoys = head.partition("@")
    if base != NAME:
        return None
    fields: dict[str, Any] = {}
    if at:
        if not decoys.isdigit():
            raise UsageError(f"dataset {name!r}: decoys {decoys!r} is not a number; write e.g. {NAME}@2")
        fields["decoys"] = int(decoys)
    for trait in traits:
        if (match := _LENGTH.fullmatch(trait)) is not None:
            field, value = "length", int(match.group(1)) * (1024 if match.group(2) else 1)
        elif trait in TRAITS:
            field, value = TRAITS[trait]
        else:
            raise unknown_choice(f"trait in dataset {name!r}:", trait, [*TRAITS, "<tokens>"])
        if field in fields:
            raise UsageError(f"dataset {name!r} sets its {field} twice")
        fields[field] = value
    return KnownFactsConfig(seed=seed, **fields)


def source(config: KnownFactsConfig) -> str:
    """The provenance string of a generated dataset (what a run's identity records instead of a file path)."""
    return f"generated:{config.name} seed={config.seed} {GENERATOR}"


def generate(config: KnownFactsConfig, count: int = DEFAULT_COUNT) -> list[dict[str, Any]]:
    """The first `count` problems of `config` as records (id, question, answer, known_answer) for `tasks.datasets`."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"count must be a positive integer, got {count!r}")
    return [_problem(config, index) for index in range(count)]


@dataclass(frozen=True)
class _Note:
    """One note before it is placed: its text, role, hop and copy, and its key's and value's characters in it."""

    text: str
    role: str  # "needed" or "decoy"
    hop: int
    copy: int
    key: tuple[int, int] = (0, 0)
    value: tuple[int, int] = (0, 0)


def _note(template: str, key: str, value: str, role: str, hop: int = 1) -> _Note:
    """`template` filled in (its key comes before its value)."""
    before_key, _, rest = template.partition("{key}")
    key_start = len(before_key)
    value_start = key_start + len(key) + len(rest.partition("{value}")[0])
    return _Note(template.format(key=key, value=value), role, hop, 1, (key_start, key_start + len(key)),
                 (value_start, value_start + len(value)))


def _statement(key: str, value: str) -> str:
    return f"{THINK_END} " + STATEMENT.format(key=key, value=value)


def _one_hop(keys: Sequence[str], values: Sequence[str]) -> tuple[list[_Note], list[_Note]]:
    """The needed note and the decoys of a one-hop problem: "The code for <name> is <code>." each."""
    return ([_note(NOTE, keys[0], values[0], "needed")],
            [_note(NOTE, key, value, "decoy") for key, value in zip(keys[1:], values[1:])])


def _two_hops(rng: random.Random, keys: Sequence[str], values: Sequence[str]) -> tuple[list[_Note], list[_Note]]:
    """The two needed notes (link, then box) and the shuffled decoys of both hops of a two-hop problem; the hop-2
    decoys alternate between an orphan box and a hop-1 decoy's box (the module docstring says why)."""
    decoys = len(keys) - 1
    boxes = rng.sample(BOXES, 1 + decoys + (decoys + 1) // 2)
    owned, orphans = boxes[1:1 + decoys], iter(boxes[1 + decoys:])
    chained = iter(owned)
    held = [next(orphans) if i % 2 == 0 else next(chained) for i in range(decoys)]
    needed = [_note(LINK_NOTE, keys[0], boxes[0], "needed", 1), _note(BOX_NOTE, boxes[0], values[0], "needed", 2)]
    others = ([_note(LINK_NOTE, key, box, "decoy", 1) for key, box in zip(keys[1:], owned)]
              + [_note(BOX_NOTE, box, value, "decoy", 2) for box, value in zip(held, values[1:])])
    rng.shuffle(others)
    return needed, others


def _order(config: KnownFactsConfig, needed: list[_Note], decoys: list[_Note]) -> list[_Note]:
    """The notes in reading order: each copy of the needed notes in turn, after or before every decoy."""
    copies = [dataclasses.replace(note, copy=copy) for copy in range(1, config.copies + 1) for note in needed]
    return copies + decoys if config.layout == "first" else decoys + copies


def _gaps(notes: Sequence[_Note]) -> list[int]:
    """The fewest filler words after each note: `COPY_GAP_WORDS` where the next copy of the needed notes begins,
    `MIN_GAP_WORDS` elsewhere (and before the answer statement)."""
    return [COPY_GAP_WORDS if after is not None and after.role == note.role == "needed" and after.copy != note.copy
            else MIN_GAP_WORDS for note, after in zip(notes, [*notes[1:], None])]


def _lengthen(rng: random.Random, blocks: list[int], length: int, notes: Sequence[_Note]) -> list[int]:
    """`blocks` (filler words of the lead-in and after each note) grown until the text holds about `length` tokens,
    the added words split in drawn proportions."""
    fixed = sum(_words(note.text) for note in notes) + _words(_statement("x", "x"))
    extra = math.ceil(length / TOKENS_PER_WORD) - fixed - sum(blocks)  # not negative: length >= min_length
    weights = [rng.random() for _ in blocks]
    return [words + int(extra * weight / sum(weights)) for words, weight in zip(blocks, weights)]


def _problem(config: KnownFactsConfig, index: int) -> dict[str, Any]:
    rng = random.Random(derive_seed(config.seed, (config.name, index)))
    people = config.decoys + 1
    keys = rng.sample(KEYS, people)  # keys[0] is the asked one
    firsts = rng.sample(range(1, 10), people)
    values = [f"{first}{rng.randrange(1000):03d}" for first in firsts]
    needed, decoys = _one_hop(keys, values) if config.hops == 1 else _two_hops(rng, keys, values)
    notes = _order(config, needed, decoys)
    blocks = [rng.choice(LEAD_WORDS), *_gaps(notes)]
    blocks[-1] += TAIL_EXTRA_WORDS[index % len(TAIL_EXTRA_WORDS)]
    if config.length is not None:
        blocks = _lengthen(rng, blocks, config.length, notes)

    parts: list[tuple[str, _Note | None]] = [(s, None) for s in _filler(rng, blocks[0])]
    for note, words in zip(notes, blocks[1:]):
        parts += [(note.text, note), *((s, None) for s in _filler(rng, words))]
    parts.append((_statement(keys[0], values[0]), None))
    text, placed = "", []
    for sentence, stated in parts:
        start = len(text) + (1 if text else 0)
        text = f"{text} {sentence}" if text else sentence
        if stated is not None:
            placed.append((stated, _spans(config, stated, start)))
    boundary = text.rindex(THINK_END)
    needed_spans = [spans for note, spans in placed if note.role == "needed"]
    info = {
        "text": text, "answer": values[0], "key": keys[0], "needed": needed_spans,
        "decoys": [spans for note, spans in placed if note.role == "decoy"],
        "statement": [boundary + len(THINK_END) + 1, len(text)], "cue": boundary,
        "answer_char": text.rindex(CUE) + len(CUE), "depth": needed_spans[0]["note"][0] / len(text),
        "decoy_count": config.decoys, "seed": config.seed, "generator": GENERATOR,
    }
    # a trait at its default is left out, so a known_facts@<decoys> record stays as it was before traits existed
    default = KnownFactsConfig()
    info |= {field: getattr(config, field) for field in ("layout", "copies", "hops", "length")
             if getattr(config, field) != getattr(default, field)}
    question = (QUESTION if config.hops == 1 else TWO_HOP_QUESTION).format(key=keys[0])
    return {"id": f"{config.name}-{index}", "question": question, "answer": values[0], META: info}


def _spans(config: KnownFactsConfig, note: _Note, start: int) -> dict[str, Any]:
    """The character spans of `note` placed at `start` (the whole note, its key, its value), then its hop when the
    problem has two and its copy when the needed notes are stated twice."""
    spans: dict[str, Any] = {"note": [start, start + len(note.text)], "key": [start + note.key[0], start + note.key[1]],
                             "value": [start + note.value[0], start + note.value[1]]}
    if config.hops > 1:
        spans["hop"] = note.hop
    if config.copies > 1 and note.role == "needed":
        spans["copy"] = note.copy
    return spans


def _filler(rng: random.Random, words: int) -> list[str]:
    """Filler sentences drawn without immediate repeats until they hold at least `words` words."""
    out: list[str] = []
    held = 0
    while held < words:
        choices = [s for s in FILLER if not out or s != out[-1]]
        out.append(rng.choice(choices))
        held += _words(out[-1])
    return out


# --- traces --------------------------------------------------------------------------------------------------------
def problem_trace(problem: Problem, tokenizer: Any, model: str) -> Trace:
    """The teacher-forced `core.schemas.Trace` of a known-answer `problem` for `tokenizer`, named after `model`;
    ``answer`` / ``correct`` stay unset until `answer_traces` asks the model. Any other problem is a `UsageError`.

    The reasoning text is tokenized once, with offsets, so every character span of ``meta["known_answer"]`` maps to
    the tokens that overlap it; ``extra["known_answer"]`` holds those spans as absolute positions, plus
    ``answer_start`` (the token holding the cue's first character, where `labeling.windows.find_answer_boundary`
    puts the boundary) and ``answer_token`` (the token holding the answer's first character: the forced cue is
    ``token_ids[answer_start:answer_token]``). A tokenizer that merges the cue's last character into the answer's
    first token leaves no cue to force and is a `UsageError`.
    """
    from tasks.prompts import build_prompt_ids

    info = problem.meta.get(META)
    if info is None:
        raise UsageError(f"problem {problem.id!r} of {problem.dataset} is not a known-answer problem ({NAME})")
    prompt_ids = build_prompt_ids(tokenizer, problem)
    encoded = tokenizer(info["text"], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(pair) for pair in encoded["offset_mapping"]]
    base = len(prompt_ids)

    def tokens(span: Sequence[int]) -> list[int]:
        inside = [i for i, (start, end) in enumerate(offsets) if start < span[1] and end > span[0]]
        return [base + inside[0], base + inside[-1] + 1]

    def holding(char: int) -> int:
        return tokens((char, char + 1))[0]

    answer_start, answer_token = holding(info["cue"]), holding(info["answer_char"])
    if holding(info["answer_char"] - 1) == answer_token:
        raise UsageError(f"problem {problem.id!r}: the tokenizer merges the end of the answer cue {CUE!r} with the "
                         "answer's first digit; the cue cannot be forced without part of the answer")
    def note(fact: dict[str, Any]) -> dict[str, Any]:
        return {part: tokens(value) if part in SPAN_PARTS else value for part, value in fact.items()}

    spans = {
        "needed": [note(fact) for fact in info["needed"]],
        "decoys": [note(fact) for fact in info["decoys"]],
        "statement": tokens(info["statement"]),
        "answer_start": answer_start,
        "answer_token": answer_token,
        "constructed": True,
    }
    eos = tokenizer.eos_token_id
    return Trace(
        id=problem.id, dataset=problem.dataset, model=model, prompt_ids=prompt_ids,
        generated_ids=ids + ([eos] if eos is not None else []), text=info["text"], gold=problem.answer,
        finish_reason="eos" if eos is not None else "length", extra={META: spans},
    )


def scripted_ids(problem: Problem, tokenizer: Any) -> list[int] | None:
    """What an evicting run teacher-forces after a known-answer problem's prompt: its constructed reasoning and the
    answer cue, up to the answer's first token, so the model states the answer from whatever the cache kept; None for
    any other problem (the model generates its own trace)."""
    if META not in problem.meta:
        return None
    trace = problem_trace(problem, tokenizer, "")
    return list(trace.generated_ids[: trace.extra[META]["answer_token"] - len(trace.prompt_ids)])


def grade(text: str, problem: Problem) -> dict[str, Any]:
    """Grade a continuation of a known-answer trace: the answer is read after the last ``</think>`` only (the answer
    statement), never from the reasoning, whose notes hold every code: a model that leaves its box open must not
    be credited with the last code the reasoning mentioned."""
    from tasks.grading import extract_answer_with_rule, is_equivalent

    statement = text[text.rfind(THINK_END) + len(THINK_END):] if THINK_END in text else text
    answer, rule = extract_answer_with_rule(statement, problem.dataset)
    return {"answer": answer, "correct": is_equivalent(answer, problem.answer), "no_answer": answer is None,
            "extracted_by": rule}


def answer_traces(lm: Any, traces: Sequence[Trace], max_new_tokens: int = 8) -> list[Trace]:
    """`traces` (from `problem_trace`) with ``answer`` / ``correct`` / ``no_answer`` / ``extracted_by`` set from what
    `lm` (a `models.lm.LoadedModel`) answers, greedily, after the unoccluded reasoning and the forced cue.

    The answer is `tasks.grading.extract_answer` of the cue's text followed by the `max_new_tokens` continuation;
    the continuation is kept in ``extra["known_answer"]["forced"]``. A trace whose forced answer would pass the
    model's context is a `UsageError`, before any is answered.
    """
    from core.limits import ModelLimits
    from tasks.generation import generate
    from tasks.grading import extract_answer_with_rule, is_equivalent

    limits = ModelLimits.from_config(lm.name, lm.config)
    for trace in traces:
        limits.check_tokens(f"trace {trace.id!r} with its prompt and a forced answer of {max_new_tokens} tokens",
                            trace.extra[META]["answer_token"] + max_new_tokens)
    answered = []
    for trace in traces:
        spans = trace.extra[META]
        ids = trace.token_ids
        result = generate(lm, ids[: spans["answer_token"]], max_new_tokens)
        cue = lm.tokenizer.decode(ids[spans["answer_start"]: spans["answer_token"]], skip_special_tokens=True)
        answer, rule = extract_answer_with_rule(cue + result.text, trace.dataset)
        answered.append(dataclasses.replace(
            trace, answer=answer, extracted_by=rule, no_answer=answer is None,
            correct=is_equivalent(answer, trace.gold) if trace.gold is not None else None,
            extra={**trace.extra, META: {**spans, "forced": result.text}}))
    return answered
