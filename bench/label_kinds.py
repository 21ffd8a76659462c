"""Every label kind on the same traces: seconds per trace and the ratio to token occlusion, and what each speed-up
of the token labeller buys.

    python bench/label_kinds.py --traces runs/qwen05-traces40.jsonl --model qwen2.5-0.5b --limit 6

Variants, each labelling the same traces one unit at a time, interleaved over `--repeats` rounds (the order rotates
each round, so a busy stretch of a shared machine does not land on one variant):

- ``token-before``: token occlusion as it was before graded labels: the answer read from the cue and the whole
  continuation, which decodes to ``--max-answer-tokens`` after the forced answer has closed, and each joining row
  prefilled alone;
- ``token-stop``: regeneration stops once the forced answer is complete (graded scores not read);
- ``token-stop-joined``: also the joining rows prefilled together;
- ``token``: the default labeller: both, plus graded effects read from the verifying forward (the ratio to
  ``token-stop-joined`` is the graded labels' cost);
- ``cache``: cache-level labels of the same windows (``--heads all``);
- ``joint``: joint labels at ``--budget`` with ``--draws`` keep-sets (also reported per draw).

Printed: per variant the median seconds per trace over rounds, its ratio to ``token-before`` and to ``token``, and
whether ``token`` gives ``token-before``'s window outcomes (the windows that differ are listed with both answers:
reading the forced box itself, not a later box the continuation writes, changes a few). Ratios are the result; the
seconds are noise on a shared machine.
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

from core.cli import (  # noqa: E402
    ArgumentParser,
    check_output_file,
    distinct,
    main_guard,
    memory_size,
    positive_int,
    unit_interval,
    write_json,
)
from core.errors import UsageError  # noqa: E402
from labeling.job import check_labelling  # noqa: E402

VARIANTS = ("token-before", "token-stop", "token-stop-joined", "token", "cache", "joint")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python bench/label_kinds.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", required=True, help="dense trace records (tasks.run generations.jsonl)")
    parser.add_argument("--model", default=None, help="model (default: the traces')")
    parser.add_argument("--limit", type=positive_int, default=4, help="the first N correctly answered traces (4)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="rounds over every variant (default 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list of variants to time (default all: {','.join(VARIANTS)})")
    parser.add_argument("--budget", type=unit_interval, default=0.25, help="joint labels' budget (default 0.25)")
    parser.add_argument("--draws", type=positive_int, default=128, help="joint labels' keep-sets per trace (128)")
    parser.add_argument("--max-answer-tokens", type=positive_int, default=64,
                        help="regeneration limit per window (default 64, the study's with a forced answer)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--max-memory", type=memory_size, default=None,
                        help="the memory the labellers may use, with its unit (e.g. 8GiB): settings whose estimated "
                        "peak exceeds it are refused before anything runs (default: this machine's memory)")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    return parser


def _variant(name: str, base) -> tuple[Any, dict[str, Any]]:
    """(config, module patches) of a variant (see the module docstring)."""
    patches: dict[str, Any] = {}
    if name in ("token-before", "token-stop"):
        patches["join_tokens"] = 1  # every joining row prefilled alone, as before rows were prefilled together
    if name in ("token-stop", "token-stop-joined"):
        patches["graded"] = False
    if name == "token-before":
        return dataclasses.replace(base, stop_at_answer=False), patches
    if name in ("cache", "joint"):
        return dataclasses.replace(base, intervention=name), patches
    return base, patches


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise UsageError(f"--variants {args.variants!r}: valid choices: {', '.join(VARIANTS)}")
    distinct("--variants", args.variants, variants)
    if args.json:
        check_output_file(Path(args.json), "--json")

    import torch

    from core.schemas import Trace, read_records
    from labeling import labeler as labeler_module
    from labeling import speculative
    from labeling.labeler import OcclusionConfig, OcclusionLabeler, Unit, select_traces
    from models.loading import load_model

    traces = select_traces(read_records(args.traces, Trace), OcclusionConfig())[: args.limit]
    if not traces:
        raise UsageError(f"--traces {args.traces!r}: no correctly answered trace")
    base = OcclusionConfig(max_answer_tokens=args.max_answer_tokens, budget=args.budget, draws=args.draws)
    model = args.model or traces[0].model
    check_labelling(model, traces, base, args.max_memory, f"--traces {args.traces}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(model, device="cpu", dtype="float32")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    labels: dict[str, list[Any]] = {}
    join_tokens, graded = speculative.JOIN_TOKENS, OcclusionConfig.graded
    for round_index in range(args.repeats):
        order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
        for name in order:
            config, patches = _variant(name, base)
            speculative.JOIN_TOKENS = patches.get("join_tokens", join_tokens)
            if patches.get("graded") is False:  # the verifying forward's scores left unread: the graded labels' cost
                labeler_module.OcclusionConfig.graded = property(lambda self: False)  # type: ignore[method-assign,assignment]
            try:
                labeler = OcclusionLabeler.for_model(lm, config, traces[0].dataset)
                started = time.perf_counter()
                found = [label for trace in traces for label in labeler.label_unit(Unit((trace,)))]
                seconds[name].append((time.perf_counter() - started) / len(traces))
            finally:
                speculative.JOIN_TOKENS = join_tokens
                labeler_module.OcclusionConfig.graded = graded  # type: ignore[method-assign]
            labels.setdefault(name, found)
            print(f"round {round_index + 1} {name:<18} {seconds[name][-1]:7.2f} s per trace", file=sys.stderr)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"\n{len(traces)} traces of {traces[0].model}, {args.repeats} rounds, {torch.get_num_threads()} thread(s); "
          f"median seconds per trace and ratios in the same run")
    print(f"{'variant':<18} {'s/trace':>8} {'x before':>9} {'x token':>8}")
    for name in variants:
        before = median.get("token-before")
        token = median.get("token")
        print(f"{name:<18} {median[name]:8.2f} {before / median[name] if before else float('nan'):9.2f} "
              f"{token / median[name] if token else float('nan'):8.2f}")
    summary: dict[str, Any] = {"median_s": median, "seconds": seconds, "traces": [t.id for t in traces],
                               "settings": {**vars(args), "threads": torch.get_num_threads()}}
    if "joint" in median:
        summary["joint_s_per_draw"] = median["joint"] / args.draws
        print(f"joint labels: {summary['joint_s_per_draw']:.3f} s per draw ({args.draws} draws per trace)")
    if "token-before" in labels and "token" in labels:
        differ = []
        for old, new in zip(labels["token-before"], labels["token"]):
            for a, b in zip(old.windows or [], new.windows or []):
                if a["outcome"] != b["outcome"]:
                    differ.append({"trace": old.id, "start": a["start"], "before": [a["outcome"], a["answer_after"]],
                                   "now": [b["outcome"], b["answer_after"]]})
        windows = sum(len(label.windows or []) for label in labels["token"])
        summary["outcomes_differ"] = differ
        print(f"window outcomes: token gives token-before's on {windows - len(differ)} of {windows} windows"
              + "".join(f"\n  {d['trace']} window at {d['start']}: before {d['before']}, now {d['now']}"
                        for d in differ))
    if args.json:
        write_json(args.json, summary)
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
