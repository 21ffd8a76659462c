"""The study's deliverables, written from its stages' outputs: ``report.md`` (self-contained: the question, the
settings, the tables, the figures inline, what is significant and what is not, the commands to reproduce),
``figures/*.png``, ``selection.json``, ``configs/<name>.json``, ``ranking.csv``, ``layers.csv`` and ``positional.csv``
(the per-layer analysis, when the selection ran), ``accuracy.csv`` and ``compare.csv``.

``selection.json`` is itself a policy configuration: its top-level ``policy`` and ``params`` are the primary
configuration (the best selected scorer, or EpiKV's default when the selection is inconclusive), so
``evictor.run --policy-config OUT/selection.json`` runs it; ``configs`` holds every configuration the evictor stage
ran, each also written to ``configs/<name>.json``.
"""

from __future__ import annotations

import csv
import math
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from core.cli import atomic_write
from core.errors import UsageError
from core.rundir import source_revision
from figures.trace import VIEWER_FILE as VIEWER
from study import stages
from study.config import PAPER_DEFAULTS, REFERENCE, is_long_context
from validation.report import write_csv, write_json

FIGURES = "figures"
SHOWN_SCORERS = 15
PRIMARY_DEFAULT = PAPER_DEFAULTS["EpiKV"]
COMPARE_COLUMNS = ("config", "sweep", "policy_a", "budget_a", "policy_b", "budget_b", "n_problems", "accuracy_a",
                   "accuracy_b", "difference", "ci_lo", "ci_hi", "bootstrap_p", "sign_p_value", "sign_a_better",
                   "sign_b_better", "sign_n_discordant", "peak_slots_a", "peak_slots_b", "equal_cache", "significant",
                   "error")


def defaults_of(result) -> dict[str, dict[str, Any]]:
    """The default configurations the study's evictor ran (`study.stages.default_configs`)."""
    return stages.default_configs(result.config, result["known"])


def fmt(value: Any, digits: int = 3) -> str:
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def pct(value: Any) -> str:
    return "–" if value is None or isinstance(value, float) and not math.isfinite(value) else f"{100 * value:.1f}%"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A CSV table's rows with numbers as numbers and empty cells as NaN (`figures.tables.read_table`)."""
    from figures.tables import read_table

    return read_table(path).to_dict("records")


def distinct_scorers(ranking: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best row of each scorer and transform: one row for a policy's scores at all of its layers and heads (a
    position-only score such as recency repeats the same rho at every layer), one per transform of g_l."""
    seen, rows = set(), []
    for row in ranking:
        key = (str(row["family"]).split(".")[0], row["transform"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def interval(row: dict[str, Any], name: str) -> str:
    """``[lo, hi]`` of the interval `name` (columns ``<name>_lo`` / ``<name>_hi``) of a row."""
    return f"[{fmt(row.get(f'{name}_lo'))}, {fmt(row.get(f'{name}_hi'))}]"


def budgets_text(budgets) -> str:
    """A study's budgets in words: fractions of each problem's dense trace length, K in tokens, or both."""
    fractions = [f"{b:g}" for b in budgets if b.tokens is None]
    tokens = [str(b) for b in budgets if b.tokens is not None]
    return "; ".join([", ".join(fractions) + " of each problem's dense trace length"] * bool(fractions)
                     + [", ".join(tokens) + " tokens (K)"] * bool(tokens))


def budget_text(budget: Any) -> str:
    return "–" if budget is None or isinstance(budget, float) and not math.isfinite(budget) else f"{budget:g}"


# --- the files beside the report -------------------------------------------------------------------------------------
def ran_configs(result) -> dict[str, dict[str, Any]]:
    """Every configuration the evictor stage ran, by name (selected ones under their selection names)."""
    configs: dict[str, dict[str, Any]] = {}
    for plan in result["evictor"]["sweeps"].values():
        configs.update(plan["configs"])
    return configs


def primary_config(result) -> tuple[str, dict[str, Any]]:
    """The best selected configuration (under the name it ran as), else EpiKV's default."""
    chosen = result["selection"]["chosen"]
    if not chosen:
        return PRIMARY_DEFAULT, ran_configs(result)[PRIMARY_DEFAULT]
    name = chosen[0]["name"]
    runs_as = stages.ran_as(name, result["selection"]["configs"][name], defaults_of(result))
    return runs_as, ran_configs(result)[runs_as]


def write_selection(result) -> dict[str, Any]:
    out = result.out
    selection, configs = result["selection"], ran_configs(result)
    for name, config in configs.items():
        write_json(out / "configs" / f"{name}.json", config)
    name, primary = primary_config(result)
    defaults = defaults_of(result)
    ranking = []
    if selection.get("ranking"):
        ranking = read_rows(stages.Paths(out).abs(selection["ranking"]))
        write_csv(out / "ranking.csv", ranking)
    for table in ("layers", "positional"):  # the per-layer analysis behind the bands, when the stage wrote it
        if selection.get(table):
            write_csv(out / f"{table}.csv", read_rows(stages.Paths(out).abs(selection[table])))
    summary = {
        "policy": primary["policy"], "params": primary["params"], "primary": name,
        "status": selection["status"], "reason": selection.get("reason"),
        "n_traces": selection["n_traces"], "n_eff": selection["n_eff"],
        "labels": selection.get("labels"), "signals": selection.get("signals"),
        "bands": selection.get("bands"), "band_layers": selection.get("band_layers"),
        "chosen": [{**c, "ran_as": stages.ran_as(c["name"], selection["configs"][c["name"]], defaults)}
                   for c in selection["chosen"]],
        "configs": {n: {**c, "file": f"configs/{n}.json"} for n, c in configs.items()},
        "ranking": [{k: row[k] for k in ("rank", "signal", "within_rho", "within_t_lo", "within_t_hi", "within_lo",
                                         "within_hi", "within_n_eff", "policy")}
                    for row in distinct_scorers(ranking)[:SHOWN_SCORERS]],
    }
    write_json(out / "selection.json", summary)
    return summary


