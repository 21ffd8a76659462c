"""Occlusion labels from the command line: ``python -m labeling.occlusion --traces FILE | --dataset D ...``.

The flags build a `labeling.job.OcclusionJob` (`job_from_args`: how traces are labelled, `labeling.labeler`, and
which traces, where and on what backend) that `labeling.job.run_occlusion` runs; its docstring describes the
outputs, resuming and the backends, `labeling.estimates` the time estimates it prints.

    python -m labeling.occlusion --dataset gsm8k --limit 20 --include-incorrect --out runs/labels-gsm8k
    python -m labeling.occlusion --traces runs/math500-smollm2-135m/generations.jsonl --backend ray --workers 4
    python -m labeling.occlusion --traces runs/math500-smollm2-135m/generations.jsonl --shard 0/4

With ``--shard I/N`` (`labeling.shards`) combine the shards' outputs with ``python -m labeling.merge DIR``. The
command exits with status 1 when nothing at all was labelled (`labeling.job.NothingLabelled`).
"""

from __future__ import annotations

import argparse
import sys

from core.backend import BackendConfig, add_backend_arguments
from core.cli import (
    ArgumentParser,
    add_device_arguments,
    main_guard,
    positive_int,
    program_name,
    thread_count,
    unit_interval,
)
from labeling.job import NothingLabelled, OcclusionJob, run_occlusion
from labeling.labeler import DRAWS, HEADS, INTERVENTIONS, METHODS, OcclusionConfig
from labeling.windows import GENERIC_CUE, NO_ANSWER_RULES
from tasks.engines import ENGINES


