"""The stages of a study, each a function of its settings and its inputs' files that writes one stage directory.

    traces -> labels -> agreement (optional) -> signals -> selection -> evictor -> compare

Each function takes the study's `StudyConfig`, the outputs of the stages it reads and its own directory, calls the
library of the stage it wraps (`tasks.run`, `labeling.job`, `labeling.agreement`, `evictor.replay`,
`signals`, `validation.select`, `evictor.run`, `validation.compare`) and returns its outputs: a JSON object
whose file paths are relative to the study directory. Every file a stage writes is that library's own format, so
each stage's output is what the stage's own command line writes and reads.

Degenerate data never raises: a stage with nothing to work on (no trace to label, labels without variation, too few
traces for an interval) returns outputs that say so, and the stages after it do what still makes sense (the evictor
stage always runs the baselines and the papers' default policies).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.backend import BackendConfig
from core.errors import UsageError
from core.paths import portable_path
from core.schemas import Label, Trace, read_records
from study.config import (
    AGREEMENT_REPLACEMENTS,
    BASELINES,
    PAPER_DEFAULTS,
    REFERENCE,
    StudyConfig,
    is_known_answer,
    is_long_context,
)
from validation.predictive import SELECTED_PREFIX

if TYPE_CHECKING:
    from validation.signals import Aligned

Outputs = dict[str, Any]
TRACES_FILE = "generations.jsonl"
REPLAY_FILE = "replay.jsonl"
# signals files: the raw per-layer interpretability signals (g_l, key norms, attention received), and g_l's
# rolling mean and rolling z (the two band scores). Attention received is H2O's score: when h2o is a replayed scorer
# its replay is that signal, under the same name, so it is not computed twice.
SMOOTHED_SIGNALS = {"raw": ("hidden_diff", "key_norm", "h2o"), "mean": ("hidden_diff",), "z": ("hidden_diff",)}
BAND_FAMILY = "hidden_diff"
BASELINE_SWEEP = "baselines"
SELECTED = SELECTED_PREFIX  # the sweep and configuration name of a selected configuration


class Paths:
    """Paths inside a study directory, stored relative to it so a study directory can move."""

    def __init__(self, root: Path):
        self.root = root

    def rel(self, path: Path) -> str:
        path = Path(path)
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def abs(self, path: str) -> Path:
        return self.root / path if not Path(path).is_absolute() else Path(path)


def generation_config(config: StudyConfig, *, temperature: float = 0.0, top_p: float = 1.0, engine: str = "hf"):
    """The dense generation (greedy: occlusion labels regenerate greedily; on `engine`) or, with a protocol's
    sampling, the evictor's (always kvscope's own decoding, which its cache needs)."""
    from tasks.run import GenerationConfig

    return GenerationConfig(dataset=config.dataset, model=config.model, data_file=config.data_file,
                            limit=config.limit, max_new_tokens=config.max_new_tokens, temperature=temperature,
                            top_p=top_p, seed=config.seed, dtype=config.dtype, device=config.device, engine=engine,
                            max_memory=config.max_memory)


def check_memory(config: StudyConfig, problems, backend: BackendConfig) -> None:
    """Refuse a study whose traces (unless --traces gives them) or labels would need more memory than the device
    has or --max-memory allows, before any stage starts: the same estimates `tasks.run` and `labeling.occlusion`
    check (`docs/limits.md`); the evictor holds less than the dense traces it replays."""
    from labeling.job import check_labelling
    from models.loading import load_tokenizer
    from tasks.prompts import build_prompt_ids

    tokenizer = load_tokenizer(config.model)
    prompts = {p.id: build_prompt_ids(tokenizer, p) for p in problems}
    if config.traces is None:
        generation_config(config).check_memory(prompts, backend)
    if not is_long_context(config.dataset):
        check_labelling(config.model, [], config.occlusion(), config.max_memory, f"--dataset {config.dataset}",
                        device=config.device, lengths=[len(ids) + config.max_new_tokens for ids in prompts.values()])


def read_traces(path: Path) -> list[Trace]:
    return read_records(path, Trace)


def check_reused_traces(config: StudyConfig, problems) -> list[Trace]:
    """The --traces records of the study's problems: dense, of --model and --dataset, holding every problem."""
    from signals.traces import read_dense_traces

    assert config.traces is not None  # called for a study that reuses --traces
    traces = {trace.id: trace for trace in read_dense_traces(config.traces)}
    models = sorted({str(t.model) for t in traces.values()})
    if {portable_path(m) for m in models} != {portable_path(config.model)}:
        raise UsageError(f"--traces {config.traces!r} holds traces of {', '.join(models)}, not of --model "
                         f"{config.model!r}")
    missing = [p.id for p in problems if p.id not in traces]
    if missing:
        raise UsageError(f"--traces {config.traces!r} has no trace of problem(s) {', '.join(missing[:5])} (the first "
                         f"{len(problems)} of {config.dataset}); generate them, or lower --limit")
    return [traces[p.id] for p in problems]


