"""Passcode test: a passcode stated once, N eviction rounds before the question; each policy keeps what it likes.

Random Attention notes §4 Part B (iii), Table 3 and Takeaway B3: "The passcode is 4729." is planted once in real
reasoning text, far enough back that N eviction rounds see it as a candidate, and the question "What was the
passcode? The passcode is" follows. Nothing is pinned: a policy recovers the passcode only if its score kept the
digits in some head. Everything after a short prefilled stub is teacher-forced through the engine's decode path
(layout: `probes.instances`, statistics: `probes.statistics`; the same machinery as `probes.planted_fact`).

Per policy: retrieval (greedy decoding reproduces the 4 digits; Wilson interval; chance 1/9000), mean log p of the
passcode's digit tokens (0 = certain, very negative = gone; instance bootstrap interval) and ``held``, the fraction
of (layer, KV head)s still holding every digit when the passcode is predicted. The dense run (no eviction) is
always reported as ``full``. Attention-requiring policies (h2o, snapkv, ...) read the engine's attention feed, which
is exact under every kernel.

    python -m probes.passcode --policy random,h2o --rounds 8 --n 20

From Python: ``run_passcode(PasscodeConfig(policies=("random", "h2o")), out)`` returns the same rows as
`core.schemas.ProbeRow` records.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from core.backend import BackendConfig, connected, run_units
from core.cli import ArgumentParser, distinct, main_guard, positive_int
from core.errors import UsageError, unknown_choice
from core.rundir import RunDir
from core.schemas import ProbeRow
from core.seeds import derive_seed
from evictor.engine import EvictionEngine
from evictor.policies import policy_names
from evictor.policy import configured_policy
from models.loading import load_tokenizer
from probes.config import ProbeConfig, add_common_arguments, config_from_arguments
from probes.forcing import SERIAL, ProbeWorker, chunks, dense_logprobs, load_probe_worker, outcome, run_forced
from probes.instances import CHANCE, Instance, InstanceBuilder, Layout, Script, base_layout, filler_texts, stub_ids
from probes.schedule import Distance, Schedule, fact_rounds, protocol_layout
from probes.statistics import retrieval_statistics
from probes.summary import ProbeResult, default_out, format_table, layout_record, write_summary

PROBE = "passcode"
SCRIPT = Script(fact="\nThe passcode is {value}.", question="\nWhat was the passcode? The passcode is")
FULL = "full"


def parse_condition(text: str) -> tuple[str, dict[str, Any]]:
    """A ``--policy`` entry, ``name`` or ``name:key=value[:key=value...]``, as (policy name, parameters); a value
    is read as JSON (``lam=0.5`` is a number) and otherwise kept as text. The entry itself names the condition."""
    name, *settings = text.split(":")
    params: dict[str, Any] = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise UsageError(f"--policy {text!r}: parameters are key=value, got {setting!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return name, params


def parse_policies(text: str, names: list[str]) -> list[str]:
    given = [p.strip() for p in text.split(",")]
    chosen = [p for p in given if p]
    if not chosen:
        raise UsageError(f"--policy {text!r}: give at least one policy name")
    if len(chosen) < len(given):
        raise UsageError(f"--policy {text!r} has an empty entry; separate the entries by single commas")
    distinct("--policy", text, chosen)
    for condition in chosen:
        name, params = parse_condition(condition)
        if name not in names:
            raise unknown_choice("policy", name, names)
        if params:
            configured_policy(name, params, "--policy")  # an unknown or bad parameter fails here, before any work
    return chosen


@dataclass(frozen=True, kw_only=True)
class PasscodeConfig(ProbeConfig):
    """A passcode run; every field is the flag of the same name (``policies``: ``--policy``; see ``--help``)."""

    policies: tuple[str, ...] = ("random",)  # besides the dense run `full`, which is always reported
    rounds: int = 8

    def check(self) -> None:
        super().check()
        parse_policies(",".join(self.policies), policy_names())
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise UsageError(f"--rounds must be a positive integer, got {self.rounds!r}")


@dataclass(frozen=True)
class PasscodePlan:
    """What every unit of a run shares, resolved by the driver."""

    config: PasscodeConfig
    stub: tuple[int, ...]
    layout: Layout


@dataclass(frozen=True)
class PasscodeBatch:
    """The unit of work: one policy (or the dense run `full`) on one batch of instances."""

    policy: str
    indices: tuple[int, ...]
    instances: tuple[Instance, ...]
    seed: int


@dataclass
class PasscodeWorker(ProbeWorker):
    """A `ProbeWorker` with one engine per policy of the run."""

    engines: dict[str, EvictionEngine] = field(default_factory=dict)


def passcode_engines(lm, config: PasscodeConfig) -> dict[str, EvictionEngine]:
    eviction = config.eviction()
    return {condition: EvictionEngine(lm, configured_policy(*parse_condition(condition), "--policy"), eviction)
            for condition in config.policies if condition != FULL}


def load_passcode_worker(config: PasscodeConfig) -> PasscodeWorker:
    """A Ray worker's `PasscodeWorker`: the model, loaded once, and its engines."""
    worker = load_probe_worker(config)
    return PasscodeWorker(worker.lm, engines=passcode_engines(worker.lm, config))


