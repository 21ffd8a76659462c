"""Teacher-forced eviction: each policy's eviction run on the very trace the model wrote, then its answer forced.

Deploying a policy decodes freely, so a run that evicts differently also writes a different trace, and an accuracy
difference mixes what the cache lost with where the generation wandered. Here every policy sees the same tokens: for
each graded label record (`labeling.answer`: it holds the trace's token ids, its answer boundary, the forced cue and
the reference answer's tokens) and each (policy, budget),

1. an `evictor.engine.Session` under the study's protocol prefills the prompt and teacher-forces the reasoning and the
   answer cue through the evicting decode path (`teacher_block` tokens per forward, a round after each forward: with
   ``teacher_block=1`` the rounds fire exactly as deployed; larger blocks let the cache hold ``teacher_block - 1`` more
   between rounds, the same for every policy, at a fraction of the cost);
2. the cue's last token and then each reference answer token are fed one step at a time, so rounds keep firing as
   in deployment, and the reference answer is scored from the logits (`labeling.answer.score_answer`): its
   log-probability, first-token margin and whether greedy decoding would reproduce it (``greedy``).

A budget in (0, 1] is a fraction of the trace's dense generated length, as the evictor resolves it
(`evictor.protocol.Budget.resolve`). Per (policy, budget) the summary gives the share of traces whose forced answer
greedy decoding reproduces (the offline accuracy), the mean effect (log-probability against the dense reference's),
with Wilson and bootstrap intervals: an offline estimate of what deploying the policy keeps, at a fraction of the
cost of free decoding, with no divergence of the generation.

    python -m evictor.teacher_forced --labels runs/study/stages/labels-KEY/labels.jsonl --policy all \\
        --budget 0.25,0.5 --protocol epikv --protect prompt --out runs/forced
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.cli import ArgumentParser, add_device_arguments, main_guard, positive_int, seed_int
from core.errors import UsageError
from core.paths import portable_path
from core.rundir import RunDir, source_revision
from core.schemas import Label, read_records
from core.seeds import derive_seed
from evictor.protocol import Budget, add_protocol_arguments, parse_budgets, protocol_overrides, resolve_protocol
from evictor.sweep import PER_RUN

DEFAULT_BLOCK = 32
RECORDS = "forced.jsonl"
SUMMARY = "summary.csv"


@dataclass(frozen=True)
class ForcedPlan:
    """What one trace feeds: its prompt, the reasoning and cue to force after it, and the reference answer."""

    id: str
    prompt: list[int]
    stream: list[int]  # reasoning up to the answer boundary, then the cue
    answer: list[int]
    reference_logp: float  # the reference answer's log-probability after the dense context
    generated: int  # the dense trace's generated length: what a fractional budget is a share of

    @classmethod
    def from_label(cls, label: Label) -> ForcedPlan | None:
        """The plan of a graded label record (None for a skipped or ungraded one)."""
        if not label.labelled or not label.graded or label.token_ids is None or label.forced_cue is None:
            return None
        assert label.reasoning_start is not None and label.answer_start is not None  # labelled records have both
        ids, cue = list(label.token_ids), label.forced_cue
        cue_ids = list(cue["ids"]) if cue.get("ids") is not None else ids[cue["start"]:cue["end"]]
        return cls(label.id, ids[:label.reasoning_start], ids[label.reasoning_start:label.answer_start] + cue_ids,
                   list(label.graded["answer_ids"]), float(label.graded["reference_logp"]),
                   len(ids) - label.reasoning_start)


def force_through(engine, plan: ForcedPlan, budget: int, block: int, seed: int) -> dict[str, Any]:
    """One plan through `engine` at K = `budget` (see the module docstring): the answer's score, the rounds that
    evicted and the peak cache slots per KV head."""
    import torch

    from labeling.answer import score_answer

    stream, answer = plan.stream, plan.answer
    logits = []
    steps = len(stream) + len(answer)
    with torch.inference_mode(), engine.session([plan.prompt], [budget], max_new_tokens=steps,
                                                seed=derive_seed(seed, (plan.id,))) as session:
        session.prefill()
        session.begin_decode()
        for start in range(0, len(stream) - 1, block):
            session.append(torch.tensor([stream[start:min(start + block, len(stream) - 1)]], dtype=torch.long))
        for token in [stream[-1], *answer[:-1]]:
            logits.append(session.step(torch.tensor([token], dtype=torch.long))[0])
        session.end_decode()
        rounds, peak = session.rounds[0], max(session.cache_sizes[0])
    score = score_answer(torch.stack(logits), answer)
    return {**score.to_json(), "effect": round(score.logp - plan.reference_logp, 6), "rounds": rounds,
            "peak_slots": peak}


@dataclass(frozen=True, kw_only=True)
class ForcedConfig:
    """A teacher-forced eviction run: graded labels, the policies (with their parameters) and budgets, the protocol.
    Every field but `device` and `max_memory` is part of what the records mean."""

    labels: str
    model: str | None = None  # default: the labels' model
    policies: tuple[str, ...]
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    budgets: tuple[Budget, ...]
    protocol: str = "epikv"
    protocol_settings: dict[str, Any] = field(default_factory=dict)
    teacher_block: int = DEFAULT_BLOCK
    seed: int = 0
    limit: int | None = None
    dtype: str = "float32"
    device: str | None = None
    max_memory: int | None = None  # bytes the run may use (None: the device's memory; `core.limits.MemoryLimit`)

    def identity(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("device")
        data.pop("max_memory")
        return {**data, "labels": portable_path(str(Path(self.labels).resolve())),
                "budgets": [b.to_json() for b in self.budgets]}


def read_plans(path: str, limit: int | None = None) -> tuple[list[ForcedPlan], str]:
    """The plans of a graded label file's labelled records and the model that made them; a `UsageError` when none
    is graded."""
    labels = read_records(path, Label)[:limit]
    plans = [plan for label in labels if (plan := ForcedPlan.from_label(label)) is not None]
    if not plans:
        raise UsageError(f"--labels {path!r}: no labelled record is graded (labels made with a forced answer that "
                         "stops where it ends carry the reference answer's tokens); relabel with python -m "
                         "labeling.occlusion")
    models = {label.model for label in labels}
    if len(models) != 1:
        raise UsageError(f"--labels {path!r} holds labels of {len(models)} models ({sorted(models)}); give one")
    return plans, models.pop()


def check_forced(config: ForcedConfig, model: str, plans: Sequence[ForcedPlan], policies: dict[str, Any]) -> None:
    """Refuse, before anything loads, token counts beyond the model's context (a budget, --teacher-block and the
    protocol's buffer and recency window), a trace it cannot read, and a run whose largest cell would need more memory
    than the device has or --max-memory allows (`evictor.engine.eviction_footprint` of a session fed the longest
    plan at the largest budget)."""
    from core.limits import MemoryLimit
    from evictor.engine import eviction_footprint
    from models.footprint import model_shape
    from models.loading import model_limits

    limits = model_limits(model)
    protocol = resolve_protocol(config.protocol, config.protocol_settings)
    limits.check_flags({"--teacher-block": config.teacher_block, "--buffer": protocol.config.buffer,
                        "--recency": protocol.config.recency})
    for budget in config.budgets:
        if budget.tokens is not None:
            limits.check_tokens(f"--budget {budget}", budget.tokens)
    longest = max(plans, key=lambda plan: len(plan.prompt) + len(plan.stream) + len(plan.answer))
    limits.check_tokens(f"--labels {config.labels}: trace {longest.id}",
                        len(longest.prompt) + len(longest.stream) + len(longest.answer))
    limits.check_token_ids({token for plan in plans for token in (*plan.prompt, *plan.stream, *plan.answer)},
                           f"--labels {config.labels}")
    shape = model_shape(model, config.dtype, config.device)
    fed = len(longest.stream) + len(longest.answer)
    largest = max((b.resolve(longest.generated) for b in config.budgets), default=fed)
    footprint = max((eviction_footprint(shape, policy, protocol.config, [len(longest.prompt)], fed, 1, budget=largest)
                     for policy in policies.values()), key=lambda footprint: footprint.total)
    footprint.check(f"{model} forcing traces of up to {len(longest.prompt) + fed} tokens through eviction",
                    MemoryLimit.of(config.device, config.max_memory), "use shorter traces or a smaller --budget")


def cell_name(policy: str, budget: Budget) -> str:
    return f"{policy}@{budget:g}"


def run_forced(config: ForcedConfig, out: str | Path) -> list[dict[str, Any]]:
    """Every (policy, budget, trace) of `config` into ``out/forced.jsonl`` (resumable), and the summary rows
    (``out/summary.csv``)."""
    from tqdm import tqdm

    from evictor.engine import EvictionEngine
    from evictor.policy import configured_policy
    from models.loading import load_model
    from validation.report import write_csv

    plans, labels_model = read_plans(config.labels, config.limit)
    model = config.model or labels_model
    policies = {name: configured_policy(name, config.policy_params.get(name, {})) for name in config.policies}
    check_forced(config, model, plans, policies)
    with RunDir(Path(out), {"run": "teacher-forced eviction", **config.identity(), "model": model}) as run:
        lm = load_model(model, device=config.device, dtype=config.dtype)
        run.save_config(**{**config.identity(), "model": model}, loaded_model=lm.describe(),
                        n_traces=len(plans), revision=source_revision())
        store = run.store(RECORDS, key="id")
        cells = [(name, budget) for name in config.policies for budget in
                 ([None] if policies[name].scores_nothing else config.budgets)]
        todo = [(name, budget, plan) for name, budget in cells for plan in plans
                if f"{cell_name(name, budget) if budget else name}/{plan.id}" not in store]
        engines: dict[tuple[str, Any], Any] = {}
        with tqdm(total=len(cells) * len(plans), initial=len(cells) * len(plans) - len(todo), unit="trace",
                  desc="teacher-forced eviction", file=sys.stderr) as bar:
            for name, budget, plan in todo:
                key = (name, budget)
                if key not in engines:
                    protocol = resolve_protocol(config.protocol, config.protocol_settings)
                    engines[key] = EvictionEngine(lm, policies[name], protocol.config)
                k = budget.resolve(plan.generated) if budget is not None else plan.generated
                cell = cell_name(name, budget) if budget else name
                result = force_through(engines[key], plan, k, config.teacher_block, config.seed)
                store.append({"kind": "forced", "id": f"{cell}/{plan.id}", "trace": plan.id, "policy": name,
                              "budget": budget.to_json() if budget else None, "budget_tokens": k, **result})
                bar.update()
        rows = summarize(store.records, config.seed)
        write_csv(run.path / SUMMARY, rows)
    return rows


def summarize(records: Sequence[dict[str, Any]], seed: int = 0, level: float = 0.95) -> list[dict[str, Any]]:
    """Per (policy, budget): traces, the share whose forced answer greedy decoding reproduces (Wilson interval) and
    the mean effect (percentile bootstrap over traces)."""
    from validation.stats import bootstrap_means, percentile_interval, wilson_interval

    cells: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for record in records:
        cells.setdefault((record["policy"], record["budget"]), []).append(record)
    rows = []
    for (policy, budget), group in cells.items():
        greedy = sum(bool(r["greedy"]) for r in group)
        effects = np.array([[r["effect"]] for r in group], dtype=float)
        lo, hi = percentile_interval(bootstrap_means(effects, 2000, np.random.default_rng(seed)), level)
        acc_lo, acc_hi = wilson_interval(greedy, len(group), level)
        rows.append({"policy": policy, "budget": budget, "traces": len(group), "accuracy": greedy / len(group),
                     "ci_lo": acc_lo, "ci_hi": acc_hi, "effect": float(effects.mean()), "effect_lo": float(lo[0]),
                     "effect_hi": float(hi[0]), "peak_slots": max(r["peak_slots"] for r in group)})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m evictor.teacher_forced",
        description="Teacher-forced eviction: every policy's eviction run on the traces the model wrote (from graded "
        "labels), then the reference answer forced and scored: an offline estimate of deployed accuracy.")
    parser.add_argument("--labels", required=True,
                        help="graded label records (python -m labeling.occlusion with a forced answer): each holds "
                        "its trace, cue and reference answer")
    parser.add_argument("--policy", required=True,
                        help="policy name, comma list or 'all' (see python -m evictor.policies)")
    parser.add_argument("--policy-config", action="append", default=None,
                        help="a policy configuration file {policy, params} (repeatable, one per policy)")
    parser.add_argument("--budget", required=True,
                        help="comma list: fractions in (0, 1] of each trace's dense generated length, or K in tokens")
    parser.add_argument("--teacher-block", type=positive_int, default=DEFAULT_BLOCK,
                        help=f"reasoning tokens forced per forward, a round after each (default {DEFAULT_BLOCK}; 1: "
                        "every round as deployed)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N label records")
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of random policies, per trace (default 0)")
    parser.add_argument("--out", required=True, help="output directory (resumable)")
    add_protocol_arguments(parser, sampling=False, default="epikv")
    add_device_arguments(parser)
    return parser


def _run(argv: list[str] | None) -> int:
    from evictor.policy import read_policy_configs, select_policies

    args = build_parser().parse_args(argv)
    # budget and seed are this command's own flags; the rest of the protocol's settings override its preset
    overrides = {k: v for k, v in protocol_overrides(vars(args)).items() if v is not None and k not in PER_RUN}
    if args.temperature is not None or args.top_p is not None:
        raise UsageError("--temperature / --top-p: every token is teacher-forced, so nothing is sampled")
    resolve_protocol(args.protocol, overrides)  # refuses a bad setting before anything loads
    params = read_policy_configs(args.policy_config or [])
    names, _ = select_policies(args.policy, params)
    config = ForcedConfig(labels=args.labels, policies=tuple(names), policy_params=params,
                          budgets=tuple(sorted(parse_budgets(args.budget))), protocol=args.protocol,
                          protocol_settings=overrides, teacher_block=args.teacher_block, seed=args.seed,
                          limit=args.limit, dtype=args.dtype, device=args.device, max_memory=args.max_memory)
    read_plans(config.labels, config.limit)
    for row in run_forced(config, args.out):
        print(f"{row['policy']:>14} {row['budget'] if row['budget'] is not None else '-':>6}  accuracy "
              f"{row['accuracy']:.3f} [{row['ci_lo']:.3f}, {row['ci_hi']:.3f}]  effect {row['effect']:+.3f}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
