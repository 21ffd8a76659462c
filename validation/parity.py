"""Are these traces the model's own greedy tokens? Teacher-forced greedy parity of dense traces.

    python -m validation.parity --traces runs/qwen15-gsm8k-traces/generations.jsonl --out runs/parity

Traces decoded by another engine (vLLM), by batched decoding or on another machine need not be the tokens kvscope's
own decoding gives: kernels and summation order differ, and greedy decoding follows whichever of two nearly tied
tokens rounding favours. Every later stage teacher-forces the trace it is given, so a difference changes *which*
traces were studied, not how they were analysed; this measures how often it happens, where, and how close the call was.

Each trace is teacher-forced through the model once (one forward over its prompt and generated tokens), and at every
generated position, the stop token included, the model's greedy choice given the trace so far is compared with the
token the trace holds. A position agrees when the trace's token attains the maximum logit (an exact tie agrees either
way). A trace is *identical* when every position agrees: kvscope's greedy decoding from the same prompt would reproduce
it token for token, up to the difference between one forward over the sequence and decoding it step by step (about
1e-6 of a logit in float32, which decides only such a tie). Where they differ, ``first_divergence`` is the first
generated position that does, ``margin`` the model's largest logit minus its logit of the trace's token there (near
zero: a near-tie that rounding decided; large: a different computation) and ``rank`` the trace token's rank among the
model's choices (1: its runner-up). A trace cut at the length limit is checked over the tokens it has. Compare in the
dtype the traces were made in (``--dtype``): a bfloat16 trace against a float32 forward measures the dtype too.

Refused, one line each, before the model loads: sampled traces (their tokens are draws, not argmaxes) and traces
generated under eviction (their tokens follow an evicted cache).

Writes ``parity.jsonl`` (one record per trace, in trace order; a rerun resumes), ``summary.json`` (`summarize`) and
``config.json``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.cli import ArgumentParser, add_device_arguments, main_guard, positive_int
from core.errors import UsageError
from core.limits import MemoryLimit
from core.rundir import RunDir
from core.schemas import Trace
from models.footprint import forward_footprint, model_shape
from signals.traces import read_dense_traces, traces_model
from validation.report import write_json
from validation.stats import wilson_interval


@dataclass(frozen=True)
class Divergence:
    """Where a trace first leaves the model's greedy path: its generated `position`, the model's largest logit minus
    its logit of the trace's token (`margin` > 0), and that token's `rank` among the model's choices (1: runner-up)."""

    position: int
    margin: float
    rank: int


def greedy_divergence(logits: torch.Tensor, tokens: torch.Tensor) -> Divergence | None:
    """The first row of `logits` [G, vocab] whose largest logit exceeds its logit of `tokens` [G]: row i holds the
    model's logits for the i-th generated token given everything before it. None when the trace's token attains the
    maximum in every row (ties agree)."""
    chosen = logits.gather(1, tokens[:, None])[:, 0]  # [G]
    best = logits.max(dim=1).values  # [G]
    behind = (chosen < best).nonzero()
    if behind.numel() == 0:
        return None
    i = int(behind[0, 0])
    return Divergence(position=i, margin=float(best[i] - chosen[i]), rank=int((logits[i] > chosen[i]).sum()))


@torch.inference_mode()
def trace_parity(lm: Any, trace: Trace) -> dict[str, Any]:
    """`trace`'s parity record: one forward of its tokens through `lm` (a `models.lm.LoadedModel`), the logits of the
    generated positions only."""
    generated = len(trace.generated_ids)
    if generated == 0:
        divergence = None
    else:
        # Position j predicts token j + 1, so the inputs stop one short and the last `generated` positions are kept.
        ids = torch.tensor([trace.token_ids[:-1]], device=lm.device)  # [1, P + G - 1]
        logits = lm.model(input_ids=ids, logits_to_keep=generated).logits[0].float()  # [G, vocab]
        divergence = greedy_divergence(logits, torch.tensor(trace.generated_ids, device=lm.device))
    engine = trace.extra.get("engine") or {"name": "hf"}
    return {"id": trace.id, "model": trace.model, "engine": engine.get("name"), "generated": generated,
            "finish_reason": trace.finish_reason, "correct": trace.correct, "identical": divergence is None,
            "first_divergence": None if divergence is None else divergence.position,
            "margin": None if divergence is None else divergence.margin,
            "rank": None if divergence is None else divergence.rank}


