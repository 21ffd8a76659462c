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
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cli import ArgumentParser, main_guard, positive_int  # noqa: E402
from core.errors import UsageError  # noqa: E402



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
    parser.add_argument("--replacement", default="pad", help="pad, space, dot, delete or a token id (default pad)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads for both methods (default: torch's, all cores, as the labeller runs; "
                        "on a machine shared with other jobs, 1 avoids oversubscription)")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    return parser


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from tasks.datasets import DATASETS

    if args.dataset not in DATASETS:
        from core.errors import unknown_choice

        raise unknown_choice("dataset", args.dataset, DATASETS)
    if args.traces is not None and not Path(args.traces).is_file():
        raise UsageError(f"--traces {args.traces!r} does not exist")

    import torch

    from labeling.occlusion import OcclusionLabeler, resolve_replacement
    from models.loading import load_model
    from core.records import read_jsonl
    from tasks.generation import generate, stop_token_ids
    from tasks.grading import extract_answer, is_equivalent

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu", dtype="float32")
    if args.traces is not None:
        traces = list(read_jsonl(args.traces))[: args.limit]
    else:
        from tasks.datasets import load_problems
        from tasks.prompts import build_prompt_ids

        traces = []
        for problem in load_problems(args.dataset, limit=args.n_traces):
            prompt = build_prompt_ids(lm.tokenizer, problem)
            result = generate(lm, prompt, args.max_new_tokens)
            traces.append({"id": problem.id, "prompt_ids": prompt, "generated_ids": result.generated_ids})
            print(f"generated {problem.id}: {len(result.generated_ids)} tokens", file=sys.stderr)

    def labeler(method: str) -> OcclusionLabeler:
        return OcclusionLabeler(model=lm.model, tokenizer=lm.tokenizer,
                                answer_of=lambda text: extract_answer(text, args.dataset), same=is_equivalent,
                                stop_ids=stop_token_ids(lm.tokenizer, lm.model), window=args.window,
                                stride=args.stride, replacement=resolve_replacement(lm.tokenizer, args.replacement),
                                max_answer_tokens=args.max_answer_tokens, batch_size=args.batch_size, method=method)

    naive, fast = labeler("naive"), labeler("fast")
    rows, groups = [], []
    print(f"{'trace':<36} {'tokens':>6} {'windows':>7} {'flips':>5} {'naive s':>8}  identical")
    for first in range(0, len(traces), args.traces_per_batch):
        group = traces[first:first + args.traces_per_batch]
        pairs = [(t["prompt_ids"], t["generated_ids"]) for t in group]
        start = time.perf_counter()
        fast_records = fast.label_many(pairs)
        fast_s = time.perf_counter() - start
        naive_s = 0.0
        for trace, pair, b in zip(group, pairs, fast_records):
            start = time.perf_counter()
            a = naive.label(*pair)
            seconds = time.perf_counter() - start
            if a["status"] != "labelled" or b["status"] != "labelled":
                print(f"{str(trace['id'])[-36:]:<36} skipped: {a.get('reason')} / {b.get('reason')}")
                continue
            naive_s += seconds
            identical = a == b  # labels, windows with their answers, reference text: everything
            row = {"trace": str(trace["id"]), "tokens": a["n_tokens"], "windows": len(a["windows"]),
                   "flips": sum(w["flipped"] for w in a["windows"]), "naive_s": seconds, "identical": identical}
            rows.append(row)
            print(f"{row['trace'][-36:]:<36} {row['tokens']:>6} {row['windows']:>7} {row['flips']:>5} "
                  f"{row['naive_s']:>8.1f}  {'yes' if identical else 'NO'}")
        if naive_s:
            groups.append({"traces": [str(t["id"]) for t in group], "naive_s": naive_s, "fast_s": fast_s,
                           "ratio": naive_s / fast_s})
            print(f"  group of {len(group)}: naive {naive_s:.1f} s, fast {fast_s:.1f} s, ratio {naive_s / fast_s:.2f}")
    if not rows:
        raise UsageError("no trace had a reasoning span of at least one window")
    summary = {
        "traces": len(rows),
        "windows": sum(r["windows"] for r in rows),
        "median_group_ratio": statistics.median(g["ratio"] for g in groups),
        "total_ratio": sum(g["naive_s"] for g in groups) / sum(g["fast_s"] for g in groups),
        "all_identical": all(r["identical"] for r in rows),
        "settings": {**{k: v for k, v in vars(args).items() if k != "json"}, "threads": torch.get_num_threads()},
    }
    print(f"\nnaive / fast: total {summary['total_ratio']:.2f}x (median over groups "
          f"{summary['median_group_ratio']:.2f}x) over {len(rows)} traces, {summary['windows']} windows, "
          f"{torch.get_num_threads()} thread(s), regeneration limit {args.max_answer_tokens}; labels identical: "
          f"{'yes' if summary['all_identical'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "groups": groups, **summary}, indent=2) + "\n")
    return 0 if summary["all_identical"] else 1


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
