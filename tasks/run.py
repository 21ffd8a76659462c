"""Generate and grade answers to benchmark problems: ``python -m tasks.run --model M --dataset D --limit N``.

Writes into ``--out`` (default ``runs/<dataset>-<model>``):

- ``generations.jsonl``: one record per problem, appended as soon as it is graded (id, dataset, model, prompt_ids,
  generated_ids, text, answer, gold, correct, finish_reason, empty_output, no_answer, timings);
- ``summary.json``: accuracy and counts over the requested problems;
- ``config.json``: the resolved configuration.

Rerunning the same command after an interruption skips the problems already in ``generations.jsonl`` and continues;
a directory holding a run with different generation settings is refused rather than mixed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from core.cli import ArgumentParser, atomic_write, main_guard, positive_int, save_config
from core.errors import UsageError
from models.registry import DEFAULT_MODEL, REGISTRY
from tasks.datasets import DATASETS, Problem, load_problems, resolve_source

# Settings that change what a record contains: a resumed run must match them exactly.
RUN_IDENTITY = ("model", "dataset", "data_source", "max_new_tokens", "temperature", "seed", "dtype")


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m tasks.run",
        description="Generate answers to benchmark problems with a causal LM, grade them, and write per-problem "
        "records (resumable) plus an accuracy summary.",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"registry name ({', '.join(sorted(REGISTRY))}), a local HF model directory, a .gguf file or a hub id "
        f"(default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--dataset", required=True, help=f"benchmark to run: {', '.join(DATASETS)}")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="run only the first N problems of the dataset (default: all)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=512,
                        help="stop a generation after this many new tokens (finish_reason 'length'; default: 512)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="0 = greedy decoding (default); > 0 samples from the softmax at this temperature")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for sampling; problem i uses seed + i, so reruns and resumes reproduce (default: 0)")
    parser.add_argument("--data-file", default=None,
                        help="read problems from this JSONL file instead of $KVSCOPE_DATA_DIR or the hub")
    parser.add_argument("--out", default=None, help="output directory (default: runs/<dataset>-<model>)")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--quiet", action="store_true", help="do not print a line per problem")
    return parser


def _default_out(model: str, dataset: str) -> Path:
    return Path("runs") / f"{dataset}-{Path(model).name.removesuffix('.gguf')}"


def _check_resumable(out: Path, identity: dict) -> None:
    """Refuse an output directory that holds a run with different generation settings."""
    config_path = out / "config.json"
    if not config_path.exists():
        return
    try:
        previous = json.loads(config_path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{config_path} is not valid JSON; use another --out") from None
    diffs = [f"{k} {previous.get(k)!r} vs {identity[k]!r}" for k in RUN_IDENTITY if previous.get(k) != identity[k]]
    if diffs:
        raise UsageError(f"--out {str(out)!r} holds a different run ({'; '.join(diffs)}); use another --out")


def _record(problem: Problem, model_name: str, prompt_ids: list[int], result, graded: dict) -> dict:
    return {
        "id": problem.id,
        "dataset": problem.dataset,
        "model": model_name,
        "prompt_ids": prompt_ids,
        "generated_ids": result.generated_ids,
        "text": result.text,
        "answer": graded["answer"],
        "extracted_by": graded["extracted_by"],
        "gold": problem.answer,
        "correct": graded["correct"],
        "finish_reason": result.finish_reason,
        "empty_output": not result.text.strip(),
        "no_answer": graded["no_answer"],
        "timings": {
            "prefill_s": round(result.prefill_s, 4),
            "decode_s": round(result.decode_s, 4),
            "tokens_per_s": round(result.tokens_per_s, 3),
        },
    }


def summarize(records: list[dict]) -> dict:
    n = len(records)
    speeds = [r["timings"]["tokens_per_s"] for r in records if r["timings"]["tokens_per_s"] > 0]
    return {
        "problems": n,
        "correct": sum(r["correct"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / n if n else 0.0,
        "no_answer": sum(r["no_answer"] for r in records),
        "empty_output": sum(r["empty_output"] for r in records),
        "truncated": sum(r["finish_reason"] == "length" for r in records),
        "generated_tokens": sum(len(r["generated_ids"]) for r in records),
        "median_tokens_per_s": statistics.median(speeds) if speeds else 0.0,
    }


def _short(text: str | None, width: int) -> str:
    text = "-" if text is None else " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(records: list[dict]) -> str:
    header = f"{'#':>3}  {'id':<36} {'gold':<18} {'answer':<18} {'ok':<3} {'tokens':>6} {'finish':<6} {'tok/s':>6}"
    lines = [header, "-" * len(header)]
    for i, r in enumerate(records, start=1):
        lines.append(
            f"{i:>3}  {_short(r['id'], 36):<36} {_short(r['gold'], 18):<18} {_short(r['answer'], 18):<18} "
            f"{'yes' if r['correct'] else 'no':<3} {len(r['generated_ids']):>6} {r['finish_reason']:<6} "
            f"{r['timings']['tokens_per_s']:>6.1f}"
        )
    return "\n".join(lines)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # Everything that can be wrong with the input is checked before the output directory is created.
    problems = load_problems(args.dataset, data_file=args.data_file, limit=args.limit)
    out = Path(args.out) if args.out else _default_out(args.model, args.dataset)
    identity = {
        "model": args.model, "dataset": args.dataset, "data_source": resolve_source(args.dataset, args.data_file),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
        "dtype": args.dtype,
    }
    _check_resumable(out, identity)

    from tqdm import tqdm

    from models.loading import load_model
    from core.records import JsonlStore
    from tasks.generation import generate
    from tasks.grading import grade
    from tasks.prompts import build_prompt_ids, uses_chat_template

    lm = load_model(args.model, device=args.device, dtype=args.dtype)

    out.mkdir(parents=True, exist_ok=True)
    save_config(out, {
        **identity, "limit": args.limit, "out": str(out), "loaded_model": lm.describe(),
        "prompt_format": "chat_template" if uses_chat_template(lm.tokenizer) else "plain (no chat template)",
    })
    store = JsonlStore(out / "generations.jsonl", key=lambda r: r["id"])
    todo = [(i, p) for i, p in enumerate(problems) if p.id not in store]
    if len(todo) < len(problems):
        print(f"resuming: {len(problems) - len(todo)} of {len(problems)} problems already in {store.path}")
    say = (lambda *_: None) if args.quiet else tqdm.write
    try:
        with tqdm(total=len(problems), initial=len(problems) - len(todo), desc=f"{args.dataset}", unit="problem",
                  file=sys.stderr) as bar:
            for index, problem in todo:
                prompt_ids = build_prompt_ids(lm.tokenizer, problem)
                result = generate(lm, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed + index)
                record = _record(problem, args.model, prompt_ids, result, grade(result.text, problem))
                store.append(record)
                bar.update(1)
                say(f"[{problem.id}] gold={_short(problem.answer, 30)} answer={_short(record['answer'], 30)} "
                    f"{'correct' if record['correct'] else 'wrong'} ({len(result.generated_ids)} tokens, "
                    f"{record['finish_reason']}, {record['timings']['tokens_per_s']:.1f} tok/s)")
    except KeyboardInterrupt:
        print(f"\ninterrupted; {len(store.records)} records are saved in {store.path}; rerun the same command to resume",
              file=sys.stderr)
        return 130

    wanted = {p.id for p in problems}
    records = [r for r in store.records if r["id"] in wanted]
    summary = {**summarize(records), "model": args.model, "dataset": args.dataset}
    with atomic_write(out / "summary.json") as handle:
        json.dump(summary, handle, indent=2)
        handle.write("\n")
    print(format_table(records))
    print(
        f"\n{args.dataset} with {args.model}: accuracy {summary['accuracy']:.1%} ({summary['correct']}/{summary['problems']}); "
        f"no answer {summary['no_answer']}, empty {summary['empty_output']}, hit max-new-tokens {summary['truncated']}; "
        f"median {summary['median_tokens_per_s']:.1f} tok/s\nwritten to {out}/ (generations.jsonl, summary.json, config.json)"
    )
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
