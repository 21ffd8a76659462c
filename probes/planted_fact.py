"""Planted-fact probe: which KV heads must hold a fact for the model to still retrieve it under eviction?

Random Attention notes §4 Part B (ii), Takeaway B2 and Step 5. A synthetic fact ``Let zq = 4729.`` (a fixed-size
box of tokens) is inserted into real reasoning text, a chosen distance before a question that needs it
(``What is the value of zq? zq = ``), and everything after a short prefilled stub is teacher-forced through the
engine's decode path so it is evicted like generated text (layout: `probes._eviction_probe`). The experimenter
decides which KV heads keep the fact; the chosen policy (default Random Attention) evicts everything else.

Pinning (`PinnedFact`) wraps the policy: it lets the policy score every candidate, then overrides the fact box's
candidates with +inf (keep) in the chosen (layer, head)s and -inf (evict) in all others, so once the box leaves
the recent buffer it is deleted at the next round from every head that does not hold it. Layers outside
``--layers`` delete the fact too: ``--layers`` isolates those layers ("only these (layer, head)s hold the fact"),
where treating the fact like ordinary text there would mix in the policy's own survival odds, which depend on the
distance and the policy rather than on the head set. Sliding-window layers (Gemma3, window 512) evict whatever has
left their window whatever the score (`evictor.engine`), so a fact more than a window back lives only in the
global layers even when pinned; the ``held`` column shows the fraction of (layer, head)s that still hold the
value's digits when the value is predicted.

Every instance also runs with the fact kept in every head (``kept``, LP_kept) and deleted from every head
(``deleted``, LP_del), and densely without eviction (``full``), so each head set gets

- retrieval: greedy decoding reproduces the 4 digits (Wilson interval over instances; chance 1/9000),
- mean LP: log p of the value's digit tokens under teacher forcing (instance bootstrap interval),
- graded recall R = sum(LP - LP_del) / sum(LP_kept - LP_del) (notes §3.3) with an instance-clustered bootstrap.

All conditions of an instance are rows of one batch: they read identical tokens and share the eviction schedule;
the policy's random draws differ per row (each row is an independent draw of the same protocol).

    python -m probes.planted_fact --heads "0;0,1;all;none" --n 20
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evictor.policy import Needs, ObserveInputs, Policy, ScoreInputs
from evictor.protocol import sequence_budgets
from core.cli import main_guard, save_config
from core.errors import UsageError
from probes._eviction_probe import (
    CHANCE,
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
    parse_distance,
    protocol,
    protocol_layout,
    run_forced,
    stub_ids,
    summarise,
    write_summary,
)

SCRIPTS = {
    "ask": Script(fact="\nLet {var} = {value}.", question="\nWhat is the value of {var}? {var} ="),
    # the easier copy task of the brief: the question repeats the fact's own left-hand side
    "recall": Script(fact="\nLet {var} = {value}.", question="\nRecall: {var} ="),
}
KEPT, DELETED, FULL = "kept", "deleted", "full"


# --- head sets ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadSet:
    label: str
    heads: tuple[int, ...]


def parse_head_sets(text: str, n_heads: int, model: str) -> list[HeadSet]:
    """``"0;0,1;all;none"`` -> head sets; heads must lie in ``0..n_heads-1``."""
    sets: list[HeadSet] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            raise UsageError(f"--heads {text!r}: empty head set; give sets like '0,1', 'all' or 'none', "
                             "separated by ';'")
        if part == "all":
            heads = tuple(range(n_heads))
        elif part == "none":
            heads = ()
        else:
            items = [i.strip() for i in part.split(",")]
            for item in items:
                if not item.lstrip("-").isdigit():
                    raise UsageError(f"--heads {text!r}: {item!r} is not a head number, 'all' or 'none'")
            heads = tuple(sorted({int(i) for i in items}))
            bad = [h for h in heads if not 0 <= h < n_heads]
            if bad:
                raise UsageError(f"head{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} out of range: "
                                 f"{model} has KV heads 0..{n_heads - 1}")
        if part not in (s.label for s in sets):
            sets.append(HeadSet(part, heads))
    return sets


def parse_layers(text: str, n_layers: int, model: str) -> tuple[int, ...]:
    """``"all"`` or a comma list of layers and ranges (``"0-9,20"``), each in ``0..n_layers-1``."""
    if text.strip() == "all":
        return tuple(range(n_layers))
    layers: set[int] = set()
    for item in (i.strip() for i in text.split(",")):
        bounds = item.split("-") if item.count("-") == 1 and not item.startswith("-") else [item]
        if not item or not all(b.strip().isdigit() for b in bounds):
            raise UsageError(f"--layers {text!r}: {item!r} is not a layer, a range like 0-9, or 'all'")
        lo, hi = int(bounds[0]), int(bounds[-1])
        for layer in (lo, hi):
            if not 0 <= layer < n_layers:
                raise UsageError(f"layer {layer} out of range: {model} has layers 0..{n_layers - 1}")
        if hi < lo:
            raise UsageError(f"--layers {text!r}: empty range {item!r}")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def keep_mask(heads: tuple[int, ...], layers: tuple[int, ...], n_layers: int, n_heads: int) -> torch.Tensor:
    """``[layers, kv_heads]`` bool: the (layer, head)s that keep the fact."""
    mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    if heads and layers:
        mask[torch.tensor(layers)[:, None], torch.tensor(heads)[None, :]] = True
    return mask


# --- pinning -----------------------------------------------------------------------------------------------------
def pin_scores(scores: torch.Tensor, positions: torch.Tensor, box: tuple[int, int], keep: torch.Tensor) -> torch.Tensor:
    """Scores ``[batch, kv_head, candidates]`` with the fact box ``[box[0], box[1])`` forced to +inf where
    `keep` ``[batch, kv_head]`` is set and to -inf elsewhere; other candidates keep the policy's scores."""
    in_box = (positions >= box[0]) & (positions < box[1])
    held = keep[:, :, None].to(positions.device)
    inf = torch.tensor(float("inf"), device=scores.device)
    return torch.where(in_box & held, inf, torch.where(in_box, -inf, scores))


