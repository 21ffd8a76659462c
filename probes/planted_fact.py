"""Planted-fact probe: which KV heads must hold a fact for the model to still retrieve it under eviction?

Random Attention notes §4 Part B (ii), Takeaway B2 and Step 5. A synthetic fact ``Let zq = 4729.`` (a fixed-size
box of tokens) is inserted into real reasoning text, a chosen distance before a question that needs it
(``What is the value of zq? zq = ``), and everything after a short prefilled stub is teacher-forced through the
engine's decode path so it is evicted like generated text (layout: `probes.instances`). The experimenter
decides which KV heads keep the fact; the chosen policy (default Random Attention) evicts everything else.

The default model, ``smollm2-135m-mha``, is SmolLM2-135M-Instruct with each KV head duplicated for every query head
of its group (`models.expand`): the same logits as SmolLM2, but 9 KV heads instead of 3. Per-head eviction then acts
per query head, a finer-grained version of the paper's experiment on Qwen3-4B, whose 8 KV heads each serve a group
of query heads; head sets such as ``2,3,5`` (Fig. 3a) exist on it.

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

    python -m probes.planted_fact --heads "2,3,5;2,3;5;all;none" --n 20

From Python: ``run_planted_fact(PlantedFactConfig(heads="2,3,5", n=20), out)`` returns the same rows as
`core.schemas.ProbeRow` records.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from core.backend import BackendConfig, connected, run_units
from core.cli import ArgumentParser, distinct, main_guard
from core.errors import UsageError, unknown_choice
from core.rundir import RunDir
from core.schemas import ProbeRow
from core.seeds import derive_seed
from evictor.engine import EvictionEngine
from evictor.policies import get_policy
from models.loading import load_tokenizer, model_config, model_limits
from probes.config import ProbeConfig, add_common_arguments, config_from_arguments
from probes.forcing import SERIAL, ProbeWorker, chunks, dense_logprobs, load_probe_worker, outcome, run_forced
from probes.instances import CHANCE, Instance, InstanceBuilder, Layout, Script, base_layout, filler_texts, stub_ids
from probes.schedule import Schedule, fact_rounds, parse_distance, protocol_layout
from probes.statistics import retrieval_statistics
from probes.summary import ProbeResult, default_out, format_table, layout_record, write_summary
from scoring.policy import Needs, ObserveInputs, Policy, ScoreInputs

PROBE = "planted_fact"
# SmolLM2-135M with one KV head per query head (models.expand): 9 heads to pin the fact in instead of 3.
DEFAULT_PROBE_MODEL = "smollm2-135m-mha"
SCRIPTS = {
    "ask": Script(fact="\nLet {var} = {value}.", question="\nWhat is the value of {var}? {var} ="),
    # an easier copy task: the question repeats the fact's own left-hand side (a fallback when "ask" is too hard)
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
            distinct("--heads", text, [int(i) for i in items])
            heads = tuple(sorted(int(i) for i in items))
            bad = [h for h in heads if not 0 <= h < n_heads]
            if bad:
                raise UsageError(f"head{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} out of range: "
                                 f"{model} has KV heads 0..{n_heads - 1}")
        same = next((s.label for s in sets if s.heads == heads), None)
        if same is not None:
            raise UsageError(f"--heads {text!r} gives the head set {part!r} twice (as {same!r}); give each once")
        sets.append(HeadSet(part, heads))
    return sets


def parse_layers(text: str, n_layers: int, model: str) -> tuple[int, ...]:
    """``"all"`` or a comma list of layers and ranges (``"0-9,20"``), each in ``0..n_layers-1``."""
    if text.strip() == "all":
        return tuple(range(n_layers))
    layers: list[int] = []
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
        layers += range(lo, hi + 1)
    distinct("--layers", text, layers)
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

    # Policy declares a class constant; the wrapper reports its inner policy's, so a property overrides it
    @property
    def default_protection(self) -> str:  # type: ignore[override]
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


# --- the probe ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PlantedFactConfig(ProbeConfig):
    """A planted-fact run; every field is the flag of the same name (see ``--help``)."""

    model: str = DEFAULT_PROBE_MODEL
    heads: str | None = None  # ';'-separated head sets; None: 'none', every single head, then 'all'
    layers: str = "all"
    policy: str = "random"
    question: str = "ask"
    distance: str = "4"

    def check(self) -> None:
        super().check()
        if self.question not in SCRIPTS:
            raise unknown_choice("question", self.question, SCRIPTS)
        distance = parse_distance(self.distance)
        # every round feeds at least one filler token, so in either unit the sequence holds lead + box + amount
        model_limits(self.model).check_tokens(f"--distance {self.distance}", self.lead + self.box + distance.amount,
                                              "the fact and the question would not fit in one sequence")


@dataclass(frozen=True)
class FactPlan:
    """What every batch of a run shares, resolved by the driver (which alone reads the filler and the settings)."""

    config: PlantedFactConfig
    stub: tuple[int, ...]
    layout: Layout
    conditions: Conditions


@dataclass(frozen=True)
class FactBatch:
    """The unit of work: a batch of instances, all conditions of each as rows of one teacher-forced batch."""

    indices: tuple[int, ...]
    instances: tuple[Instance, ...]
    seed: int


def run_fact_batch(plan: FactPlan, worker: ProbeWorker, unit: FactBatch) -> list[dict[str, Any]]:
    """One instance record per instance of `unit`: every condition's outcome under eviction, and the dense run's."""
    config, layout, conditions, lm = plan.config, plan.layout, plan.conditions, worker.lm
    eviction = config.eviction()
    keep = torch.stack([mask for _ in unit.instances for mask in conditions.masks])  # [rows, layers, kv_heads]
    engine = EvictionEngine(lm, PinnedFact(get_policy(config.policy), (layout.box_start, layout.box_end), keep),
                            eviction)
    bodies = [inst.body for inst in unit.instances for _ in conditions.masks]
    watch = unit.instances[0].watch
    with worker.decode_bar(layout.total - layout.stub - 1, "decode") as bar:
        forced = run_forced(engine, plan.stub, bodies, layout.value, watch, unit.seed, bar.update)
    dense = dense_logprobs(lm, plan.stub, [inst.body for inst in unit.instances], layout.value, watch)
    rounds = fact_rounds(forced.rounds, layout, Schedule.of(eviction, engine.protect, layout.stub))
    rows_per = len(conditions.masks)
    records = []
    for k, inst in enumerate(unit.instances):
        target = inst.body[-layout.value:]
        results = {label: outcome(lm.tokenizer, forced, k * rows_per + conditions.row_of[label], target)
                   for label in conditions.labels}
        records.append({
            "id": inst.id, "index": inst.index, "var": inst.var, "value": inst.value,
            "filler": list(inst.filler_ids), "seed": unit.seed, "batch": list(unit.indices),
            "fact_rounds": rounds, "round_positions": forced.rounds,
            "full": outcome(lm.tokenizer, dense, k, target), "conditions": results,
        })
    return records


def run_planted_fact(config: PlantedFactConfig, out: str | os.PathLike | None = None, *, progress: bool = True,
                     backend: BackendConfig = SERIAL) -> ProbeResult:
    """Run (or resume) the planted-fact probe into `out`; one `ProbeRow` per head set, then the kept / deleted
    references not among them, then the dense run ``full``. `backend` runs the batches (`core.backend`); the records
    are the same either way.

    Everything that can be checked without the model is checked before `out` is claimed; the rest (head and layer
    ranges, the budget) before anything is written. A second run on the same `out` is refused at once.
    """
    config.check()
    distance = parse_distance(config.distance)
    inner = get_policy(config.policy)
    if inner.scores_nothing:
        raise UsageError(f"--policy {config.policy!r} never evicts, so nothing can be pinned; choose an evicting "
                         "policy")
    eviction = config.eviction()
    texts, origin = filler_texts(config.filler, config.dataset, config.data_file)
    script = SCRIPTS[config.question]
    identity = {
        "probe": PROBE, **config.identity(), "policy": inner.config(), "distance": str(distance),
        "question": config.question, "script": asdict(script), "filler": origin,
        "head_sets": None if config.heads is None else [part.strip() for part in config.heads.split(";")],
        "layers": config.layers.strip(),
    }
    out = Path(out) if out is not None else default_out(
        PROBE, config.model, config.policy, *config.out_parts(), f"d{distance}", config.question, f"s{config.seed}")
    # The head sets, the layout and the memory they take are checked before --out is claimed: they need the model's
    # config and tokenizer alone.
    model = model_config(config.model)
    n_layers, n_heads = model.num_hidden_layers, model.num_key_value_heads
    sets = parse_head_sets(config.heads or _default_heads(n_heads), n_heads, config.model)
    layers = parse_layers(config.layers, n_layers, config.model)
    conditions = build_conditions(sets, layers, n_layers, n_heads)
    tokenizer = load_tokenizer(config.model)
    stub = stub_ids(tokenizer)
    protect = eviction.protect or inner.default_protection
    layout = protocol_layout(base_layout(tokenizer, script, len(stub), config.lead, config.box), distance,
                             eviction, [protect])
    schedule = Schedule.of(eviction, protect, len(stub))
    room = schedule.budget - schedule.limit - schedule.recency
    if room < config.box:
        raise UsageError(f"--budget {config.budget} leaves {room} scored slots after the {schedule.limit} "
                         f"protected prompt tokens and the recency window of {schedule.recency}, fewer than the "
                         f"{config.box}-token fact box to pin; raise --budget")
    config.check_memory([inner], len(stub), layout.total, backend, dense_logits=layout.value)
    with RunDir(out, identity) as run, connected(backend):
        lm = config.load_model()
        probe = EvictionEngine(lm, PinnedFact(inner, (0, 0), torch.zeros(1, n_layers, n_heads)), eviction)
        builder = InstanceBuilder(tokenizer, script, texts, layout, config.seed, uses_var=True)
        instances = [builder.build(i) for i in range(config.n)]
        run.save_config(config=asdict(config), loaded_model=lm.describe(), engine=probe.describe(),
                        layout=layout_record(layout), conditions=conditions.describe,
                        backend=asdict(backend))
        store = run.store("instances.jsonl", key="id")
        units = [FactBatch(tuple(batch), tuple(instances[i] for i in batch), derive_seed(config.seed, batch))
                 for batch in chunks(config.n, config.batch_size)
                 if not all(instances[i].id in store for i in batch)]
        plan = FactPlan(config, tuple(stub), layout, conditions)

        def commit(unit: FactBatch, records: list[dict[str, Any]]) -> None:
            for record in records:
                if record["id"] not in store:
                    store.append(record)

        with tqdm(total=config.n, initial=sum(i.id in store for i in instances), unit="instance", file=sys.stderr,
                  desc=PROBE, disable=not progress) as bar:
            run_units(units, functools.partial(load_probe_worker, config), functools.partial(run_fact_batch, plan),
                      backend, on_result=commit, progress=lambda unit, records: bar.update(len(records)),
                      local_worker=ProbeWorker(lm, progress))

        wanted = {inst.id for inst in instances}
        records = sorted((r for r in store.records if r["id"] in wanted), key=lambda r: r["index"])
        rows = condition_rows(records, [s.label for s in sets], conditions, config.n_boot, config.level, config.seed,
                              config.protocol_record())
        context = {"chance": CHANCE, "layout": layout_record(layout), "distance": str(distance),
                   "fact_rounds": sorted({r["fact_rounds"] for r in records}), "n_instances": len(records),
                   "deleted_retrieval": float(np.mean([r["conditions"][DELETED]["retrieved"] for r in records])),
                   "protocol": config.protocol_record()}
        write_summary(run.path, rows, context)
    return ProbeResult(rows, layout, out, context)


def condition_rows(records: list[dict], requested: list[str], conditions: Conditions, n_boot: int, level: float,
                   seed: int, protocol: dict[str, Any]) -> list[ProbeRow]:
    """One row per requested head set, then the kept / deleted references not among them, then the dense run; each
    states the protocol and the peak cache slots per KV head (the dense run's: its whole context)."""
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
        stats = retrieval_statistics(column(label, "retrieved"), column(label, "lp"), n_boot, level, seed, kept,
                                     deleted)
        rows.append(ProbeRow(id=label, probe=PROBE, condition=label, **stats,
                             held=float(column(label, "resident").mean()),
                             extra={**info, "protocol": None if label == FULL else protocol,
                                    "peak_slots": int(column(label, "peak_slots").max())}))
    return rows


def _default_heads(n_heads: int) -> str:
    return ";".join(["none", *map(str, range(n_heads)), "all"])


# --- command line ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m probes.planted_fact",
        description="Random Attention's planted-fact probe: plant 'Let zq = 4729.' in real reasoning text, "
        "teacher-force it through the eviction engine's decode path with the fact kept in chosen KV heads only, "
        "and measure whether the model still retrieves the value (retrieval, log p, graded recall R). The default "
        f"model, {DEFAULT_PROBE_MODEL}, is SmolLM2-135M with each KV head duplicated per query head (the same "
        "logits, 9 KV heads): per-head eviction then acts per query head, a finer-grained version of the paper's "
        "experiment on a model with 8 KV heads.",
    )
    p.add_argument("--heads", default=None,
                   help="KV head sets that keep the fact, ';'-separated: a comma list, 'all' or 'none', e.g. "
                   f"'2,3,5;all' ({DEFAULT_PROBE_MODEL} has KV heads 0..8, one per query head; default: 'none', "
                   "each single head, then 'all')")
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
    add_common_arguments(p, default_model=DEFAULT_PROBE_MODEL)
    return p


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_arguments(PlantedFactConfig, args)
    backend = BackendConfig.from_flags(vars(args))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = run_planted_fact(config, args.out, backend=backend)
    except KeyboardInterrupt:
        print("\ninterrupted; finished instances are saved; rerun the same command to resume", file=sys.stderr)
        return 130
    layout, context = result.layout, result.context
    columns = [("condition", "head set", 12), ("n_heads", "heads", 5), ("layers", "layers", 8)]
    print(format_table(result.rows, columns, graded=True))
    print(f"\nchance: {CHANCE:.5f} for a blind 4-digit guess; empirical with the fact deleted everywhere: "
          f"{context['deleted_retrieval']:.3f}. Fact box at positions {layout.box_start}..{layout.box_end - 1}, value "
          f"at {layout.value_start}; {layout.gap} filler tokens between; rounds that saw the fact before the answer: "
          f"{', '.join(map(str, context['fact_rounds']))}. held = fraction of (layer, KV head)s holding the value's "
          "digits when it is predicted.")
    print(f"written to {result.out}/ (instances.jsonl, summary.csv, summary.json, config.json)")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    from probes.planted_fact import main  # this module under its own name, so Ray workers unpickle its functions

    raise SystemExit(main())