def run_passcode_batch(plan: PasscodePlan, worker: PasscodeWorker, unit: PasscodeBatch) -> list[dict[str, Any]]:
    """One record per instance of `unit`: the outcome under the unit's policy (or dense)."""
    layout, lm = plan.layout, worker.lm
    bodies = [inst.body for inst in unit.instances]
    watch = unit.instances[0].watch
    if unit.policy == FULL:
        forced, rounds = dense_logprobs(lm, plan.stub, bodies, layout.value, watch), 0
    else:
        engine = worker.engines[unit.policy]
        with worker.decode_bar(layout.total - layout.stub - 1, unit.policy) as bar:
            forced = run_forced(engine, plan.stub, bodies, layout.value, watch, unit.seed, bar.update)
        rounds = fact_rounds(forced.rounds, layout, Schedule.of(engine.config, engine.protect, layout.stub,
                                                                engine.policy.kept_recent))
    return [{"policy": unit.policy, "id": inst.id, "index": inst.index, "value": inst.value,
             "filler": list(inst.filler_ids), "seed": unit.seed, "batch": list(unit.indices), "fact_rounds": rounds,
             "round_positions": forced.rounds, **outcome(lm.tokenizer, forced, k, inst.body[-layout.value:])}
            for k, inst in enumerate(unit.instances)]