# --- traces ---------------------------------------------------------------------------------------------------------
def traces_stage(config: StudyConfig, problems, path: Path, paths: Paths, backend: BackendConfig) -> Outputs:
    """Dense greedy traces of the study's problems (a `tasks.run` output directory), or the --traces records."""
    if config.traces is not None:
        traces = check_reused_traces(config, problems)
        file = Path(config.traces).resolve()
    elif is_known_answer(config.dataset):
        traces, file = _construct(config, problems, path), path / TRACES_FILE
    else:
        traces, file = _generate(config, problems, path, backend), path / TRACES_FILE
    return {"traces": paths.rel(file), "n": len(traces), "correct": sum(bool(t.correct) for t in traces),
            "mean_generated": sum(len(t.generated_ids) for t in traces) / len(traces),
            "reused_file": config.traces is not None}


def traces_file(config: StudyConfig, traces: Outputs, paths: Paths) -> Path:
    """The dense traces' file: --traces when the study reuses one (the traces stage's key holds its SHA-256, so this
    is the file the stage recorded, wherever the checkout now keeps it), else the traces stage's own file."""
    return Path(config.traces).resolve() if config.traces is not None else paths.abs(traces["traces"])


def check_budgets_fit(config: StudyConfig, problems, traces: Outputs, paths: Paths) -> None:
    """Refuse, right after the traces, a budget that some problem's protected prompt (and recency window) does not
    fit under the study's protocol (`evictor.sweep.check_budgets_fit`), on the problems the evictor stage may run
    (with ``evict_problems="labelled"`` the labelled ones are among the correctly answered): the evictor would
    refuse it only after labelling, signals and selection."""
    from evictor.sweep import check_budgets_fit as sweep_fits

    file = traces_file(config, traces, paths)
    ids = {problem.id for problem in problems}
    records = [t for t in read_traces(file) if t.id in ids
               and (config.evict_problems == "all" or config.include_incorrect or t.correct)]
    sweep_fits(sweep_config(config, default_configs(config), file),
               {t.id: len(t.prompt_ids) for t in records}, {t.id: len(t.generated_ids) for t in records})


def kvscope_decode_rate(traces: list[Trace]) -> float | None:
    """Single-sequence decode tokens/s of kvscope's own decoding that `traces` imply, which the study's time estimates
    scale from: the median over traces of each one's tokens/s times the square root of the batch it shared (a trace's
    rate is per sequence, and batching on a CPU gains about the square root of the batch: bench/README.md). None when
    another engine decoded them (vLLM's speed says nothing about kvscope's cache, which the replay and the evictor
    decode with) or none was timed (constructed traces)."""
    rates = []
    for trace in traces:
        engine = trace.extra.get("engine") or {}  # absent from traces made before the engine choice: hf, batch 1
        if engine.get("name", "hf") != "hf":
            return None
        if rate := trace.timings.get("tokens_per_s"):
            rates.append(rate * engine.get("batch_size", 1) ** 0.5)
    return float(np.median(rates)) if rates else None


def _construct(config: StudyConfig, problems, path: Path) -> list[Trace]:
    """The constructed traces of a known-answer task (`tasks.known_answer.problem_trace`), each answered by the model
    after its unoccluded reasoning and the forced cue (`answer_traces`): correct when it states the planted value."""
    from core.rundir import RunDir
    from models.loading import load_model
    from tasks.known_answer import answer_traces, problem_trace

    generation = generation_config(config)
    with RunDir(path, {"constructed": generation.identity()}) as run:
        store = run.store(TRACES_FILE)
        todo = [p for p in problems if p.id not in store]
        if todo:
            lm = load_model(config.model, device=config.device, dtype=config.dtype)
            run.save_config(**dataclasses.asdict(generation), loaded_model=lm.describe(),
                            traces="constructed by tasks.known_answer, answered under the forced cue")
            for trace in answer_traces(lm, [problem_trace(p, lm.tokenizer, config.model) for p in todo]):
                store.append(trace.to_json())
        by_id = {str(r["id"]): Trace.from_json(r, str(store.path)) for r in store.records}
    return [by_id[p.id] for p in problems]


