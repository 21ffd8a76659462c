"""Per-layer signal validation against occlusion labels, band selection, and the policy configuration it implies.

    python -m validation.layers --labels labels.jsonl --signals signals.jsonl --out runs/validation
    python -m validation.layers --labels labels.jsonl --signals sig_mean.jsonl sig_z.jsonl --out runs/validation

Reproduces EpiKV's signal-validation pipeline: the per-layer Spearman table (§4.2, Appendix 6) pooled and
within-trace (per-trace rho averaged in Fisher-z space, n_eff = traces with a defined rho, the paper's Fisher-z
interval, a t-interval over traces and a bootstrap over traces; Appendix 12) with a multiple-comparison correction
across layers; the positional confound check and raw-vs-detrended comparison (§3.2 "temporal-trend correction",
Appendix 10); band selection and the combined score (§3.2, Eq. 1); scorer selection by within-trace rho. A band is a
run of layers that are significant by `validation.correlation.SIGNIFICANCE` (with --band-stat within, the t-test of
the per-trace z over traces after the correction; `validation.stats.fisher_mean` says why not the paper's Fisher-z
interval). The table and the ranking work on any signal names (per-layer interpretability signals, a policy's
replayed scores); only the policy configuration is specific to the EpiKV band policies. File formats:
`validation.signals`; columns: `validation.correlation`.

The library entry point is `validate_layers(LayersConfig(...))`; the CLI is a thin adapter over it. Outputs under
--out: layers.csv (one row per signal), scorers.csv (signals and the combined band scores ranked by within-trace
rho), positional.csv (raw vs detrended, label rho and position rho per layer, each with its Fisher-z interval
`_lo/_hi` and t-interval `_t_lo/_t_hi`), summary.json (all of it, plus the bands), policy.json (when both a positive
and a negative band exist in the signal the band policies score with; runnable by `evictor.run --policy-config`),
config.json (the settings and what they resolved to). Without --out the summary is printed only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.cli import ArgumentParser, main_guard, non_negative_int, positive_int
from core.errors import UsageError, unknown_choice
from core.rundir import RunDir
from validation.bands import (
    BAND_LAYER_MODES,
    BAND_POLICY_SIGNAL,
    Band,
    band_policy,
    choose_layers,
    combined_score,
    find_bands,
    policy_config,
)
from validation.correlation import SIGNIFICANCE, informative_traces, rank_scorers, signal_table
from validation.report import fmt, write_csv, write_json
from validation.signals import Aligned, load_aligned, parse_signal_name
from validation.stats import CORRECTIONS, DEFAULT_N_BOOT

BAND_STATS = ("within", "pooled")
DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class LayersConfig:
    """Everything `validate_layers` needs; the CLI flags of the same names document each field."""

    labels: str
    signals: tuple[str, ...]
    correct_only: bool = False
    signal_names: tuple[str, ...] | None = None
    family: str | None = None
    raw_transform: str | None = None
    detrended_transform: str | None = None
    band_transform: str | None = None
    band_stat: str = "within"
    band_layers: str = "peak"
    min_band_length: int = 1
    correction: str = "fdr_bh"
    alpha: float = 0.05
    level: float = 0.95
    window: int | None = None
    n_boot: int = DEFAULT_N_BOOT
    seed: int = 0

    def check(self) -> None:
        """Refuse settings no analysis can run with, before any file is read."""
        if self.correction not in CORRECTIONS:
            raise unknown_choice("multiple-comparison correction", self.correction, CORRECTIONS)
        if self.band_stat not in BAND_STATS:
            raise unknown_choice("band statistic", self.band_stat, BAND_STATS)
        if self.band_layers not in BAND_LAYER_MODES:
            raise unknown_choice("band layer mode", self.band_layers, BAND_LAYER_MODES)
        for name in ("alpha", "level"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise UsageError(f"--{name} must be in (0, 1), got {value}")
        if not self.signals:
            raise UsageError("give at least one --signals file")

    def identity(self) -> dict[str, Any]:
        """The settings the outputs depend on, with input paths made absolute (the run directory's identity)."""
        return {**dataclasses.asdict(self), "labels": str(Path(self.labels).resolve()),
                "signals": [str(Path(path).resolve()) for path in self.signals]}


@dataclass(frozen=True)
class BandSetup:
    """Which layered signals the bands are looked for in, and which transforms are the raw / detrended scores."""

    family: str
    raw: str | None
    detrended: str | None
    band: str
    window: int


@dataclass
class LayersResult:
    """What `validate_layers` found; every table row is a plain dict with the columns of `validation.correlation`."""

    rows: list[dict]  # one per signal
    setup: BandSetup | None  # None: no layered signal, no band selection
    scorers: list[dict]  # rows and combined rows, best within-trace rho first
    bands: list[Band] = field(default_factory=list)
    layers: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (positive, negative) chosen for the combined score
    combined_rows: list[dict] = field(default_factory=list)
    positional: list[dict] = field(default_factory=list)
    band_policies: dict[str, dict] = field(default_factory=dict)  # combined band signal -> the config scoring it
    policy: dict | None = None  # the better of `band_policies`
    n_traces: int = 0
    dropped_traces: list[str] = field(default_factory=list)
    skipped_label_records: dict[str, int] = field(default_factory=dict)
    nonfinite_positions_dropped: int = 0

    def summary(self) -> dict:
        return {"signals": self.rows, "combined": self.combined_rows, "scorers": [r["signal"] for r in self.scorers],
                "bands": [b.to_dict() for b in self.bands], "positional": self.positional,
                "n_traces": self.n_traces, "dropped_traces": self.dropped_traces,
                "skipped_label_records": self.skipped_label_records,
                "nonfinite_positions_dropped": self.nonfinite_positions_dropped}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m validation.layers",
        description="Per-layer Spearman validation of importance signals against occlusion labels "
        "(EpiKV §3.2, §4.2, App. 6/10/12), band selection and a runnable policy configuration.",
    )
    add_analysis_arguments(parser)
    parser.add_argument("--out", help="output directory; without it the summary is printed and nothing is written")
    return parser


