"""Machinery shared by the eviction probes `probes.planted_fact` and `probes.passcode`.

An *instance* is a scripted token sequence run through the eviction engine (`evictor.engine`):

    [ stub | lead filler | fact box | gap filler | question box | value ]
      prefill  ------------- teacher-forced through Session.step, one token per step -------------

Only the stub (a short chat-template turn, or plain text for base models) is prefilled, so only it is protected by
prompt protection; every later token goes through the decode path and is scored and evicted exactly like a
generated token (Random Attention notes, Step 5: "23-token prefilled stub, scripted body fed through the true decode
path, 16-token fact box"). The fact box holds the fact sentence followed by the continuing filler; the question box
holds filler followed by the question, right-aligned. Every segment has a fixed size, so all instances of a run
share one layout and batch without padding (and share one eviction schedule).

Filler is real reasoning text: the reference solutions of a benchmark (default MATH-500) or the model's own dense
traces (a `tasks.run` / `evictor.run` generations.jsonl). Each instance reads consecutive texts from its own random
starting point, and draws its variable name and value so that neither occurs in its filler.

The value is a 4-digit number (1000..9999, chance of a blind guess 1/9000) and its digit tokens are the target:
the tokenizer's leading space token is moved into the question, so log p(value) sums over the digits only.
Retrieval = every digit is the argmax under teacher forcing, which is exactly "greedy decoding reproduces the value"
(greedy decoding walks the teacher-forced path for as long as it agrees with it).

Distance: ``N`` (or ``Nr``) eviction rounds = the shortest gap such that N rounds fire with the whole fact box among
the candidates (older than the buffer and the recency window) before the value's first token is predicted; ``Nt``
= N filler tokens. The schedule comes from simulating the engine's own `evictor.protocol.plan_round`, and every
instance records the rounds that actually fired.

Protocol: ``--protocol random_attention|epikv|valuediff|custom`` and the protocol flags (`evictor.protocol`) set the
trigger, buffer, recency window, budget scope and protection; the probes teacher-force every token, so sampling does
not apply. The resolved protocol is part of the run's identity and of every row, with the peak cache slots per head.

Each probe is a `ProbeConfig` subclass and a function that runs it into a `core.rundir.RunDir` (the directory is
claimed before the model loads, so a second run on it is refused at once) and returns a `ProbeResult` whose rows are
`core.schemas.ProbeRow` records. The directory holds ``instances.jsonl`` (one record per instance, and per policy in
the passcode test; resumable), ``summary.json`` / ``summary.csv`` (the rows) and ``config.json``.

Backends (`core.backend`): the unit of work is one batch of instances (and, in the passcode test, one policy); with
``--backend ray --workers N`` each worker loads the model once and the driver alone writes the records, in the order
a serial run writes them.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from core.backend import BackendConfig, add_backend_arguments
from core.cli import add_device_arguments, atomic_write, positive_int, seed_int, thread_count, write_json
from core.errors import UsageError
from core.records import read_jsonl
from core.schemas import ProbeRow, as_json
from evictor.protocol import (
    SAMPLING_FIELDS,
    EvictionConfig,
    Protocol,
    add_protocol_arguments,
    plan_round,
    protocol_overrides,
    resolve_protocol,
    sequence_budgets,
    token_flags,
)
from evictor.run import csv_value
from models.loading import KERNELS, load_model, model_limits
from models.registry import DEFAULT_MODEL, REGISTRY
from tasks.prompts import uses_chat_template
from validation.paired import bootstrap_means, percentile_interval
from validation.stats import wilson_interval

C = TypeVar("C", bound="ProbeConfig")

STUB_TEXT = "Read the following working and answer the question at the end."
VALUES = (1000, 10000)  # 4-digit values, drawn uniformly from [1000, 10000)
CHANCE = 1.0 / (VALUES[1] - VALUES[0])
# Two-letter variable names, minus words and symbols that real maths text uses as words (the filler check below
# also rejects any name that occurs in an instance's own filler).
_COMMON = {"am", "an", "as", "at", "be", "by", "do", "go", "he", "if", "in", "is", "it", "me", "my", "no", "of",
           "on", "or", "so", "to", "up", "us", "we", "ok", "pi", "ln", "lg", "dx", "dy", "dt", "cm", "km", "mm", "kg",
           "th", "st", "nd", "rd", "eq", "id", "ie", "eg", "vs", "mi", "ft", "hr", "cd", "ab", "bc", "ac"}
VARIABLES = tuple(a + b for a in string.ascii_lowercase for b in string.ascii_lowercase if a + b not in _COMMON)


# --- scripts and layout ------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class Distance:
    amount: int
    unit: str  # "rounds" | "tokens"

    def __str__(self) -> str:
        return f"{self.amount}{'r' if self.unit == 'rounds' else 't'}"


def parse_distance(text: str) -> Distance:
    """``"4"`` / ``"4r"`` -> 4 eviction rounds; ``"300t"`` -> 300 filler tokens."""
    match = re.fullmatch(r"\s*(\d+)\s*([rt]?)\s*", text)
    if not match:
        raise UsageError(f"--distance {text!r} must be N (eviction rounds), Nr (rounds) or Nt (filler tokens)")
    amount, unit = int(match.group(1)), "tokens" if match.group(2) == "t" else "rounds"
    if unit == "rounds" and amount < 1:
        raise UsageError(f"--distance {text!r}: at least 1 eviction round")
    return Distance(amount, unit)


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


# --- the eviction schedule ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """When one probe sequence evicts: the protocol, and the sequence's effective budget K, protection limit and
    recency window as `evictor.protocol.sequence_budgets` resolves them (the engine uses the same)."""

    config: EvictionConfig
    budget: int
    limit: int
    recency: int

    @classmethod
    def of(cls, config: EvictionConfig, protect: str, prompt_len: int,
           kept_recent: Callable[[int], int] | None = None) -> Schedule:
        """The schedule of a sequence with a `prompt_len`-token prompt; `kept_recent` is the policy's own
        `Policy.kept_recent` (the newest tokens it keeps, which widen the recency window)."""
        resolved = sequence_budgets([int(config.budget)], [prompt_len], protect, config, kept_recent=kept_recent)
        return cls(config, resolved.budgets[0], resolved.limits[0], resolved.recency[0])


def eviction_rounds(prompt_len: int, end: int, schedule: Schedule) -> list[int]:
    """``next_pos`` at every eviction round of one sequence whose positions ``0..end-1`` are fed (prompt in
    prefill blocks, then one token per step), replaying `evictor.protocol.plan_round` on host-side counts."""
    config = schedule.config
    fired, n = [], 0
    feeds = [(min(s + config.block, prompt_len), True) for s in range(0, prompt_len, config.block)]
    feeds += [(pos, False) for pos in range(prompt_len + 1, end + 1)]
    produced = 0
    for next_pos, boundary in feeds:
        n += next_pos - produced
        produced = next_pos
        plan = plan_round(slots=n, n_valid=[n], next_pos=[next_pos], limits=[schedule.limit],
                          budgets=[schedule.budget], buffer=config.buffer, recency=[schedule.recency],
                          trigger=config.trigger, boundary=boundary, interval=config.interval)
        if plan is not None:
            n = plan.n_keep[0]
            fired.append(next_pos)
    return fired


def fact_rounds(rounds: Sequence[int], layout: Layout, schedule: Schedule) -> int:
    """Rounds that had the whole fact box among their candidates and fired before the value's first token was
    predicted (a round after the forward of position p has ``next_pos = p + 1``; the value's first token is
    predicted by the forward of position ``value_start - 1``)."""
    unscored = schedule.config.buffer + schedule.recency
    return sum(1 for next_pos in rounds if layout.box_end <= next_pos - unscored and next_pos < layout.value_start)


def resolve_gap(layout: Layout, distance: Distance, schedule: Schedule) -> Layout:
    """The layout with its gap: `distance` tokens, or the shortest gap giving `distance` fact rounds."""
    if distance.unit == "tokens":
        return replace(layout, gap=distance.amount)

    def count(gap: int) -> int:
        trial = replace(layout, gap=gap)
        return fact_rounds(eviction_rounds(layout.stub, trial.value_start, schedule), trial, schedule)

    config = schedule.config
    # a round at most every `period` steps, each reaching back past the buffer and the recency window
    span = config.buffer + config.period + schedule.recency + 1
    high = schedule.budget + config.buffer + config.period + (distance.amount + 2) * span + layout.box
    if count(high) < distance.amount:
        raise UsageError(f"--distance {distance}: the protocol fires fewer than {distance.amount} rounds within "
                         f"{high} tokens (budget {schedule.budget}, buffer {config.buffer}, trigger {config.trigger})")
    low = 0
    while low < high:  # the count never decreases as the gap grows
        middle = (low + high) // 2
        if count(middle) >= distance.amount:
            high = middle
        else:
            low = middle + 1
    return replace(layout, gap=low)


def protocol_layout(layout: Layout, distance: Distance, config: EvictionConfig, protections: Sequence[str]) -> Layout:
    """The layout whose gap gives every one of `protections` (the policies' resolved protection) at least
    `distance`: under a budget that counts only scored tokens (EpiKV) the protection moves the schedule."""
    return max((resolve_gap(layout, distance, Schedule.of(config, protect, layout.stub)) for protect in protections),
               key=lambda resolved: resolved.gap)


# --- filler and instances ----------------------------------------------------------------------------------------
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
        tokens, ids, k = [], [], start
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


# --- running -----------------------------------------------------------------------------------------------------
@dataclass
class Forced:
    """Teacher-forced results of one batch, per row."""

    logprobs: np.ndarray  # [rows, value] log p of each digit token of the value
    argmax: np.ndarray  # [rows, value] the greedy token at each digit position
    resident: np.ndarray  # [rows, layers, kv_heads] every digit of the fact visible when the value is first predicted
    rounds: list[int]  # next_pos of every decode-time eviction round (all rows share the schedule)
    peak_slots: int  # the most cache slots a KV head held at any forward (all rows share it)


def resident_heads(cache, watch: Sequence[int], query: int) -> np.ndarray:
    """``[batch, layers, kv_heads]``: can a query at position `query` attend to every position of `watch` in that
    (layer, head)? The slots must be cached and, in a sliding-window layer, inside the window (the engine may leave
    out-of-window slots cached when the budget has room, but the mask hides them)."""
    wanted = torch.tensor(list(watch), dtype=torch.int32)
    held = []
    for layer in cache.layers:
        positions = layer.positions  # [batch, kv_head, slots]
        hit = (positions[..., None] == wanted.to(positions.device)).any(dim=2)  # [batch, kv_head, len(watch)]
        if layer.sliding_window is not None:
            hit &= (query - wanted.to(positions.device)) < layer.sliding_window
        held.append(hit.all(dim=-1))
    return torch.stack(held, dim=1).cpu().numpy()


def run_forced(engine, prompt: Sequence[int], bodies: Sequence[Sequence[int]], value_len: int,
               watch: Sequence[int], seed: int, progress: Callable[[int], None] | None = None) -> Forced:
    """Prefill `prompt` and teacher-force every row's body through the engine's decode path.

    All rows share the prompt and the body length (so they share positions and the eviction schedule). The last
    `value_len` body tokens are the value; the log-probs of those tokens are collected as they are forced.
    """
    body = torch.tensor([list(b) for b in bodies], dtype=torch.long)  # [rows, T]
    rows, length = body.shape
    first = length - value_len  # body index of the value's first token
    logprobs, argmax, rounds, resident = [], [], [], None
    with torch.inference_mode(), engine.session([list(prompt)] * rows, max_new_tokens=length, seed=seed) as session:
        session.prefill()
        session.begin_decode()
        for j in range(length - 1):  # the value's last token is never fed
            if j == first - 1:  # this forward predicts the value's first token: what does it attend to?
                resident = resident_heads(session.cache, watch, session.next_pos[0])
            before = session.rounds[0]
            logits = session.step(body[:, j])
            if session.rounds[0] > before:
                rounds.append(session.next_pos[0])
            if j >= first - 1:
                scores = logits.float().log_softmax(-1)  # [rows, vocab]
                target = body[:, j + 1].to(scores.device)
                logprobs.append(scores.gather(-1, target[:, None])[:, 0].cpu())
                argmax.append(scores.argmax(-1).cpu())
            if progress is not None:
                progress(1)
        session.end_decode()
        peak = max(session.cache_sizes[0])
    return Forced(torch.stack(logprobs, 1).numpy(), torch.stack(argmax, 1).numpy(), resident, rounds, peak)


@torch.inference_mode()
def dense_logprobs(lm, prompt: Sequence[int], bodies: Sequence[Sequence[int]], value_len: int,
                   watch: Sequence[int]) -> Forced:
    """The same rows without eviction (one ordinary forward each): the `full` reference. Every layer holds the
    fact, but a sliding-window layer sees it only while it is inside the window."""
    ids = torch.tensor([list(prompt) + list(b[:-1]) for b in bodies], dtype=torch.long, device=lm.device)
    logits = lm.model(input_ids=ids, logits_to_keep=value_len).logits.float().log_softmax(-1)  # [rows, value, vocab]
    target = torch.tensor([list(b[-value_len:]) for b in bodies], dtype=torch.long, device=logits.device)
    logprobs = logits.gather(-1, target[..., None])[..., 0].cpu().numpy()
    cfg = lm.config
    query = len(prompt) + len(bodies[0]) - value_len - 1  # the position whose forward predicts the first digit
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    visible = [t != "sliding_attention" or query - min(watch) < cfg.sliding_window for t in types]
    resident = np.broadcast_to(np.array(visible)[None, :, None],
                               (len(bodies), cfg.num_hidden_layers, cfg.num_key_value_heads)).copy()
    return Forced(logprobs, logits.argmax(-1).cpu().numpy(), resident, [], ids.shape[1])


def outcome(tokenizer, forced: Forced, row: int, target: Sequence[int]) -> dict[str, Any]:
    """One row's result: log p(value), per-token log-probs, retrieval, the greedy continuation up to and including
    its first wrong token (exactly what greedy decoding would have produced), and the peak cache slots per head."""
    picks = [int(t) for t in forced.argmax[row]]
    agree = [p == t for p, t in zip(picks, target)]
    greedy = picks if all(agree) else picks[: agree.index(False) + 1]
    return {
        "lp": float(forced.logprobs[row].sum()),
        "token_lp": [round(float(x), 5) for x in forced.logprobs[row]],
        "retrieved": all(agree),
        "greedy": tokenizer.decode(greedy),
        "resident": float(forced.resident[row].mean()),
        "resident_heads": forced.resident[row].astype(int).tolist(),
        "peak_slots": forced.peak_slots,
    }


def chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(s, min(n, s + size))) for s in range(0, n, size)]


# --- workers ------------------------------------------------------------------------------------------------------
SERIAL = BackendConfig()  # the default backend: every unit in this process
@dataclass
class ProbeWorker:
    """What runs a probe's units: the loaded model, and whether to show a per-token bar (only the driver's own
    worker has a terminal)."""

    lm: Any
    progress: bool = False

    def decode_bar(self, steps: int, desc: str):
        return tqdm(total=steps, unit="tok", leave=False, file=sys.stderr, desc=desc, disable=not self.progress)


def load_probe_worker(config: ProbeConfig) -> ProbeWorker:
    """A Ray worker's `ProbeWorker`: the probe's model, loaded once."""
    return ProbeWorker(config.load_model())


# --- statistics --------------------------------------------------------------------------------------------------
def graded_recall(lp, lp_kept, lp_del) -> float:
    """Random Attention notes §3.3: R = sum(LP - LP_del) / sum(LP_kept - LP_del) over instances.

    1 = as good as keeping the fact everywhere, 0 = as good as deleting it; NaN when keeping does not beat deleting
    on aggregate (the denominator is <= 0 and R has no meaning).
    """
    lp, lp_kept, lp_del = (np.asarray(x, dtype=float) for x in (lp, lp_kept, lp_del))
    den = float(np.sum(lp_kept - lp_del))
    return float(np.sum(lp - lp_del)) / den if den > 0 else math.nan


def ratio_bootstrap(num, den, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Replicates of sum(num) / sum(den), resampling instances (pairs kept together) with replacement; NaN where
    a replicate's denominator is <= 0."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    idx = rng.integers(0, num.size, size=(n_boot, num.size))
    top, bottom = num[idx].sum(axis=1), den[idx].sum(axis=1)
    return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), np.nan)


def interval(replicates: np.ndarray, level: float) -> tuple[float, float]:
    finite = replicates[np.isfinite(replicates)]
    return percentile_interval(finite, level) if finite.size else (math.nan, math.nan)


def retrieval_statistics(retrieved, lp, n_boot: int, level: float, seed: int, kept=None,
                         deleted=None) -> dict[str, float | int]:
    """The statistics of one condition, keyed by their `ProbeRow` fields: retrieval with its Wilson interval (one
    0/1 trial per instance), mean log p with an instance-bootstrap interval and, given the kept / deleted references
    of the same instances, graded recall R with an instance-clustered bootstrap interval."""
    retrieved, lp = np.asarray(retrieved, dtype=float), np.asarray(lp, dtype=float)
    n = lp.size
    rng = np.random.default_rng(seed)
    lo, hi = wilson_interval(float(retrieved.sum()), n, level)
    lp_lo, lp_hi = interval(bootstrap_means(lp, n_boot, rng), level)
    row = {"n": n, "retrieval": float(retrieved.mean()), "retrieval_lo": lo, "retrieval_hi": hi,
           "mean_lp": float(lp.mean()), "lp_lo": lp_lo, "lp_hi": lp_hi}
    if kept is not None:
        kept, deleted = np.asarray(kept, dtype=float), np.asarray(deleted, dtype=float)
        r_lo, r_hi = interval(ratio_bootstrap(lp - deleted, kept - deleted, n_boot, rng), level)
        row.update({"R": graded_recall(lp, kept, deleted), "R_lo": r_lo, "R_hi": r_hi})
    return row


# --- configuration ------------------------------------------------------------------------------------------------
# The protocol settings a probe takes from the command line: everything `evictor.protocol` presets but the sampling
# (every token is teacher-forced, so nothing is sampled) and what the probe sets itself (its --budget and --seed).
_NOT_PROBE_SETTINGS = ("budget", "seed", "keep_log", *SAMPLING_FIELDS)


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """The settings both probes share; each is the command-line flag of the same name (``data_file``:
    ``--data-file``), except `protocol_settings`: the protocol flags given explicitly (``--buffer 8`` ->
    ``{"buffer": 8}``), which override the `protocol` preset."""

    model: str = DEFAULT_MODEL
    n: int = 20  # instances; a finished run may be resumed with more
    seed: int = 0
    budget: int = 256  # K per KV head in tokens, prompt included
    protocol: str = "custom"  # its schedule is Random Attention's: an interval trigger with a buffer of 64
    protocol_settings: dict[str, Any] = field(default_factory=dict)
    lead: int = 32  # filler tokens before the fact
    box: int = 16  # tokens of the fact box
    filler: str | None = None  # a generations.jsonl (or its run directory) to cut filler from
    dataset: str = "math500"  # whose reference solutions are the filler when `filler` is None
    data_file: str | None = None
    batch_size: int = 8
    n_boot: int = 4000
    level: float = 0.95
    kernel: str | None = None
    device: str | None = None
    dtype: str | None = None

    def check(self) -> None:
        """Refuse settings that are wrong before anything is loaded or written."""
        for name in ("n", "budget", "lead", "box", "batch_size", "n_boot"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not 0 < self.level < 1:
            raise UsageError(f"--level must be in (0, 1), got {self.level}")
        if self.data_file is not None and not Path(self.data_file).expanduser().is_file():
            raise UsageError(f"--data-file {self.data_file!r} does not exist")
        if self.filler is None:
            check_filler_dataset(self.dataset)
        self.check_limits()
        sampling = [key for key in SAMPLING_FIELDS if self.protocol_settings.get(key) is not None]
        if sampling:
            flags = " and ".join("--" + key.replace("_", "-") for key in sampling)
            raise UsageError(f"{flags}: the probes teacher-force every token, so nothing is sampled; leave "
                             f"{'them' if len(sampling) > 1 else 'it'} out")
        self.resolved()

    def check_limits(self) -> None:
        """Refuse token counts beyond the model's context (read from its config, before the weights load): no
        instance could hold them, so the probe would run for nothing or fail deep in the model."""
        limits = model_limits(self.model)
        limits.check_flags({"--budget": self.budget, "--lead": self.lead, "--box": self.box,
                            **token_flags(self.protocol_settings)})

    def resolved(self) -> Protocol:
        """The protocol preset with the explicit settings, at this probe's budget and seed."""
        settings = {k: v for k, v in self.protocol_settings.items() if k not in _NOT_PROBE_SETTINGS}
        protocol = resolve_protocol(self.protocol, settings)
        return replace(protocol, config=replace(protocol.config, budget=self.budget, seed=self.seed))

    def eviction(self) -> EvictionConfig:
        return self.resolved().config

    def protocol_record(self) -> dict[str, Any]:
        """The resolved protocol as every probe record and row states it (no sampling: nothing is sampled)."""
        return {k: v for k, v in self.resolved().to_dict().items()
                if k not in ("seed", "keep_log", *SAMPLING_FIELDS)}

    def identity(self) -> dict[str, Any]:
        """The shared settings that change what an instance record holds (a resumed run must match them); the
        instance count, the bootstrap, the device and the backend do not."""
        return {"model": self.model, "seed": self.seed, "batch_size": self.batch_size, "lead": self.lead,
                "box": self.box, "dtype": self.dtype, "kernel": self.kernel, "protocol": self.protocol_record()}

    def load_model(self):
        return load_model(self.model, device=self.device, dtype=self.dtype, attn_implementation=self.kernel)

    def out_parts(self) -> list[str]:
        """The protocol part of the default output directory's name."""
        return [self.protocol, f"K{self.budget}", f"r{self.eviction().buffer}"]