def _generate(config: StudyConfig, problems, path: Path, backend: BackendConfig) -> list[Trace]:
    from tasks.run import generate_run

    return generate_run(generation_config(config, engine=config.engine), path, backend, problems=problems,
                        label="dense traces")[0]


# --- labels ---------------------------------------------------------------------------------------------------------
def labels_stage(config: StudyConfig, traces: Outputs, path: Path, paths: Paths, backend: BackendConfig,
                 kind: str = "token") -> Outputs:
    """Labels of the dense traces (correct ones only unless --include-incorrect) of one kind (`labeling.labeler.
    INTERVENTIONS`): token occlusion (the labels stage), cache-level or joint (their own stages)."""
    from labeling.job import NoAnswerCue, NothingLabelled, OcclusionJob, run_occlusion
    from labeling.labeler import select_traces

    occlusion = config.occlusion(intervention=kind)
    trace_file = traces_file(config, traces, paths)
    eligible = select_traces(read_traces(trace_file), occlusion)
    if not eligible:
        return {"labels": None, "labelled": 0, "skipped": 0, "eligible": 0,
                "reason": f"no correctly answered trace among {traces['n']} (rerun with --include-incorrect to "
                          "label against the model's own answers)"}
    # The traces name their dataset (a generated task its canonical name, e.g. known_facts@1).
    job = OcclusionJob(config=occlusion, traces=str(trace_file), dataset=None, model=config.model,
                       device=config.device)
    try:
        labels = run_occlusion(job, path, backend).labels
        reason = None
    except NothingLabelled as err:
        labels, reason = read_records(path / "labels.jsonl", Label), str(err)
    except NoAnswerCue as err:
        return {"labels": None, "labelled": 0, "skipped": len(eligible), "eligible": len(eligible), "reason": str(err)}
    return {"labels": paths.rel(path / "labels.jsonl"), **label_counts(labels), "eligible": len(eligible),
            "reason": reason, "kind": kind}


def labellable(config: StudyConfig, traces: Outputs, paths: Paths) -> str | None:
    """Why no trace of the study can be labelled (None when some can), from the traces and the tokenizer alone:
    said right after the traces stage, before any other stage spends time."""
    from labeling.labeler import OcclusionLabeler, select_traces
    from models.loading import load_tokenizer
    from tasks.generation import stop_token_ids

    occlusion = config.occlusion()
    eligible = select_traces(read_traces(traces_file(config, traces, paths)), occlusion)
    if not eligible:
        return (f"no correctly answered trace among {traces['n']} (rerun with --include-incorrect to label against "
                "the model's own answers)")
    tokenizer = load_tokenizer(config.model)
    labeler = OcclusionLabeler(model=None, tokenizer=tokenizer, answer_of=str, same=str.__eq__,
                               stop_ids=stop_token_ids(tokenizer), config=occlusion)
    reasons = {plan.skip_reason for plan in map(labeler.plan, eligible)}
    return None if None in reasons else "; ".join(sorted(str(r) for r in reasons))


def label_counts(labels: list[Label]) -> Outputs:
    from labeling.breakdown import effect_breakdown, no_answer_share, outcome_breakdown

    labelled = [label for label in labels if label.labelled]
    fractions = [label.important_fraction for label in labelled if label.important_fraction is not None]
    breakdown = outcome_breakdown(labelled)
    return {"labelled": len(labelled), "skipped": len(labels) - len(labelled),
            "skip_reasons": sorted({label.reason for label in labels if not label.labelled}),
            "mean_important_fraction": sum(fractions) / len(fractions) if fractions else None,
            "replacement": labelled[0].replacement if labelled else None,
            "labelled_ids": [label.id for label in labelled],
            "positions": sum(len(label.positions or []) for label in labelled),
            # every labelled record has its answer boundary
            "unlabelled_positions": sum(label.answer_start - len(label.positions or []) for label in labelled
                                        if label.answer_start is not None),
            "breakdown": breakdown, "no_answer_share": no_answer_share(breakdown),
            "places": effect_breakdown(labelled)}