def summarize(records: Sequence[dict[str, Any]], level: float = 0.95) -> dict[str, Any]:
    """Identical traces (count, share, Wilson interval over traces), where the others diverge (positions, as
    fractions of their length) and how close the call was there (margins, ranks)."""
    n = len(records)
    if n == 0:
        raise UsageError("no trace to summarize")
    identical = sum(r["identical"] for r in records)
    lo, hi = wilson_interval(identical, n, level)
    diverged = [r for r in records if not r["identical"]]
    margins = [r["margin"] for r in diverged]
    return {
        "traces": n, "identical": identical, "identical_share": identical / n, "identical_lo": lo, "identical_hi": hi,
        "level": level, "generated_tokens": sum(r["generated"] for r in records),
        "engines": sorted({str(r["engine"]) for r in records}),
        "first_divergences": [r["first_divergence"] for r in diverged],
        "median_first_divergence": statistics.median(r["first_divergence"] for r in diverged) if diverged else None,
        "median_divergence_fraction": (statistics.median(r["first_divergence"] / r["generated"] for r in diverged)
                                       if diverged else None),
        "margins": margins, "median_margin": statistics.median(margins) if margins else None,
        "max_margin": max(margins) if margins else None,
        "runner_up": sum(r["rank"] == 1 for r in diverged),
    }


def describe(summary: dict[str, Any]) -> str:
    """One paragraph: the headline a reader quotes."""
    text = (f"{summary['identical']} of {summary['traces']} traces ({summary['identical_share']:.0%}, "
            f"{summary['level']:.0%} Wilson [{summary['identical_lo']:.2f}, {summary['identical_hi']:.2f}]) are the "
            f"model's greedy tokens at every one of their positions")
    if summary["first_divergences"]:
        text += (f"; the others first leave its greedy path at generated position "
                 f"{', '.join(str(p) for p in summary['first_divergences'])} (median fraction of the trace "
                 f"{summary['median_divergence_fraction']:.2f}), the trace's token behind the model's choice by "
                 f"{summary['median_margin']:.3g} logits in the median (max {summary['max_margin']:.3g}), its "
                 f"runner-up in {summary['runner_up']} of {len(summary['first_divergences'])}")
    return text + "."


def check_greedy(traces: Iterable[Trace], where: str) -> None:
    """Refuse sampled traces: their tokens are draws, so disagreeing with an argmax says nothing."""
    sampled = [t for t in traces if float(t.sampling.get("temperature", 0.0)) > 0]
    if sampled:
        raise UsageError(f"{where}: {len(sampled)} trace(s) were sampled (first {sampled[0].id!r}, temperature "
                         f"{sampled[0].sampling['temperature']}); greedy parity needs greedy traces (temperature 0)")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m validation.parity",
        description="Teacher-force dense traces (from vLLM, batched decoding, another machine) through kvscope's "
        "model and say, per trace, whether every token is the model's greedy choice, and where and by how much the "
        "first one that is not falls behind; writes parity.jsonl, summary.json and config.json.",
    )
    parser.add_argument("--traces", required=True, help="dense greedy traces (a tasks.run generations.jsonl)")
    parser.add_argument("--model", default=None,
                        help="model to check against (registry name, directory, .gguf or hub id); default: the "
                        "traces' model")
    parser.add_argument("--limit", type=positive_int, default=None, help="the first N traces (default: all)")
    add_device_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory: parity.jsonl, summary.json, config.json")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _run(argv: list[str] | None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    where = f"--traces {args.traces}"
    traces = read_dense_traces(args.traces, args.limit)
    if not traces:
        raise UsageError(f"{where}: no trace in the file")
    check_greedy(traces, where)
    model_name = traces_model(traces, args.model, where)
    longest = max(len(trace.token_ids) for trace in traces)
    generated = max(len(trace.generated_ids) for trace in traces)
    forward_footprint(model_shape(model_name, args.dtype, args.device), 1, longest, logits=generated).check(
        f"{model_name} reading traces of up to {longest} tokens ({where})",
        MemoryLimit.of(args.device, args.max_memory), "use shorter traces")
    identity = {"traces": str(Path(args.traces).resolve()), "model": model_name, "limit": args.limit,
                "dtype": args.dtype}
    with RunDir(args.out, identity) as run:
        from models.loading import load_model

        store = run.store("parity.jsonl")  # a damaged output is refused before the model loads
        lm = load_model(model_name, device=args.device, dtype=args.dtype)
        run.save_config(loaded_model=lm.describe())
        todo = [t for t in traces if t.id not in store]
        for trace in tqdm(todo, desc="parity", unit="trace", file=sys.stderr, disable=args.quiet):
            store.append(trace_parity(lm, trace))
        by_id = {r["id"]: r for r in store.records}
        summary = summarize([by_id[t.id] for t in traces])
        write_json(run.path / "summary.json", {**summary, "model": model_name, "traces_file": args.traces})
    print(describe(summary))
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