class PinnedFact(Policy):
    """A policy wrapper that keeps the fact box exactly in chosen (row, layer, head)s and deletes it elsewhere.

    `keep` ``[rows, layers, kv_heads]`` (rows = sequences of the batch). The wrapped policy scores first; a policy
    that shares one keep set across heads gets its scores averaged over heads here (the engine's own averaging
    would mix the pins of different heads), so its filler keep sets stay shared while the fact is pinned per head.
    """

    name = "pinned_fact"
    citation = ("Random Attention notes §4 Part B (ii), Step 5 (FORCE_KEEP_RANGE): the experimenter chooses which "
                "heads keep a planted fact")
    deviations = "The fact is deleted from the non-chosen heads at the first round that sees it as a candidate."

    def __init__(self, inner: Policy, box: tuple[int, int], keep: torch.Tensor):
        if inner.scores_nothing:
            raise UsageError(f"policy {inner.name!r} never evicts, so nothing can be pinned; choose an evicting policy")
        self.inner = inner
        self.box = (int(box[0]), int(box[1]))
        self.keep = keep.bool()

    @property
    def needs(self) -> Needs:
        return self.inner.needs

    @property
    def default_protection(self) -> str:
        return self.inner.default_protection

    def for_depth(self, n_layers: int) -> PinnedFact:
        if self.keep.shape[1] != n_layers:
            raise UsageError(f"pin mask covers {self.keep.shape[1]} layers, the model has {n_layers}")
        return PinnedFact(self.inner.for_depth(n_layers), self.box, self.keep)

    def observe(self, inputs: ObserveInputs) -> torch.Tensor | None:
        return self.inner.observe(inputs)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        shape = inputs.positions.shape
        scores = self.inner.score(inputs).float().expand(shape)
        if self.inner.shared_across_heads:
            scores = scores.mean(1, keepdim=True).expand(shape)
        return pin_scores(scores, inputs.positions, self.box, self.keep[:, inputs.layer])

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "inner": self.inner.config(), "box": list(self.box)}


# --- conditions --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conditions:
    """Labels (requested head sets, then the kept/deleted references) and the distinct masks they run as rows."""

    labels: tuple[str, ...]
    masks: tuple[torch.Tensor, ...]  # distinct [layers, kv_heads] masks
    row_of: dict[str, int]  # label -> index into masks
    describe: dict[str, dict[str, Any]]  # label -> heads / layers, for the table


def build_conditions(sets: list[HeadSet], layers: tuple[int, ...], n_layers: int, n_heads: int) -> Conditions:
    everything = tuple(range(n_layers))
    entries = [(s.label, s.heads, layers) for s in sets]
    entries += [(KEPT, tuple(range(n_heads)), everything), (DELETED, (), everything)]
    masks: list[torch.Tensor] = []
    row_of, describe = {}, {}
    for label, heads, chosen in entries:
        mask = keep_mask(heads, chosen, n_layers, n_heads)
        index = next((i for i, m in enumerate(masks) if torch.equal(m, mask)), None)
        if index is None:
            masks.append(mask)
            index = len(masks) - 1
        row_of[label] = index
        describe[label] = {"heads": ",".join(map(str, heads)) or "-", "n_heads": len(heads),
                           "layers": "all" if chosen == everything else ",".join(map(str, chosen)),
                           "pairs": int(mask.sum())}
    return Conditions(tuple(row_of), tuple(masks), row_of, describe)