# --- label agreement ------------------------------------------------------------------------------------------------
def agreement_stage(config: StudyConfig, traces: Outputs, labels: Outputs, path: Path, paths: Paths,
                    backend: BackendConfig) -> Outputs:
    """The first --agreement-traces labelled traces (default all) relabelled with each other replacement (auto: the
    pad token where it is harmless; the neutral space token; deletion), and the agreement of every pair of label sets
    (`labeling.agreement`: Cohen's kappa per position and per window, and how window outcomes move)."""
    from labeling.agreement import pairwise_agreement
    from labeling.job import NothingLabelled, OcclusionJob, run_occlusion

    ids = labels["labelled_ids"][: config.agreement_traces]
    main = labels["replacement"]
    sets = {main["chosen"]: [label for label in read_records(paths.abs(labels["labels"]), Label) if label.id in ids]}
    subset = path / "traces.jsonl"
    by_id = {trace.id: trace for trace in read_traces(traces_file(config, traces, paths))}
    path.mkdir(parents=True, exist_ok=True)
    subset.write_text("".join(json.dumps(by_id[i].to_json()) + "\n" for i in ids))
    files, unavailable, tokens = {main["chosen"]: labels["labels"]}, {}, {main["chosen"]: main.get("token_id")}
    for spec in AGREEMENT_REPLACEMENTS:
        if spec in (main["spec"], main["chosen"]):  # the study's own labels already fill this way
            continue
        job = OcclusionJob(config=config.occlusion(spec), traces=str(subset), dataset=None,
                           model=config.model, device=config.device)
        try:
            result = run_occlusion(job, path / spec, backend)
        except (NothingLabelled, UsageError) as err:  # nothing labelled, or the tokenizer cannot fill this way
            unavailable[spec] = str(err)
            continue
        replacement = result.labels[0].replacement or {"chosen": spec}
        chosen = replacement["chosen"]
        if chosen in sets and tokens.get(chosen) == replacement.get("token_id"):
            note = f": {replacement['note']}" if replacement.get("note") else ""
            unavailable[spec] = f"resolves to {chosen}, already compared{note}"
            continue
        sets[chosen], files[chosen] = result.labels, paths.rel(result.labels_path)
        tokens[chosen] = replacement.get("token_id")
    rows = pairwise_agreement(sets)
    return {"traces": ids, "files": files, "rows": rows, "unavailable": unavailable}


# --- signals --------------------------------------------------------------------------------------------------------
def signals_stage(config: StudyConfig, traces: Outputs, labels: Outputs, path: Path, paths: Paths) -> Outputs:
    """Every scorer's replayed scores (`evictor.replay`) and the per-layer interpretability signals
    (`signals`: g_l raw, rolling mean, rolling z; key norms; attention received) of the labelled traces."""
    from tqdm import tqdm

    from evictor.policy import configured_policy
    from evictor.replay import ReplayConfig, build_engines, replay_signals
    from models.loading import load_model
    from signals.traces import SignalsConfig, claim_output, trace_signals

    ids = set(labels["labelled_ids"])
    todo_traces = [t for t in read_traces(traces_file(config, traces, paths)) if t.id in ids]
    if not todo_traces:
        return {"files": [], "reason": "no labelled trace"}
    lm = load_model(config.model, device=config.device, dtype=config.dtype)
    replay = ReplayConfig(seed=config.seed, tail=config.tail)
    policies: dict[str, dict[str, Any]] = {name: {} for name in config.scorers}
    files = []
    out = path / REPLAY_FILE
    identity = {"traces": traces["traces"], "ids": sorted(ids), "model": config.model, "dtype": config.dtype,
                "policies": [configured_policy(n, p).config() for n, p in policies.items()], "replay": replay.to_dict()}
    with claim_output(out, identity) as run:
        engines = build_engines(lm, policies, replay)
        run.save_config(loaded_model=lm.describe(), protocol=replay.protocol().to_dict())
        store = run.store(out.name, key="id")
        todo = [t for t in todo_traces if t.id not in store]
        with tqdm(total=len(todo) * len(engines), desc="replayed scores", unit="policy", file=sys.stderr) as bar:
            for record in replay_signals(lm, engines, todo, replay, progress=bar.update):
                store.append(record.to_json())
    files.append(paths.rel(out))
    replayed = {configured_policy(name, params).signal for name, params in policies.items()}
    for smoothing, signals in SMOOTHED_SIGNALS.items():
        signals = tuple(s for s in signals if s not in replayed)
        signal_config = SignalsConfig(signals=signals, smoothing=smoothing, window=config.signal_window)
        out = path / f"signals-{smoothing}.jsonl"
        identity = {"traces": traces["traces"], "ids": sorted(ids), "model": config.model, "dtype": config.dtype,
                    **signal_config.record_settings()}
        with claim_output(out, identity) as run:
            run.save_config(loaded_model=lm.describe())
            store = run.store(out.name, key="id")
            todo = [t for t in todo_traces if t.id not in store]
            for record in tqdm(trace_signals(lm, todo, signal_config), total=len(todo), unit="trace",
                               desc=f"signals ({smoothing})", file=sys.stderr):
                store.append(record.to_json())
        files.append(paths.rel(out))
    return {"files": files, "traces": len(todo_traces), "scorers": list(config.scorers)}


