"""Known-answer tasks: constructed reasoning traces whose answer depends on facts at positions known by construction.

Occlusion labels (`labeling.occlusion`) claim to say which reasoning tokens an answer depends on. These tasks make
that claim checkable: each problem carries its own reasoning text, which the study teacher-forces instead of letting
the model generate, so where the facts sit is known exactly, and the labeller's flips can be scored against them
(`validation.known_answer`).

A problem of ``known_facts@<decoys>`` (``known_facts`` is ``known_facts@1``; 0 to `MAX_DECOYS` decoys) asks for the
four-digit code of a named person. The prompt names the person and states no number; the constructed reasoning
reads::

    <lead-in filler> The code for Hugo is 7305. <filler> The code for Elena is 4817. <filler>
    </think> So the code for Elena is \\boxed{4817}.

- the *needed* note, about the asked person: the only place its value appears before the answer (the prompt is never
  occluded, so a value it stated could be re-read, and none is in it);
- `decoys` *decoy* notes of exactly the same form about other people, which the answer does not depend on;
- digit-free, name-free *filler* sentences: at least `MIN_GAP_WORDS` words after every note, so that a 32-token
  occlusion window of any tokenizer that splits at whitespace (each word is at least one token) touches at most one
  note, and notes are at least two windows apart from each other and from the answer boundary;
- the answer boundary ``</think>`` (`labeling.windows.find_answer_boundary` takes the first ``</think>`` when there
  is one, else the last ``\\boxed{``), then the answer statement. The answer cue, from the boundary up to the answer
  itself, is ``</think> So the code for Elena is \\boxed{``: appended after an occluded context, it forces an answer.

**Why the statement lies after the boundary.** With the boundary at the statement's ``\\boxed{`` instead, the
statement "So the code for Elena is" is reasoning, and occluding it takes away what tells SmolLM2-135M to write the
code (measured on 24 traces under the forced cue ``\\boxed{``: all 24 windows flush with the boundary flipped with a
space filler, to an empty box or more spaces, and 22 of 24 with deletion, to answers like "1", "code" or "{}"; 29
and 28 of the 35 windows touching the statement flipped). The prompt states the name too, so those flips measure the
replacement, not a fact the reasoning holds; the statement therefore belongs to the answer, which is never occluded.

**Why the needed note comes last.** SmolLM2-135M mostly answers with the latest note's value rather than looking the
name up (measured on 24 problems with one decoy and the needed note first or last in turn: 18 answered correctly
unoccluded, and all 6 wrong ones had the needed note first; on the 6 needed-first traces it got right the answer was
fragile, so occluding decoy or filler windows flipped it: 3 of 17 decoy and 10 of 42 filler windows, against 0 of 24
and 2 of 79 on needed-last traces, no-answer flips left out). So every decoy precedes the needed note, and the
needed note's depth varies instead through the lead-in filler (`LEAD_WORDS`, drawn) and the filler after it
(`MIN_GAP_WORDS` plus `TAIL_EXTRA_WORDS`, cycled over consecutive problems). A consequence for scorers: a score that
grows with position ranks the needed note above every decoy; `validation.known_answer.scorer_auc` therefore also
compares the needed tokens with the filler, most of which comes after them. Codes are four-digit numbers whose first
digits all differ, so a partly occluded value never reads as another note's value.

**Determinism.** Problem ``i`` is drawn with `random.Random` seeded by `core.seeds.derive_seed` of (seed, name, i):
the same on every run and machine, whatever the limit, and independent of any tokenizer (the text is fixed; only its
tokenization, done once in `problem_trace`, depends on the model).

**Records.** ``Problem.meta["known_answer"]`` holds the reasoning text, the answer, the asked name, the character
spans ``[start, end)`` of the needed note and of each decoy note (each with its ``key`` (the name) and ``value``
sub-spans), the answer statement's span, where the cue (``cue``) and the answer (``answer_char``) begin, the needed
note's depth (its start over the text's length), the number of decoys, the seed and the generator version.
`problem_trace` turns a problem into a `core.schemas.Trace` for a tokenizer: the prompt from
`tasks.prompts.build_prompt_ids` (the standard instruction: answer within ``\\boxed{}``), the generated ids from
tokenizing the reasoning text once with offsets (then the tokenizer's end-of-sequence token), and
``extra["known_answer"]`` with the same spans as absolute token positions ``[start, end)`` (every token that overlaps
the characters). `answer_traces` checks with a loaded model that the unoccluded trace is answered under the forced cue
and sets ``answer`` / ``correct`` from what the model says.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import UsageError
from core.schemas import Trace
from core.seeds import derive_seed
from tasks.problem import Problem

NAME = "known_facts"
NAMES = (NAME,)
META = "known_answer"  # the key of a problem's meta and of a trace's extra
DEFAULT_DECOYS = 1
MAX_DECOYS = 8  # the first digits of the codes must all differ (1-9)
DEFAULT_COUNT = 24  # problems when no limit is given
LEAD_WORDS = (0, 20, 40)  # the lead-in filler before the first note holds at least this many words (one drawn)
# Filler words after the needed note beyond MIN_GAP_WORDS, cycled over consecutive problems so its depth varies.
TAIL_EXTRA_WORDS = (0, 32, 64)
MIN_GAP_WORDS = 64  # filler words between two notes, and between the last note and the answer statement
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
# Reasoning-like sentences with no digit, no name and no "code": occluding them removes nothing the answer needs, so
# a flip there is a false positive of the labeller.
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
STATEMENT = "So the code for {key} is \\boxed{{{value}}}."
QUESTION = ("Several people each have a four-digit code, and your notes say whose is which. Go through the notes and "
            "report the code for {key}.")
_WORDS = re.compile(r"\S+")
_NOTE = re.compile(r"The code for (\w+) is (\d+)\.")


@dataclass(frozen=True)
class KnownFactsConfig:
    """One known-answer dataset: how many decoy notes each trace has, and the seed its problems are drawn from."""

    decoys: int = DEFAULT_DECOYS
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.decoys, bool) or not isinstance(self.decoys, int) or not 0 <= self.decoys <= MAX_DECOYS:
            raise UsageError(f"known_facts decoys must be an integer in 0..{MAX_DECOYS}, got {self.decoys!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"known_facts seed must be an integer, got {self.seed!r}")

    @property
    def name(self) -> str:
        """The canonical dataset name, decoys included: ``known_facts@2``."""
        return f"{NAME}@{self.decoys}"


def parse_name(name: str, seed: int = 0) -> KnownFactsConfig | None:
    """``known_facts[@<decoys>]`` as a `KnownFactsConfig`; None for a name outside this family."""
    base, at, decoys = name.partition("@")
    if base not in NAMES:
        return None
    if not at:
        return KnownFactsConfig(seed=seed)
    if not decoys.isdigit():
        raise UsageError(f"dataset {name!r}: decoys {decoys!r} is not a number; write e.g. {NAME}@2")
    return KnownFactsConfig(int(decoys), seed)


def source(config: KnownFactsConfig) -> str:
    """The provenance string of a generated dataset (what a run's identity records instead of a file path)."""
    return f"generated:{config.name} seed={config.seed} {GENERATOR}"


def generate(config: KnownFactsConfig, count: int = DEFAULT_COUNT) -> list[dict[str, Any]]:
    """The first `count` problems of `config` as records (id, question, answer, known_answer) for `tasks.datasets`."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"count must be a positive integer, got {count!r}")
    return [_problem(config, index) for index in range(count)]


def _problem(config: KnownFactsConfig, index: int) -> dict[str, Any]:
    rng = random.Random(derive_seed(config.seed, (config.name, index)))
    notes = config.decoys + 1
    keys = rng.sample(KEYS, notes)  # keys[0] is the asked one
    firsts = rng.sample(range(1, 10), notes)
    values = [f"{first}{rng.randrange(1000):03d}" for first in firsts]
    parts: list[tuple[str, str | None]] = [(s, None) for s in _filler(rng, rng.choice(LEAD_WORDS))]
    for k in range(1, notes):
        parts.append((NOTE.format(key=keys[k], value=values[k]), "decoy"))
        parts += [(s, None) for s in _filler(rng, MIN_GAP_WORDS)]
    parts.append((NOTE.format(key=keys[0], value=values[0]), "needed"))
    tail = MIN_GAP_WORDS + TAIL_EXTRA_WORDS[index % len(TAIL_EXTRA_WORDS)]
    parts += [(s, None) for s in _filler(rng, tail)]
    parts.append((f"{THINK_END} " + STATEMENT.format(key=keys[0], value=values[0]), "statement"))

    text, needed, decoys, statement, boundary = "", None, [], None, None
    for sentence, role in parts:
        start = len(text) + (1 if text else 0)
        text = f"{text} {sentence}" if text else sentence
        if role == "needed":
            needed = _fact_spans(text, start)
        elif role == "decoy":
            decoys.append(_fact_spans(text, start))
        elif role == "statement":
            boundary, statement = start, [start + len(THINK_END) + 1, len(text)]
    answer_char = text.rindex(CUE) + len(CUE)
    assert needed is not None  # every problem holds the needed note
    info = {
        "text": text, "answer": values[0], "key": keys[0], "needed": [needed], "decoys": decoys,
        "statement": statement, "cue": boundary, "answer_char": answer_char,
        "depth": needed["note"][0] / len(text), "decoy_count": config.decoys, "seed": config.seed,
        "generator": GENERATOR,
    }
    return {"id": f"{config.name}-{index}", "question": QUESTION.format(key=keys[0]), "answer": values[0], META: info}


def _fact_spans(text: str, start: int) -> dict[str, list[int]]:
    """The character spans of the note ending `text` at `start`: the whole note, its key name and its value."""
    match = _NOTE.fullmatch(text, start)
    assert match is not None  # the text ends with a note made from NOTE
    return {"note": [start, len(text)], "key": list(match.span(1)), "value": list(match.span(2))}


def _filler(rng: random.Random, words: int) -> list[str]:
    """Filler sentences drawn without immediate repeats until they hold at least `words` words."""
    out: list[str] = []
    while sum(len(_WORDS.findall(s)) for s in out) < words:
        choices = [s for s in FILLER if not out or s != out[-1]]
        out.append(rng.choice(choices))
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
    spans = {
        "needed": [{part: tokens(span) for part, span in fact.items()} for fact in info["needed"]],
        "decoys": [{part: tokens(span) for part, span in fact.items()} for fact in info["decoys"]],
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
    the continuation is kept in ``extra["known_answer"]["forced"]``.
    """
    import dataclasses

    from tasks.generation import generate
    from tasks.grading import extract_answer_with_rule, is_equivalent

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