def add_analysis_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a `LayersConfig` (read back with `config_from_args`): the inputs, the statistics, the bands."""
    parser.add_argument("--labels", required=True, help="occlusion labels JSONL (labeling.occlusion output)")
    parser.add_argument("--signals", required=True, nargs="+", metavar="FILE",
                        help="signal records JSONL (python -m signals output, or a policy's replayed scores); several "
                        "files (e.g. one per smoothing) are merged by trace id and position")
    parser.add_argument("--correct-only", action="store_true",
                        help="use only the traces the model answered correctly (EpiKV's protocol, §3.4). Default: "
                        "every labelled trace in --labels, because the labeller already chose which traces to label "
                        "(labeling.occlusion labels correct traces only unless given --include-incorrect), so labels "
                        "made either way validate without repeating that choice here")
    parser.add_argument("--signal-names", nargs="+", metavar="NAME",
                        help="analyse only these signals, named {signal}.l{layer}.{transform} (default: every signal "
                        "in the files)")
    parser.add_argument("--family",
                        help=f"layered signal to find bands in (default: the only layered signal, or "
                        f"{BAND_POLICY_SIGNAL!r}, the one the epikv policies score with, when there are several)")
    parser.add_argument("--raw-transform",
                        help="transform of the raw (rolling-mean) score, e.g. mean64 (default: the family's only "
                        "transform not starting with 'z')")
    parser.add_argument("--detrended-transform",
                        help="transform of the detrended (rolling z) score, e.g. z64 (default: the family's only "
                        "transform starting with 'z', if any)")
    parser.add_argument("--band-transform",
                        help="transform whose per-layer rho defines the bands (default: the raw transform, as in "
                        "EpiKV App. 6)")
    parser.add_argument("--band-stat", choices=BAND_STATS, default="within",
                        help="which rho defines the bands: within-trace (default; robust to cross-problem "
                        "structure, §3.2; a layer is significant by the t-test of its per-trace z over traces) or "
                        "pooled over tokens (significant by the paper's Fisher-z test on n_eff traces)")
    parser.add_argument("--band-layers", choices=BAND_LAYER_MODES, default="peak",
                        help="peak: one representative layer per band, largest |rho| (EpiKV's 10 and 21); "
                        "all: every layer of the band (band-mean score)")
    parser.add_argument("--min-band-length", type=positive_int, default=1,
                        help="shortest run of consecutive significant layers that counts as a band (default 1)")
    parser.add_argument("--correction", default="fdr_bh",
                        help=f"multiple-comparison correction across layers: {', '.join(CORRECTIONS)} "
                        "(default fdr_bh)")
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="family-wise / false-discovery level of the correction (default 0.05)")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals (default 0.95)")
    parser.add_argument("--n-boot", type=positive_int, default=DEFAULT_N_BOOT,
                        help=f"bootstrap replicates over traces for the within-trace intervals (default "
                        f"{DEFAULT_N_BOOT})")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="bootstrap random seed (default 0)")
    parser.add_argument("--window", type=positive_int,
                        help="rolling window written into the policy (default: the window in the scored transform's "
                        f"name, e.g. z64 -> 64, which python -m signals records; else {DEFAULT_WINDOW})")


def _pick(kind: str, given: str | None, options: list[str], flag: str) -> str | None:
    """`given` if it is one of `options`, else the only option (None when there is none)."""
    if given is not None:
        if given not in options:
            raise unknown_choice(kind, given, options)
        return given
    if len(options) > 1:
        raise UsageError(f"more than one {kind} ({', '.join(options)}); choose one with {flag}")
    return options[0] if options else None


def resolve_setup(names: list[str], config: LayersConfig) -> BandSetup | None:
    """Resolve family and transforms from the signal names; None when there is no layered signal at all."""
    parsed = [parse_signal_name(n) for n in names]
    families = sorted({p.family for p in parsed if p.layer is not None})
    if not families:
        if config.family:
            raise UsageError(f"--family {config.family!r} given but no signal name carries a layer index")
        return None
    family = config.family or (BAND_POLICY_SIGNAL if BAND_POLICY_SIGNAL in families else None)
    family = _pick("layered signal family", family, families, "--family")
    assert family is not None  # families is not empty
    transforms = sorted({p.transform for p in parsed if p.family == family and p.layer is not None})
    detrended_options = [t for t in transforms if t.startswith("z")]
    raw_options = [t for t in transforms if not t.startswith("z")]
    for requested in (config.raw_transform, config.detrended_transform):
        if requested is not None and requested not in transforms:
            raise unknown_choice(f"transform of {family!r}", requested, transforms)
    given = {config.raw_transform, config.detrended_transform}
    raw = config.raw_transform or _pick(f"raw transform of {family!r}", None,
                                        [t for t in raw_options if t not in given], "--raw-transform")
    detrended = config.detrended_transform or _pick(f"detrended transform of {family!r}", None,
                                                    [t for t in detrended_options if t not in given | {raw}],
                                                    "--detrended-transform")
    scored = raw or detrended
    assert scored is not None  # at least one exists: every transform is either raw or detrended
    band = _pick(f"transform of {family!r}", config.band_transform or scored, transforms, "--band-transform")
    assert band is not None  # transforms is not empty: the family has a layered signal
    digits = re.search(r"(\d+)$", scored)
    window = config.window or (int(digits.group(1)) if digits else DEFAULT_WINDOW)
    return BandSetup(family, raw, detrended, band, window)


def _layer_columns(names: list[str], family: str, transform: str) -> dict[int, int]:
    out = {}
    for i, name in enumerate(names):
        p = parse_signal_name(name)
        if p.family == family and p.transform == transform and p.layer is not None:
            out[p.layer] = i
    return out


def _combined_name(setup: BandSetup, transform: str | None) -> str:
    return f"band:{setup.family}.{transform}"


def _positional_rows(rows: list[dict], combined_rows: list[dict], setup: BandSetup) -> list[dict]:
    """Raw vs detrended per layer (and for the combined score): label rho and position rho, within-trace (§3.2)."""
    by_key = {(r["family"], r["layer"], r["transform"]): r for r in rows}
    out = []
    layers = sorted({r["layer"] for r in rows if r["family"] == setup.family and r["layer"] is not None})
    pairs = [(str(l), by_key.get((setup.family, l, setup.raw)), by_key.get((setup.family, l, setup.detrended)))
             for l in layers]
    combined = {r["signal"]: r for r in combined_rows}
    pairs.append(("combined", combined.get(_combined_name(setup, setup.raw)),
                  combined.get(_combined_name(setup, setup.detrended))))
    for layer, raw, det in pairs:
        if raw is None or det is None:
            continue
        row = {"layer": layer, "raw_signal": raw["signal"], "detrended_signal": det["signal"]}
        for prefix, r in (("raw", raw), ("detrended", det)):
            for k in ("within_rho", "within_lo", "within_hi", "within_t_lo", "within_t_hi", "position_rho",
                      "position_lo", "position_hi", "position_t_lo", "position_t_hi"):
                row[f"{prefix}_{k.replace('within', 'label')}"] = r[k]
        row["abs_position_rho_reduction"] = abs(raw["position_rho"]) - abs(det["position_rho"])
        out.append(row)
    return out


def validate_layers(config: LayersConfig) -> LayersResult:
    """Read, align and analyse: everything the CLI reports, computed before anything is written."""
    config.check()
    aligned = load_aligned(config.labels, config.signals, config.correct_only)
    if config.signal_names:
        aligned = aligned.select(config.signal_names)
    return analyse(aligned.finite(), config)


def analyse(aligned: Aligned, config: LayersConfig, bands: bool = True) -> LayersResult:
    """The analysis of an aligned label/signal set (see the module docstring); `bands` False ranks the signals
    without looking for bands."""
    longest = max((int(t.positions.max()) - int(t.positions.min()) + 1 for t in aligned.traces if t.positions.size),
                  default=0)
    if config.window is not None and longest and config.window > longest:
        raise UsageError(f"--window {config.window} is longer than the longest aligned trace ({longest} positions): "
                         f"the policy's rolling mean would never fill; give at most {longest}")
    n_informative = informative_traces(aligned)
    if n_informative <= 3:
        raise UsageError(
            f"too few traces with varying labels for an interval: n_eff={n_informative} of {len(aligned.traces)} "
            "aligned traces (need n_eff > 3)"
        )
    rows = sorted(signal_table(aligned, config.level, config.correction, config.alpha, config.n_boot, config.seed),
                  key=lambda r: (r["layer"] is None, r["family"], r["transform"], r["layer"] or 0))
    setup = resolve_setup(aligned.names, config) if bands else None
    result = LayersResult(rows=rows, setup=setup, scorers=[], n_traces=len(aligned.traces),
                          dropped_traces=aligned.dropped_traces, skipped_label_records=aligned.skipped_labels,
                          nonfinite_positions_dropped=aligned.nonfinite_positions)
    if setup is not None:
        band_rows = sorted((r for r in rows if r["family"] == setup.family and r["transform"] == setup.band
                            and r["layer"] is not None), key=lambda r: r["layer"])
        stat = config.band_stat
        result.bands = find_bands([r["layer"] for r in band_rows], [r[f"{stat}_rho"] for r in band_rows],
                                  [r[f"{SIGNIFICANCE[stat]}_significant"] for r in band_rows],
                                  config.min_band_length)
        if result.bands:
            result.layers = choose_layers(result.bands, config.band_layers)
            result.combined_rows = _combined_rows(aligned, setup, *result.layers, config)
        result.positional = _positional_rows(rows, result.combined_rows, setup)
    result.scorers = rank_scorers(rows + result.combined_rows)
    if result.combined_rows:
        assert setup is not None and result.layers is not None  # combined scores come from the chosen band layers
        if all(result.layers) and setup.family == BAND_POLICY_SIGNAL:
            result.band_policies = _band_policies(result, aligned, config)
            if result.band_policies:
                # Scorer selection between the raw and detrended combined score: the higher within-trace rho wins
                # (§3.2); a tie goes to the detrended score, EpiKV's primary method.
                chosen = max(reversed(result.band_policies), key=lambda name: _finite_or_worst(
                    next(r for r in result.combined_rows if r["signal"] == name)["within_rho"]))
                result.policy = result.band_policies[chosen]
    return result


def _combined_rows(aligned: Aligned, setup: BandSetup, positive, negative, config: LayersConfig) -> list[dict]:
    names, columns = [], []
    for transform in dict.fromkeys(t for t in (setup.raw, setup.detrended) if t is not None):
        layer_columns = _layer_columns(aligned.names, setup.family, transform)
        if not all(l in layer_columns for l in (*positive, *negative)):
            continue
        names.append(_combined_name(setup, transform))
        columns.append([combined_score(t.values, layer_columns, positive, negative) for t in aligned.traces])
    if not names:
        return []
    # A combined name has no layer index, so each combined score is a family of one in the correction.
    return signal_table(aligned.with_columns(names, columns).select(names), config.level, config.correction,
                        config.alpha, config.n_boot, config.seed)


def _finite_or_worst(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


def _band_policies(result: LayersResult, aligned: Aligned, config: LayersConfig) -> dict[str, dict]:
    """Combined band signal -> the configuration of the band policy that scores it (`validation.bands.band_policy`:
    a rolling-mean transform is epikv_raw's score, a rolling-z one epikv's); none for a combined score no policy
    computes (signals smoothed otherwise, e.g. raw g, would configure a score nobody measured)."""
    setup = result.setup
    assert setup is not None and result.layers is not None  # only called on the combined scores of a band
    positive, negative = result.layers
    combined = {r["signal"]: r for r in result.combined_rows}
    options = [(band_policy(transform), combined.get(_combined_name(setup, transform)))
               for transform in (setup.raw, setup.detrended) if transform is not None]
    candidates = [(p, r) for p, r in options if p is not None and r is not None]

    def summary(row: dict) -> dict:
        keys = ("signal", "within_rho", "within_lo", "within_hi", "within_t_lo", "within_t_hi", "within_boot_lo",
                "within_boot_hi", "within_n_eff", "pooled_rho", "position_rho")
        return {k: row[k] for k in keys}

    provenance = {
        "source": "validation.layers",
        "labels": str(config.labels),
        "signals": [str(p) for p in config.signals],
        "correct_only": config.correct_only,
        "family": setup.family,
        "raw_transform": setup.raw,
        "detrended_transform": setup.detrended,
        "band_transform": setup.band,
        "band_stat": config.band_stat,
        "significance": f"{SIGNIFICANCE[config.band_stat]}_significant",
        "band_layers": config.band_layers,
        "min_band_length": config.min_band_length,
        "correction": config.correction,
        "alpha": config.alpha,
        "level": config.level,
        "n_boot": config.n_boot,
        "seed": config.seed,
        "n_traces": len(aligned.traces),
        "n_tokens": int(sum(t.labels.size for t in aligned.traces)),
        "n_dropped_traces": len(aligned.dropped_traces),
        "skipped_label_records": aligned.skipped_labels,
        "nonfinite_positions_dropped": aligned.nonfinite_positions,
        "bands": [b.to_dict() for b in result.bands],
        "combined_scores": {p: summary(r) for p, r in candidates},
        "best_scorer": summary(result.scorers[0]),
    }
    return {row["signal"]: policy_config(policy, positive, negative, setup.window,
                                         {**provenance, "chosen": summary(row)}, aligned.hidden_hook)
            for policy, row in candidates}


def _print_summary(result: LayersResult, config: LayersConfig, out) -> None:
    setup = result.setup
    level = f"{config.level:.0%}"
    print(f"{'signal':36s} {'pooled':>7s} {'within':>7s} {level + ' t':>17s} {level + ' Fisher z':>17s} "
          f"{level + ' bootstrap':>17s} {'n_eff':>5s} {'sig':>3s} {'pos':>7s}", file=out)
    for r in result.rows:
        t = f"[{fmt(r['within_t_lo'])},{fmt(r['within_t_hi'])}]"
        ci = f"[{fmt(r['within_lo'])},{fmt(r['within_hi'])}]"
        boot = f"[{fmt(r['within_boot_lo'])},{fmt(r['within_boot_hi'])}]"
        print(f"{r['signal']:36s} {fmt(r['pooled_rho']):>7s} {fmt(r['within_rho']):>7s} {t:>17s} {ci:>17s} "
              f"{boot:>17s} {r['within_n_eff']:5d} {'*' if r['within_t_significant'] else '':>3s} "
              f"{fmt(r['position_rho']):>7s}", file=out)
    print(f"sig: {SIGNIFICANCE['within']}_significant, the t-test over traces after the {config.correction} "
          "correction", file=out)
    if setup is None:
        print("no layered signals: no band selection", file=out)
        return
    print(f"bands in {setup.family}.{setup.band} ({config.band_stat} rho, {config.correction}):", file=out)
    for b in result.bands:
        print(f"  {'+' if b.sign > 0 else '-'} layers {b.layers[0]}-{b.layers[-1]} peak l{b.peak_layer} "
              f"rho {fmt(b.peak_rho)}", file=out)
    if not result.bands:
        print("  none: no layer is significant after correction; no policy configuration", file=out)
    for r in result.positional:
        where = r["layer"] if r["layer"] == "combined" else f"l{r['layer']}"
        print(f"  positional {where}: position rho raw {fmt(r['raw_position_rho'])} -> detrended "
              f"{fmt(r['detrended_position_rho'])}; label rho raw {fmt(r['raw_label_rho'])} -> detrended "
              f"{fmt(r['detrended_label_rho'])}", file=out)
    best = result.scorers[0]
    print(f"best scorer by within-trace rho: {best['signal']} ({fmt(best['within_rho'])})", file=out)
    if result.bands and not result.policy:
        if setup.family != BAND_POLICY_SIGNAL:
            print(f"  no policy configuration: the epikv policies score with {BAND_POLICY_SIGNAL}, not "
                  f"{setup.family}", file=out)
        elif not (result.layers and all(result.layers)):
            print("  no policy configuration: the epikv policies need both a positive and a negative band", file=out)
        else:
            print(f"  no policy configuration: the epikv policies score with a rolling mean (epikv_raw) or rolling "
                  f"z-score (epikv) of {BAND_POLICY_SIGNAL}, and neither is among the signals; validate signals made "
                  "with python -m signals --smoothing mean and --smoothing z", file=out)
    if result.policy:
        params = result.policy["params"]
        print(f"policy {result.policy['policy']}: positive {params['positive_layers']} negative "
              f"{params['negative_layers']} window {params['window']}", file=out)


def _write(directory: Path, result: LayersResult) -> None:
    write_csv(directory / "layers.csv", result.rows)
    write_csv(directory / "scorers.csv", result.scorers)
    if result.positional:
        write_csv(directory / "positional.csv", result.positional)
    write_json(directory / "summary.json", result.summary())
    if result.policy:
        write_json(directory / "policy.json", result.policy)


def config_from_args(args: argparse.Namespace) -> LayersConfig:
    return LayersConfig(
        labels=args.labels, signals=tuple(args.signals), correct_only=args.correct_only,
        signal_names=tuple(args.signal_names) if args.signal_names else None, family=args.family,
        raw_transform=args.raw_transform, detrended_transform=args.detrended_transform,
        band_transform=args.band_transform, band_stat=args.band_stat, band_layers=args.band_layers,
        min_band_length=args.min_band_length, correction=args.correction, alpha=args.alpha, level=args.level,
        window=args.window, n_boot=args.n_boot, seed=args.seed)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    config.check()
    if not args.out:
        _print_summary(validate_layers(config), config, sys.stdout)
        return 0
    with RunDir(args.out, config.identity()) as run:
        result = validate_layers(config)
        _print_summary(result, config, sys.stdout)
        _write(run.path, result)
        setup = result.setup
        resolved = {} if setup is None else {"family": setup.family, "raw_transform": setup.raw,
                                             "detrended_transform": setup.detrended, "band_transform": setup.band,
                                             "window": setup.window}
        run.save_config(**resolved)
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
