"""What a study runs: its settings (`StudyConfig`), checked in one place before anything is loaded or written.

Every setting belongs to one stage (`STAGE_SETTINGS`); a stage's key is computed from its own settings and its
inputs' keys (`study.stages`), so changing a setting recomputes that stage and the stages after it, and nothing
before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import UsageError, unknown_choice
from labeling.labeler import (
    DEFAULT_NO_ANSWER,
    DRAWS,
    HEADS,
    INTERVENTIONS,
    OcclusionConfig,
)
from labeling.replacement import check_spec
from labeling.windows import DEFAULT_TAIL
from models.registry import DEFAULT_MODEL
from validation.layers import DEFAULT_WINDOW
from validation.stats import DEFAULT_N_BOOT

if TYPE_CHECKING:
    from evictor.protocol import Budget

# The paper whose claim each default policy carries (EpiKV, ValueDiff, Random Attention), and the baselines every
# study runs beside them: full attention (the ceiling), random with the prompt kept (the null every scored policy must
# beat) and recency with the prompt kept.
PAPER_DEFAULTS = {"EpiKV": "epikv", "ValueDiff": "valuediff", "Random Attention": "random"}
BASELINES = ("full", "random", "recency")
REFERENCE = "random"  # every policy is compared with it
# Scorers replayed by default: the paper defaults and their raw variants, a key- and a value-geometric score, one
# attention-derived score and the two scoreless baselines; a few seconds each per trace on a small model.
DEFAULT_SCORERS = ("epikv", "epikv_raw", "valuediff", "valuediff_norm", "keydiff", "h2o", "recency", "random")
# The replacements label agreement compares with the study's own: auto (the pad token where it is harmless, EpiKV's
# filler; else the neutral token), the neutral space token and deletion. The pad token itself is never forced: where
# it is the BOS or an end-of-turn token it breaks the conversation (labeling.replacement).
AGREEMENT_REPLACEMENTS = ("auto", "space", "delete")
# Forced-answer labels of short traces are cheap, so by default every labelled trace is relabelled (None = all).
DEFAULT_AGREEMENT_TRACES: int | None = None
# The label kinds a study computes (`labeling.labeler.INTERVENTIONS`): token occlusion always (the labels the
# selection ranks scorers against); cache-level and joint labels beside it when asked (docs/labels.md).
DEFAULT_LABELS = ("token",)
# Joint labels' budget when none is given and no study budget is a fraction: Random Attention's ~4x compression.
DEFAULT_JOINT_BUDGET = 0.25
DEFAULT_TOP = 2
DEFAULT_PROTOCOL = "epikv"
DEFAULT_PROTECT = "prompt"
COMPARE_N_BOOT = 10_000
# The problems the evictor stage runs: every problem of the study, or only those whose dense trace was labelled.
EVICT_PROBLEMS = ("all", "labelled")


def study_budgets(text: str) -> tuple[Budget, ...]:
    """A study's ``--budget`` list (`evictor.protocol.parse_budgets`: fractions in (0, 1] of each problem's dense
    trace length, K in tokens >= 2, what K counts being the protocol's), sorted so that a study's stage keys do not
    depend on the order the budgets are written in."""
    from evictor.protocol import parse_budgets

    return tuple(sorted(parse_budgets(text)))


def is_long_context(dataset: str) -> bool:
    """A RULER task: the evidence is in the prompt (the haystack), the answer a few tokens with no reasoning span."""
    from tasks.ruler import parse_name

    return parse_name(dataset) is not None


def is_known_answer(dataset: str) -> bool:
    """A known-answer task (`tasks.known_answer`): constructed traces, teacher-forced, whose facts sit at known
    positions, so the labels and every scorer are checked against them."""
    from tasks.known_answer import parse_name

    return parse_name(dataset) is not None


# Why a study of a long-context task has no labelling stage: what occlusion of the generated trace would label.
LONG_CONTEXT_LABELS = ("a RULER task's answer has no reasoning span to occlude (its evidence is the prompt), so the "
                       "study measures accuracy against compression only")


def parse_names(text: str, flag: str) -> tuple[str, ...]:
    from core.cli import distinct

    names = tuple(part.strip() for part in str(text).split(",") if part.strip())
    if not names:
        raise UsageError(f"{flag} {text!r} names nothing; give a comma list")
    distinct(flag, text, names)  # a scorer or label kind named twice would be computed, or counted, twice
    return names


@dataclass(frozen=True)
class StudyConfig:
    """Every setting of a study; the CLI flags of the same names document each field."""

    dataset: str
    budgets: tuple[Budget, ...]  # as `study_budgets` orders them
    model: str = DEFAULT_MODEL
    data_file: str | None = None
    limit: int | None = None
    max_new_tokens: int = 512
    traces: str | None = None  # reuse these dense traces instead of generating
    # labelling
    include_incorrect: bool = False
    engine: str = "hf"  # what generates the dense traces and the labeller's regenerations (`tasks.engines`)
    window: int = 32
    stride: int = 16
    replacement: str = "auto"
    max_answer_tokens: int | None = None  # None: the labeller's cap for a forced or a free answer
    tail: int = DEFAULT_TAIL
    force_answer: bool = True  # the trace's answer cue after every occluded context (docs/labels.md)
    no_answer: str = DEFAULT_NO_ANSWER
    stop_at_answer: bool = True  # a forced answer's regeneration ends where the answer does (graded labels)
    generic_cue: bool = True  # a trace with no answer cue of its own gets a generic one
    agreement_traces: int | None = DEFAULT_AGREEMENT_TRACES  # None: every labelled trace
    labels: tuple[str, ...] = DEFAULT_LABELS  # label kinds: token first, then cache and joint when asked
    cache_heads: str = "all"  # cache labels: remove a window from every KV head at once, or each head on its own
    joint_budget: float | None = None  # None: the smallest fractional --budget, else DEFAULT_JOINT_BUDGET
    joint_draws: int | None = None  # None: labeling.joint.auto_draws
    joint_draw: str = "shared"
    joint_unit: int = 16
    teacher_forced: bool = False  # teacher-forced eviction of every deployed configuration (evictor.teacher_forced)
    teacher_block: int = 32
    # signals and selection
    scorers: tuple[str, ...] = DEFAULT_SCORERS
    signal_window: int = DEFAULT_WINDOW
    top: int = DEFAULT_TOP
    level: float = 0.95
    n_boot: int = DEFAULT_N_BOOT
    # eviction and comparison
    protocol: str = DEFAULT_PROTOCOL
    protect: str = DEFAULT_PROTECT
    budget_scope: str | None = None  # what K counts (evictor.protocol.BUDGET_SCOPES); None: the protocol's own
    on_long_prompt: str | None = None  # a prompt K cannot hold (evictor.protocol.ON_LONG_PROMPT); None: error
    compare_n_boot: int = COMPARE_N_BOOT
    batch_size: int = 1  # problems decoded together by the evictor stage: speed only, so not in any stage's key
    evict_problems: str = "all"  # all | labelled: the problems the evictor stage runs
    deploy_scorers: bool = False  # every replayed scorer also runs in the evictor
    seed: int = 0
    dtype: str = "float32"
    device: str | None = None
    max_memory: int | None = None  # bytes a stage may use (None: the device's memory; `core.limits.MemoryLimit`)

    def check(self) -> None:
        """Refuse any setting no stage can run with, naming it: nothing is loaded or written before this passes."""
        from evictor.policies import POLICIES, get_policy
        from evictor.policy import calibrated_policies, choose_policies
        from evictor.protocol import BUDGET_SCOPES, ON_LONG_PROMPT, PROTECTIONS, PROTOCOLS
        from models.loading import check_model_name
        from tasks.datasets import check_dataset
        from tasks.engines import ENGINES

        check_dataset(self.dataset)
        check_model_name(self.model)
        if self.engine not in ENGINES:
            raise unknown_choice("engine", self.engine, ENGINES)
        if not self.budgets:
            raise UsageError("give at least one --budget fraction")
        if is_long_context(self.dataset):
            fractions = [b for b in self.budgets if b.tokens is None]
            if fractions:
                raise UsageError(f"--budget {','.join(f'{b:g}' for b in fractions)} on {self.dataset}: a RULER task "
                                 "compresses its prompt, so give K in tokens (e.g. 256,1024), not fractions of the "
                                 "few answer tokens")
            if self.protect == "prompt":
                raise UsageError(f"--protect prompt on {self.dataset} keeps the whole haystack, so nothing can be "
                                 "evicted; valid choices: sinks, none")
        if not self.labels or self.labels[0] != "token" or len(set(self.labels)) != len(self.labels):
            raise UsageError(f"--labels {','.join(self.labels)}: list token first (the labels selection ranks "
                             "scorers against), then cache and/or joint, each once")
        for kind in self.labels:
            if kind not in INTERVENTIONS:
                raise unknown_choice("label kind", kind, INTERVENTIONS)
        if self.cache_heads not in HEADS:
            raise unknown_choice("cache heads", self.cache_heads, HEADS)
        if self.joint_draw not in DRAWS:
            raise unknown_choice("joint draw", self.joint_draw, DRAWS)
        if self.teacher_block < 1:
            raise UsageError(f"--teacher-block must be a positive integer, got {self.teacher_block}")
        for kind in self.labels:
            self.occlusion(intervention=kind)  # window, stride, replacement, dtype; a kind's own settings
        check_spec(self.replacement)
        if self.protocol not in PROTOCOLS:
            raise unknown_choice("protocol", self.protocol, PROTOCOLS)
        if self.protect not in PROTECTIONS:
            raise unknown_choice("protection", self.protect, PROTECTIONS)
        if self.budget_scope is not None and self.budget_scope not in BUDGET_SCOPES:
            raise unknown_choice("budget scope", self.budget_scope, BUDGET_SCOPES)
        if self.on_long_prompt is not None and self.on_long_prompt not in ON_LONG_PROMPT:
            raise unknown_choice("long-prompt fallback", self.on_long_prompt, ON_LONG_PROMPT)
        if self.evict_problems not in EVICT_PROBLEMS:
            raise unknown_choice("evict-problems", self.evict_problems, EVICT_PROBLEMS)
        for name in ("top", "signal_window", "n_boot", "compare_n_boot", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.agreement_traces is not None and self.agreement_traces < 0:
            raise UsageError(f"--agreement-traces must be >= 0, got {self.agreement_traces}")
        if not 0 < self.level < 1:
            raise UsageError(f"--level must be in (0, 1), got {self.level}")
        choose_policies(",".join(self.scorers))
        calibrated = calibrated_policies(self.scorers)
        if calibrated:
            raise UsageError(f"--scorers {', '.join(calibrated)}: calibrated policies need a per-model calibration "
                             "file; replay them with python -m evictor.replay --policy-config FILE")
        idle = [name for name in self.scorers if get_policy(name).scores_nothing]
        if idle:
            raise UsageError(f"--scorers {', '.join(idle)}: evicts nothing, so there is no score to validate; "
                             f"valid choices: {', '.join(n for n in POLICIES if n not in idle)}")
        if self.traces is not None and not Path(self.traces).is_file():
            raise UsageError(f"--traces {self.traces!r} does not exist" if not Path(self.traces).exists()
                             else f"--traces {self.traces!r} is not a file")
        from core.limits import check_memory

        problems = self.limit or 1
        for flag, n_boot in (("--n-boot", self.n_boot), ("--compare-n-boot", self.compare_n_boot)):
            # a bootstrap holds at least one float64 per replicate and problem, whatever its statistic
            check_memory(f"{flag} {n_boot} over {problems} problems", 8 * n_boot * problems,
                         remedy=f"lower {flag}")
        self.check_limits()

    def check_limits(self) -> None:
        """Refuse token counts beyond the model's context and a filler id outside its vocabulary, read from its
        config before any stage loads it: no trace could hold them, so every stage after the traces would fail."""
        from models.loading import model_limits

        limits = model_limits(self.model)
        limits.check_flags({"--max-new-tokens": self.max_new_tokens, "--window": self.window,
                            "--max-answer-tokens": self.max_answer_tokens, "--signal-window": self.signal_window,
                            "--teacher-block": self.teacher_block})
        for budget in self.budgets:
            if budget.tokens is not None:
                limits.check_tokens(f"--budget {budget}", budget.tokens,
                                    "the cache could never fill, so nothing is evicted")
        if self.replacement.isdigit():
            limits.check_token_ids([int(self.replacement)], f"--replacement {self.replacement}")

    @property
    def protocol_overrides(self) -> dict[str, str]:
        """The protocol settings given over the preset beside the protection (only those given, so a default
        study's evictor key does not change)."""
        given = {"budget_scope": self.budget_scope, "on_long_prompt": self.on_long_prompt}
        return {name: value for name, value in given.items() if value is not None}

    @property
    def protocol_settings(self) -> dict[str, Any]:
        """What the study sets over its protocol's preset (`evictor.protocol.resolve_protocol`)."""
        return {"protect": self.protect, **self.protocol_overrides}

    def protocol_flags(self) -> list[str]:
        """The protocol's flags as a command line gives them (`--protect`, then each override)."""
        flags = ["--protect", self.protect]
        for name, value in self.protocol_overrides.items():
            flags += [f"--{name.replace('_', '-')}", value]
        return flags

    @property
    def deployed_scorers(self) -> tuple[str, ...]:
        """The replayed scorers the evictor stage runs beside the defaults (none unless `deploy_scorers`)."""
        return self.scorers if self.deploy_scorers else ()

    @property
    def joint_share(self) -> float:
        """The joint labels' budget: as given, else the study's smallest fractional budget (where eviction bites
        most), else `DEFAULT_JOINT_BUDGET`."""
        if self.joint_budget is not None:
            return self.joint_budget
        fractions = [float(b.amount) for b in self.budgets if b.tokens is None]
        return min(fractions) if fractions else DEFAULT_JOINT_BUDGET

    def occlusion(self, replacement: str | None = None, intervention: str = "token") -> OcclusionConfig:
        """The labelling settings of one label kind (with another `replacement` for label agreement)."""
        return OcclusionConfig(window=self.window, stride=self.stride,
                               replacement=self.replacement if replacement is None else replacement,
                               max_answer_tokens=self.max_answer_tokens, include_incorrect=self.include_incorrect,
                               tail=self.tail, dtype=self.dtype, force_answer=self.force_answer,
                               stop_at_answer=self.stop_at_answer, generic_cue=self.generic_cue,
                               no_answer=self.no_answer, engine=self.engine if intervention == "token" else "hf",
                               intervention=intervention, heads=self.cache_heads, budget=self.joint_share,
                               draws=self.joint_draws, draw=self.joint_draw, unit=self.joint_unit, seed=self.seed)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "budgets": [budget.to_json() for budget in self.budgets]}
