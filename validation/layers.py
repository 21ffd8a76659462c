"""Per-layer signal validation against occlusion labels, band selection, and the policy configuration it implies.

    python -m validation.layers --labels labels.jsonl --signals signals.jsonl --out runs/validation
    python -m validation.layers --labels labels.jsonl --signals sig_mean.jsonl sig_z.jsonl --out runs/validation

Reproduces EpiKV's signal-validation pipeline: the per-layer Spearman table (§4.2, Appendix 6) pooled and
within-trace with Fisher-z intervals on n_eff = traces (Appendix 12) and a multiple-comparison correction across
layers; the positional confound check and raw-vs-detrended comparison (§3.2 "temporal-trend correction",
Appendix 10); band selection and the combined score (§3.2, Eq. 1); scorer selection by within-trace rho. File formats
are documented in `validation.signals`.

Outputs under --out: layers.csv (one row per signal), scorers.csv (signals and the combined band scores ranked by
within-trace rho), positional.csv (raw vs detrended, label rho and position rho per layer), summary.json (all of it,
plus the bands), policy.json (when both a positive and a negative band exist; runnable by
`evictor.run --policy-config`), config.json (resolved
configuration). Without --out the summary is printed only.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from core.cli import main_guard, positive_int, save_config
from core.errors import UsageError, unknown_choice
from validation.bands import BAND_LAYER_MODES, Band, choose_layers, combined_score, find_bands, policy_config
from validation.correlation import informative_traces, rank_scorers, signal_table
from validation.report import fmt, write_csv, write_json
from validation.signals import Aligned, load_aligned, parse_signal_name
from validation.stats import CORRECTIONS

BAND_STATS = ("within", "pooled")
PREFERRED_FAMILY = "hidden_diff"
DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class BandSetup:
    """Which layered signals the bands are looked for in, and which transforms are the raw / detrended scores."""

    family: str
    raw: str | None
    detrended: str | None
    band: str
    window: int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m validation.layers",
        description="Per-layer Spearman validation of importance signals against occlusion labels "
        "(EpiKV §3.2, §4.2, App. 6/10/12), band selection and a runnable policy configuration.",
    )
    parser.add_argument("--labels", required=True, help="occlusion labels JSONL (labeling.occlusion output)")
    parser.add_argument("--signals", required=True, nargs="+", metavar="FILE",
                        help="per-token signals: JSONL (one record per trace, flat or probes.signals per-layer "
                        "layout) or .npz (long format), see validation.signals; several files (e.g. one per "
                        "smoothing) are merged by trace and position")
    parser.add_argument("--include-incorrect", action="store_true",
                        help="also use label records marked correct=false (EpiKV labels correct traces only)")
    parser.add_argument("--out", help="output directory; without it the summary is printed and nothing is written")
    parser.add_argument("--signal-names", nargs="+", metavar="NAME",
                        help="analyse only these signals (default: every signal in the file)")
    parser.add_argument("--family",
                        help=f"layered signal family to find bands in (default: {PREFERRED_FAMILY!r} if present, "
                        "else the only layered family)")
    parser.add_argument("--raw-transform",
                        help="transform of the raw (rolling-mean) score, e.g. roll64 (default: the family's only "
                        "transform not starting with 'z')")
    parser.add_argument("--detrended-transform",
                        help="transform of the detrended (rolling z) score, e.g. z64 (default: the family's only "
                        "transform starting with 'z', if any)")
    parser.add_argument("--band-transform",
                        help="transform whose per-layer rho defines the bands (default: the raw transform, as in "
                        "EpiKV App. 6)")
    parser.add_argument("--band-stat", choices=BAND_STATS, default="within",
                        help="which rho defines the bands: within-trace (default; robust to cross-problem "
                        "structure, §3.2) or pooled over tokens")
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
    parser.add_argument("--window", type=positive_int,
                        help="rolling window written into the policy (default: the digits of the raw transform "
                        f"name, e.g. roll64 -> 64, else {DEFAULT_WINDOW})")
    return parser


def _pick(kind: str, given: str | None, options: list[str], flag: str) -> str | None:
    """`given` if it is one of `options`, else the only option (None when there is none)."""
    if given is not None:
        if given not in options:
            raise unknown_choice(kind, given, options)
        return given
    if len(options) > 1:
        raise UsageError(f"more than one {kind} ({', '.join(options)}); choose one with {flag}")
    return options[0] if options else None


def resolve_setup(names: list[str], args: argparse.Namespace) -> BandSetup | None:
    """Resolve family and transforms from the signal names; None when there is no layered signal at all."""
    parsed = [parse_signal_name(n) for n in names]
    families = sorted({p.family for p in parsed if p.layer is not None})
    if not families:
        if args.family:
            raise UsageError(f"--family {args.family!r} given but no signal name carries a layer index")
        return None
    family = args.family or (PREFERRED_FAMILY if PREFERRED_FAMILY in families else None)
    family = _pick("layered signal family", family, families, "--family")
    transforms = sorted({p.transform for p in parsed if p.family == family and p.layer is not None})
    detrended_options = [t for t in transforms if t.startswith("z")]
    raw_options = [t for t in transforms if not t.startswith("z")]
    for requested in (args.raw_transform, args.detrended_transform):
        if requested is not None and requested not in transforms:
            raise unknown_choice(f"transform of {family!r}", requested, transforms)
    given = {args.raw_transform, args.detrended_transform}
    raw = args.raw_transform or _pick(f"raw transform of {family!r}", None,
                                      [t for t in raw_options if t not in given], "--raw-transform")
    detrended = args.detrended_transform or _pick(f"detrended transform of {family!r}", None,
                                                  [t for t in detrended_options if t not in given | {raw}],
                                                  "--detrended-transform")
    scored = raw or detrended  # at least one exists: every transform is either raw or detrended
    band = _pick(f"transform of {family!r}", args.band_transform or scored, transforms, "--band-transform")
    digits = re.search(r"(\d+)$", scored)
    window = args.window or (int(digits.group(1)) if digits else DEFAULT_WINDOW)
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
            for k in ("within_rho", "within_lo", "within_hi", "position_rho", "position_lo", "position_hi"):
                row[f"{prefix}_{k.replace('within', 'label')}"] = r[k]
        row["abs_position_rho_reduction"] = abs(raw["position_rho"]) - abs(det["position_rho"])
        out.append(row)
    return out


def analyse(aligned: Aligned, args: argparse.Namespace) -> dict:
    """Everything the CLI reports, computed before anything is written."""
    n_informative = informative_traces(aligned)
    if n_informative <= 3:
        raise UsageError(
            f"too few traces with varying labels for an interval: n_eff={n_informative} of {len(aligned.traces)} "
            "aligned traces (need n_eff > 3)"
        )
    rows = sorted(signal_table(aligned, args.level, args.correction, args.alpha),
                  key=lambda r: (r["layer"] is None, r["family"], r["transform"], r["layer"] or 0))
    setup = resolve_setup(aligned.names, args)
    result: dict = {"rows": rows, "setup": setup, "bands": [], "combined_rows": [], "policy": None}
    if setup is not None:
        band_rows = sorted((r for r in rows if r["family"] == setup.family and r["transform"] == setup.band
                            and r["layer"] is not None), key=lambda r: r["layer"])
        stat = args.band_stat
        bands = find_bands([r["layer"] for r in band_rows], [r[f"{stat}_rho"] for r in band_rows],
                           [r[f"{stat}_significant"] for r in band_rows], args.min_band_length)
        result["bands"] = bands
        if bands:
            positive, negative = choose_layers(bands, args.band_layers)
            result["layers"] = (positive, negative)
            result["combined_rows"] = _combined_rows(aligned, setup, positive, negative, args)
    result["scorers"] = rank_scorers(rows + result["combined_rows"])
    if setup is not None:
        result["positional"] = _positional_rows(rows, result["combined_rows"], setup)
    if result["combined_rows"] and all(result["layers"]):
        result["policy"] = _policy(result, aligned, args)
    return result


def _combined_rows(aligned: Aligned, setup: BandSetup, positive, negative, args) -> list[dict]:
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
    return signal_table(aligned.with_columns(names, columns).select(names), args.level, args.correction, args.alpha)


def _finite_or_worst(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


def _policy(result: dict, aligned: Aligned, args: argparse.Namespace) -> dict:
    """The policy configuration: "epikv_raw" scores with the rolling mean of g (EpiKV Eq. 1), "epikv" with the rolling
    z-score (Eq. 2), so the raw transform maps to epikv_raw and the detrended one to epikv."""
    setup: BandSetup = result["setup"]
    positive, negative = result["layers"]
    combined = {r["signal"]: r for r in result["combined_rows"]}
    candidates = [("epikv_raw", combined.get(_combined_name(setup, setup.raw))),
                  ("epikv", combined.get(_combined_name(setup, setup.detrended)))]
    candidates = [(p, r) for p, r in candidates if r is not None]
    # Scorer selection between the raw and detrended combined score: the higher within-trace rho wins (§3.2);
    # a tie goes to the detrended score, EpiKV's primary method.
    policy, chosen = max(reversed(candidates), key=lambda c: _finite_or_worst(c[1]["within_rho"]))

    def summary(row: dict) -> dict:
        keys = ("signal", "within_rho", "within_lo", "within_hi", "within_n_eff", "pooled_rho", "position_rho")
        return {k: row[k] for k in keys}

    best = result["scorers"][0]
    provenance = {
        "source": "validation.layers",
        "labels": str(args.labels),
        "signals": [str(p) for p in args.signals],
        "family": setup.family,
        "raw_transform": setup.raw,
        "detrended_transform": setup.detrended,
        "band_transform": setup.band,
        "band_stat": args.band_stat,
        "band_layers": args.band_layers,
        "min_band_length": args.min_band_length,
        "correction": args.correction,
        "alpha": args.alpha,
        "level": args.level,
        "n_traces": len(aligned.traces),
        "n_tokens": int(sum(t.labels.size for t in aligned.traces)),
        "n_dropped_traces": len(aligned.dropped_traces),
        "skipped_label_records": aligned.skipped_labels,
        "nonfinite_positions_dropped": aligned.nonfinite_positions,
        "bands": [b.to_dict() for b in result["bands"]],
        "combined_scores": {p: summary(r) for p, r in candidates},
        "chosen": summary(chosen),
        "best_scorer": summary(best),
    }
    return policy_config(policy, positive, negative, setup.window, provenance)


def _print_summary(result: dict, args: argparse.Namespace, out) -> None:
    setup: BandSetup | None = result["setup"]
    print(f"{'signal':36s} {'pooled':>7s} {'within':>7s} {'95% CI':>17s} {'n_eff':>5s} {'sig':>3s} {'pos':>7s}",
          file=out)
    for r in result["rows"]:
        ci = f"[{fmt(r['within_lo'])},{fmt(r['within_hi'])}]"
        print(f"{r['signal']:36s} {fmt(r['pooled_rho']):>7s} {fmt(r['within_rho']):>7s} {ci:>17s} "
              f"{r['within_n_eff']:5d} {'*' if r['within_significant'] else '':>3s} {fmt(r['position_rho']):>7s}",
              file=out)
    if setup is None:
        print("no layered signals: no band selection", file=out)
        return
    bands: list[Band] = result["bands"]
    print(f"bands in {setup.family}.{setup.band} ({args.band_stat} rho, {args.correction}):", file=out)
    for b in bands:
        print(f"  {'+' if b.sign > 0 else '-'} layers {b.layers[0]}-{b.layers[-1]} peak l{b.peak_layer} "
              f"rho {fmt(b.peak_rho)}", file=out)
    if not bands:
        print("  none: no layer is significant after correction; no policy configuration", file=out)
    for r in result["positional"]:
        where = r["layer"] if r["layer"] == "combined" else f"l{r['layer']}"
        print(f"  positional {where}: position rho raw {fmt(r['raw_position_rho'])} -> detrended "
              f"{fmt(r['detrended_position_rho'])}; label rho raw {fmt(r['raw_label_rho'])} -> detrended "
              f"{fmt(r['detrended_label_rho'])}", file=out)
    best = result["scorers"][0]
    print(f"best scorer by within-trace rho: {best['signal']} ({fmt(best['within_rho'])})", file=out)
    if bands and not result["policy"]:
        print("  no policy configuration: the epikv policies need both a positive and a negative band", file=out)
    if result["policy"]:
        params = result["policy"]["params"]
        print(f"policy {result['policy']['policy']}: positive {params['positive_layers']} negative "
              f"{params['negative_layers']} window {params['window']}", file=out)


def _validate_args(args: argparse.Namespace) -> None:
    if args.correction not in CORRECTIONS:
        raise unknown_choice("multiple-comparison correction", args.correction, CORRECTIONS)
    for name in ("alpha", "level"):
        value = getattr(args, name)
        if not 0.0 < value < 1.0:
            raise UsageError(f"--{name} must be in (0, 1), got {value}")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _validate_args(args)
    aligned = load_aligned(args.labels, args.signals, args.include_incorrect)
    if args.signal_names:
        aligned = aligned.select(args.signal_names)
    aligned = aligned.finite()
    result = analyse(aligned, args)
    _print_summary(result, args, sys.stdout)
    if not args.out:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "layers.csv", result["rows"])
    write_csv(out / "scorers.csv", result["scorers"])
    if result.get("positional"):
        write_csv(out / "positional.csv", result["positional"])
    setup = result["setup"]
    write_json(out / "summary.json", {
        "signals": result["rows"],
        "combined": result["combined_rows"],
        "scorers": [r["signal"] for r in result["scorers"]],
        "bands": [b.to_dict() for b in result["bands"]],
        "positional": result.get("positional", []),
        "n_traces": len(aligned.traces),
        "dropped_traces": aligned.dropped_traces,
        "skipped_label_records": aligned.skipped_labels,
        "nonfinite_positions_dropped": aligned.nonfinite_positions,
    })
    if result["policy"]:
        write_json(out / "policy.json", result["policy"])
    config = dict(vars(args))
    if setup is not None:
        config.update(family=setup.family, raw_transform=setup.raw, detrended_transform=setup.detrended,
                      band_transform=setup.band, window=setup.window)
    save_config(out, config)
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