def comparison_rows(result) -> list[dict[str, Any]]:
    level = result.config.level
    rows = []
    for row in result["compare"].get("rows", []):
        full = {column: row.get(column) for column in COMPARE_COLUMNS}
        if row.get("error") is None:
            full["significant"] = bool(row["bootstrap_p"] < 1 - level)
        rows.append(full)
    return rows


def accuracy_rows(result) -> list[dict[str, Any]]:
    keys = ("config", "policy", "budget", "problems", "correct", "accuracy", "ci_lo", "ci_hi", "no_answer",
            "empty_output", "truncated", "mean_generated", "mean_rounds", "evicted", "max_peak_slots", "sweep")
    return [{k: cell.get(k) for k in keys} for cell in result["evictor"]["cells"]]


# --- figures ---------------------------------------------------------------------------------------------------------
def draw_figures(result, ranking: list[dict[str, Any]], accuracy: list[dict], comparisons: list[dict]) -> dict:
    """Each figure's PNG path relative to the study directory, or why it was not drawn."""
    from figures.accuracy_budget import plot_accuracy_vs_budget
    from figures.forest import plot_forest
    from figures.layer_rho import from_validation_table, plot_layer_rho
    from figures.save import save_figure

    out = result.out / FIGURES
    layered = [r for r in ranking if math.isfinite(r["layer"]) and ".h" not in r["family"]]
    bands = [r for r in layered if r["family"] == stages.BAND_FAMILY]
    others = [r for r in layered if r["family"] != stages.BAND_FAMILY]
    deployable = [{**r, "policy": r["policy"] if isinstance(r["policy"], str) else "(no policy)"}
                  for r in distinct_scorers(ranking)[:SHOWN_SCORERS]]
    evicting = [r for r in comparisons if r.get("error") is None]
    drawn = {}
    plans = {
        "layer_rho": ("per-layer rho of g_l (raw, rolling mean, rolling z)",
                      lambda: plot_layer_rho(from_validation_table(bands),
                                             band_signal=f"{stages.BAND_FAMILY}.mean{result.config.signal_window}")),
        "signals_by_layer": ("per-layer rho of the other layered signals and replayed scores",
                             lambda: plot_layer_rho(from_validation_table(others))),
        "scorer_ranking": ("the best scorers by within-trace rho",
                           lambda: plot_forest(deployable, label="signal", value="within_rho", low="within_t_lo",
                                               high="within_t_hi", group="policy",
                                               xlabel="within-trace ρ with the labels (t-interval over traces)")),
        "accuracy_budget": ("accuracy against the budget",
                            lambda: plot_accuracy_vs_budget([{**r, "policy": r["config"]} for r in accuracy])),
        "difference_vs_random": ("accuracy difference against random",
                                 lambda: plot_forest([{**r, "label": comparison_label(r)}
                                                      for r in evicting], value="difference", low="ci_lo",
                                                     high="ci_hi", xlabel=f"accuracy − {REFERENCE} (paired)")),
    }
    for stem, (what, draw) in plans.items():
        try:
            figure = draw()
        except UsageError as err:
            drawn[stem] = {"what": what, "skipped": str(err)}
            continue
        save_figure(figure, out, stem)
        drawn[stem] = {"what": what, "png": f"{FIGURES}/{stem}.png"}
    return drawn


# --- report.md -------------------------------------------------------------------------------------------------------
def figure_md(figures: dict, stem: str) -> str:
    figure = figures[stem]
    if "png" in figure:
        return f"![{figure['what']}]({figure['png']})"
    return f"*Figure {stem} not drawn: {figure['skipped']}*"


def settings_section(result) -> str:
    c = result.config
    rows = [["model", c.model], ["dataset", f"{c.dataset}" + (f" ({c.data_file})" if c.data_file else "")],
            ["problems", f"{result['traces']['n']} (--limit {c.limit})"], ["max new tokens", c.max_new_tokens],
            ["dense traces", "reused from --traces" if c.traces else "generated greedily"],
            *([["labels, signals, selection", "off (a RULER task: its evidence is the prompt)"]]
              if is_long_context(c.dataset) else [
                ["labelled traces", "every trace (--include-incorrect)" if c.include_incorrect else
                 "correctly answered only (EpiKV)"],
                ["occlusion", f"window {c.window}, stride {c.stride}, replacement {c.replacement}, answer "
                              f"regenerated up to {c.occlusion().answer_cap} tokens"
                              + (" after the trace's own answer cue (forced answer)" if c.force_answer else
                                 f" from the answer boundary, tail {c.tail}")
                              + f"; no-answer rule {c.no_answer}"
                              + ("; graded (every window's effect on the reference answer's log-probability)"
                                 if c.occlusion().graded else "")],
                ["label kinds", ", ".join(c.labels)
                 + (f"; cache-level: {c.cache_heads} KV heads" if "cache" in c.labels else "")
                 + (f"; joint: budget {c.joint_share:g}, units of {c.joint_unit} tokens, {c.joint_draw} draws"
                    if "joint" in c.labels else "")],
                ["scorers replayed", ", ".join(c.scorers)],
                ["per-layer signals", "g_l (raw, rolling mean and rolling z over "
                                      f"{c.signal_window}), key norm, attention received (h2o)"],
                ["selection", f"top {c.top}, {c.level:.0%} intervals, {c.n_boot} bootstrap replicates over traces"]]),
            ["budgets", budgets_text(c.budgets)],
            ["protocol", f"{c.protocol} for every policy, {' '.join(c.protocol_flags())}"],
            ["evicted problems", "every problem" if c.evict_problems == "all" else
             "the labelled ones (accuracy = how often a policy keeps an answer the full cache got right)"],
            ["comparison", f"paired problem-clustered bootstrap ({c.compare_n_boot} replicates) and exact sign test "
                           f"against {REFERENCE}"],
            ["seed, dtype, device", f"{c.seed}, {c.dtype}, {c.device or 'default'}"]]
    return table(["setting", "value"], rows)