# --- selection ------------------------------------------------------------------------------------------------------
def default_configs(config: StudyConfig, known: Outputs | None = None) -> dict[str, dict[str, Any]]:
    """The configurations every study's evictor stage runs: each paper's default scorer and the baselines, with
    --deploy-scorers every replayed scorer at its default parameters (so the offline statistic of each can be set
    beside what eviction by it keeps), and on a known-answer task the scorer that finds the planted facts (`known`,
    the known stage's outputs), so the report can say what evicting by it keeps."""
    papers = {policy: paper for paper, policy in PAPER_DEFAULTS.items()}
    finding = (known or {}).get("finding")
    names = dict.fromkeys([*PAPER_DEFAULTS.values(), *BASELINES, *config.deployed_scorers,
                           *([finding] if finding else [])])
    roles = {name: f"{papers[name]} default" if name in papers else "baseline" if name in BASELINES else
             "deployed scorer" if name in config.deployed_scorers else "finds the planted facts" for name in names}
    return {name: {"policy": name, "params": {}, "provenance": {"source": "study", "role": roles[name]}}
            for name in names}


def ranking_robustness(config: StudyConfig, agreement: Outputs, labels_file: str, files: tuple[str, ...],
                       paths: Paths) -> Outputs:
    """The scorer ranking under the labels of every replacement the agreement stage compared (`robustness_table`),
    against the study's own labels (`labels_file`): does a finding survive a change of filler?"""
    from validation.signals import load_aligned

    sets = {chosen: load_aligned(paths.abs(file), files) for chosen, file in agreement["files"].items()}
    study_filler = next(chosen for chosen, file in agreement["files"].items() if file == labels_file)
    scorers = [scorer for scorer in config.scorers if scorer != "random"]
    return robustness_table(sets, study_filler, scorers, config.level, config.n_boot, config.seed)


def robustness_table(sets: dict[str, Aligned], reference: str, scorers: list[str], level: float, n_boot: int,
                     seed: int) -> Outputs:
    """Each scorer's within-trace rho (its own aggregate score, `{scorer}.agg.raw`) under each label set, on the
    traces every set labelled, and Spearman's rho between the `reference` set's scorer ranking and each other one's.
    "sets" names the label sets in that order, reference first whatever the order of `sets` (a stage file sorts the
    keys of each row)."""
    from scipy.stats import spearmanr

    from validation.correlation import signal_table

    names = [f"{scorer}.agg.raw" for scorer in scorers]
    shared = set.intersection(*({t.id for t in aligned.traces} for aligned in sets.values()))
    rho = {}
    for chosen in [reference, *(other for other in sets if other != reference)]:
        subset = sets[chosen].select([n for n in names if n in sets[chosen].names]).restrict(shared).finite()
        rows = signal_table(subset, level, n_boot=n_boot, seed=seed)
        rho[chosen] = {row["signal"].removesuffix(".agg.raw"): row["within_rho"] for row in rows}
    main, *others = list(rho)
    ranked = list(rho[main])
    rows = [{"scorer": scorer, **{chosen: rho[chosen].get(scorer) for chosen in rho}} for scorer in ranked]
    agreement_rows = []
    for other in others:
        pairs = [(rho[main][s], rho[other].get(s)) for s in ranked]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None and np.isfinite(a) and np.isfinite(b)]
        agreement_rows.append({
            "a": main, "b": other, "scorers": len(pairs),
            "spearman": float(spearmanr(*zip(*pairs)).statistic) if len(pairs) > 2 else None,
            "best_a": max(rho[main], key=lambda s: np.nan_to_num(rho[main][s], nan=-2)),
            "best_b": max(rho[other], key=lambda s: np.nan_to_num(rho[other][s], nan=-2)),
        })
    return {"traces": len(shared), "sets": list(rho), "rows": rows, "agreement": agreement_rows}