def run_passcode(config: PasscodeConfig, out: str | os.PathLike | None = None, *, progress: bool = True,
                 backend: BackendConfig = SERIAL) -> ProbeResult:
    """Run (or resume) the passcode test into `out`; one `ProbeRow` per policy, the dense run ``full`` first.
    `backend` runs the units (`core.backend`); the records are the same either way.

    Records are keyed by (policy, instance), so a finished run may be resumed with more policies or instances.
    """
    config.check()
    policies = [p for p in dict.fromkeys(config.policies) if p != FULL]
    eviction = config.eviction()
    texts, origin = filler_texts(config.filler, config.dataset, config.data_file)
    identity = {"probe": PROBE, **config.identity(), "script": asdict(SCRIPT), "filler": origin,
                "rounds": config.rounds}
    out = Path(out) if out is not None else default_out(PROBE, config.model, *config.out_parts(), f"R{config.rounds}",
                                                        f"s{config.seed}")
    # The layout and the memory it takes are checked before --out is claimed: they need the tokenizer alone.
    tokenizer = load_tokenizer(config.model)
    stub = stub_ids(tokenizer)
    evicting = [configured_policy(*parse_condition(condition), "--policy") for condition in policies]
    # Every policy sees the passcode in at least --rounds rounds, whatever its protection.
    protections = sorted({eviction.protect or policy.default_protection for policy in evicting}) or ["prompt"]
    layout = protocol_layout(base_layout(tokenizer, SCRIPT, len(stub), config.lead, config.box),
                             Distance(config.rounds, "rounds"), eviction, protections)
    config.check_memory(evicting, len(stub), layout.total, backend, dense_logits=layout.value)
    with RunDir(out, identity) as run, connected(backend):
        lm = config.load_model()
        engines = passcode_engines(lm, config)
        builder = InstanceBuilder(tokenizer, SCRIPT, texts, layout, config.seed, uses_var=False)
        instances = [builder.build(i) for i in range(config.n)]
        run.save_config(config=asdict(config), loaded_model=lm.describe(), layout=layout_record(layout),
                        engines={n: e.describe() for n, e in engines.items()}, backend=asdict(backend))
        store = run.store("instances.jsonl", key=lambda r: (r["policy"], r["id"]))
        cells = [FULL, *policies]
        units = [PasscodeBatch(cell, tuple(batch), tuple(instances[i] for i in batch), derive_seed(config.seed, batch))
                 for batch in chunks(config.n, config.batch_size) for cell in cells
                 if not all((cell, instances[i].id) in store for i in batch)]
        plan = PasscodePlan(config, tuple(stub), layout)

        def commit(unit: PasscodeBatch, records: list[dict[str, Any]]) -> None:
            for record in records:
                if (record["policy"], record["id"]) not in store:
                    store.append(record)

        with tqdm(total=config.n * len(cells), initial=sum((c, i.id) in store for c in cells for i in instances),
                  unit="run", file=sys.stderr, desc=PROBE, disable=not progress) as bar:
            run_units(units, functools.partial(load_passcode_worker, config),
                      functools.partial(run_passcode_batch, plan), backend, on_result=commit,
                      progress=lambda unit, records: bar.update(len(records)),
                      local_worker=PasscodeWorker(lm, progress, engines))

        wanted = {inst.id for inst in instances}
        protocol = config.protocol_record()
        rows = []
        for cell in cells:
            records = sorted((r for r in store.records if r["policy"] == cell and r["id"] in wanted),
                             key=lambda r: r["index"])
            stats = retrieval_statistics([r["retrieved"] for r in records], [r["lp"] for r in records],
                                         config.n_boot, config.level, config.seed)
            rows.append(ProbeRow(id=cell, probe=PROBE, condition=cell, **stats,
                                 held=float(np.mean([r["resident"] for r in records])),
                                 extra={"protection": "-" if cell == FULL else engines[cell].protect,
                                        "fact_rounds": max((r["fact_rounds"] for r in records), default=0),
                                        "protocol": None if cell == FULL else protocol,
                                        "peak_slots": max(r["peak_slots"] for r in records)}))
        context = {"chance": CHANCE, "layout": layout_record(layout), "rounds": config.rounds, "protocol": protocol}
        write_summary(run.path, rows, context)
    return ProbeResult(rows, layout, out, context)


# --- command line ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m probes.passcode",
        description="Random Attention's passcode test: state a passcode once, let N eviction rounds pass, ask for "
        "it, and measure per policy whether the model still reproduces it (retrieval, mean log p).",
    )
    p.add_argument("--policy", default="random",
                   help="policies, comma-separated (any registered name, python -m evictor.policies), each with "
                   "optional parameters as name:key=value[:key=value] (e.g. r_kv:lam=0.5), the entry naming its "
                   "row; 'full' is the dense run, always reported (default: random)")
    p.add_argument("--rounds", type=positive_int, default=8,
                   help="eviction rounds that see the whole passcode box as a candidate before the question is "
                   "answered (default: 8)")
    add_common_arguments(p)
    return p


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_arguments(PasscodeConfig, args, policies=tuple(parse_policies(args.policy, policy_names())))
    backend = BackendConfig.from_flags(vars(args))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = run_passcode(config, args.out, backend=backend)
    except KeyboardInterrupt:
        print("\ninterrupted; finished runs are saved; rerun the same command to resume", file=sys.stderr)
        return 130
    layout = result.layout
    print(format_table(result.rows, [("condition", "policy", 16), ("protection", "protect", 7)], graded=False))
    print(f"\nchance: {CHANCE:.5f} for a blind 4-digit guess. Passcode at positions {layout.box_start}.."
          f"{layout.box_end - 1}, answer at {layout.value_start} ({layout.gap} filler tokens between); "
          f"{config.rounds} eviction rounds saw it before the question. held = fraction of (layer, KV head)s holding "
          "every digit when the passcode is predicted.")
    print(f"written to {result.out}/ (instances.jsonl, summary.csv, summary.json, config.json)")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    from probes.passcode import main  # this module under its own name, so Ray workers unpickle its functions

    raise SystemExit(main())