def config_from_arguments(cls: type[C], args: argparse.Namespace, **parsed: Any) -> C:
    """A probe's config from its parsed command line: every field is the flag of the same name, except those given
    in `parsed` (flags the command line spells differently) and the protocol settings given explicitly."""
    flags = vars(args)
    settings = {k: v for k, v in protocol_overrides(flags).items() if v is not None and k not in ("budget", "seed")}
    return cls(**{f.name: flags[f.name] for f in fields(cls) if f.name not in parsed and f.name in flags},
               protocol_settings=settings, **parsed)


@dataclass(frozen=True)
class ProbeResult:
    """A finished probe run: one `ProbeRow` per condition, the layout every instance shared, and the run-level
    facts written beside the rows in ``summary.json``."""

    rows: list[ProbeRow]
    layout: Layout
    out: Path
    context: dict[str, Any]


# --- output ------------------------------------------------------------------------------------------------------
def default_out(probe: str, model: str, *parts: object) -> Path:
    return Path("runs") / probe / "-".join([Path(model).name, *map(str, parts)])


def write_summary(out: Path, rows: list[ProbeRow], context: dict[str, Any]) -> None:
    """``summary.json`` (the rows and `context`) and ``summary.csv`` (the rows), both written atomically."""
    records = as_json(rows)
    write_json(out / "summary.json", {"rows": records, **context})
    columns = list(dict.fromkeys(k for record in records for k in record))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows({k: csv_value(v) for k, v in record.items()} for record in records)
    with atomic_write(out / "summary.csv") as handle:
        handle.write(buffer.getvalue())


