"""Dense generation: HF one sequence at a time, HF batched and vLLM, tokens/s and how often their greedy tokens agree.

    python bench/generation_throughput.py                       # SmolLM2 and Qwen2.5-0.5B, 32 GSM8K problems
    python bench/generation_throughput.py --models smollm2-135m --problems 8 --settings hf-1,hf-8 --out runs/gen
    python bench/generation_throughput.py --settings hf-1,vllm-32 --problems 12 --max-new-tokens 512   # agreement

Every setting greedily continues the same chat prompts of the first ``--problems`` GSM8K problems (each stopping at
its model's stop tokens or ``--max-new-tokens``), the settings of one model interleaved repeat by repeat
(`bench.common.interleaved`). A setting is ``<engine>-<batch size>``: ``hf-1`` is `tasks.generation.generate`, one
problem at a time (the baseline), ``hf-N`` continuous batching of N (`tasks.generation.generate_batch`), ``vllm-N``
vLLM with at most N requests in flight (one engine per model, started once with the largest N; its start-up is
printed, not counted). ``tok/s`` is every generated token over the setting's wall time; ``x hf-1`` its ratio to
``hf-1`` of the same model in the same run. Medians over ``--repeats``.

Agreement: each setting's tokens (first repeat) against ``hf-1``'s, prompt by prompt: how many are identical (with a
Wilson interval) and, where they differ, the first position that does (a shorter output that is a prefix of the
other diverges at its end). HF batched rows should agree except at exact near-ties of the top two logits; vLLM's
kernels and summation order differ from transformers', so its agreement is a measurement, not a guarantee.

Labelling time, kvscope's labeller against vLLM regenerations, is `bench/labelling_engines.py`.

Writes, with ``--out DIR``: ``throughput.csv``, ``agreement.csv`` and ``config.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import interleaved, median, set_threads, table  # noqa: E402
from core.cli import ArgumentParser, distinct, main_guard, memory_size, positive_int  # noqa: E402
from core.errors import UsageError  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-0.5b")
SETTINGS = ("hf-1", "hf-8", "hf-32", "vllm-1", "vllm-8", "vllm-32")
BASELINE = "hf-1"


def parse_settings(text: str) -> list[tuple[str, int]]:
    """``"hf-1,vllm-8"`` -> ``[("hf", 1), ("vllm", 8)]``; the baseline ``hf-1`` is always measured, first."""
    settings = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        match = re.fullmatch(r"(hf|vllm)-([1-9][0-9]*)", item)
        if not match:
            raise UsageError(f"--settings: {item!r} is not <engine>-<batch size> with engine hf or vllm (e.g. hf-8)")
        settings.append((match[1], int(match[2])))
    distinct("--settings", text, [f"{engine}-{size}" for engine, size in settings])
    return [("hf", 1)] + [s for s in settings if s != ("hf", 1)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a strict prefix diverges at its end); None if identical."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement_row(model: str, setting: str, outputs: list[list[int]], reference: list[list[int]]) -> dict:
    from validation.stats import wilson_interval

    divergences = [first_divergence(a, b) for a, b in zip(outputs, reference)]
    differing = sorted(d for d in divergences if d is not None)
    same = len(divergences) - len(differing)
    lo, hi = wilson_interval(same, len(divergences))
    return {"model": model, "setting": setting, "traces": len(divergences), "identical": same,
            "identical_share": same / len(divergences), "identical_lo": lo, "identical_hi": hi,
            "median_first_divergence": median(differing), "first_divergences": " ".join(map(str, differing))}


def measure_model(model: str, settings: list[tuple[str, int]], args) -> tuple[list[dict], list[dict]]:
    from models.loading import load_model
    from tasks.datasets import load_problems
    from tasks.engines import HFEngine, VLLMEngine
    from tasks.generation import Request, generate
    from tasks.prompts import build_prompt_ids

    lm = load_model(model, device="cpu", dtype="float32")
    problems = load_problems("gsm8k", data_file=args.data_file, limit=args.problems)
    prompts = [build_prompt_ids(lm.tokenizer, p) for p in problems]
    requests = [Request(tuple(ids), args.max_new_tokens) for ids in prompts]
    generate(lm, prompts[0], 4)  # first-call costs (allocator, kernels) stay out of the baseline
    vllm_sizes = [size for engine, size in settings if engine == "vllm"]
    with contextlib.ExitStack() as stack:
        engines = {f"hf-{size}": HFEngine(lm, size) for engine, size in settings if engine == "hf"}
        if vllm_sizes:
            start = time.perf_counter()
            served = stack.enter_context(VLLMEngine.load(model, batch_size=max(vllm_sizes), dtype="float32"))
            print(f"{model}: vLLM {served.ready['version']} started in {time.perf_counter() - start:.0f} s", flush=True)
        outputs: dict[str, list[list[int]]] = {}

        def run(name: str) -> dict:
            engine, size = name.split("-")
            if engine == "vllm":
                served.batch_size = int(size)  # requests in flight, at most the max_num_seqs it started with
            start = time.perf_counter()
            results = dict((served if engine == "vllm" else engines[name]).stream(requests))
            wall = time.perf_counter() - start
            tokens = [results[i].generated_ids for i in range(len(requests))]
            outputs.setdefault(name, tokens)
            generated = sum(len(t) for t in tokens)
            return {"wall_s": wall, "tokens": generated, "tok_s": generated / wall}

        names = [f"{engine}-{size}" for engine, size in settings]
        print(f"{model}: {len(requests)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
              f"up to {args.max_new_tokens} new tokens; settings {', '.join(names)}", flush=True)
        results = interleaved(names, args.repeats, run)
    baseline = median([r["tok_s"] for r in results[BASELINE]])
    rows = []
    for name in names:
        tok_s = median([r["tok_s"] for r in results[name]])
        assert tok_s is not None and baseline is not None  # every run measures tok_s
        engine, size = name.split("-")
        rows.append({"model": model, "setting": name, "engine": engine, "batch": int(size), "problems": len(requests),
                     "tokens": results[name][0]["tokens"], "wall_s": median([r["wall_s"] for r in results[name]]),
                     "tok_s": tok_s, "x_hf1": tok_s / baseline})
    agreement = [agreement_row(model, name, outputs[name], outputs[BASELINE]) for name in names if name != BASELINE]
    return rows, agreement


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python bench/generation_throughput.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated models (default {','.join(MODELS)})")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated <engine>-<batch size>, engine hf or vllm (default {','.join(SETTINGS)}; "
                        f"{BASELINE}, the baseline, is always measured)")
    parser.add_argument("--problems", type=positive_int, default=32,
                        help="the first N GSM8K test problems, one prompt each (default 32)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                        help="generation limit per prompt (default 128)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="interleaved repeats per setting (default 1)")
    parser.add_argument("--data-file", default=None,
                        help="GSM8K JSONL file (default: $KVSCOPE_DATA_DIR/gsm8k_test.jsonl)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads for the HF settings (default: torch's, all cores; vLLM sets its own)")
    parser.add_argument("--max-memory", type=memory_size, default=None,
                        help="the memory the HF settings may use, with its unit (e.g. 8GiB): a setting whose "
                        "estimated peak exceeds it is refused before anything runs (default: this machine's memory)")
    parser.add_argument("--out", default=None, help="also write throughput.csv, agreement.csv and config.json here")
    return parser


def check_memory(models: list[str], settings: list[tuple[str, int]], args) -> None:
    """Refuse a run whose prompts and --max-new-tokens exceed a model's context, or whose largest HF batch would need
    more memory than this machine has or --max-memory allows (`tasks.generation.generation_footprint`; vLLM sizes its
    own cache in its own process)."""
    from core.limits import MemoryLimit
    from models.footprint import model_shape
    from models.loading import load_tokenizer, model_limits
    from tasks.datasets import load_problems
    from tasks.generation import generation_footprint
    from tasks.prompts import build_prompt_ids

    problems = load_problems("gsm8k", data_file=args.data_file, limit=args.problems)
    batch = max(size for engine, size in settings if engine == "hf")
    for model in models:
        tokenizer = load_tokenizer(model)
        lengths = [len(build_prompt_ids(tokenizer, problem)) for problem in problems]
        model_limits(model).check_tokens(f"a prompt of {max(lengths)} tokens + --max-new-tokens {args.max_new_tokens}",
                                         max(lengths) + args.max_new_tokens)
        generation_footprint(model_shape(model, "float32", "cpu"), lengths, args.max_new_tokens, batch).check(
            f"{model} decoding hf-{batch} ({max(lengths)} prompt + --max-new-tokens {args.max_new_tokens} tokens)",
            MemoryLimit.of("cpu", args.max_memory), "lower --settings' hf batch sizes or --max-new-tokens")


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from core.rundir import RunDir
    from models.loading import check_model_name
    from tasks.engines import check_engine
    from validation.report import write_csv

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in models:
        check_model_name(model)
    distinct("--models", args.models, models)
    settings = parse_settings(args.settings)
    if any(engine == "vllm" for engine, _ in settings):
        check_engine("vllm")
    check_memory(models, settings, args)
    if args.threads is not None:
        set_threads(args.threads)
    identity = {k: v for k, v in vars(args).items() if k not in ("out", "threads", "max_memory")}
    with RunDir(args.out, identity) if args.out else contextlib.nullcontext() as run:
        throughput, agreement = [], []
        for model in models:
            rows, agrees = measure_model(model, settings, args)
            throughput += rows
            agreement += agrees
        print("\n" + table(throughput, [("model", "model", ""), ("setting", "setting", ""),
                                        ("problems", "problems", "d"), ("tokens", "tokens", "d"),
                                        ("wall_s", "wall s", ".1f"), ("tok_s", "tok/s", ".1f"),
                                        ("x_hf1", "x hf-1", ".2f")]))
        if agreement:
            print("\nagreement with hf-1 (greedy tokens, prompt by prompt)\n" + table(agreement, [
                ("model", "model", ""), ("setting", "setting", ""), ("traces", "traces", "d"),
                ("identical", "identical", "d"), ("identical_share", "share", ".2f"), ("identical_lo", "lo", ".2f"),
                ("identical_hi", "hi", ".2f"), ("median_first_divergence", "median div", ".0f"),
                ("first_divergences", "first divergences", "")]))
        if run is not None:
            write_csv(run.path / "throughput.csv", throughput)
            write_csv(run.path / "agreement.csv", agreement)
            run.save_config(**identity)
            print(f"\nwritten to {run.path}/ (throughput.csv, agreement.csv, config.json)")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
