"""The eviction protocol: every knob, its paper default, and the one place where the budget is defined.

Budget semantics (per sequence, per layer, per KV head; all counts are cache slots = tokens)
------------------------------------------------------------------------------------------
At an eviction round the resident tokens of one (sequence, layer, KV head) split, oldest to newest, into

    [ protected | candidates | recency window w | buffer r ]

- **protected**: positions below the protection limit -- the whole prompt (``protect="prompt"``), the first
  ``n_sinks`` tokens (``"sinks"``) or nothing (``"none"``). Never scored, never evicted.
- **buffer** ``r``: the ``r`` newest tokens. Never scored, never evicted, and *not* counted in the budget (Random
  Attention §3.1: the cache returns to ``K + r`` entries after each round).
- **recency window** ``w`` (default 0): the ``w`` tokens just older than the buffer. Never scored, never evicted,
  counted in the budget (EpiKV App. 9 keeps a trailing recency window of ``min(128, K/4)`` inside ``K``). With
  ``recency_share`` set, each sequence has its own window ``w_b = min(recency, floor(recency_share * K_b))`` from its
  own budget ``K_b`` as given (before `budget_scope` is applied), so a fractional budget, which resolves to a
  different K for every problem, gives every problem EpiKV's ``min(128, K/4)``; `sequence_budgets` returns the
  windows and `plan_round` takes one per sequence. A policy that itself always keeps its newest tokens
  (`scoring.policy.Policy.kept_recent`: SnapKV's and R-KV's observation windows, H2O's recent share) widens the
  window to cover them whatever the protocol: ``w_b = max(w_b, kept - r)``.
- **candidates**: everything else. The policy scores them and the top ``K - |protected| - w`` survive.

So after a round the cache holds ``K + r`` slots: ``K`` = protected + recency window + scored survivors, plus the
buffer. With ``budget_scope="trace"`` the budget counts only the scored survivors (EpiKV's footnote: "applies its
budget to the remaining positions"), i.e. the effective ``K`` becomes ``K + |protected| + w``. With
``budget_scope="with_buffer"`` K counts the buffer too (effective ``K - r``, so a round leaves ``K`` slots), which
is how Random Attention's released engine counts its ``token_budget``.

If the protected part plus the recency window does not fit in ``K`` (a long prompt), the run fails with a clear
error unless ``on_long_prompt`` chooses a fallback explicitly: ``"expand"`` raises that sequence's budget to
``|prompt| + w`` (its trace then keeps only the window and the buffer), ``"sinks"`` protects only the first
``n_sinks`` tokens of that sequence.

Triggers (when a round fires for one sequence; ``n`` = its resident tokens after the forward just run):

- ``"interval"`` (Random Attention): once ``n >= K + 2r``, i.e. every ``r`` decode steps once past ``K + r``; the
  cache oscillates between ``K + r`` and ``K + 2r``. Needs ``r >= 1``. With ``interval = I`` set the period is I
  instead of r: a round fires once ``n >= K + r + I`` (R-KV's staging buffer: I = 128 generated tokens, all of them
  scored, r = 0).
- ``"step"`` (EpiKV, ValueDiff): whenever ``n > K + r``; the cache stays at ``K + r`` (``K + r + 1`` while attending).
- Prefill blocks (ValueDiff §2.2, both triggers): the prompt is processed in blocks of ``B`` tokens and every block
  boundary (and the end of the prefill) evicts down to ``K + r`` whenever ``n > K + r``, so the prefill peak is
  ``K + r + B``. ``B >= prompt length`` is one ordinary prefill.

Rounds run after a forward, for every layer, on the tokens that forward appended as well (the newest are in the
buffer). A sequence of a batch that does not trigger keeps everything.

Budgets as asked (`Budget`, parsed by `parse_budgets`): K tokens (a whole number >= 2), or a fraction ``f`` in
(0, 1] of ``L``, the length of the reference generation: the dense (``--policy full``) trace length of the same
problem when a reference run is given, otherwise ``max_new_tokens``. A fraction resolves per sequence
(`Budget.resolve`) to ``ceil(f * L)`` tokens, so ``f = 1`` keeps the whole reference length. The prompt is not part
of ``L`` (compression factor ~ 1/f of the generated trace, as Random Attention reports it) but protected prompt
tokens still count inside ``K``. Records, summaries and identities write a budget as a number (`Budget.to_json`):
tokens as an integer (``192``), a fraction as a float (``0.5``, ``1.0``).

Per-paper presets (`PRESETS`, `resolve_protocol`): ``random_attention``, ``epikv``, ``valuediff`` set the trigger,
buffer, recency window, budget scope, prefill blocks, protection and sampling as each paper states them;
``custom`` sets nothing beyond the `EvictionConfig` defaults. Explicit settings override a preset; an explicit
``recency`` without ``recency_share`` is a fixed window (EpiKV's preset sets ``recency=128, recency_share=0.25``, a
window of ``min(128, floor(K_b / 4))`` per problem, whatever the budget, fractional or not).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

from core.cli import distinct
from core.errors import UsageError, unknown_choice
from tasks.sampling import check_sampling

TRIGGERS = ("interval", "step")
PROTECTIONS = ("prompt", "sinks", "none")
ON_LONG_PROMPT = ("error", "expand", "sinks")
BUDGET_SCOPES = ("all", "trace", "with_buffer")

DEFAULT_BUFFER = 64  # Random Attention's r
DEFAULT_BLOCK = 128  # ValueDiff's B
DEFAULT_SINKS = 4  # StreamingLLM
WHOLE_PROMPT = 1 << 30  # a prefill block longer than any prompt: one ordinary prefill, no eviction inside it
TOKENS, FRACTION = "tokens", "fraction"
BUDGET_UNITS = (TOKENS, FRACTION)
NOT_A_BUDGET = ("neither a fraction in (0, 1] of the reference length nor a whole number of tokens >= 2; e.g. "
                "0.25,0.5 or 256,1024")


@dataclass(frozen=True, order=True)
class Budget:
    """A cache budget as asked: `amount` tokens (a whole number >= 2), or a fraction `amount` in (0, 1] of the
    reference length L, whose K differs per sequence (`resolve`). Anything else is a `UsageError`.

    Ordered by amount, so every fraction comes before every token budget. Formats as its amount: ``f"{b:g}"`` is
    ``0.5`` or ``192``, as cell names write it.
    """

    amount: int | float
    unit: str

    def __post_init__(self) -> None:
        if self.unit not in BUDGET_UNITS:
            raise unknown_choice("budget unit", str(self.unit), BUDGET_UNITS)
        amount = self.amount
        real = isinstance(amount, numbers.Real) and not isinstance(amount, bool)
        whole = real and (isinstance(amount, numbers.Integral) or float(amount).is_integer())
        if self.unit == FRACTION and real and 0 < amount <= 1:
            object.__setattr__(self, "amount", float(amount))
        elif self.unit == TOKENS and whole and amount >= 2:
            object.__setattr__(self, "amount", int(amount))
        else:
            raise UsageError(f"budget {amount!r} ({self.unit}) is {NOT_A_BUDGET}")

    @property
    def tokens(self) -> int | None:
        """K in tokens when it is the same for every sequence; None for a fraction."""
        if self.unit != TOKENS:
            return None
        assert isinstance(self.amount, int)  # __post_init__ stores a token budget as an int
        return self.amount

    def resolve(self, reference_length: int) -> int:
        """K in tokens of a sequence whose reference length is `reference_length`: a token budget as is, a fraction
        ``f`` as ``ceil(f * reference_length)`` (at least 1)."""
        if (tokens := self.tokens) is not None:
            return tokens
        return max(1, math.ceil(round(self.amount * reference_length, 6)))  # round: 0.3 * 10 must give 3, not 4

    def to_json(self) -> int | float:
        """The budget as records, summaries and identities write it: an int of tokens or a float fraction."""
        return self.amount

    def __str__(self) -> str:
        return str(self.amount)

    def __format__(self, spec: str) -> str:
        return format(self.amount, spec)


def parse_budget(text: str, flag: str = "--budget") -> Budget:
    """One budget as written on a command line: a number in (0, 1] is a fraction of the reference length (so ``1``
    is the whole of it, not one token), a whole number >= 2 that many tokens; anything else is a `UsageError` naming
    `flag` and the valid forms."""
    part = text.strip()
    try:
        value = float(part)
    except ValueError:
        raise UsageError(f"{flag} {part!r} is not a number; give fractions in (0, 1] of the reference length (e.g. "
                         "0.25,0.5) or token budgets (e.g. 256,1024)") from None
    exact = int(part) if part.isdigit() else value  # a long integer as written, not rounded through a float
    try:
        return Budget(exact, FRACTION if value <= 1 else TOKENS)
    except UsageError:
        raise UsageError(f"{flag} {part!r} is {NOT_A_BUDGET}") from None


def parse_budgets(text: str, flag: str = "--budget") -> tuple[Budget, ...]:
    """A comma list of budgets (`parse_budget`) in the order given; a budget given twice is refused (each budget is
    one cell of a sweep)."""
    budgets = tuple(parse_budget(part, flag) for part in str(text).split(","))
    distinct(flag, text, budgets)
    return budgets


@dataclass(frozen=True)
class EvictionConfig:
    """Protocol knobs with the papers' defaults (see the module docstring for the exact budget semantics).

    `budget` is K in tokens for every sequence, or None when each sequence is given its own (a fraction's K differs
    per problem: `Budget.resolve`). `protect=None` takes the policy's `default_protection`; `query_window=None` takes
    the policy's `Needs.queries_window` (0 = every query since entry, exact under every kernel).
    """

    budget: int | None = 1024
    buffer: int = DEFAULT_BUFFER
    interval: int | None = None  # decode steps between rounds of the interval trigger; None: the buffer r
    block: int = DEFAULT_BLOCK
    trigger: str = "interval"
    protect: str | None = None
    n_sinks: int = DEFAULT_SINKS
    recency: int = 0
    recency_share: float | None = None  # per-sequence window min(recency, floor(recency_share * K_b)); None: recency
    budget_scope: str = "all"
    on_long_prompt: str = "error"
    shared: bool = False  # force one keep set per layer (mean of the policy's per-head scores)
    query_window: int | None = None
    seed: int = 0
    keep_log: bool = False

    def __post_init__(self) -> None:
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise UsageError(f"budget must be a positive whole number of tokens K (a fraction resolves per "
                             f"sequence: Budget.resolve), got {self.budget!r}")
        for name in ("buffer", "recency", "n_sinks"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block < 1:
            raise UsageError(f"block must be >= 1, got {self.block}")
        if self.trigger not in TRIGGERS:
            raise unknown_choice("trigger", self.trigger, TRIGGERS)
        if self.interval is not None and self.interval < 1:
            raise UsageError(f"interval must be >= 1, got {self.interval}")
        if self.trigger == "interval" and self.period < 1:
            raise UsageError(
                "trigger 'interval' evicts every `interval` steps (default: the buffer), so it needs interval or "
                "buffer >= 1 (or use --trigger step)"
            )
        if self.protect is not None and self.protect not in PROTECTIONS:
            raise unknown_choice("protection", self.protect, PROTECTIONS)
        if self.on_long_prompt not in ON_LONG_PROMPT:
            raise unknown_choice("long-prompt fallback", self.on_long_prompt, ON_LONG_PROMPT)
        if self.budget_scope not in BUDGET_SCOPES:
            raise unknown_choice("budget scope", self.budget_scope, BUDGET_SCOPES)
        if self.recency_share is not None and not 0 < self.recency_share <= 1:
            raise UsageError(f"recency_share must be in (0, 1], got {self.recency_share}")
        if self.query_window is not None and self.query_window < 1:
            raise UsageError(f"query_window must be >= 1, got {self.query_window}")

    @property
    def period(self) -> int:
        """Decode steps between two rounds of the interval trigger: `interval`, or the buffer r when unset."""
        return self.buffer if self.interval is None else self.interval

    def to_dict(self) -> dict:
        return asdict(self)


def protection_limit(protect: str, prompt_len: int, n_sinks: int) -> int:
    """Positions below this limit are protected."""
    return {"prompt": prompt_len, "sinks": n_sinks, "none": 0}[protect]


def recency_window(config: EvictionConfig, budget: int) -> int:
    """The recency window of a sequence whose budget (as given, in tokens) is `budget`."""
    if config.recency_share is None:
        return config.recency
    return min(config.recency, math.floor(round(config.recency_share * budget, 6)))


class SequenceBudgets(NamedTuple):
    """Per sequence: the effective budget K_b, the protection limit and the recency window w_b."""

    budgets: list[int]
    limits: list[int]
    recency: list[int]


def sequence_budgets(
    budgets: Sequence[int],
    prompt_lens: Sequence[int],
    protect: str,
    config: EvictionConfig,
    names: Sequence[str] | None = None,
    kept_recent: Callable[[int], int] | None = None,
) -> SequenceBudgets:
    """Per-sequence effective budget K_b, protection limit and recency window (`recency_window`), applying
    `budget_scope` and `on_long_prompt`.

    `kept_recent` (a policy's `Policy.kept_recent`) maps a budget as given to the newest tokens the policy itself
    always keeps (its observation window): the window becomes at least that many minus the buffer (which holds the
    newest already), so the policy's own protection holds under every protocol, counted inside K like the window.

    Raises `UsageError` naming the sequence when a protected prompt plus the recency window exceeds its budget and no
    fallback was chosen.
    """
    out = SequenceBudgets([], [], [])
    for index, (budget, prompt_len) in enumerate(zip(budgets, prompt_lens)):
        who = names[index] if names is not None else f"sequence {index}"
        limit = protection_limit(protect, prompt_len, config.n_sinks)
        recency = recency_window(config, budget)
        if kept_recent is not None:
            recency = max(recency, kept_recent(budget) - config.buffer)
        if config.budget_scope == "trace":
            budget = budget + limit + recency
        elif config.budget_scope == "with_buffer":
            if budget <= config.buffer:
                raise UsageError(f"{who}: budget {budget} must exceed the buffer {config.buffer} it includes")
            budget -= config.buffer
        if config.budget_scope != "trace" and limit + recency > budget:
            if config.on_long_prompt == "error":
                raise UsageError(
                    f"{who}: {limit} protected tokens ({protect}) + recency window {recency} exceed "
                    f"the budget {budget}; raise --budget, count only the trace with --budget-scope trace, use "
                    f"--protect sinks|none, or choose a fallback with "
                    f"--on-long-prompt expand|sinks"
                )
            if config.on_long_prompt == "expand":
                budget = limit + recency
            else:
                limit = config.n_sinks
                if limit + recency > budget:
                    raise UsageError(
                        f"{who}: even {limit} sinks + recency window {recency} exceed the budget {budget}"
                    )
        out.budgets.append(budget)
        out.limits.append(limit)
        out.recency.append(recency)
    return out


@dataclass(frozen=True)
class RoundPlan:
    """One eviction round, decided on host-side counts only (no device sync).

    Per sequence b: `n_keep[b]` slots survive; its candidates occupy slots ``[cand_start[b], cand_end[b])`` (the same
    range in every layer and head, because valid slots are right-aligned and sorted by position); `keep_cand[b]` of
    them survive. `slots` is the slot count after the round (max of `n_keep`); `span` the candidate slice
    ``[lo, hi)`` covering every triggered sequence.
    """

    triggered: tuple[bool, ...]
    n_keep: tuple[int, ...]
    cand_start: tuple[int, ...]
    cand_end: tuple[int, ...]
    keep_cand: tuple[int, ...]
    slots: int
    span: tuple[int, int]


def plan_round(
    *,
    slots: int,
    n_valid: Sequence[int],
    next_pos: Sequence[int],
    limits: Sequence[int],
    budgets: Sequence[int],
    buffer: int,
    recency: Sequence[int],
    trigger: str,
    boundary: bool,
    interval: int | None = None,
) -> RoundPlan | None:
    """Which sequences evict now and how many slots each keeps; None when no sequence evicts.

    `slots`: current slot count (valid slots of sequence b are the last ``n_valid[b]``); `next_pos[b]`: positions
    ``0..next_pos[b]-1`` have been produced; `limits[b]`: protection limit; `budgets[b]`: effective K_b;
    `recency[b]`: recency window w_b; `boundary`: a prefill block boundary (evicts whenever over ``K + r``
    regardless of the trigger); `interval`: the interval trigger's period (None: the buffer).
    """
    period = buffer if interval is None else interval
    triggered, n_keep, starts, ends, keeps = [], [], [], [], []
    for n, produced, limit, budget, window in zip(n_valid, next_pos, limits, budgets, recency, strict=True):
        n_prot = min(limit, produced)
        n_buf = min(buffer, n - n_prot)
        n_rec = min(window, n - n_prot - n_buf)
        n_cand = n - n_prot - n_buf - n_rec
        keep_cand = max(0, budget - n_prot - window)
        if boundary or trigger == "step":
            fires = n > budget + buffer
        else:
            fires = n >= budget + buffer + period
        fires = fires and n_cand > keep_cand
        start = slots - n + n_prot
        triggered.append(fires)
        n_keep.append(n - (n_cand - keep_cand) if fires else n)
        starts.append(start)
        ends.append(start + n_cand)
        keeps.append(keep_cand if fires else n_cand)
    if not any(triggered):
        return None
    lo = min(s for s, t in zip(starts, triggered) if t)
    hi = max(e for e, t in zip(ends, triggered) if t)
    return RoundPlan(tuple(triggered), tuple(n_keep), tuple(starts), tuple(ends), tuple(keeps), max(n_keep), (lo, hi))


# --- per-paper presets ---------------------------------------------------------------------------------------------

SAMPLING_FIELDS = ("temperature", "top_p")


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: greedy at temperature 0, else softmax at `temperature` restricted to the `top_p`
    nucleus (`tasks.generation.pick_tokens`)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        try:
            check_sampling(self.temperature, self.top_p)
        except ValueError as err:
            raise UsageError(str(err)) from None


@dataclass(frozen=True)
class Preset:
    """One paper's protocol: `settings` are `EvictionConfig` fields (``protect`` left to each policy's own default,
    which encodes the per-method rule the paper reports), `source` the passages it follows."""

    name: str
    summary: str
    source: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    sampling: Sampling = Sampling()


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "random_attention",
            "evict every r = 64 decode steps once past K + r; the r newest tokens unscored, on top of K; no recency "
            "window; whole-prompt prefill; each policy's own protection; T = 0.6, top-p 0.95",
            "Random Attention notes §3.1 (periodic eviction: 'every r decode steps ... the cache returns to K + r', "
            "r = 64 throughout) and §4 general setup (released sampling settings: temperature 0.6 for Qwen3, "
            "top-p 0.95; prompt protection only in Random Attention and TriAttention in the main grid). Its released "
            "engine counts the buffer inside token_budget: budget_scope='with_buffer' reproduces that.",
            {"trigger": "interval", "buffer": DEFAULT_BUFFER, "recency": 0, "budget_scope": "all",
             "block": WHOLE_PROMPT},
            Sampling(temperature=0.6, top_p=0.95),
        ),
        Preset(
            "epikv",
            "evict at every step; prompt kept (prefill policies) and a recency window of min(128, K/4) unscored, "
            "K counting only the remaining positions; no buffer; whole-prompt prefill; greedy",
            "EpiKV §3.1 ('at each step a policy scores the cached positions and retains the K highest'), §3.3 and "
            "footnote 1 ('preserves the prompt ... and a trailing recency window, and applies its budget to the "
            "remaining positions'), App. 9 ('Recency is min(128, K/4) throughout'; H2O keeps sinks, RaaS and the "
            "hidden-state/KV families the prefill), §3.5 ('Generation is greedy throughout').",
            {"trigger": "step", "buffer": 0, "recency": 128, "recency_share": 0.25, "budget_scope": "trace",
             "block": WHOLE_PROMPT},
            Sampling(),
        ),
        Preset(
            "valuediff",
            "evict whenever the cache exceeds N (top-N at every step); no buffer, no recency window; block prompt "
            "processing with B = 128; each policy's own protection (none for the geometric scores); greedy",
            "ValueDiff §2.1 eq. 2 (top-N whenever the cache exceeds N), §2.2 eq. 3 (eviction at every block "
            "boundary), §4 protocol ('block prompt processing ... chunk size of B = 128 combined with decode-time "
            "token eviction'). Sampling: App. F samples k = 5 at each model card's temperature / top-p (greedy for "
            "Qwen3.5); kvscope's models carry no such card, so the preset is greedy and a card's values are given "
            "explicitly.",
            {"trigger": "step", "buffer": 0, "recency": 0, "budget_scope": "all", "block": DEFAULT_BLOCK},
            Sampling(),
        ),
        Preset(
            "r_kv",
            "evict every 128 decode steps once the cache reaches K + 128 (R-KV's staging buffer, scored: no unscored "
            "buffer); no recency window; whole-prompt prefill, compressed once when over K; each policy's own "
            "protection (R-KV keeps its 8 observation tokens); T = 0.6, top-p 0.95",
            "Zefan-Cai/R-KV README (B_buffer = 128 staging buffer, alpha = 8 observation tokens; temperature 0.6, "
            "top-p 0.95) and rkv/modeling.py (divide_length 128: update_kv compresses to the budget every 128 "
            "tokens, the prompt at prefill when it exceeds the budget). R-KV compresses when the sequence length is "
            "a multiple of 128; here when the cache reaches K + 128 (the same period, another phase).",
            {"trigger": "interval", "interval": 128, "buffer": 0, "recency": 0, "budget_scope": "all",
             "block": WHOLE_PROMPT},
            Sampling(temperature=0.6, top_p=0.95),
        ),
        Preset(
            "custom",
            "nothing preset: the EvictionConfig defaults and explicit settings only; greedy",
            "kvscope's EvictionConfig defaults (interval trigger, r = 64, B = 128, no recency window).",
        ),
    )
}
PROTOCOLS = tuple(PRESETS)
OVERRIDABLE = tuple(f.name for f in fields(EvictionConfig)) + SAMPLING_FIELDS


@dataclass(frozen=True)
class Protocol:
    """A resolved protocol: the eviction settings, the sampling, the preset they came from and which settings were
    given explicitly (they win over the preset)."""

    preset: str
    config: EvictionConfig
    sampling: Sampling
    explicit: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.preset, **self.config.to_dict(), **asdict(self.sampling),
                "explicit": list(self.explicit)}


def resolve_protocol(preset: str, overrides: Mapping[str, Any] | None = None) -> Protocol:
    """(preset name, explicit settings) -> `Protocol`. `overrides` holds `EvictionConfig` fields plus ``temperature``
    and ``top_p``; None values mean "not given" (so a CLI can pass its parsed flags whose default is None)."""
    if preset not in PRESETS:
        raise unknown_choice("protocol", preset, PROTOCOLS)
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    for key in given:
        if key not in OVERRIDABLE:
            raise unknown_choice("protocol setting", key, OVERRIDABLE)
    chosen = PRESETS[preset]
    settings = {**chosen.settings, **{k: v for k, v in given.items() if k not in SAMPLING_FIELDS}}
    if "recency" in given and "recency_share" not in given:
        settings["recency_share"] = None  # an explicit window is that window, not a cap on a preset's share of K
    sampling = replace(chosen.sampling, **{k: v for k, v in given.items() if k in SAMPLING_FIELDS})
    return Protocol(preset, EvictionConfig(**settings), sampling, tuple(sorted(given)))


def add_protocol_arguments(parser, *, sampling: bool = True, default: str = "custom") -> None:
    """The protocol flags every eviction CLI shares: ``--protocol`` (default `default`) and the settings it presets
    (all default None, meaning "the preset's"); read them back with ``protocol_overrides(vars(args))``.

    ``sampling=False`` is for CLIs that teacher-force every token: ``--temperature`` and ``--top-p`` leave the help,
    and are still parsed so that the CLI can refuse them in one line saying why, rather than as unknown flags."""
    import argparse

    from core.cli import non_negative_float, non_negative_int, positive_int, unit_interval

    if default not in PRESETS:
        raise unknown_choice("protocol", default, PROTOCOLS)
    described = "; ".join(f"{p.name}: {p.summary}" for p in PRESETS.values())
    unsampled = "" if sampling else "; every token is teacher-forced, so no preset's sampling applies"
    parser.add_argument("--protocol", default=default, choices=PROTOCOLS,
                        help=f"per-paper eviction protocol; explicit flags below override it ({described}{unsampled}) "
                        f"(default: {default})")
    parser.add_argument("--buffer", type=non_negative_int, default=None,
                        help="recent buffer r: the r newest tokens are never scored nor evicted, on top of K")
    parser.add_argument("--interval", type=positive_int, default=None,
                        help="decode steps between rounds of the interval trigger (default: the buffer r; R-KV: 128)")
    parser.add_argument("--block", type=positive_int, default=None,
                        help="prefill block size B; eviction at every block boundary, prefill peak K + r + B")
    parser.add_argument("--trigger", default=None, choices=TRIGGERS,
                        help="interval: evict every r (--interval) steps once the cache reaches K + 2r (K + r + "
                        "interval); step: whenever over K + r")
    parser.add_argument("--protect", default=None, choices=PROTECTIONS,
                        help="never evict the whole prompt, the first --n-sinks tokens, or nothing (default: the "
                        "policy's)")
    parser.add_argument("--n-sinks", type=non_negative_int, default=None,
                        help=f"sink tokens for --protect sinks (default: {DEFAULT_SINKS})")
    parser.add_argument("--recency", type=non_negative_int, default=None,
                        help="recency window w inside K: the w tokens before the buffer are kept unscored (the cap "
                        "of the window when --recency-share is given)")
    parser.add_argument("--recency-share", type=unit_interval, default=None,
                        help="per-problem recency window min(--recency, floor(share * K)) from each problem's own K "
                        "(EpiKV: 128 and 0.25)")
    parser.add_argument("--budget-scope", default=None, choices=BUDGET_SCOPES,
                        help="all: K counts protected tokens and the recency window; trace: K counts only scored "
                        "survivors; with_buffer: K also counts the buffer")
    parser.add_argument("--on-long-prompt", default=None, choices=ON_LONG_PROMPT,
                        help="if the protected prompt + recency window exceed K: error (default), expand K to fit "
                        "it, or protect only sinks for that problem")
    parser.add_argument("--temperature", type=non_negative_float, default=None,
                        help="sampling temperature; 0 = greedy (default: the preset's)" if sampling
                        else argparse.SUPPRESS)
    parser.add_argument("--top-p", type=unit_interval, default=None,
                        help="nucleus mass for sampling, in (0, 1] (default: the preset's)" if sampling
                        else argparse.SUPPRESS)


def protocol_overrides(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The protocol settings among parsed CLI arguments (``vars(args)``), None where not given."""
    return {key: arguments.get(key) for key in OVERRIDABLE if key in arguments}


# The settings that count tokens of one sequence: none can exceed the model's context (`core.limits`).
TOKEN_SETTINGS = ("buffer", "interval", "block", "n_sinks", "recency", "query_window")


def token_flags(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``{"--buffer": 64, ...}``: the token-count settings among `settings` by flag (None: not given), for
    `core.limits.ModelLimits.check_flags`."""
    return {"--" + key.replace("_", "-"): settings.get(key) for key in TOKEN_SETTINGS}