def stages_section(result) -> str:
    rows = [[r.name, r.status, r.key or "–", f"`{r.path}`" if r.path else r.outputs.get("reason", "–"),
             f"{r.seconds:.1f} s"] for r in result.stages.values()]
    reused = [r.name for r in result.stages.values() if r.status == "reused"]
    note = (f"Reused from an earlier run with the same settings: {', '.join(reused)}." if reused else
            "No stage was reused: every stage ran in this invocation (or resumed its own records).")
    return table(["stage", "status", "key", "directory", "wall time"], rows) + "\n\n" + note


def labels_section(result) -> str:
    from labeling.breakdown import AT_BOUNDARY
    from labeling.windows import OUTCOMES

    labels, traces, c = result["labels"], result["traces"], result.config
    lines = [f"Dense traces: {traces['n']} problems, {traces['correct']} answered correctly, "
             f"{traces['mean_generated']:.0f} generated tokens on average (`{traces['traces']}`).", ""]
    if labels.get("labels") is None:
        return "\n".join(lines + [f"No labels: {labels['reason']}."])
    replacement = labels.get("replacement") or {}
    lines.append(f"Occlusion labels (`{labels['labels']}`): {labels['labelled']} traces labelled, {labels['skipped']} "
                 f"skipped{' (' + '; '.join(labels['skip_reasons']) + ')' if labels['skip_reasons'] else ''}; windows "
                 f"filled with {replacement.get('chosen', '–')} ({replacement.get('text')!r}); mean important fraction "
                 f"of the reasoning span {fmt(labels['mean_important_fraction'], 2)}.")
    breakdown = labels.get("breakdown")
    if breakdown:
        share, unlabelled = labels.get("no_answer_share"), labels.get("unlabelled_positions", 0)
        names = [name.replace("_", " ") for name in OUTCOMES]
        rows = [[r["where"], *[r[name] for name in OUTCOMES], r["windows"]] for r in breakdown]
        lines += ["", "### What each occluded window did", "",
                  "Every window's regenerated answer: the same as the unoccluded context's, a different one, none, or "
                  "a degenerate continuation (it stops at once or repeats the filler), by where the window sits in "
                  f"its trace's reasoning span (fifths by start; the window that {AT_BOUNDARY} on its own). Rule for "
                  f"windows without an answer: **{c.no_answer}** (flip: important; exclude: no evidence either way; "
                  "own-class: their positions are left out); "
                  + ("each context ended with the trace's own answer cue (forced answer)." if c.force_answer else
                     "contexts ended at the answer boundary (no forced answer)."), "",
                  table(["where", *names, "windows"], rows), "",
                  f"Of the windows whose answer did not stay the same, {pct(share)} gave no answer at all"
                  + (f"; {unlabelled} of {unlabelled + labels.get('positions', 0)} positions are unlabelled under "
                     "the rule." if c.no_answer != "flip" else ".")]
    lines += kinds_lines(result)
    agreement = result["agreement"]
    if result.stages["agreement"].status == "off":
        lines += ["", f"Label agreement: off ({agreement['reason']})."]
    else:
        rows = [[r["a"], r["b"], r["traces"], r["positions"], fmt(r["agreement"]), fmt(r["kappa"]),
                 r.get("windows", "–"), fmt(r.get("window_kappa")), fmt(r["important_a"], 2),
                 fmt(r["important_b"], 2)] for r in agreement["rows"]]
        lines += ["", f"### Label agreement between replacements ({len(agreement['traces'])} traces relabelled)", "",
                  "Cohen's kappa over the reasoning positions both sets label, and over the windows both count as "
                  "evidence (did the window flip?) (labeling.agreement); a low kappa means the labels depend on what "
                  "fills the window, not only on what it removes.", "",
                  table(["A", "B", "traces", "positions", "agreement", "kappa", "windows", "window kappa",
                         "important A", "important B"], rows)]
        for r in agreement["rows"]:
            moved = {pair: n for pair, n in (r.get("outcome_pairs") or {}).items()
                     if pair.split(" -> ")[0] != pair.split(" -> ")[1]}
            if moved:
                lines.append(f"\n{r['a']} → {r['b']}, windows whose outcome changed: "
                             + ", ".join(f"{pair.replace('_', ' ')} ({n})" for pair, n in moved.items()) + ".")
        for spec, why in agreement["unavailable"].items():
            lines.append(f"\n{spec}: not compared ({why}).")
    return "\n".join(lines)


