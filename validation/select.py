"""Choose scorers by statistics and write the configurations that deploy them: ``python -m validation.select``.

    python -m validation.select --labels labels.jsonl --signals signals.jsonl replay.jsonl --out runs/select --top 3

Every (scorer, layer) pair of the signal files is ranked by its within-trace Spearman rho with the occlusion labels:
one rho per trace, averaged in Fisher-z space, n_eff = traces with a defined rho, the paper's Fisher-z interval, the
t-interval over traces that significance rests on, and a bootstrap over traces (`validation.correlation`, EpiKV §3.2
and App. 12). All scorers are ranked on the same tokens: a position where any signal is undefined is left out for
all (their count is reported). When the files hold hidden_diff at several layers, EpiKV's bands are found in it
(`validation.layers`, `validation.bands`) and the combined band scores join the ranking.

Walking down the ranking, the first `--top` scorers that a registered policy computes, each with a positive rho (a
policy keeps its high scores), are chosen, and each gets the configuration ``{"policy", "params"}`` that
``evictor.run --policy-config`` runs unchanged:

- a policy's replayed scores (`evictor.replay`: ``valuediff.agg``, ``valuediff.l10``, ``valuediff.h2.l10``, ...)
  deploy that policy as it was replayed, read from the records' ``extra["policies"]`` (e.g. ``{"policy":
  "valuediff", "params": {}}``); a policy scores every layer and head itself, so its best layer picks the policy, and
  its other rows are not chosen again;
- a combined band score of hidden_diff deploys ``epikv`` (rolling z) or ``epikv_raw`` (rolling mean) with the bands
  found, the window and, when the signals state it, the hidden-state hook they were read at;
- signals no policy computes (K/V norms, attention received, one layer's g) are ranked, not deployed.

Outputs under --out: ``selection.json`` (the settings, the ranked table with rho, intervals and n_eff, the bands, the
chosen scorers with their configurations), ``ranking.csv`` (the table), ``configs/<name>.json`` (one per chosen
scorer, named after its policy), ``best.json`` (a copy of the best chosen scorer's configuration, so a pipeline can
name it without knowing which policy won; absent when nothing is chosen), ``config.json``. The library entry point
is `select(SelectConfig(...))`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from core.cli import ArgumentParser, main_guard, positive_int
from core.errors import UsageError
from core.rundir import RunDir
from validation.bands import BAND_POLICY_SIGNAL
from validation.layers import LayersConfig, LayersResult, add_analysis_arguments, analyse, config_from_args
from validation.report import fmt, write_csv, write_json
from validation.signals import Aligned, load_aligned, parse_signal_name, signal_source

DEFAULT_TOP = 3
# The columns of a ranked row worth a chosen configuration's provenance.
_EVIDENCE = ("signal", "within_rho", "within_lo", "within_hi", "within_t_lo", "within_t_hi", "within_boot_lo",
             "within_boot_hi", "within_n_eff", "within_p_adj", "within_significant", "within_t_p_adj",
             "within_t_significant", "pooled_rho", "position_rho")


BEST_FILE = "best.json"

@dataclass(frozen=True)
class SelectConfig:
    """What `select` reads and how it chooses; `analysis` holds the inputs and statistics (the flags of
    `validation.layers`), `top` the number of configurations to write."""

    analysis: LayersConfig
    top: int = DEFAULT_TOP

    def check(self) -> None:
        self.analysis.check()
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise UsageError(f"--top must be a positive integer, got {self.top!r}")

    def identity(self) -> dict[str, Any]:
        return {**self.analysis.identity(), "top": self.top}


@dataclass
class Selection:
    """The ranked scorers, the chosen ones and their configurations (name -> ``{"policy", "params",
    "provenance"}``)."""

    result: LayersResult
    ranking: list[dict]
    chosen: list[dict] = field(default_factory=list)
    configs: dict[str, dict] = field(default_factory=dict)

    def summary(self, config: SelectConfig) -> dict:
        result = self.result
        return {"labels": config.analysis.labels, "signals": list(config.analysis.signals), "top": config.top,
                "level": config.analysis.level, "n_traces": result.n_traces,
                "n_tokens": result.rows[0]["n_tokens"] if result.rows else 0,
                "dropped_traces": result.dropped_traces, "skipped_label_records": result.skipped_label_records,
                "nonfinite_positions_dropped": result.nonfinite_positions_dropped,
                "band_family": None if result.setup is None else result.setup.family,
                "bands": [b.to_dict() for b in result.bands],
                "band_layers": None if result.layers is None else [list(side) for side in result.layers],
                "chosen": self.chosen, "ranking": self.ranking}


def deployed_by(row: dict, aligned: Aligned, result: LayersResult) -> dict | None:
    """The ``{"policy", "params"}`` configuration whose scores `row` ranks, None when no policy computes them."""
    band = result.band_policies.get(row["signal"])
    if band is not None:
        return {"policy": band["policy"], "params": band["params"]}
    return aligned.policies.get(signal_source(row["family"]))


def _has_band_family(aligned: Aligned) -> bool:
    return any(p.family == BAND_POLICY_SIGNAL and p.layer is not None for p in map(parse_signal_name, aligned.names))


def _config_name(policy: str, taken: dict[str, dict]) -> str:
    name, k = policy, 1
    while name in taken:
        k += 1
        name = f"{policy}-{k}"
    return name


def select(config: SelectConfig) -> Selection:
    """Read, align, rank and choose (see the module docstring); nothing is written."""
    config.check()
    analysis = config.analysis
    aligned = load_aligned(analysis.labels, analysis.signals, analysis.correct_only)
    if analysis.signal_names:
        aligned = aligned.select(analysis.signal_names)
    aligned = aligned.finite()
    bands = analysis.family is not None or _has_band_family(aligned)
    if bands and analysis.family is None:
        analysis = dataclasses.replace(analysis, family=BAND_POLICY_SIGNAL)
    result = analyse(aligned, analysis, bands=bands)
    selection = Selection(result, [])
    seen: list[dict] = []
    for rank, row in enumerate(result.scorers, start=1):
        deployed = deployed_by(row, aligned, result)
        entry = {"rank": rank, **row, "policy": None if deployed is None else deployed["policy"], "config": None}
        selection.ranking.append(entry)
        rho = row["within_rho"]
        if deployed is None or deployed in seen or not (math.isfinite(rho) and rho > 0):
            continue
        if len(selection.chosen) == config.top:
            continue
        seen.append(deployed)
        name = _config_name(deployed["policy"], selection.configs)
        entry["config"] = name
        evidence = {k: row[k] for k in _EVIDENCE}
        selection.chosen.append({"name": name, **deployed, "rank": rank, **evidence})
        provenance = {"source": "validation.select", "labels": str(analysis.labels),
                      "signals": [str(p) for p in analysis.signals], "rank": rank, "scorer": evidence,
                      "n_traces": result.n_traces}
        selection.configs[name] = {**deployed, "provenance": provenance}
    return selection


def _print_summary(selection: Selection, config: SelectConfig, out, shown: int = 15) -> None:
    level = f"{config.analysis.level:.0%}"
    print(f"{'rank':>4s} {'scorer':40s} {'within':>7s} {level + ' t':>17s} {'n_eff':>5s} {'deploys':>12s}",
          file=out)
    for entry in selection.ranking[:shown]:
        ci = f"[{fmt(entry['within_t_lo'])},{fmt(entry['within_t_hi'])}]"
        deploys = entry["policy"] or "-"
        print(f"{entry['rank']:4d} {entry['signal'][:40]:40s} {fmt(entry['within_rho']):>7s} {ci:>17s} "
              f"{entry['within_n_eff']:5d} {deploys:>12s}", file=out)
    if len(selection.ranking) > shown:
        print(f"     ... {len(selection.ranking) - shown} more in ranking.csv", file=out)
    if not selection.chosen:
        print("no scorer that a policy computes has a positive within-trace rho: no configuration", file=out)
    for chosen in selection.chosen:
        print(f"chosen: {chosen['name']} (rank {chosen['rank']}, {chosen['signal']}, rho {fmt(chosen['within_rho'])}): "
              f"{json.dumps({'policy': chosen['policy'], 'params': chosen['params']}, sort_keys=True)}", file=out)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m validation.select",
        description="Rank every (scorer, layer) pair of signal files (python -m signals, evictor.replay) by "
        "within-trace Spearman rho with occlusion labels (Fisher-z mean, n_eff = traces, t-interval over traces), find "
        "EpiKV's bands in hidden_diff, and write a runnable evictor.run --policy-config file for each of the best "
        "scorers a policy computes.",
    )
    add_analysis_arguments(parser)
    parser.add_argument("--top", type=positive_int, default=DEFAULT_TOP,
                        help=f"configurations to write: the best distinct scorers a policy computes, each with a "
                        f"positive within-trace rho (default {DEFAULT_TOP})")
    parser.add_argument("--out", required=True,
                        help="output directory: selection.json, ranking.csv, configs/<name>.json, best.json (the "
                        "best chosen configuration), config.json")
    return parser


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = SelectConfig(config_from_args(args), args.top)
    config.check()
    with RunDir(args.out, config.identity()) as run:
        selection = select(config)
        _print_summary(selection, config, sys.stdout)
        write_csv(run.path / "ranking.csv", selection.ranking)
        for name, policy_config in selection.configs.items():
            write_json(run.path / "configs" / f"{name}.json", policy_config)
        best = run.path / BEST_FILE
        if selection.chosen:
            write_json(best, selection.configs[selection.chosen[0]["name"]])
        else:
            best.unlink(missing_ok=True)  # a rerun on other data must not leave an earlier winner behind
        write_json(run.path / "selection.json", selection.summary(config))
        run.save_config(chosen=[c["name"] for c in selection.chosen])
    written = "selection.json, ranking.csv, configs/" + (f", {BEST_FILE}" if selection.chosen else "")
    print(f"written to {args.out}/ ({written})")
    if not selection.chosen:
        print("no scorer was chosen (none a policy computes has a positive rho), so there is no best.json",
              file=sys.stderr)
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