# --- CLI ---------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m probes.planted_fact",
        description="Random Attention's planted-fact probe: plant 'Let zq = 4729.' in real reasoning text, "
        "teacher-force it through the eviction engine's decode path with the fact kept in chosen KV heads only, "
        "and measure whether the model still retrieves the value (retrieval, log p, graded recall R).",
    )
    p.add_argument("--heads", default=None,
                   help="KV head sets that keep the fact, ';'-separated: a comma list, 'all' or 'none', e.g. "
                   "'0;0,1;all;none' (default: 'none', each single head, then 'all')")
    p.add_argument("--layers", default="all",
                   help="layers in which the chosen heads keep the fact: 'all' or a list like '0-9,20'; the fact is "
                   "deleted from every head of the other layers (default: all)")
    p.add_argument("--policy", default="random",
                   help="eviction policy for everything else (any registered name, python -m evictor.policies; "
                   "default: random)")
    p.add_argument("--question", default="ask", choices=sorted(SCRIPTS),
                   help="ask: 'What is the value of zq? zq =' (default); recall: 'Recall: zq =' (an easier copy task)")
    p.add_argument("--distance", default="4",
                   help="how far back the fact is: N (or Nr) eviction rounds that see the whole fact box as a "
                   "candidate before the question is answered, or Nt filler tokens (default: 4)")
    add_common_arguments(p)
    return p