def format_table(rows: list[ProbeRow], columns: Sequence[tuple[str, str, int]], graded: bool) -> str:
    """Rows as a fixed-width table: the label `columns` ((key, header, width), the first left-aligned), then
    n, retrieval and its interval, mean LP and its interval, R and its interval when `graded`, and held."""

    def num(value, spec):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    def ci(row, lo, hi, spec):
        return "-" if row.get(lo) is None else f"[{num(row[lo], spec)}, {num(row[hi], spec)}]"

    stats = [("n", 4, lambda r: str(r["n"])), ("retr", 6, lambda r: num(r["retrieval"], ".3f")),
             ("retr CI", 15, lambda r: ci(r, "retrieval_lo", "retrieval_hi", ".3f")),
             ("mean LP", 8, lambda r: num(r["mean_lp"], ".3f")),
             ("LP CI", 17, lambda r: ci(r, "lp_lo", "lp_hi", ".2f"))]
    if graded:
        stats += [("R", 6, lambda r: num(r.get("R"), ".3f")), ("R CI", 15, lambda r: ci(r, "R_lo", "R_hi", ".2f"))]
    stats.append(("held", 5, lambda r: num(r.get("held"), ".2f")))

    def line(labels: list[str], values: list[str]) -> str:
        (_, _, first), *rest = columns
        parts = [f"{labels[0][:first]:<{first}}"] + [f"{v:>{w}}" for v, (_, _, w) in zip(labels[1:], rest)]
        return " ".join(parts + [f"{v:>{w}}" for v, (_, w, _) in zip(values, stats)])

    records = as_json(rows)
    head = line([h for _, h, _ in columns], [h for h, _, _ in stats])
    body = [line(["-" if r.get(k) is None else str(r[k]) for k, _, _ in columns], [f(r) for _, _, f in stats])
            for r in records]
    return "\n".join([head, "-" * len(head), *body])