def selection_stage(config: StudyConfig, labels: Outputs, signals: Outputs, path: Path, paths: Paths,
                    agreement: Outputs | None = None) -> Outputs:
    """Rank every (scorer, layer) pair by within-trace Spearman rho with the labels (`validation.select`) and choose
    the --top configurations; inconclusive (with its n) when the data cannot support an interval."""
    from validation.layers import LayersConfig
    from validation.report import write_csv, write_json
    from validation.select import SelectConfig, select

    if not signals.get("files"):
        return inconclusive(labels.get("reason") or signals.get("reason") or "no labelled trace", 0, 0)
    files = tuple(str(paths.abs(f)) for f in signals["files"])
    transforms = {smoothing: f"{smoothing}{config.signal_window}" for smoothing in ("mean", "z")}
    analysis = LayersConfig(labels=str(paths.abs(labels["labels"])), signals=files, family=BAND_FAMILY,
                            raw_transform=transforms["mean"], detrended_transform=transforms["z"], level=config.level,
                            n_boot=config.n_boot, seed=config.seed)
    n_traces, n_eff = informative(analysis)
    try:
        selection = select(SelectConfig(analysis, config.top))
    except UsageError as err:
        return inconclusive(str(err), n_traces, n_eff)
    path.mkdir(parents=True, exist_ok=True)
    write_csv(path / "ranking.csv", selection.ranking)
    write_csv(path / "layers.csv", selection.result.rows)  # per-layer rho of each signal and transform
    positional = None
    if selection.result.positional:  # raw vs detrended: rho with the labels and with position, per layer
        positional = path / "positional.csv"
        write_csv(positional, selection.result.positional)
    summary = selection.summary(SelectConfig(analysis, config.top))
    write_json(path / "selection.json", summary)
    return {"status": "selected" if selection.chosen else "inconclusive",
            "reason": None if selection.chosen else "no scorer that a policy computes has a positive within-trace rho",
            "n_traces": n_traces, "n_eff": n_eff, "ranking": paths.rel(path / "ranking.csv"),
            "layers": paths.rel(path / "layers.csv"), "positional": positional and paths.rel(positional),
            "bands": summary["bands"], "band_layers": summary["band_layers"],
            "nonfinite_positions_dropped": summary["nonfinite_positions_dropped"], "n_tokens": summary["n_tokens"],
            "chosen": selection.chosen, "configs": selection.configs, "labels": labels["labels"],
            "signals": list(signals["files"]),
            "robustness": ranking_robustness(config, agreement, labels["labels"], files, paths)
            if agreement and len(agreement.get("files", {})) > 1 else None}


def informative(analysis) -> tuple[int, int]:
    """(traces aligned, traces whose labels vary: n_eff), or (0, 0) when labels and signals do not align."""
    from validation.correlation import informative_traces
    from validation.signals import load_aligned

    try:
        aligned = load_aligned(analysis.labels, analysis.signals).finite()
    except UsageError:
        return 0, 0
    return len(aligned.traces), informative_traces(aligned)


def inconclusive(reason: str, n_traces: int, n_eff: int) -> Outputs:
    return {"status": "inconclusive", "reason": reason, "n_traces": n_traces, "n_eff": n_eff, "chosen": [],
            "configs": {}, "ranking": None, "bands": [], "band_layers": None}


