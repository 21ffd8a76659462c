"""Generate with decode-time KV eviction, grade, and tabulate: ``python -m evictor.run --policy P --budget K ...``.

One *cell* is a (policy, budget) pair. With one cell the records go to ``OUT/generations.jsonl``; a sweep
(``--policy all`` or a comma list, and/or a comma list of budgets) writes ``OUT/<policy>-K<budget>/generations.jsonl``
per cell. Either way ``OUT/summary.csv`` and ``OUT/summary.json`` hold one `core.schemas.Cell` row per cell (accuracy
with its Wilson 95% interval ``ci_lo``/``ci_hi``, cost, peak cache slots per head) and ``config.json`` files the
resolved settings. Records are `core.schemas.Trace` records with the eviction fields set (so ``--policy full`` output
serves as a dense trace), appended as each batch finishes.

Protocol: ``--protocol random_attention|epikv|valuediff|custom`` (`evictor.protocol.PRESETS`) sets the trigger,
buffer, recency window, budget scope, prefill blocks and sampling as that paper states them; the protocol flags
(``--buffer``, ``--trigger``, ...) override it. Each cell resolves the protocol at its own budget (EpiKV's recency
window is min(128, K/4)); every trace and summary row records the resolved protocol (``protocol``: the preset, every
setting, the protection, the sampling and which settings were explicit) and its peak cache slots per head, and each
trace its own recency window (``eviction["recency"]``).

Policies: ``--policy all`` runs every registered policy except the calibrated ones (TriAttention, ThinKV), which need
a per-model calibration file; a line says so and how to include them: ``--policy-config FILE`` (repeatable, one file
per policy) gives a policy its parameters, its calibration file among them.

``OUT`` is claimed with a `core.rundir.RunDir`: a second run on it exits at once, and a rerun resumes only with the
same shared settings (model, data, generation, protocol preset and explicit settings); each cell directory has its
own identity (policy configuration, budget, resolved protocol), so a rerun may add cells to a sweep but never mixes
records made differently.

``--backend ray --workers N`` spreads the work over N Ray workers (`core.backend`), here or on a cluster: the unit of
work is a `Batch`, one cell's batch of ``--batch-size`` problems, so the workers share the cells of a sweep, and the
records (and keep-logs) are those of a serial run, in the same order.

Library: ``evictor.sweep.run_sweep(SweepConfig(...), out)`` does all of it (problems, reference, run directory, cells,
summary) and returns the `Cell` rows; this command line parses its flags into a `SweepConfig` and prints the table
(`evictor.summary`).

Budget semantics (what K counts, triggers, the buffer, prompt protection): see `evictor.protocol`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from core.backend import BackendConfig, add_backend_arguments
from core.cli import ArgumentParser, add_device_arguments, main_guard, positive_int, seed_int
from evictor.policy import left_out_line, read_policy_configs, select_policies
from evictor.protocol import add_protocol_arguments, parse_budgets, protocol_overrides, resolve_protocol
from evictor.summary import format_table
from evictor.sweep import PER_RUN, SweepConfig, run_sweep
from models.loading import KERNELS
from models.registry import DEFAULT_MODEL, REGISTRY
from tasks.run import GenerationConfig


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m evictor.run",
        description="Generate answers with decode-time KV-cache eviction (physical, per KV head), grade them, and "
        "write per-problem records and a results table. --protocol chooses a paper's eviction protocol (trigger, "
        "buffer, recency window, what K counts, sampling); the flags after it override single settings. Under the "
        "default (custom) K counts the protected tokens and the recency window and the recent buffer r comes on top "
        "(after a round the cache holds K + r per head); under epikv K counts only the scored tokens.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name ({', '.join(sorted(REGISTRY))}), local HF directory, .gguf file or hub id",
    )
    p.add_argument("--dataset", required=True, help="benchmark (see tasks.datasets.DATASETS)")
    p.add_argument("--data-file", default=None, help="read problems from this JSONL instead of $KVSCOPE_DATA_DIR")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N problems")
    p.add_argument(
        "--policy",
        default=None,
        help="policy name, comma list, or 'all' (every registered policy except those that need a per-model "
        "calibration file, unless --policy-config gives one); see python -m evictor.policies",
    )
    p.add_argument(
        "--policy-config",
        action="append",
        default=None,
        metavar="FILE",
        help='JSON file {"policy": name, "params": {...}}: parameters for that policy (validation.select writes '
        "them); repeat for several policies, one file each; each file's policy runs beside those --policy names",
    )
    p.add_argument(
        "--budget",
        default="1024",
        help="K per head: a whole number of tokens >= 2, or a fraction f in (0, 1] = ceil(f * L) with L the "
        "problem's dense trace length from --reference (else --max-new-tokens; 1 is the whole L); comma list to "
        "sweep (default: 1024)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="a --policy full run (directory or generations.jsonl) giving L for fractional budgets",
    )
    add_protocol_arguments(p)
    p.add_argument(
        "--shared",
        action="store_true",
        default=None,
        help="force one keep set per layer (mean of per-head scores)",
    )
    p.add_argument(
        "--query-window",
        type=positive_int,
        default=None,
        help="for attention-requiring policies: the recent queries whose attention counts (default: the "
        "policy's own, e.g. every query since entry for H2O)",
    )
    p.add_argument("--kernel", default=None, choices=KERNELS, help="attention kernel (default: sdpa, or FA2 on CUDA)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="problems decoded together (left-padded); with --reference, in order of their dense length, "
                   "since a batch decodes until its longest problem stops")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="generation cap (default: 512)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="seeds random policies and sampling, per batch (default: 0)")
    p.add_argument(
        "--keep-log", action="store_true", help="save evicted positions per round/layer/head (keeplogs/*.npz)"
    )
    add_device_arguments(p)
    add_backend_arguments(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quiet", action="store_true", help="no line per batch")
    return p


def _sweep_config(args: argparse.Namespace) -> tuple[SweepConfig, list[str]]:
    """The typed configuration of the command line and the policies ``--policy all`` left out; every flag is checked
    here, before --out is claimed."""
    params = read_policy_configs(args.policy_config or [])
    policies, left_out = select_policies(args.policy or ",".join(params), params)
    budgets = parse_budgets(args.budget)
    flags = vars(args)
    settings = {k: v for k, v in protocol_overrides(flags).items() if k not in PER_RUN and v is not None}
    sampling = resolve_protocol(args.protocol, settings).sampling
    generation = GenerationConfig.from_flags({**flags, **dataclasses.asdict(sampling)})
    config = SweepConfig(
        generation=generation,
        policies=tuple(policies),
        budgets=budgets,
        protocol=args.protocol,
        protocol_settings=settings,
        policy_params=params,
        kernel=args.kernel,
        reference=args.reference,
        batch_size=args.batch_size,
        keep_log=args.keep_log,
    )
    config.check()
    return config, left_out


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config, left_out = _sweep_config(args)
    backend = BackendConfig.from_flags(vars(args))
    if left_out:
        print(left_out_line(left_out), file=sys.stderr)
    try:
        rows = run_sweep(config, args.out, backend=backend, quiet=args.quiet)
    except KeyboardInterrupt:
        print("\ninterrupted; finished batches are saved; rerun the same command to resume", file=sys.stderr)
        return 130
    print(format_table(rows))
    print(f"\nwritten to {args.out}/ (summary.csv, summary.json; generations.jsonl per cell)")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