def selection_section(result, ranking: list[dict[str, Any]], figures: dict) -> str:
    selection, level = result["selection"], f"{result.config.level:.0%}"
    lines = []
    if selection.get("signals"):
        lines += ["Input files (relative to this directory; every statistic below is recomputable from them):", "",
                  f"- labels: `{selection['labels']}`"]
        lines += [f"- signals: `{path}`" for path in selection["signals"]]
        lines.append("")
    if selection["status"] != "selected":
        lines.append(f"**Selection inconclusive** (n = {selection['n_traces']} aligned traces, n_eff = "
                     f"{selection['n_eff']} with varying labels): {selection['reason']}. The evictor stage ran the "
                     "baselines and each paper's default scorer only.")
    if ranking:
        shown = distinct_scorers(ranking)[:SHOWN_SCORERS]
        rows = [[r["rank"], r["signal"], fmt(r["within_rho"]), interval(r, "within_t"), interval(r, "within"),
                 interval(r, "within_boot"), r["within_n_eff"], fmt(r["within_t_p_adj"]),
                 "yes" if r["within_t_significant"] is True else "no", fmt(r["position_rho"]),
                 r["policy"] if isinstance(r["policy"], str) else "–"] for r in shown]
        lines += [f"Scorers ranked by within-trace Spearman rho with the labels (one rho per trace, Fisher-z mean, "
                  f"n_eff = traces with a defined rho; {selection['n_tokens']} reasoning positions, "
                  f"{selection['nonfinite_positions_dropped']} positions where any signal is undefined left out for "
                  f"every signal); the best layer and head of each scorer and transform, {len(rows)} of "
                  f"{len(ranking)} rows (all in `ranking.csv`). Significance rests on the t-interval over the "
                  "per-trace z (it resamples the spread between traces; p corrected across each family's layers, "
                  "FDR); the paper's Fisher-z interval (se 1/sqrt(n_eff − 3)) and the bootstrap over traces are "
                  "beside it:", "",
                  table(["rank", "scorer", "rho", f"{level} t (traces)", f"{level} Fisher z", f"{level} bootstrap",
                         "n_eff", "p (t, FDR)", "significant", "rho with position", "deploys"], rows), "",
                  figure_md(figures, "scorer_ranking"), "", figure_md(figures, "layer_rho"), "",
                  figure_md(figures, "signals_by_layer")]
        bands = selection.get("bands") or []
        lines.append("")
        lines.append("Bands of g_l (runs of adjacent significant layers): " + (
            "; ".join(f"{'+' if b['sign'] > 0 else '−'} layers {b['layers'][0]}–{b['layers'][-1]} (peak "
                      f"{b['peak_layer']}, rho {fmt(b['peak_rho'])})" for b in bands) if bands else "none found."))
    if selection.get("robustness"):
        lines += ["", *robustness_lines(selection["robustness"])]
    if selection["chosen"]:
        defaults = defaults_of(result)
        rows = [[stages.ran_as(c["name"], selection["configs"][c["name"]], defaults), c["policy"],
                 f"`{c['params']}`", c["signal"], fmt(c["within_rho"]), interval(c, "within_t")]
                for c in selection["chosen"]]
        lines += ["", "Selected configurations, under the name they ran as (a selected configuration equal to a "
                  "baseline or a paper's default runs once, under that name; each is in `configs/<name>.json`):", "",
                  table(["ran as", "policy", "params", "scorer", "rho", f"{level} t (traces)"], rows)]
    return "\n".join(lines)


def robustness_lines(robustness: dict[str, Any]) -> list[str]:
    """The scorer ranking under each replacement (`stages.robustness_table`), as report lines."""
    if "sets" not in robustness:  # stored by a kvscope before b5df263, whose table read other signals' columns
        return ["### Scorer ranking under each replacement", "",
                "Not shown: the selection stage that holds it was computed by a kvscope whose table read some "
                "scorers from other signals' columns. Delete that stage's `stage.json` (the Stages table names it) "
                "and rerun the same command: the selection is recomputed and every other stage is reused."]
    names = robustness["sets"]
    rows = [[r["scorer"], *[fmt(r[name]) for name in names]] for r in robustness["rows"]]
    lines = [f"### Scorer ranking under each replacement ({robustness['traces']} traces labelled by every set)", "",
             "Each replayed scorer's within-trace rho (its own aggregate score) with the labels made by each filler; "
             "a finding rests on labels that agree:", "", table(["scorer", *[f"rho ({name})" for name in names]], rows),
             ""]
    return lines + [f"- {r['a']} vs {r['b']}: Spearman {fmt(r['spearman'])} across {r['scorers']} scorers; best "
                    f"{r['best_a']} vs {r['best_b']}" + (" (the same)" if r["best_a"] == r["best_b"] else
                                                         " (**the best scorer changes**)")
                    for r in robustness["agreement"]]


def eviction_section(result, accuracy: list[dict], figures: dict) -> str:
    c = result.config
    flags = " ".join(c.protocol_flags())
    lines = [f"Every configuration ran under the **{c.protocol}** protocol with `{flags}` for all policies"
             ", so a budget means the same cache for each (a fraction f: K = ceil(f × L) for each "
             "problem's dense trace length L; a whole number: K tokens), and a cell's peak cache is the most slots "
             "any KV head held (`max_peak_slots`). `rounds` is the mean number of eviction rounds per problem while it "
             "was generating, `evicted` the problems that had at least one (the others decoded as dense). Cells "
             "stored before kvscope 539b8e7 show no `evicted`, and their `rounds` also counts rounds after a problem "
             "had stopped."]
    rows = [[r["config"], budget_text(r["budget"]), r["problems"], pct(r["accuracy"]),
             f"[{pct(r['ci_lo'])}, {pct(r['ci_hi'])}]", r["no_answer"], fmt(r["mean_generated"], 1),
             fmt(r["mean_rounds"], 1), fmt(r["evicted"]), fmt(r["max_peak_slots"])] for r in accuracy]
    lines += ["", table(["configuration", "budget", "n", "accuracy", "95% Wilson", "no answer", "tokens", "rounds",
                         "evicted", "peak slots"], rows), "", figure_md(figures, "accuracy_budget")]
    return "\n".join(lines + forced_lines(result))