# --- known answers ---------------------------------------------------------------------------------------------------
def known_stage(config: StudyConfig, traces: Outputs, labels: Outputs, signals: Outputs, paths: Paths,
                kinds: dict[str, Outputs] | None = None) -> Outputs:
    """On a known-answer task, the labels and the scorers checked against the planted facts
    (`validation.known_answer`): each label kind's window-level recall and precision (token occlusion under
    ``labels``, the others under ``kinds``), and each replayed scorer's AUC (its own aggregate score) for ranking the
    needed value's tokens above the decoys' and above the filler."""
    from validation.known_answer import fact_spans, finding_scorer, label_scores, scorer_auc
    from validation.signals import SignalSet, SignalTrace, read_signals

    if labels.get("labels") is None or not labels.get("labelled"):
        return {"reason": labels.get("reason") or "no labelled trace"}
    spans = {t.id: fact_spans(t) for t in read_traces(traces_file(config, traces, paths))}
    scores = label_scores(read_records(paths.abs(labels["labels"]), Label), spans, config.level)
    out: Outputs = {"labels": scores.to_json(), "auc": [], "kinds": {}}
    for kind, stage in (kinds or {}).items():
        if stage.get("labels") and stage.get("labelled"):
            kind_scores = label_scores(read_records(paths.abs(stage["labels"]), Label), spans, config.level)
            out["kinds"][kind] = kind_scores.to_json()
    replay = next((f for f in signals.get("files", []) if f.endswith(REPLAY_FILE)), None)
    if replay is None:
        return out
    every = read_signals(paths.abs(replay))
    names = [f"{scorer}.agg.raw" for scorer in config.scorers if f"{scorer}.agg.raw" in every.names]
    columns = [every.names.index(name) for name in names]
    aggregates = SignalSet(names, [SignalTrace(t.id, t.positions, t.values[:, columns]) for t in every.traces])
    found = {against: scorer_auc(aggregates, spans, against=against, level=config.level, n_boot=config.n_boot,
                                 seed=config.seed) for against in ("decoy", "filler")}
    for decoy, filler in zip(found["decoy"], found["filler"]):
        out["auc"].append({"scorer": decoy.name.removesuffix(".agg.raw"), "auc_decoy": decoy.auc,
                           "auc_decoy_lo": decoy.auc_lo, "auc_decoy_hi": decoy.auc_hi, "auc_filler": filler.auc,
                           "auc_filler_lo": filler.auc_lo, "auc_filler_hi": filler.auc_hi, "traces": decoy.traces})
    # random is the reference eviction is compared with, never a finding however its AUC falls
    best = finding_scorer([row for row in out["auc"] if row["scorer"] != "random"])
    out["finding"] = best["scorer"] if best is not None else None
    return out


# --- teacher-forced eviction ----------------------------------------------------------------------------------------
def forced_stage(config: StudyConfig, labels: Outputs, selection: Outputs, known: Outputs, path: Path,
                 paths: Paths) -> Outputs:
    """Every configuration the evictor stage deploys, teacher-forced on the labelled traces at every budget and its
    reference answer scored (`evictor.teacher_forced`): each configuration's offline accuracy and graded effect on
    the traces the model wrote, beside what deploying it keeps."""
    from evictor.teacher_forced import ForcedConfig, run_forced

    if not labels.get("labels") or not labels.get("labelled"):
        return {"rows": [], "reason": labels.get("reason") or "no labelled trace"}
    rows = []
    for name, configs in sweeps(config, selection, known).items():
        forced = ForcedConfig(labels=str(paths.abs(labels["labels"])), model=config.model,
                              policies=tuple(c["policy"] for c in configs.values()),
                              policy_params={c["policy"]: c["params"] for c in configs.values()},
                              budgets=config.budgets, protocol=config.protocol,
                              protocol_settings=config.protocol_settings, teacher_block=config.teacher_block,
                              seed=config.seed, dtype=config.dtype, device=config.device)
        for row in run_forced(forced, path / name):
            rows.append({"sweep": name, "config": config_label(name, row["policy"], configs), **row})
    return {"rows": rows}


