"""Passcode test: a passcode stated once, N eviction rounds before the question; each policy keeps what it likes.

Random Attention notes §4 Part B (iii), Table 3 and Takeaway B3: "The passcode is 4729." is planted once in real
reasoning text, far enough back that N eviction rounds see it as a candidate, and the question "What was the
passcode? The passcode is" follows. Nothing is pinned: a policy recovers the passcode only if its score kept the
digits in some head. Everything after a short prefilled stub is teacher-forced through the engine's decode path
(layout and statistics: `probes._eviction_probe`; the same machinery as `probes.planted_fact`).

Per policy: retrieval (greedy decoding reproduces the 4 digits; Wilson interval; chance 1/9000), mean log p of the
passcode's digit tokens (0 = certain, very negative = gone; instance bootstrap interval) and ``held``, the fraction
of (layer, KV head)s still holding every digit when the passcode is predicted. The dense run (no eviction) is
always reported as ``full``. Attention-requiring policies (h2o, snapkv, ...) read the engine's attention source:
``--attention-source window`` recomputes attention for recent queries under SDPA, ``eager`` needs ``--kernel eager``.

    python -m probes.passcode --policy random,h2o --rounds 8 --n 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from core.cli import main_guard, positive_int, save_config
from core.errors import UsageError, unknown_choice
from probes._eviction_probe import (
    CHANCE,
    Distance,
    InstanceBuilder,
    Parser,
    Script,
    add_common_arguments,
    base_layout,
    batch_seed,
    check_common,
    check_resumable,
    chunks,
    dense_logprobs,
    fact_rounds,
    filler_texts,
    format_table,
    layout_record,
    outcome,
    protocol,
    protocol_layout,
    run_forced,
    stub_ids,
    summarise,
    write_summary,
)

SCRIPT = Script(fact="\nThe passcode is {value}.", question="\nWhat was the passcode? The passcode is")
FULL = "full"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m probes.passcode",
        description="Random Attention's passcode test: state a passcode once, let N eviction rounds pass, ask for "
        "it, and measure per policy whether the model still reproduces it (retrieval, mean log p).",
    )
    p.add_argument("--policy", default="random",
                   help="policies, comma-separated (any registered name, python -m evictor.policies); 'full' is the "
                   "dense run, always reported (default: random)")
    p.add_argument("--rounds", type=positive_int, default=8,
                   help="eviction rounds that see the whole passcode box as a candidate before the question is "
                   "answered (default: 8)")
    add_common_arguments(p)
    return p


def parse_policies(text: str, names: list[str]) -> list[str]:
    chosen = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not chosen:
        raise UsageError(f"--policy {text!r}: give at least one policy name")
    for name in chosen:
        if name not in names:
            raise unknown_choice("policy", name, names)
    return chosen


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_common(args)
    from evictor.engine import EvictionEngine
    from evictor.policy import get_policy, policy_names
    from models.loading import load_model

    policies = [p for p in parse_policies(args.policy, policy_names()) if p != FULL]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, attn_implementation=args.kernel)
    config = protocol(args)
    engines = {name: EvictionEngine(lm, get_policy(name), config) for name in policies}
    texts, origin = filler_texts(args.filler, args.dataset, args.data_file)
    tokenizer = lm.tokenizer
    stub = stub_ids(tokenizer)
    # The schedule does not depend on the protection (a round always returns the cache to K + r); any policy's
    # protection limit gives the same layout.
    protect = next(iter(engines.values())).protect if engines else "prompt"
    distance = Distance(args.rounds, "rounds")
    layout = protocol_layout(base_layout(tokenizer, SCRIPT, len(stub), args.lead, args.box), distance, config, protect)
    builder = InstanceBuilder(tokenizer, SCRIPT, texts, layout, args.seed, uses_var=False)
    instances = [builder.build(i) for i in range(args.n)]

    identity = {
        "probe": "passcode", "model": args.model, "script": vars(SCRIPT), "filler": origin, "seed": args.seed,
        "batch_size": args.batch_size, "dtype": args.dtype, "rounds": args.rounds, "layout": layout_record(layout),
        "protocol": {k: v for k, v in config.to_dict().items() if k not in ("seed", "keep_log")},
        "kernel": lm.kernel,
    }
    out = Path(args.out) if args.out else Path("runs") / "passcode" / (
        f"{Path(args.model).name}-K{args.budget}-r{args.buffer}-R{args.rounds}-s{args.seed}")
    check_resumable(out, identity)  # policies may be added to a run: records are keyed by (policy, instance)

    from tqdm import tqdm

    from core.records import JsonlStore

    out.mkdir(parents=True, exist_ok=True)
    save_config(out, {"identity": identity, "command": sys.argv, "n": args.n, "policies": policies,
                      "engines": {n: e.describe() for n, e in engines.items()}, "loaded_model": lm.describe(),
                      "args": vars(args)})
    store = JsonlStore(out / "instances.jsonl", key=lambda r: (r["policy"], r["id"]))
    cells = [FULL, *policies]
    steps = layout.total - layout.stub - 1
    try:
        with tqdm(total=args.n * len(cells), initial=sum((c, i.id) in store for c in cells for i in instances),
                  unit="run", file=sys.stderr, desc="passcode") as bar:
            for batch in chunks(args.n, args.batch_size):
                group = [instances[i] for i in batch]
                seed = batch_seed(args.seed, batch)
                for cell in cells:
                    if all((cell, inst.id) in store for inst in group):
                        continue
                    bodies = [inst.body for inst in group]
                    if cell == FULL:
                        forced = dense_logprobs(lm, stub, bodies, layout.value, group[0].watch)
                    else:
                        with tqdm(total=steps, unit="tok", leave=False, file=sys.stderr, desc=cell) as inner_bar:
                            forced = run_forced(engines[cell], stub, bodies, layout.value, group[0].watch, seed,
                                                inner_bar.update)
                    for k, inst in enumerate(group):
                        if (cell, inst.id) in store:
                            continue
                        store.append({
                            "policy": cell, "id": inst.id, "index": inst.index, "value": inst.value,
                            "filler": list(inst.filler_ids), "seed": seed, "batch": batch,
                            "fact_rounds": fact_rounds(forced.rounds, layout, config),
                            "round_positions": forced.rounds,
                            **outcome(tokenizer, forced, k, inst.body[-layout.value:]),
                        })
                        bar.update(1)
    except KeyboardInterrupt:
        print("\ninterrupted; finished runs are saved; rerun the same command to resume", file=sys.stderr)
        return 130

    wanted = {inst.id for inst in instances}
    rows = []
    for cell in cells:
        records = sorted((r for r in store.records if r["policy"] == cell and r["id"] in wanted),
                         key=lambda r: r["index"])
        stats = summarise([r["retrieved"] for r in records], [r["lp"] for r in records], args.n_boot, args.level,
                          args.seed)
        rows.append({"condition": cell, "protection": "-" if cell == FULL else engines[cell].protect,
                     "fact_rounds": max((r["fact_rounds"] for r in records), default=0), **stats,
                     "held": float(np.mean([r["resident"] for r in records]))})
    write_summary(out, rows, {"chance": CHANCE, "layout": layout_record(layout), "rounds": args.rounds})
    print(format_table(rows, [("condition", "policy", 16), ("protection", "protect", 7)], graded=False))
    print(f"\nchance: {CHANCE:.5f} for a blind 4-digit guess. Passcode at positions {layout.box_start}.."
          f"{layout.box_end - 1}, answer at {layout.value_start} ({layout.gap} filler tokens between); "
          f"{args.rounds} eviction rounds saw it before the question. held = fraction of (layer, KV head)s holding "
          "every digit when the passcode is predicted.")
    print(f"written to {out}/ (instances.jsonl, summary.csv, summary.json, config.json)")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
