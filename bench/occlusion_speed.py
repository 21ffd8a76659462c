"""Occlusion labelling: the fast engine vs re-prefilling every window from scratch, on the same real traces.

    python bench/occlusion_speed.py --traces runs/gsm8k-smollm2-135m/generations.jsonl --limit 3
    python bench/occlusion_speed.py --n-traces 3          # generate the traces first (greedy, not timed)

Both methods label the same windows of every trace (each trace's own regenerated answer is the reference, so
incorrect traces count too). The fast method labels `--traces-per-batch` traces at a time (their windows share
batches), the naive one each trace alone, right after, on the same machine state. Printed: naive seconds per
trace, naive and fast seconds per group with their ratio, the total ratio, and whether the two methods' records
(labels, every window's regenerated answer, the reference text) are identical. Timings on a shared CPU are noisy:
compare ratios from one run, not seconds across runs.

The ratio depends on the hardware and the regime (bench/README.md has measurements): the naive method decodes one
token per forward, which is memory-bound and gains nothing from more cores, while the fast method's batched
forwards are compute-bound and do; long regenerations (`--max-answer-tokens 512`, the labeller's default) favour
the fast method, short ones leave the prefill of the occluded suffix, which no method can skip, dominant.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cli import ArgumentParser, check_output_file, main_guard, memory_size, positive_int, write_json  # noqa: E402
from core.errors import UsageError  # noqa: E402
from labeling.job import check_labelling  # noqa: E402

# Tokens a generated trace's GSM8K prompt may take, for the memory check made before the traces exist.
PROMPT_ALLOWANCE = 512


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python bench/occlusion_speed.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=None, help="trace records (tasks.run generations.jsonl); default: "
                        "generate --n-traces gsm8k traces first")
    parser.add_argument("--model", default="smollm2-135m", help="model (default smollm2-135m)")
    parser.add_argument("--dataset", default="gsm8k", help="answer-extraction rules / generated problems (gsm8k)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N trace records")
    parser.add_argument("--n-traces", type=positive_int, default=3, help="traces to generate without --traces (3)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=160,
                        help="length of generated traces (default 160)")
    parser.add_argument("--window", type=positive_int, default=32, help="occlusion window (default 32)")
    parser.add_argument("--stride", type=positive_int, default=16, help="window stride (default 16)")
    parser.add_argument("--max-answer-tokens", type=positive_int, default=64,
                        help="regeneration limit per window (default 64; the labeller's default is 512)")
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="fast method: rows per batch (default 32, the labeller's default)")
    parser.add_argument("--traces-per-batch", type=positive_int, default=4,
                        help="fast method: traces labelled together, their windows sharing batches (default 4)")
    parser.add_argument("--replacement", default="pad",
                        help="auto, pad, space, dot, delete or a token id (default pad, as measured in README.md)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads for both methods (default: torch's, all cores, as the labeller runs; "
                        "on a machine shared with other jobs, 1 avoids oversubscription)")
    parser.add_argument("--max-memory", type=memory_size, default=None,
                        help="the memory the labellers may use, with its unit (e.g. 8GiB): settings whose estimated "
                        "peak exceeds it are refused before anything runs (default: this machine's memory)")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    return parser


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from tasks.datasets import check_dataset

    check_dataset(args.dataset)

    import torch

    from core.schemas import Trace, read_records
    from labeling.labeler import OcclusionConfig, OcclusionLabeler, make_units
    from models.loading import load_model, model_limits
    from tasks.generation import generate
    from tasks.ruler import parse_name

    config = OcclusionConfig(window=args.window, stride=args.stride, replacement=args.replacement,
                             max_answer_tokens=args.max_answer_tokens, batch_size=args.batch_size,
                             traces_per_batch=args.traces_per_batch)
    traces = read_records(args.traces, Trace)[: args.limit] if args.traces is not None else []
    if args.json:
        check_output_file(Path(args.json), "--json")
    limits = model_limits(args.model)
    limits.check_flags({"--max-new-tokens": args.max_new_tokens, "--window": args.window})
    generated = parse_name(args.dataset)
    if generated is not None:
        limits.check_tokens(f"dataset {args.dataset!r}: ruler length {generated.context_tokens}",
                            generated.context_tokens)
    check_labelling(args.model, traces, config, args.max_memory, f"--traces {args.traces}",
                    lengths=[args.max_new_tokens + PROMPT_ALLOWANCE])
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu", dtype="float32")
    if args.traces is None:
        from tasks.datasets import load_problems
        from tasks.prompts import build_prompt_ids

        for problem in load_problems(args.dataset, limit=args.n_traces):
            prompt = build_prompt_ids(lm.tokenizer, problem)
            result = generate(lm, prompt, args.max_new_tokens)
            traces.append(Trace(id=problem.id, dataset=args.dataset, model=args.model, prompt_ids=prompt,
                                generated_ids=result.generated_ids))
            print(f"generated {problem.id}: {len(result.generated_ids)} tokens", file=sys.stderr)

    naive = OcclusionLabeler.for_model(lm, dataclasses.replace(config, method="naive"), args.dataset)
    fast = OcclusionLabeler.for_model(lm, config, args.dataset)
    rows: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    print(f"{'trace':<36} {'tokens':>6} {'windows':>7} {'flips':>5} {'naive s':>8}  identical")
    for unit in make_units(traces, args.traces_per_batch):
        start = time.perf_counter()
        fast_records = fast.label_unit(unit)
        fast_s = time.perf_counter() - start
        naive_s = 0.0
        for trace, b in zip(unit.traces, fast_records):
            start = time.perf_counter()
            a = naive.label(trace)
            seconds = time.perf_counter() - start
            if not (a.labelled and b.labelled):
                print(f"{trace.id[-36:]:<36} skipped: {a.reason} / {b.reason}")
                continue
            naive_s += seconds
            assert a.windows is not None  # a labelled record holds its windows
            identical = a == b  # labels, windows with their answers, reference text: everything
            row = {"trace": trace.id, "tokens": a.n_tokens, "windows": len(a.windows),
                   "flips": sum(w["flipped"] for w in a.windows), "naive_s": seconds, "identical": identical}
            rows.append(row)
            print(f"{row['trace'][-36:]:<36} {row['tokens']:>6} {row['windows']:>7} {row['flips']:>5} "
                  f"{row['naive_s']:>8.1f}  {'yes' if identical else 'NO'}")
        if naive_s:
            groups.append({"traces": unit.ids, "naive_s": naive_s, "fast_s": fast_s, "ratio": naive_s / fast_s})
            print(f"  group of {len(unit.traces)}: naive {naive_s:.1f} s, fast {fast_s:.1f} s, "
                  f"ratio {naive_s / fast_s:.2f}")
    if not rows:
        raise UsageError("no trace had a reasoning span of at least one window")
    summary = {
        "traces": len(rows),
        "windows": sum(r["windows"] for r in rows),
        "median_group_ratio": statistics.median(g["ratio"] for g in groups),
        "total_ratio": sum(g["naive_s"] for g in groups) / sum(g["fast_s"] for g in groups),
        "all_identical": all(r["identical"] for r in rows),
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("json", "max_memory")},
                     "threads": torch.get_num_threads()},
    }
    print(f"\nnaive / fast: total {summary['total_ratio']:.2f}x (median over groups "
          f"{summary['median_group_ratio']:.2f}x) over {len(rows)} traces, {summary['windows']} windows, "
          f"{torch.get_num_threads()} thread(s), regeneration limit {args.max_answer_tokens}; labels identical: "
          f"{'yes' if summary['all_identical'] else 'NO'}")
    if args.json:
        write_json(args.json, {"rows": rows, "groups": groups, **summary})
    return 0 if summary["all_identical"] else 1


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