def layout_record(layout: Layout) -> dict[str, int]:
    return {**asdict(layout), **layout.positions()}


# --- command line ------------------------------------------------------------------------------------------------
def add_common_arguments(p: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    p.add_argument("--model", default=default_model, help=f"registry name ({', '.join(sorted(REGISTRY))}), local HF "
                   f"directory, .gguf file or hub id (default: {default_model})")
    p.add_argument("--n", type=positive_int, default=20,
                   help="instances; rerunning a finished run with a larger --n adds instances (default: 20)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="draws each instance's variable, value and filler start, and seeds the eviction (default: 0)")
    p.add_argument("--budget", type=positive_int, default=256,
                   help="K per KV head in tokens; Random Attention's 1024 scaled to a 135M model (default: 256)")
    add_protocol_arguments(p, sampling=False)
    p.add_argument("--lead", type=positive_int, default=32, help="filler tokens before the fact (default: 32)")
    p.add_argument("--box", type=positive_int, default=16,
                   help="tokens of the fact box: the fact sentence, padded with the following filler (default: 16)")
    p.add_argument("--filler", default=None,
                   help="a generations.jsonl (or its run directory) of the model's dense traces to cut filler from "
                   "(default: the --dataset reference solutions)")
    p.add_argument("--dataset", default="math500", help="benchmark whose solutions are the filler (default: math500)")
    p.add_argument("--data-file", default=None, help="read the --dataset problems from this JSONL")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="instances decoded together; the rows of a batch share the eviction draws' generator, so "
                   "results are reproducible for the same --n and --batch-size (default: 8)")
    p.add_argument("--n-boot", type=positive_int, default=4000, help="bootstrap replicates (default: 4000)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals, in (0, 1) "
                   "(default: 0.95)")
    p.add_argument("--kernel", default=None, choices=KERNELS, help="attention kernel (default: sdpa, FA2 on CUDA)")
    add_device_arguments(p)
    p.add_argument("--threads", type=thread_count, default=None,
                   help="CPU threads for torch (default: torch's choice); 1 is fastest on a CPU shared with other jobs")
    add_backend_arguments(p)
    p.add_argument("--out", default=None, help="output directory; rerun the same command to resume it "
                   "(default: runs/<probe>/<model>-<settings>)")