def build_parser() -> argparse.ArgumentParser:
    from models.registry import DEFAULT_MODEL, REGISTRY

    defaults = OcclusionConfig()
    parser = ArgumentParser(
        prog="python -m labeling.occlusion",
        description="Counterfactual occlusion labels (EpiKV App. 8): slide a window over each trace's reasoning, "
        "occlude it, force the answer and mark the window important if the answer changes; every window also "
        "records the change of the reference answer's log-probability (graded effect). --intervention cache removes "
        "the window from the KV cache instead; --intervention joint evicts random keep-sets at --budget.",
    )
    parser.add_argument("--dataset", default=None,
                        help="math500, aime24 or gsm8k: the problems to generate traces for (required without "
                        "--traces) and the answer-extraction rules (default with --traces: the records' dataset)")
    parser.add_argument("--traces", default=None,
                        help="label these dense traces (a tasks.run generations.jsonl or an evictor.run --policy "
                        "full output) instead of generating new ones")
    parser.add_argument("--model", default=None,
                        help=f"model to label with ({', '.join(sorted(REGISTRY))}, a directory, .gguf or hub id); "
                        f"default: the traces' model, or {DEFAULT_MODEL} when generating")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="use only the first N problems (generation) or trace records (--traces)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=512,
                        help="generation length of new traces (default 512; ignored with --traces)")
    parser.add_argument("--data-file", default=None, help="problems JSONL for generation (see tasks.run)")
    parser.add_argument("--out", default=None, help="output directory (default: runs/labels-<dataset>-<model>)")
    parser.add_argument("--include-incorrect", action="store_true",
                        help="also label wrongly answered traces, against the model's own (regenerated) answer")
    parser.add_argument("--allow-evicted", action="store_true",
                        help="label traces generated under eviction (refused by default: occlusion labels describe "
                        "the dense model); recorded in the config")
    parser.add_argument("--window", type=positive_int, default=defaults.window,
                        help=f"occlusion window in tokens (default {defaults.window})")
    parser.add_argument("--stride", type=positive_int, default=defaults.stride,
                        help=f"step between window starts, <= --window (default {defaults.stride})")
    parser.add_argument("--replacement", default=defaults.replacement,
                        help="what replaces a window: auto (default: the pad token when it is harmless, else a "
                        "single space, because many chat models pad with their end-of-turn token), pad (the pad "
                        "token whatever it is, as in EpiKV), space, dot (single neutral tokens), delete (remove the "
                        "window, shortening the context) or a token id; the choice is recorded in every label")
    parser.add_argument("--intervention", default=defaults.intervention, choices=INTERVENTIONS,
                        help="what a label's counterfactual does (docs/labels.md): token (default: replace a window's "
                        "text and regenerate, EpiKV App. 8), cache (remove a window's keys and values from the dense "
                        "cache at the answer boundary and force the answer: eviction's own intervention, no "
                        "re-prefill) or joint (random keep-sets of the trace at --budget, each unit's share of the "
                        "answer fitted by a linear datamodel: sees a fact stated twice)")
    parser.add_argument("--heads", default=defaults.heads, choices=HEADS,
                        help="cache labels: remove a window from every KV head at once (all, default) or from each KV "
                        "head on its own (each: one row per window and head)")
    parser.add_argument("--budget", type=unit_interval, default=defaults.budget,
                        help="joint labels: the share of the trace each keep-set holds, in (0, 1] (each unit kept "
                        f"with this probability; default {defaults.budget})")
    parser.add_argument("--draws", type=positive_int, default=None,
                        help="joint labels: random keep-sets per trace (default: max(128, 8 x the trace's units))")
    parser.add_argument("--draw", default=defaults.draw, choices=DRAWS,
                        help="joint labels: one keep-set for every KV head (shared, default) or one per KV head "
                        "(per-head, as Random Attention draws)")
    parser.add_argument("--unit", type=positive_int, default=defaults.unit,
                        help=f"joint labels: tokens per unit drawn, the labels' resolution (default {defaults.unit})")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help=f"joint labels: the seed each trace's draws derive from (default {defaults.seed})")
    parser.add_argument("--force-answer", action=argparse.BooleanOptionalAction, default=defaults.force_answer,
                        help="append the trace's own answer cue (the tokens from the answer boundary up to the answer "
                        "itself, e.g. '\\boxed{' or 'The answer is') after every occluded context, so each must "
                        "state an answer and a window is important when the answer changes (default, as the study "
                        "labels: docs/labels.md); --no-force-answer regenerates freely from the answer boundary "
                        "(EpiKV App. 8)")
    parser.add_argument("--stop-at-answer", action=argparse.BooleanOptionalAction, default=defaults.stop_at_answer,
                        help="a forced answer's regeneration stops once the answer is complete (its box closes, or "
                        "the answer phrase's line ends) and the answer is read there, never from a later box; graded "
                        "effects need it (default on; --no-stop-at-answer reads cue + continuation as labels made "
                        "before it did)")
    parser.add_argument("--generic-cue", action=argparse.BooleanOptionalAction, default=defaults.generic_cue,
                        help=f"a trace with no answer cue of its own gets a generic one ({GENERIC_CUE!r} after its "
                        "text), recorded as such (default on; --no-generic-cue skips such traces, naming why)")
    parser.add_argument("--no-answer", default=defaults.no_answer, choices=NO_ANSWER_RULES,
                        help="how a window after which the model states no answer (or degenerates: it stops at once "
                        "or repeats the filler) labels its positions: flip (important, EpiKV's literal rule), exclude "
                        "(no evidence: its positions keep the other covering window's label, or none), own-class "
                        f"(its positions are left out of validation as their own class); default {defaults.no_answer}")
    parser.add_argument("--max-answer-tokens", type=positive_int, default=None,
                        help=f"greedy regeneration length limit per window (default {defaults.max_answer_tokens} "
                        f"with a forced answer, {OcclusionConfig(force_answer=False).max_answer_tokens} without)")
    parser.add_argument("--batch-size", type=positive_int, default=defaults.batch_size,
                        help=f"contexts regenerated together by the fast method (default {defaults.batch_size}; "
                        "memory grows with it: each holds a copy of its trace's KV cache)")
    parser.add_argument("--traces-per-batch", type=positive_int, default=defaults.traces_per_batch,
                        help="traces labelled together, the unit of work (fast method: their windows share batches; "
                        f"default {defaults.traces_per_batch}); records are written when a unit finishes")
    parser.add_argument("--engine", default=defaults.engine, choices=ENGINES,
                        help="what regenerates the occluded contexts: hf (default: kvscope's own regeneration on "
                        "transformers, --method) or vllm (every context of a unit to vLLM at once, its prefix cache "
                        "sharing each trace's unchanged prefix; its environment: docs/engines.md); vLLM's greedy "
                        "tokens need not equal kvscope's, so the engine is part of the labels' identity")
    parser.add_argument("--method", default=defaults.method, choices=METHODS,
                        help="fast (shared prefix cache, batched windows; default) or naive (re-prefill every "
                        "window); both give the same labels")
    parser.add_argument("--shard", default=None,
                        help="I/N: label only the selected traces i with i %% N == I (run N processes, even at once "
                        "into one --out, then python -m labeling.merge OUT: for job-array schedulers; on a Ray "
                        "cluster use --backend ray instead); needs --traces")
    add_device_arguments(parser, dtype_default=defaults.dtype)
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="torch CPU threads, here and in every Ray worker (default: torch's choice, or Ray's "
                        "--cpus-per-worker; 1 is faster on a busy shared CPU)")
    add_backend_arguments(parser)
    return parser


def job_from_args(args: argparse.Namespace) -> OcclusionJob:
    config = OcclusionConfig(window=args.window, stride=args.stride, replacement=args.replacement,
                             max_answer_tokens=args.max_answer_tokens, include_incorrect=args.include_incorrect,
                             allow_evicted=args.allow_evicted, dtype=args.dtype, force_answer=args.force_answer,
                             no_answer=args.no_answer, batch_size=args.batch_size,
                             traces_per_batch=args.traces_per_batch, method=args.method, engine=args.engine,
                             stop_at_answer=args.stop_at_answer, generic_cue=args.generic_cue,
                             intervention=args.intervention, heads=args.heads, budget=args.budget, draws=args.draws,
                             draw=args.draw, unit=args.unit, seed=args.seed)
    return OcclusionJob(config=config, traces=args.traces, dataset=args.dataset, model=args.model,
                        data_file=args.data_file, limit=args.limit, max_new_tokens=args.max_new_tokens,
                        shard=args.shard, device=args.device, threads=args.threads,
                        max_memory=args.max_memory)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    job = job_from_args(args)
    backend = BackendConfig.from_flags(vars(args))
    try:
        result = run_occlusion(job, args.out, backend)
    except NothingLabelled as err:
        print(f"{program_name()}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    labelled = len(result.labelled)
    print(f"{labelled} traces labelled, {len(result.labels) - labelled} skipped; written to {result.labels_path}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
