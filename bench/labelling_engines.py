"""Occlusion labelling time per trace: kvscope's labeller against vLLM regenerations, and how far their labels agree.

    python bench/labelling_engines.py --traces runs/dense/generations.jsonl --limit 10 --out runs/label-engines

Both label the same dense traces with the same settings (`labeling.labeler.OcclusionConfig`: forced answer, the
exclude rule, the auto filler, 64 answer tokens, unless given): ``hf`` is kvscope's fast labeller (shared prefix
cache, batched windows, drafts verified), ``vllm`` hands every occluded context of a unit to vLLM at once
(`tasks.engines.greedy_continuations`; its prefix cache computes each trace's unchanged prefix once). Seconds per
trace are each engine's wall time over the traces (vLLM's start-up printed, not counted), hf first, then vllm, in
one run, and ``x hf`` is hf's time over the engine's. Agreement (`labeling.agreement`): Cohen's kappa per
position and per window, and how window outcomes move between the two.

Writes, with ``--out DIR``: ``labelling.csv``, ``agreement.csv``, both engines' ``labels-<engine>.jsonl`` and
``config.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import set_threads, table  # noqa: E402
from core.cli import ArgumentParser, main_guard, memory_size, positive_int  # noqa: E402
from core.errors import UsageError  # noqa: E402
from labeling.job import check_labelling  # noqa: E402

ENGINES = ("hf", "vllm")


def label_with(engine_name: str, traces, config, dataset: str | None, model: str):
    """(labels, seconds labelling, seconds starting the engine) of `traces` with engine `engine_name`."""
    from labeling.labeler import OcclusionLabeler, label_traces
    from models.loading import load_model
    from tasks.engines import load_engine

    lm = load_model(model, device="cpu", dtype=config.dtype)
    labeler = OcclusionLabeler.for_model(lm, dataclasses.replace(config, engine=engine_name), dataset)
    started = time.perf_counter()
    if engine_name != "hf":
        labeler.engine = load_engine(engine_name, model, batch_size=config.batch_size, dtype=config.dtype)
    start_s = time.perf_counter() - started
    try:
        started = time.perf_counter()
        labels = label_traces(labeler, traces)
        return labels, time.perf_counter() - started, start_s
    finally:
        if labeler.engine is not None:
            labeler.engine.close()


def build_parser():
    from labeling.labeler import OcclusionConfig

    defaults = OcclusionConfig()
    parser = ArgumentParser(prog="python bench/labelling_engines.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", required=True, help="dense traces (a tasks.run generations.jsonl)")
    parser.add_argument("--limit", type=positive_int, default=10, help="the first N correctly answered traces "
                        "(default 10; every trace with --include-incorrect)")
    parser.add_argument("--include-incorrect", action="store_true", help="label wrongly answered traces too")
    parser.add_argument("--no-force-answer", action="store_true",
                        help="regenerate from the answer boundary instead of after the trace's answer cue")
    parser.add_argument("--replacement", default=defaults.replacement, help="the filler (labeling.replacement)")
    parser.add_argument("--max-answer-tokens", type=positive_int, default=64,
                        help="regeneration limit per context (default 64)")
    parser.add_argument("--traces-per-batch", type=positive_int, default=defaults.traces_per_batch,
                        help=f"traces per unit (default {defaults.traces_per_batch})")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads for hf")
    parser.add_argument("--max-memory", type=memory_size, default=None,
                        help="the memory kvscope's labeller may use, with its unit (e.g. 8GiB): settings whose "
                        "estimated peak exceeds it are refused before anything runs (default: this machine's memory)")
    parser.add_argument("--out", default=None, help="also write the tables, both label sets and config.json here")
    return parser


def _run(argv: list[str] | None) -> int:
    from core.rundir import RunDir
    from core.schemas import Trace, read_records
    from labeling.agreement import label_agreement
    from labeling.labeler import OcclusionConfig, select_traces
    from tasks.engines import check_engine
    from validation.report import write_csv

    args = build_parser().parse_args(argv)
    config = OcclusionConfig(replacement=args.replacement, max_answer_tokens=args.max_answer_tokens,
                             include_incorrect=args.include_incorrect, force_answer=not args.no_force_answer,
                             traces_per_batch=args.traces_per_batch)
    traces = select_traces(read_records(args.traces, Trace), config)[: args.limit]
    if not traces:
        raise UsageError(f"--traces {args.traces!r}: no trace to label (pass --include-incorrect?)")
    models, datasets = {t.model for t in traces}, {t.dataset for t in traces}
    if len(models) != 1 or len(datasets) != 1:
        raise UsageError(f"--traces {args.traces!r}: the traces name {sorted(models)} and "
                         f"{sorted(datasets, key=str)}; give the traces of one model on one dataset")
    model, dataset = models.pop(), datasets.pop()
    check_labelling(model, traces, config, args.max_memory, f"--traces {args.traces}")
    if args.threads is not None:
        set_threads(args.threads)
    identity = {k: v for k, v in vars(args).items() if k not in ("out", "threads", "max_memory")}
    with RunDir(args.out, identity) if args.out else contextlib.nullcontext() as run:
        check_engine("vllm")  # last: every setting and --out are checked first, with or without vLLM here
        results, rows = {}, []
        for engine in ENGINES:
            labels, seconds, start_s = label_with(engine, traces, config, dataset, model)
            results[engine] = labels
            labelled = sum(label.labelled for label in labels)
            print(f"{engine}: {labelled} of {len(labels)} traces labelled in {seconds:.1f} s"
                  + (f" (engine start-up {start_s:.0f} s, not counted)" if engine != "hf" else ""), flush=True)
            rows.append({"model": model, "engine": engine, "traces": len(labels), "labelled": labelled,
                         "windows": sum(len(label.windows or []) for label in labels), "seconds": seconds,
                         "s_per_trace": seconds / len(labels), "start_s": start_s})
        for row in rows:
            row["x_hf"] = rows[0]["seconds"] / row["seconds"]
        found = label_agreement(results["hf"], results["vllm"])
        agreement = [{"model": model, "traces": found.traces, "positions": found.positions,
                      "kappa": found.kappa, "windows": found.windows, "window_kappa": found.window_kappa,
                      "window_agreement": found.window_agreement, "flipped_hf": found.flipped_a,
                      "flipped_vllm": found.flipped_b,
                      "outcomes_moved": json.dumps({k: n for k, n in found.outcome_pairs.items()
                                                    if k.split(" -> ")[0] != k.split(" -> ")[1]})}]
        print("\n" + table(rows, [("engine", "engine", ""), ("traces", "traces", "d"), ("windows", "windows", "d"),
                                  ("seconds", "seconds", ".1f"), ("s_per_trace", "s/trace", ".2f"),
                                  ("x_hf", "x hf", ".2f")]))
        print("\n" + table(agreement, [("model", "model", ""), ("traces", "traces", "d"), ("kappa", "kappa", ".3f"),
                                       ("windows", "windows", "d"), ("window_kappa", "window kappa", ".3f"),
                                       ("outcomes_moved", "outcomes moved", "")]))
        if run is not None:
            write_csv(run.path / "labelling.csv", rows)
            write_csv(run.path / "agreement.csv", agreement)
            for engine, labels in results.items():
                (run.path / f"labels-{engine}.jsonl").write_text(
                    "".join(json.dumps(label.to_json()) + "\n" for label in labels))
            run.save_config(**identity, labelling=config.to_json())
            print(f"\nwritten to {run.path}/")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