def _default_heads(n_heads: int) -> str:
    return ";".join(["none", *map(str, range(n_heads)), "all"])


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_common(args)
    distance = parse_distance(args.distance)
    from evictor.engine import EvictionEngine
    from evictor.policy import get_policy
    from models.loading import load_model

    inner = get_policy(args.policy)
    if inner.scores_nothing:
        raise UsageError(f"--policy {args.policy!r} never evicts, so nothing can be pinned; choose an evicting policy")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, attn_implementation=args.kernel)
    n_layers, n_heads = lm.config.num_hidden_layers, lm.config.num_key_value_heads
    sets = parse_head_sets(args.heads or _default_heads(n_heads), n_heads, lm.name)
    layers = parse_layers(args.layers, n_layers, lm.name)
    conditions = build_conditions(sets, layers, n_layers, n_heads)
    config = protocol(args)
    probe = EvictionEngine(lm, PinnedFact(inner, (0, 0), torch.zeros(1, n_layers, n_heads)), config)
    texts, origin = filler_texts(args.filler, args.dataset, args.data_file)
    tokenizer, script = lm.tokenizer, SCRIPTS[args.question]
    stub = stub_ids(tokenizer)
    layout = protocol_layout(base_layout(tokenizer, script, len(stub), args.lead, args.box), distance, config,
                             probe.protect)
    budgets, limits = sequence_budgets([args.budget], [len(stub)], probe.protect, config)
    room = budgets[0] - limits[0] - config.recency
    if room < args.box:
        raise UsageError(f"--budget {args.budget} leaves {room} scored slots after the {limits[0]} protected prompt "
                         f"tokens, fewer than the {args.box}-token fact box to pin; raise --budget")
    builder = InstanceBuilder(tokenizer, script, texts, layout, args.seed, uses_var=True)
    instances = [builder.build(i) for i in range(args.n)]

    identity = {
        "probe": "planted_fact", "model": args.model, "policy": probe.policy.config()["inner"],
        "protocol": {k: v for k, v in probe.describe().items() if k not in ("policy", "seed", "keep_log")},
        "distance": str(distance), "question": args.question, "script": vars(script), "filler": origin,
        "seed": args.seed, "batch_size": args.batch_size, "dtype": args.dtype, "layout": layout_record(layout),
        "head_sets": [[s.label, list(s.heads)] for s in sets], "layers": list(layers),
    }
    out = Path(args.out) if args.out else Path("runs") / "planted_fact" / (
        f"{Path(args.model).name}-{args.policy}-K{args.budget}-r{args.buffer}-d{distance}-{args.question}-s{args.seed}")
    check_resumable(out, identity)

    from tqdm import tqdm

    from core.records import JsonlStore

    out.mkdir(parents=True, exist_ok=True)
    save_config(out, {"identity": identity, "command": sys.argv, "n": args.n, "loaded_model": lm.describe(),
                      "args": vars(args), "conditions": conditions.describe})
    store = JsonlStore(out / "instances.jsonl", key=lambda r: r["id"])
    box = (layout.box_start, layout.box_end)
    rows_per = len(conditions.masks)
    steps = layout.total - layout.stub - 1
    try:
        with tqdm(total=args.n, initial=sum(i.id in store for i in instances), unit="instance", file=sys.stderr,
                  desc="planted_fact") as bar:
            for batch in chunks(args.n, args.batch_size):
                todo = [instances[i] for i in batch if instances[i].id not in store]
                if not todo:
                    continue
                group = [instances[i] for i in batch]
                keep = torch.stack([mask for _ in group for mask in conditions.masks])  # [rows, layers, kv_heads]
                engine = EvictionEngine(lm, PinnedFact(inner, box, keep), config)
                seed = batch_seed(args.seed, batch)
                bodies = [inst.body for inst in group for _ in conditions.masks]
                with tqdm(total=steps, unit="tok", leave=False, file=sys.stderr, desc="decode") as inner_bar:
                    forced = run_forced(engine, stub, bodies, layout.value, group[0].watch, seed, inner_bar.update)
                dense = dense_logprobs(lm, stub, [inst.body for inst in group], layout.value, group[0].watch)
                rounds = fact_rounds(forced.rounds, layout, config)
                for k, inst in enumerate(group):
                    if inst.id in store:
                        continue
                    target = inst.body[-layout.value:]
                    results = {label: outcome(tokenizer, forced, k * rows_per + conditions.row_of[label], target)
                               for label in conditions.labels}
                    store.append({
                        "id": inst.id, "index": inst.index, "var": inst.var, "value": inst.value,
                        "filler": list(inst.filler_ids), "seed": seed, "batch": batch,
                        "fact_rounds": rounds, "round_positions": forced.rounds,
                        "full": outcome(tokenizer, dense, k, target), "conditions": results,
                    })
                    bar.update(1)
    except KeyboardInterrupt:
        print("\ninterrupted; finished instances are saved; rerun the same command to resume", file=sys.stderr)
        return 130

    wanted = {inst.id for inst in instances}
    records = sorted((r for r in store.records if r["id"] in wanted), key=lambda r: r["index"])
    rows = summary_rows(records, [s.label for s in sets], conditions, args.n_boot, args.level, args.seed)
    extra = {"chance": CHANCE, "layout": layout_record(layout), "distance": str(distance),
             "fact_rounds": sorted({r["fact_rounds"] for r in records}), "n_instances": len(records),
             "deleted_retrieval": float(np.mean([r["conditions"][DELETED]["retrieved"] for r in records]))}
    write_summary(out, rows, extra)
    columns = [("condition", "head set", 12), ("n_heads", "heads", 5), ("layers", "layers", 8)]
    print(format_table(rows, columns, graded=True))
    print(f"\nchance: {CHANCE:.5f} for a blind 4-digit guess; empirical with the fact deleted everywhere: "
          f"{extra['deleted_retrieval']:.3f}. Fact box at positions {layout.box_start}..{layout.box_end - 1}, value at "
          f"{layout.value_start}; {layout.gap} filler tokens between; rounds that saw the fact before the answer: "
          f"{', '.join(map(str, extra['fact_rounds']))}. held = fraction of (layer, KV head)s holding the value's "
          f"digits when it is predicted.")
    print(f"written to {out}/ (instances.jsonl, summary.csv, summary.json, config.json)")
    return 0


def summary_rows(records: list[dict], requested: list[str], conditions: Conditions, n_boot: int, level: float,
                 seed: int) -> list[dict]:
    """One row per requested head set, then the kept / deleted references not among them, then the dense run."""
    def column(label: str, key: str) -> np.ndarray:
        source = (lambda r: r["full"]) if label == FULL else (lambda r: r["conditions"][label])
        return np.array([source(r)[key] for r in records], dtype=float)

    shown = list(requested)
    for label in (KEPT, DELETED):
        if all(conditions.row_of[label] != conditions.row_of[s] for s in requested):
            shown.append(label)
    kept, deleted = column(KEPT, "lp"), column(DELETED, "lp")
    rows = []
    for label in [*shown, FULL]:
        info = conditions.describe.get(label, {"heads": "all", "n_heads": None, "layers": "all", "pairs": None})
        stats = summarise(column(label, "retrieved"), column(label, "lp"), n_boot, level, seed, kept, deleted)
        rows.append({"condition": label, **info, **stats, "held": float(column(label, "resident").mean())})
    return rows


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
