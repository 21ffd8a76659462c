"""List the registered eviction policies: what each reads, FlashAttention compatibility, head and layer sharing,
protection (where it comes from), the protections the method is defined for, and citation.

    python -m evictor.policies                 # one table row per policy
    python -m evictor.policies --name epikv    # one policy in full (parameters, deviations)
    python -m evictor.policies --json          # machine-readable
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from core.cli import ArgumentParser, main_guard
from core.errors import unknown_choice

if TYPE_CHECKING:
    from scoring.policy import Policy


def reads(policy: Policy) -> str:
    """What the policy reads, from its `needs`."""
    needs = policy.needs
    parts = [kind for kind, wanted in (("keys", needs.keys), ("values", needs.values)) if wanted]
    if needs.cache and parts:
        parts[-1] += " + cache mean"
    if needs.hidden_layers:
        hook = needs.hidden_hook.removeprefix("hook_")
        parts.append(f"hidden {hook} L" + ",".join(str(layer) for layer in needs.hidden_layers))
    if needs.refresh_threshold is not None:
        parts.append(f"attention refresh timestamps (> {needs.refresh_threshold:g}/n, every query)")
    elif needs.attention:
        window = {0: "all queries since entry", 1: "last query"}.get(needs.queries_window)
        window = window or f"last {needs.queries_window} queries"
        group = ", group max logit" if needs.attention_group == "max_logits" else ""
        parts.append(f"attention ({window}{group})")
    return "; ".join(parts) or "nothing beyond positions"


def protection(policy: Policy) -> str:
    """Where the policy's protection comes from: the engine's default protection for it (prompt / sinks / none,
    overridable by the run) plus the newest tokens the policy itself keeps under every protocol (`kept_recent`)."""
    small, large = policy.kept_recent(256), policy.kept_recent(1024)
    if not large:
        return policy.default_protection
    own = f"newest {large}" if small == large else f"newest {large / 1024:g} K"
    return f"{policy.default_protection} + {own} (own)"


def describe(name: str) -> dict[str, Any]:
    from evictor.policies import get_policy
    from scoring.policy import Policy

    policy = get_policy(name)
    return {
        "name": name,
        "reads": reads(policy),
        "fa_compatible": policy.needs.fa_compatible,
        "heads": "shared" if policy.shared_across_heads else "per-head",
        "layers": "shared" if policy.shared_across_layers else "per-layer",
        "protection": protection(policy),
        "defined_for": "any" if policy.defined_for is None else "/".join(policy.defined_for),
        "defined_by": policy.defined_by,
        "frozen_at_generation": type(policy).observe is not Policy.observe,
        "evicts": not policy.scores_nothing,
        "citation": policy.citation,
        "deviations": policy.deviations,
        "params": {key: value for key, value in policy.config().items() if key != "name"},
    }


def table(rows: list[dict[str, Any]]) -> str:
    columns = [("name", "policy"), ("reads", "reads"), ("fa", "FA"), ("heads", "heads"), ("layers", "layers"),
               ("protection", "protect"), ("defined_for", "defined-for"), ("citation", "citation")]
    cells = [{**row, "fa": "yes" if row["fa_compatible"] else "no"} for row in rows]
    widths = {key: max(len(title), *(len(str(cell[key])) for cell in cells)) for key, title in columns[:-1]}
    lines = ["  ".join(title.ljust(widths.get(key, 0)) for key, title in columns).rstrip()]
    for cell in cells:
        lines.append("  ".join(str(cell[key]).ljust(widths.get(key, 0)) for key, _ in columns).rstrip())
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m evictor.policies",
        description="List the registered KV-cache eviction policies. Columns: what the policy reads (keys, values, "
        "the resident cache's mean, hidden-state layers, attention), FA = FlashAttention-compatible (never reads "
        "attention), heads = one keep set per KV head or shared by all heads, layers = one keep set per layer or "
        "shared by all layers, protect = the engine's default protection for it (prompt / sinks / none, which a "
        "run may override) plus '(own)': the newest tokens the policy itself keeps under every protocol, inside K "
        "(an observation window, a recent share of K), defined-for = the protections the method is defined for (a "
        "run under another one is marked outside its protocol), citation = paper and equation.",
    )
    parser.add_argument("--name", help="show one policy in full: parameters, citation and deviations from the paper")
    parser.add_argument(
        "--json", action="store_true", help="print JSON (a list of policies, or one object) instead of a table"
    )
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from evictor.policies import POLICIES, policy_names  # the policies import torch: after --help has answered

    names = policy_names()
    if args.name is not None and args.name not in POLICIES:
        raise unknown_choice("policy", args.name, names)
    if args.name is not None:
        row = describe(args.name)
        print(json.dumps(row, indent=2) if args.json else "\n".join(f"{key}: {value}" for key, value in row.items()))
        return 0
    rows = [describe(name) for name in names]
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