def comparison_section(result, comparisons: list[dict], figures: dict) -> str:
    level = result.config.level
    if not comparisons:
        return f"No comparison: {result['compare'].get('reason', 'nothing was compared')}."
    rows, refused = [], []
    for r in comparisons:
        if r.get("error"):
            refused.append(f"- {r['config']}: **not compared**: {r['error']}")
            continue
        cache = {True: "equal", False: "UNEQUAL", None: "–"}[r["equal_cache"]]
        rows.append([r["config"], budget_text(r["budget_a"]), budget_text(r["budget_b"]),
                     r["n_problems"], pct(r["accuracy_a"]), pct(r["accuracy_b"]), f"{100 * r['difference']:+.1f}",
                     f"[{100 * r['ci_lo']:+.1f}, {100 * r['ci_hi']:+.1f}]", fmt(r["bootstrap_p"]),
                     fmt(r["sign_p_value"]), f"{r['sign_a_better']}/{r['sign_b_better']}",
                     f"{fmt(r['peak_slots_a'])} / {fmt(r['peak_slots_b'])} ({cache})",
                     "**yes**" if r["significant"] else "no"])
    significant = [r for r in comparisons if r.get("significant")]
    lines = [f"Each configuration against **{REFERENCE}** (prompt kept) on the same problems: accuracy difference in "
             f"points with its {level:.0%} paired problem-clustered bootstrap interval, bootstrap and exact sign-test "
             "p-values, discordant problems (better/worse), and the peak cache slots per KV head of both cells "
             "(validation.compare refuses unequal peaks; full is the unlimited reference). Also in `compare.csv`.",
             "", table(["configuration", "budget", f"{REFERENCE} budget", "n", "accuracy", REFERENCE, "diff (pts)",
                        f"{level:.0%} CI", "bootstrap p", "sign p", "better/worse", "peak slots", "significant"],
                       rows), ""]
    lines += refused + ["", figure_md(figures, "difference_vs_random"), "", "### What is significant", ""]
    if significant:
        lines += [f"- {comparison_label(r)}: {100 * r['difference']:+.1f} points "
                  f"[{100 * r['ci_lo']:+.1f}, {100 * r['ci_hi']:+.1f}], bootstrap p = {fmt(r['bootstrap_p'])}"
                  for r in significant]
    else:
        lines.append(f"- Nothing: no configuration's interval excludes zero against {REFERENCE}.")
    others = [r for r in comparisons if not r.get("significant") and not r.get("error")]
    if others:
        n = max(r["n_problems"] for r in others)
        names = ", ".join(comparison_label(r) for r in others)
        lines += ["", f"Not significant ({len(others)} comparisons, n ≤ {n} problems; at this n one problem is "
                  f"{100 / n:.0f} points): {names}."]
    return "\n".join(lines)


def comparison_label(row: dict[str, Any]) -> str:
    """A comparison with random as the report names it: the configuration at its budget, or, for one without a budget
    (full, compared with random at every budget), the budget random ran at."""
    if row["budget_a"] is None:
        return f"{row['config']} vs {REFERENCE} @ {budget_text(row['budget_b'])}"
    return f"{row['config']} @ {budget_text(row['budget_a'])}"


