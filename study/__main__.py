"""``python -m study``: the whole kvscope loop in one command, into one directory with a self-contained report.

    python -m study --model smollm2-135m --dataset gsm8k --limit 4 --max-new-tokens 160 --include-incorrect \\
        --budget 0.5 --out runs/study

See `study` (the package docstring) for the stages and the outputs.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from core.backend import BackendConfig, add_backend_arguments
from core.cli import (
    ArgumentParser,
    add_device_arguments,
    main_guard,
    non_negative_int,
    positive_int,
    unit_interval,
)
from evictor.protocol import BUDGET_SCOPES, ON_LONG_PROMPT, PROTECTIONS, PROTOCOLS
from labeling.labeler import DEFAULT_NO_ANSWER, DRAWS, FORCED_ANSWER_TOKENS, FREE_ANSWER_TOKENS, HEADS
from labeling.windows import DEFAULT_TAIL, NO_ANSWER_RULES
from models.registry import DEFAULT_MODEL, REGISTRY
from study.config import (
    AGREEMENT_REPLACEMENTS,
    BASELINES,
    COMPARE_N_BOOT,
    DEFAULT_AGREEMENT_TRACES,
    DEFAULT_JOINT_BUDGET,
    DEFAULT_LABELS,
    DEFAULT_PROTECT,
    DEFAULT_PROTOCOL,
    DEFAULT_SCORERS,
    DEFAULT_TOP,
    EVICT_PROBLEMS,
    PAPER_DEFAULTS,
    StudyConfig,
    parse_names,
    study_budgets,
)
from tasks.engines import ENGINES
from validation.stats import DEFAULT_N_BOOT


def count_or_all(text: str) -> int | None:
    """``all`` -> None (every one), else a non-negative integer."""
    if text == "all":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}; or all") from None


def build_parser() -> argparse.ArgumentParser:
    papers = ", ".join(f"{paper}: {policy}" for paper, policy in PAPER_DEFAULTS.items())
    parser = ArgumentParser(
        prog="python -m study",
        description="Which cheap signal finds the tokens a model's answer depends on, and does evicting by it beat "
        "random eviction at equal cache? Generates dense traces, labels them by counterfactual occlusion, replays "
        "every scorer's score and the per-layer signals, ranks them by within-trace Spearman rho (Fisher-z mean, "
        "n_eff, 95% CI), selects configurations, runs them in the evictor against full, random and recency (prompt "
        f"kept) and each paper's default scorer ({papers}) under one protocol, compares each with random (paired "
        "bootstrap, sign test) at equal peak cache, and writes OUT/report.md. Each stage's output is kept under a key "
        "of its settings: rerunning resumes, changing a setting recomputes from that stage on.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"registry name ({', '.join(sorted(REGISTRY))}), a local HF directory, a .gguf file or a "
                        f"hub id (default: {DEFAULT_MODEL})")
    parser.add_argument("--dataset", required=True, help="benchmark: gsm8k, math500, aime24, or a RULER task such as "
                        "ruler_niah_single@2048 (see tasks.datasets)")
    parser.add_argument("--data-file", default=None,
                        help="read problems from this JSONL file instead of $KVSCOPE_DATA_DIR or the hub")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="the first N problems of the dataset (default: all)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=512,
                        help="generation cap of the dense traces and of every eviction run (default: 512)")
    parser.add_argument("--traces", default=None,
                        help="reuse these dense traces (a tasks.run generations.jsonl of --model holding the first "
                        "--limit problems) instead of generating them")
    parser.add_argument("--budget", required=True,
                        help="comma list of cache budgets, each a fraction in (0, 1] of each problem's dense trace "
                        "length (1: K is the whole dense trace) or a whole number of tokens K >= 2 (what K counts is "
                        "the --protocol's). RULER tasks (ruler_*) take tokens only: the prompt is what is "
                        "compressed, and they skip labelling, signals and selection (their answer has no reasoning "
                        "span), so the study measures accuracy against compression")
    labels = parser.add_argument_group("occlusion labels (labeling.occlusion)")
    labels.add_argument("--include-incorrect", action="store_true",
                        help="also label wrongly answered traces, against the model's own answer (default: correctly "
                        "answered traces only, EpiKV's protocol)")
    labels.add_argument("--engine", default="hf", choices=ENGINES,
                        help="what generates the dense traces and the labeller's regenerations: hf (default: kvscope's "
                        "own decoding on transformers) or vllm (its environment: KVSCOPE_VLLM=1 bash scripts/setup.sh, "
                        "docs/engines.md); the replay and the evictor always run on kvscope's cache")
    labels.add_argument("--window", type=positive_int, default=32, help="occlusion window in tokens (default 32)")
    labels.add_argument("--stride", type=positive_int, default=16,
                        help="step between windows, <= --window (default 16)")
    labels.add_argument("--replacement", default="auto",
                        help="what fills a window: auto (default: the pad token when harmless, else a neutral token), "
                        "pad, space, dot, delete or a token id")
    labels.add_argument("--max-answer-tokens", type=positive_int, default=None,
                        help=f"regeneration length limit per window (default {FORCED_ANSWER_TOKENS} with a forced "
                        f"answer, which follows the cue at once; {FREE_ANSWER_TOKENS} without)")
    labels.add_argument("--tail", type=non_negative_int, default=DEFAULT_TAIL,
                        help=f"answer span of a trace with neither </think> nor \\boxed{{ (default {DEFAULT_TAIL})")
    labels.add_argument("--force-answer", action=argparse.BooleanOptionalAction, default=True,
                        help="append the trace's own answer cue (e.g. '\\boxed{') after every occluded context, so "
                        "each must state an answer and a window is important when the answer changes (default: on; "
                        "--no-force-answer regenerates from the answer boundary, EpiKV App. 8)")
    labels.add_argument("--stop-at-answer", action=argparse.BooleanOptionalAction, default=True,
                        help="a forced answer's regeneration stops once the answer is complete and the answer is read "
                        "there, so every window also carries a graded effect (the change of the reference answer's "
                        "log-probability); default on")
    labels.add_argument("--generic-cue", action=argparse.BooleanOptionalAction, default=True,
                        help="a trace without an answer cue of its own is labelled after a generic one (an answer "
                        "prompt appended after its text), recorded as such (default on; off: such traces are skipped)")
    labels.add_argument("--labels", default=",".join(DEFAULT_LABELS),
                        help="label kinds, token first (the labels selection ranks scorers against), then any of "
                        "cache (a window's keys and values removed from the dense cache at the answer boundary) and "
                        "joint (random keep-sets at --joint-budget, each unit's share of the answer fitted by a "
                        "linear datamodel); docs/labels.md says what each measures and costs (default: token)")
    labels.add_argument("--cache-heads", default="all", choices=HEADS,
                        help="cache labels: remove a window from every KV head at once (all, default) or from each KV "
                        "head on its own (each)")
    labels.add_argument("--joint-budget", type=unit_interval, default=None,
                        help="joint labels: the share of the trace each keep-set holds, in (0, 1] (default: the "
                        f"smallest fractional --budget, else {DEFAULT_JOINT_BUDGET})")
    labels.add_argument("--joint-draws", type=positive_int, default=None,
                        help="joint labels: random keep-sets per trace (default max(128, 8 x the trace's units))")
    labels.add_argument("--joint-draw", default="shared", choices=DRAWS,
                        help="joint labels: one keep-set for every KV head (shared, default) or one per KV head")
    labels.add_argument("--joint-unit", type=positive_int, default=16,
                        help="joint labels: tokens per unit drawn, the labels' resolution (default 16)")
    labels.add_argument("--no-answer", default=DEFAULT_NO_ANSWER, choices=NO_ANSWER_RULES,
                        help="how a window after which no answer comes back labels its positions: flip (important), "
                        "exclude (no evidence either way) or own-class (left out of validation as a class of its own); "
                        f"default {DEFAULT_NO_ANSWER} (docs/labels.md)")
    labels.add_argument("--agreement-traces", type=count_or_all, default=DEFAULT_AGREEMENT_TRACES,
                        help=f"relabel the first K labelled traces (or all) with each other replacement "
                        f"({', '.join(AGREEMENT_REPLACEMENTS)}; auto is the pad token where it is harmless) and report "
                        "label agreement (Cohen's kappa per position and per window) and the ranking under each; 0 = "
                        "off (default: all)")
    signals = parser.add_argument_group("signals and selection (evictor.replay, signals, validation.select)")
    signals.add_argument("--scorers", default=",".join(DEFAULT_SCORERS),
                         help="comma list of registered policies whose replayed scores are validated and may be "
                         f"selected (default: {','.join(DEFAULT_SCORERS)}; python -m evictor.policies lists them)")
    signals.add_argument("--signal-window", type=positive_int, default=64,
                         help="rolling window of g_l's mean and z-score (EpiKV's w; default 64)")
    signals.add_argument("--top", type=positive_int, default=DEFAULT_TOP,
                         help="configurations to select: the best distinct scorers a policy computes, each with a "
                         f"positive within-trace rho (default {DEFAULT_TOP})")
    signals.add_argument("--level", type=unit_interval, default=0.95,
                         help="confidence level of every interval (default 0.95)")
    signals.add_argument("--n-boot", type=positive_int, default=DEFAULT_N_BOOT,
                         help=f"bootstrap replicates over traces for the rho intervals (default {DEFAULT_N_BOOT})")
    evict = parser.add_argument_group("eviction and comparison (evictor.run, validation.compare)")
    evict.add_argument("--protocol", default=DEFAULT_PROTOCOL, choices=PROTOCOLS,
                       help="one eviction protocol for every policy, so K means the same cache for all "
                       f"(evictor.protocol; default {DEFAULT_PROTOCOL}: evict every step, recency min(128, K/4), K "
                       "counting the trace positions)")
    evict.add_argument("--protect", default=DEFAULT_PROTECT, choices=PROTECTIONS,
                       help="what every policy keeps unscored: one protection for all, so every policy holds the same "
                       f"peak cache (default {DEFAULT_PROTECT}: {', '.join(BASELINES[1:])} keep the prompt)")
    evict.add_argument("--budget-scope", default=None, choices=BUDGET_SCOPES,
                       help="what K counts, over the protocol's own rule: all (the protected tokens and the recency "
                       "window too), trace (only the scored survivors) or with_buffer (the recent buffer too); "
                       "default: the protocol's (epikv: trace; random_attention: all, so a fraction of a short trace "
                       "may not hold the prompt)")
    evict.add_argument("--on-long-prompt", default=None, choices=ON_LONG_PROMPT,
                       help="where the protected prompt and the recency window exceed a problem's K: error "
                       "(default; the study stops right after its traces), expand that problem's K to fit them, or "
                       "protect only the sinks for that problem")
    evict.add_argument("--evict-problems", default="all", choices=EVICT_PROBLEMS,
                       help="the problems the evictor runs: all (default) or labelled, only those whose dense trace "
                       "was labelled (the correctly answered ones unless --include-incorrect): accuracy then measures "
                       "how often a policy keeps an answer the full cache got right, at a fraction of the compute")
    evict.add_argument("--deploy-scorers", action="store_true",
                       help="also run every --scorers policy in the evictor at its default parameters, so the report "
                       "can set each scorer's offline rho beside what evicting by it keeps and give the rank "
                       "correlation between the two (costs one cell per scorer and budget)")
    evict.add_argument("--teacher-forced", action="store_true",
                       help="also run every deployed configuration teacher-forced on the dense traces at every "
                       "budget, the reference answer forced and scored (evictor.teacher_forced): an offline estimate "
                       "of deployed accuracy beside the deployed cells (costs about one prefill per trace, "
                       "configuration and budget)")
    evict.add_argument("--teacher-block", type=positive_int, default=32,
                       help="teacher-forced eviction: trace tokens per forward, a round after each (default 32; 1: "
                       "every round as deployed)")
    evict.add_argument("--batch-size", type=positive_int, default=1,
                       help="problems the evictor decodes together, left-padded (default 1); a speed setting, so a "
                       "rerun with another batch size reuses the finished eviction records")
    evict.add_argument("--compare-n-boot", type=positive_int, default=COMPARE_N_BOOT,
                       help=f"bootstrap replicates of the paired comparison (default {COMPARE_N_BOOT})")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seeds random policies, sampling and bootstraps (default 0)")
    add_device_arguments(parser, dtype_default="float32")
    add_backend_arguments(parser)
    parser.add_argument("--out", required=True,
                        help="study directory: report.md, selection.json, compare.csv, figures/, configs/, stages/")
    parser.add_argument("--quiet", action="store_true", help="no line per eviction batch")
    return parser


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    return StudyConfig(
        dataset=args.dataset, budgets=study_budgets(args.budget), model=args.model, data_file=args.data_file,
        limit=args.limit, max_new_tokens=args.max_new_tokens, traces=args.traces,
        include_incorrect=args.include_incorrect, engine=args.engine, window=args.window, stride=args.stride,
        replacement=args.replacement, max_answer_tokens=args.max_answer_tokens, tail=args.tail,
        force_answer=args.force_answer, no_answer=args.no_answer, stop_at_answer=args.stop_at_answer,
        generic_cue=args.generic_cue, labels=parse_names(args.labels, "--labels"), cache_heads=args.cache_heads,
        joint_budget=args.joint_budget, joint_draws=args.joint_draws, joint_draw=args.joint_draw,
        joint_unit=args.joint_unit, teacher_forced=args.teacher_forced, teacher_block=args.teacher_block,
        agreement_traces=args.agreement_traces, scorers=parse_names(args.scorers, "--scorers"),
        signal_window=args.signal_window, top=args.top, level=args.level, n_boot=args.n_boot,
        protocol=args.protocol, protect=args.protect, budget_scope=args.budget_scope,
        on_long_prompt=args.on_long_prompt, compare_n_boot=args.compare_n_boot,
        batch_size=args.batch_size, evict_problems=args.evict_problems, deploy_scorers=args.deploy_scorers,
        seed=args.seed, dtype=args.dtype, device=args.device, max_memory=args.max_memory)


def _run(argv: list[str] | None) -> int:
    from figures.trace import VIEWER_FILE
    from study.pipeline import run_study
    from study.report import headline

    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    backend = BackendConfig.from_flags(vars(args))
    command = ["python", "-m", "study", *(sys.argv[1:] if argv is None else argv)]
    try:
        result = run_study(config, args.out, backend, quiet=args.quiet, command=command)
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished stages and records are kept in {args.out}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    print(headline(result))
    print(f"\nreport: {result.out / 'report.md'} (reproduce: {shlex.join(command)})")
    print(f"trace viewer: {result.out / VIEWER_FILE} (open it in a browser: every trace token by token)")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    from study.__main__ import main  # this module under its own name, so Ray workers unpickle its functions from there

    raise SystemExit(main())