# --- evictor --------------------------------------------------------------------------------------------------------
def sweeps(config: StudyConfig, selection: Outputs,
           known: Outputs | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Sweep name -> its configurations: the baselines and paper defaults (`default_configs`) in one sweep, each
    selected configuration not among them in its own (one sweep holds one configuration per policy name)."""
    defaults = default_configs(config, known)
    plan = {BASELINE_SWEEP: defaults}
    for name, chosen in selection["configs"].items():
        runs_as = ran_as(name, chosen, defaults)
        if runs_as not in defaults:
            plan[runs_as] = {runs_as: chosen}
    return plan


def ran_as(name: str, chosen: dict[str, Any], defaults: dict[str, dict[str, Any]]) -> str:
    """The name a selected configuration runs under: the default configuration it equals (a baseline or a paper's
    default), else ``selected-<name>`` (a default of the same policy may run beside it)."""
    for default, config in defaults.items():
        if (config["policy"], config["params"]) == (chosen["policy"], chosen["params"]):
            return default
    return SELECTED + name


def sweep_config(config: StudyConfig, configs: dict[str, dict[str, Any]], reference: Path,
                 problem_ids: tuple[str, ...] | None = None):
    from evictor.protocol import resolve_protocol
    from evictor.sweep import SweepConfig

    settings = config.protocol_settings
    sampling = resolve_protocol(config.protocol, settings).sampling
    generation = generation_config(config, temperature=sampling.temperature, top_p=sampling.top_p)
    return SweepConfig(generation=dataclasses.replace(generation, problem_ids=problem_ids),
                       policies=tuple(c["policy"] for c in configs.values()),
                       budgets=config.budgets,
                       protocol=config.protocol, protocol_settings=settings,
                       policy_params={c["policy"]: c["params"] for c in configs.values()},
                       reference=str(reference), batch_size=config.batch_size,
                       keep_log=True)  # the trace viewer draws what each KV head kept; a keep-log changes no token


def evictor_stage(config: StudyConfig, traces: Outputs, labels: Outputs, selection: Outputs, known: Outputs,
                  path: Path, paths: Paths, backend: BackendConfig, quiet: bool) -> Outputs:
    """Every configuration at every budget under one protocol (`evictor.sweep.run_sweep`), fractions of each problem's
    dense trace length or K in tokens; on every problem, or with ``evict_problems="labelled"`` on the labelled ones
    (all problems when none was labelled, so the baselines still run)."""
    from evictor.sweep import run_sweep

    reference = traces_file(config, traces, paths)
    labelled = tuple(labels.get("labelled_ids") or ())
    problem_ids = labelled if config.evict_problems == "labelled" and labelled else None
    cells, plan = [], {}
    for name, configs in sweeps(config, selection, known).items():
        out = path / name
        rows = run_sweep(sweep_config(config, configs, reference, problem_ids), out, backend=backend, quiet=quiet)
        plan[name] = {"path": paths.rel(out), "configs": configs}
        cells += [{**cell.to_json(), "sweep": name, "config": config_label(name, cell.policy, configs)}
                  for cell in rows]
    return {"sweeps": plan, "cells": cells}


def config_label(sweep: str, policy: str, configs: dict[str, dict[str, Any]]) -> str:
    """How a cell's configuration is named in tables: the policy, or the selected configuration's name."""
    return policy if sweep == BASELINE_SWEEP else next(iter(configs))


# --- compare --------------------------------------------------------------------------------------------------------
def compare_stage(config: StudyConfig, evictor: Outputs, paths: Paths) -> Outputs:
    """Each configuration against random (prompt kept) at each budget: paired problem-clustered bootstrap and exact
    sign test (`validation.compare`), refusing cells of unequal peak cache."""
    from validation.compare import EVERY_POLICY, CompareConfig, compare

    baseline = evictor["sweeps"][BASELINE_SWEEP]
    pairs = [(BASELINE_SWEEP, policy) for policy in baseline["configs"] if policy != REFERENCE]
    pairs += [(name, EVERY_POLICY) for name in evictor["sweeps"] if name != BASELINE_SWEEP]
    rows = []
    for sweep, policy in pairs:
        plan = evictor["sweeps"][sweep]
        runs = (str(paths.abs(plan["path"])), str(paths.abs(baseline["path"])))
        try:
            result = compare(CompareConfig(runs=runs, policies=(policy, REFERENCE), n_boot=config.compare_n_boot,
                                           level=config.level, seed=config.seed))
        except UsageError as err:  # unequal peak cache, or no shared problem: reported, not hidden
            rows.append({"sweep": sweep, "config": policy, "policy_b": REFERENCE, "error": str(err)})
            continue
        for row in result.comparisons:
            rows.append({"sweep": sweep, "config": config_label(sweep, row["policy_a"], plan["configs"]), **row})
    return {"rows": rows}