def offline_rows(result, ranking: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each configuration the evictor ran, with the offline statistic of the score it deploys: a selected
    configuration's chosen signal, a policy at its default parameters its own aggregate score (``<policy>.agg.raw``)."""
    from validation.predictive import offline_from_ranking

    defaults = defaults_of(result)
    chosen = {stages.ran_as(c["name"], result["selection"]["configs"][c["name"]], defaults): c["signal"]
              for c in result["selection"]["chosen"]}
    policies = {name: config["policy"] for name, config in ran_configs(result).items()}
    return offline_from_ranking(ranking, policies, chosen)


def predictive_section(result, ranking: list[dict[str, Any]], comparisons: list[dict]) -> str:
    """Every scorer that ran in the evictor: its offline rho beside its deployed difference against random, and
    the rank correlation between the two (`validation.predictive`)."""
    from validation.predictive import deployed_from_comparisons, describe, predictive

    level = result.config.level
    deployed = deployed_from_comparisons(comparisons, REFERENCE)  # full deploys no score: it has no budget
    offline = offline_rows(result, ranking)
    if not deployed or not offline:
        return "Nothing to set side by side: " + ("no scorer was validated offline." if not offline else
                                                  "no scorer was compared with random.")
    found = predictive(offline, deployed, level=level, seed=result.config.seed)
    rows = [[r["scorer"], r["signal"] or "–", budget_text(r["budget"]), fmt(r["offline_rho"]),
             f"[{fmt(r['offline_lo'])}, {fmt(r['offline_hi'])}]", f"{100 * r['difference']:+.1f}",
             f"[{100 * r['ci_lo']:+.1f}, {100 * r['ci_hi']:+.1f}]", r["n_problems"]] for r in found.rows]
    lines = ["Does the statistic the scorers were ranked by predict what evicting by them keeps? Each configuration "
             "that ran in the evictor, its within-trace rho with the labels (the score it deploys: its own aggregate "
             "over layers and heads, or the selected layer) beside its accuracy difference against "
             f"{REFERENCE} (points), and Spearman's rho between the two across scorers (per budget, and their mean):",
             "", table(["configuration", "offline signal", "budget", "rho", f"{level:.0%} t (traces)",
                        f"diff vs {REFERENCE}", f"{level:.0%} CI", "n"], rows), ""]
    for budget, test in found.per_budget.items():
        lines.append(f"- budget {budget_text(budget)}: {describe(test, level)}")
    if len(found.per_budget) > 1:
        lines.append(f"- all budgets: {describe(found.overall, level)}")
    if found.not_validated:
        lines.append(f"\nNo offline statistic (not a replayed scorer): {', '.join(found.not_validated)}.")
    return "\n".join(lines)


def reproduce_section(result, summary: dict) -> str:
    c = result.config
    selection = result["selection"]
    revision = source_revision()
    source = ("kvscope from an unknown source (not a git checkout)" if revision is None else
              f"kvscope commit `{revision['commit']}`" + (" with uncommitted changes" if revision["dirty"] else ""))
    lines = [f"Made with {source} (also in `config.json`).", "",
             "The whole study (rerunning it reuses every finished stage):", "", "```",
             shlex.join(result.command) if result.command else "(run through the library: study.run_study)", "```"]
    if selection.get("signals"):
        select = ["python", "-m", "validation.select", "--labels", selection["labels"], "--signals",
                  *selection["signals"], "--family", stages.BAND_FAMILY, "--raw-transform", f"mean{c.signal_window}",
                  "--detrended-transform", f"z{c.signal_window}", "--level", str(c.level), "--n-boot",
                  str(c.n_boot), "--seed", str(c.seed), "--top", str(c.top), "--out", "reselect"]
        lines += ["", "The ranking and selection from the files alone (run in this directory):", "", "```",
                  shlex.join(select), "```"]
    name = summary["primary"]
    evict = ["python", "-m", "evictor.run", "--policy-config", "selection.json", "--model", c.model, "--dataset",
             c.dataset, *(["--data-file", c.data_file] if c.data_file else []),
             *(["--limit", str(c.limit)] if c.limit else []), "--max-new-tokens", str(c.max_new_tokens), "--budget",
             ",".join(str(b) for b in c.budgets), "--reference", result["traces"]["traces"],
             "--protocol", c.protocol, *c.protocol_flags(), "--seed", str(c.seed), "--out", f"rerun-{name}"]
    lines += ["", f"The primary configuration ({name}, the top level of `selection.json`; every other one is in "
              "`configs/`) in the evictor (run in this directory):", "", "```", shlex.join(evict), "```"]
    baseline = result["evictor"]["sweeps"][stages.BASELINE_SWEEP]["path"]
    lines += ["", "A comparison against random (here EpiKV's default):", "", "```",
              shlex.join(["python", "-m", "validation.compare", "--runs", baseline, baseline, "--policies",
                          PRIMARY_DEFAULT, REFERENCE]), "```"]
    return "\n".join(lines)


KIND_TEXT = {"token": "token occlusion (the window's text replaced, the answer regenerated)",
             "cache": "cache-level (the window's keys and values removed at the answer boundary)",
             "joint": "joint (units of random keep-sets at the joint budget, datamodel coefficients)"}


def label_kinds(result) -> dict[str, dict[str, Any]]:
    """Each label kind the study computed, by kind: its stage's outputs (token occlusion's is the labels stage)."""
    kinds = {"token": result["labels"]}
    for kind, stage in (("cache", "cache_labels"), ("joint", "joint_labels")):
        if stage in result.stages and result.stages[stage].status != "off":
            kinds[kind] = result[stage]
    return {kind: outputs for kind, outputs in kinds.items() if outputs.get("places")}


def kinds_lines(result) -> list[str]:
    """Where each label kind's important windows lie, in fifths of the reasoning span: is there ground truth before
    the last fifth?"""
    kinds = label_kinds(result)
    if not kinds:
        return []
    places = [row["where"] for row in next(iter(kinds.values()))["places"]]
    rows = []
    for i, place in enumerate(places):
        row = [place]
        for outputs in kinds.values():
            r = outputs["places"][i]
            row += [f"{r['important']} / {r['windows']}", pct(r["share"]), fmt(r["mean_effect"], 3)]
        rows.append(row)
    header = ["where"] + [f"{kind} {column}" for kind in kinds for column in ("important", "share", "mean effect")]
    c = result.config
    joint = (f" Joint labels at a budget of {c.joint_share:g} of the trace, units of {c.joint_unit} tokens, "
             f"{c.joint_draw} draws." if "joint" in kinds else "")
    return ["", "### Where each label kind finds the windows the answer needs", "",
            "Per label kind (" + "; ".join(f"{k}: {KIND_TEXT[k]}" for k in kinds) + "): the important windows in "
            "each fifth of the reasoning span (by start; the window ending at the answer boundary on its own), their "
            "share of all important windows, and the mean graded effect of the windows there (the change of the "
            "reference answer's log-probability when the window, or a joint label's unit with the rest of the cache "
            "evicted at its budget, is taken away: negative where the answer needs it)." + joint, "",
            table(header, rows)]


def forced_lines(result) -> list[str]:
    """Teacher-forced eviction beside deployment: each configuration's offline accuracy and effect."""
    stage = result.stages.get("forced")
    if stage is None or stage.status == "off" or not result["forced"].get("rows"):
        return []
    rows = [[r["config"], budget_text(r["budget"]), r["traces"], f"{pct(r['accuracy'])} [{pct(r['ci_lo'])}, "
             f"{pct(r['ci_hi'])}]", f"{fmt(r['effect'])} [{fmt(r['effect_lo'])}, {fmt(r['effect_hi'])}]",
             r["peak_slots"]] for r in result["forced"]["rows"]]
    return ["", "### Teacher-forced eviction", "",
            "Each configuration's eviction run on the labelled traces the model wrote, teacher-forced through the "
            f"evicting decode path ({result.config.teacher_block} tokens per forward, a round after each), then the "
            "reference answer forced (evictor.teacher_forced): the share whose answer greedy decoding still "
            "reproduces (Wilson interval) and the mean change of its log-probability (bootstrap over traces).", "",
            table(["configuration", "budget", "traces", "accuracy", "effect", "peak slots"], rows)]


def known_line(result, comparisons: list[dict]) -> str:
    """The known-answer task's answer in a few sentences: label recall and precision, the scorer that finds the
    planted facts, and eviction by it against random."""
    known = result["known"]
    if "labels" not in known:
        return f"No known-answer check: {known.get('reason', 'no labels')}."
    labels = known["labels"]
    lines = [f"Against the planted facts the labels have recall {pct(labels['recall'])} "
             f"[{pct(labels['recall_lo'])}, {pct(labels['recall_hi'])}] ({labels['planted_flipped']} of "
             f"{labels['planted_windows']} planted windows flipped) and precision {pct(labels['precision'])} "
             f"[{pct(labels['precision_lo'])}, {pct(labels['precision_hi'])}] over {labels['traces']} traces."]
    best = next((r for r in known["auc"] if r["scorer"] == known.get("finding")), None)
    if best is None:
        return " ".join(lines + ["No scorer ranks the planted facts above chance by its AUCs."])
    lines.append(f"The scorer that finds them is {best['scorer']} (AUC of the needed value's tokens over the decoys' "
                 f"{fmt(best['auc_decoy'])}, over the filler {fmt(best['auc_filler'])}).")
    evicted = [r for r in comparisons if r.get("config") == best["scorer"] and not r.get("error")]
    for r in evicted:
        lines.append(f"Evicting by it at budget {budget_text(r['budget_a'])}: {pct(r['accuracy_a'])} against "
                     f"{REFERENCE}'s {pct(r['accuracy_b'])} at equal peak cache ({100 * r['difference']:+.1f} points "
                     f"[{100 * r['ci_lo']:+.1f}, {100 * r['ci_hi']:+.1f}], n = {r['n_problems']}"
                     + (", significant)." if r["significant"] else ", not significant)."))
    if not evicted:
        lines.append(f"Evicting by it has no comparison with {REFERENCE} (see the comparisons).")
    return " ".join(lines)


def known_section(result) -> str:
    """The known-answer check: window classes, label recall and precision, every scorer's AUC."""
    known = result["known"]
    if "labels" not in known:
        return f"No known-answer check: {known.get('reason', 'no labels')}."
    labels = known["labels"]
    rows = [[cls, labels[f"{cls}_windows"], labels[f"{cls}_flipped"]]
            for cls in ("planted", "key", "decoy_key", "decoy", "filler", "flush") if f"{cls}_windows" in labels]
    lines = ["The traces are constructed (`tasks.known_answer`): the answer copies one note's value, which appears "
             "nowhere else in the context, and decoy notes of the same form are not needed. A window is *planted* "
             "when it overlaps the needed value, *key* when it touches the rest of the needed note only (neither "
             "positive nor negative), *decoy* or *filler* otherwise; *flush* counts the windows ending at the answer "
             f"boundary, whatever their class ({labels['excluded']} windows without an answer left out under the "
             "no-answer rule).", "", table(["window class", "windows", "flipped"], rows), "",
             f"- recall {pct(labels['recall'])} [{pct(labels['recall_lo'])}, {pct(labels['recall_hi'])}]; precision "
             f"{pct(labels['precision'])} [{pct(labels['precision_lo'])}, {pct(labels['precision_hi'])}]; decoy "
             f"windows that kept the answer {pct(labels['decoy_kept'])}, filler windows {pct(labels['filler_kept'])} "
             "(Wilson intervals over windows, which share their trace's context, so they are somewhat narrow)."]
    kinds = {"token": labels, **known.get("kinds", {})}
    # the needed notes of a trace stated twice, or reached in two hops: recall per copy or per hop, and the share of
    # traces in which a window over every needed note changed the answer
    groups = [g for g in ("copy1", "copy2", "hop1", "hop2") if labels.get(f"{g}_windows") and (
        g.startswith("copy") and labels.get("copy2_windows") or g.startswith("hop") and labels.get("hop2_windows"))]
    if len(kinds) > 1 or groups:
        rows = [[kind, f"{pct(found['recall'])} [{pct(found['recall_lo'])}, {pct(found['recall_hi'])}]",
                 f"{pct(found['precision'])} [{pct(found['precision_lo'])}, {pct(found['precision_hi'])}]",
                 *[f"{pct(found.get(f'{g}_recall'))} ({found.get(f'{g}_flipped')} / {found.get(f'{g}_windows')})"
                   for g in groups],
                 *([pct(found.get("found_all"))] if groups else []),
                 found["planted_windows"], found["decoy_windows"], found["filler_windows"]]
                for kind, found in kinds.items()]
        lines += ["", "Each label kind against the planted facts (windows for token and cache-level labels, units for "
                  "joint labels)" + (": recall per copy or hop of the needed notes, and the share of traces in which "
                                     "every needed note was found" if groups else "") + ":", "",
                  table(["label kind", "recall", "precision", *[f"{g} recall" for g in groups],
                         *(["all found"] if groups else []), "planted", "decoy", "filler"], rows)]
    if known["auc"]:
        rows = [[r["scorer"], fmt(r["auc_decoy"]), f"[{fmt(r['auc_decoy_lo'])}, {fmt(r['auc_decoy_hi'])}]",
                 fmt(r["auc_filler"]), f"[{fmt(r['auc_filler_lo'])}, {fmt(r['auc_filler_hi'])}]", r["traces"]]
                for r in sorted(known["auc"], key=lambda r: -min(np.nan_to_num(r["auc_decoy"]),
                                                               np.nan_to_num(r["auc_filler"])))]
        from tasks.known_answer import parse_name

        case = parse_name(result.config.dataset)
        position = ("every needed note precedes the decoys, so a score that grows with position loses against them "
                    "by construction" if case is not None and case.layout == "first" else
                    "every decoy precedes the needed note, so a score that grows with position wins against the "
                    "decoys by construction, not against the filler after the needed note")
        lines += ["", "Each replayed scorer (its own aggregate score, higher = keep): the probability that a token of "
                  "the needed value scores above a token of a decoy's value, and above a filler token, per trace, "
                  f"averaged, with a bootstrap over traces (0.5 is chance; {position}):", "",
                  table(["scorer", "AUC vs decoys", "interval", "AUC vs filler", "interval", "traces"], rows)]
    return "\n".join(lines)


def answer_line(result, comparisons: list[dict]) -> str:
    selection = result["selection"]
    if selection["status"] == "selected":
        best = selection["chosen"][0]
        first = (f"The best deployable scorer is {best['signal']} (rho {fmt(best['within_rho'])} "
                 f"{interval(best, 'within_t')}, n_eff {best['within_n_eff']}), deployed as {best['policy']}.")
    else:
        first = (f"The selection is inconclusive (n = {selection['n_traces']} traces, n_eff = {selection['n_eff']}): "
                 f"{selection['reason']}.")
    significant = [r for r in comparisons if r.get("significant")]
    second = (f"{len(significant)} of {len(comparisons)} comparisons with {REFERENCE} are significant."
              if comparisons else "Nothing was compared with random.")
    return f"{first} {second}"


def write_report(result) -> Path:
    """Write every deliverable of `result` (a `study.pipeline.StudyResult`) into its directory; the report's path."""
    summary = write_selection(result)
    ranking = read_rows(result.out / "ranking.csv") if result["selection"].get("ranking") else []
    comparisons = comparison_rows(result)
    accuracy = accuracy_rows(result)
    with atomic_write(result.out / "compare.csv") as handle:  # the header even without a comparison
        writer = csv.DictWriter(handle, fieldnames=COMPARE_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(comparisons)
    write_csv(result.out / "accuracy.csv", accuracy)
    figures = draw_figures(result, ranking, accuracy, comparisons)
    c = result.config
    defaults = ", ".join(f"{p}: {n}" for p, n in PAPER_DEFAULTS.items())
    question = (
        "How much of the dense model's accuracy does each policy keep when the long prompt is compressed to K "
        f"tokens, and does any beat evicting at random at equal peak cache? Each paper's default scorer ({defaults}) "
        "and recency run; with no labels there is no selection." if is_long_context(c.dataset) else
        "Which cheap per-token signal finds the reasoning tokens the model's answer depends on (counterfactual "
        "occlusion labels, EpiKV §3.4), and does evicting the KV cache by the best of them keep more answers than "
        "evicting at random with the prompt kept (Random Attention) at equal peak cache? Each paper's default scorer "
        f"({defaults}) runs beside the selected ones.")
    known = ran_known(result)
    if known:
        question = ("Do the occlusion labels find the facts a constructed trace's answer depends on (planted at known "
                    "positions, beside decoys of the same form), which scorer finds them, and does evicting by it "
                    "keep more answers than evicting at random at equal peak cache?")
    parts = [
        f"# kvscope study: {c.model} on {c.dataset}", "",
        f"**Question.** {question}",
        "", f"**Answer.** {opening_line(result, comparisons)}", "",
        *(["## The known answer", "", known_section(result), ""] if known else []),
        "## Settings", "", settings_section(result), "",
        "## Stages", "", stages_section(result), "",
        "## 1. Traces and occlusion labels", "", labels_section(result), "",
        "## 2. Signals, statistics and selection", "", selection_section(result, ranking, figures), "",
        "## 3. Eviction at equal cache", "", eviction_section(result, accuracy, figures), "",
        f"## 4. Against {REFERENCE}", "", comparison_section(result, comparisons, figures), "",
        *(["## 5. Does the offline statistic predict eviction?", "", predictive_section(result, ranking, comparisons),
           ""] if not is_long_context(c.dataset) else []),
        "## Reproduce", "", reproduce_section(result, summary), "",
        f"Every trace, token by token (labels, each scorer's scores, what each policy kept): [{VIEWER}]({VIEWER}).", "",
        f"Wall time of this invocation: {result.seconds:.0f} s.", "",
    ]
    path = result.out / "report.md"
    with atomic_write(path) as handle:
        handle.write("\n".join(parts))
    return path


def write_viewer(result) -> Path:
    """The study's trace viewer (`figures.trace`): every trace's tokens coloured by labels, scores and kept sets."""
    from figures.trace import write_study_viewer

    return write_study_viewer(result.out, model=result.config.model,
                              traces_file=stages.traces_file(result.config, result["traces"], stages.Paths(result.out)),
                              stages={name: result.out / record.path for name, record in result.stages.items()
                                      if record.path})


def ran_known(result) -> bool:
    """Whether the study ran the known-answer check (a known-answer task)."""
    return result.stages["known"].status != "off"


def opening_line(result, comparisons: list[dict]) -> str:
    """The report's answer: against the planted facts on a known-answer task, else the selection and eviction."""
    return known_line(result, comparisons) if ran_known(result) else answer_line(result, comparisons)


def headline(result) -> str:
    """The report's headline table as plain text: each configuration against random, per budget."""
    rows = comparison_rows(result)
    lines = [opening_line(result, rows), ""]
    if rows:
        lines.append(f"{'configuration':32s} {'budget':>6s} {'acc':>7s} {REFERENCE:>7s} {'diff':>7s} "
                     f"{'95% CI':>17s} {'p':>6s}")
        for r in rows:
            if r.get("error"):
                lines.append(f"{r['config'][:32]:32s} not compared: {r['error']}")
                continue
            lines.append(f"{r['config'][:32]:32s} {budget_text(r['budget_a']):>6s} {pct(r['accuracy_a']):>7s} "
                         f"{pct(r['accuracy_b']):>7s} {100 * r['difference']:+6.1f} "
                         f"[{100 * r['ci_lo']:+6.1f}, {100 * r['ci_hi']:+6.1f}] {fmt(r['bootstrap_p']):>6s}"
                         + (" *" if r["significant"] else ""))
    return "\n".join(lines)
