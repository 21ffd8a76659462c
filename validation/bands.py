"""Band selection and the combined band score (EpiKV §3.2 "two-band anatomy", Appendix 6, §5).

A *band* is a run of consecutive layer indices whose correlation with the occlusion labels is significant (after the
multiple-comparison correction across layers) with one consistent sign. Which test decides "significant" is the
caller's: `validation.layers` passes `validation.correlation.SIGNIFICANCE`, the t-test of the per-trace z over
traces for the within-trace rho, because the paper's Fisher-z interval ignores how much the traces disagree. EpiKV
finds Band A (layers 7-13, rho > 0) and Band B (18-25, rho < 0) and scores s(t) = g_10(t) - g_21(t) (Eq. 1), one
representative layer per band. Here the combined score is, in general,

    s(t) = mean_{l in P} x_l(t) - mean_{l in N} x_l(t)

for positive layers P and negative layers N (an empty side contributes 0), which is Eq. 1 for P = {10}, N = {21}
and the "band mean" variant when P, N are whole bands. The selected layers become a policy configuration JSON that
`evictor.run --policy-config FILE` runs directly::

    {"policy": "epikv" | "epikv_raw",
     "params": {"positive_layers": [...], "negative_layers": [...], "window": 64[, "hidden_hook": ...]},
     "provenance": {...}}
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import UsageError, unknown_choice

BAND_LAYER_MODES = ("peak", "all")
# The per-layer signal the epikv / epikv_raw policies combine (g_l, EpiKV Eq. 1-2): bands found in any other signal
# describe that signal, but no band policy would deploy them.
BAND_POLICY_SIGNAL = "hidden_diff"
# The band policies by the smoothing they score with: epikv_raw the rolling mean of g (Eq. 1), epikv its rolling
# z-score (Eq. 2); a transform named e.g. mean64 or z64 is deployed by the policy of its smoothing.
BAND_POLICIES = ("epikv_raw", "epikv")
BAND_SMOOTHING = {"mean": "epikv_raw", "z": "epikv"}


def band_policy(transform: str | None) -> str | None:
    """The band policy that scores with a signal of this transform (``z64`` -> epikv), None when none does."""
    match = re.fullmatch(r"([a-z]+)\d*", transform or "")
    return BAND_SMOOTHING.get(match.group(1)) if match else None


@dataclass(frozen=True)
class Band:
    sign: int  # +1: high signal marks an important token; -1: a dispensable one
    layers: tuple[int, ...]
    rho: tuple[float, ...]  # the per-layer rho the band was found with, aligned with `layers`

    @property
    def peak_layer(self) -> int:
        """The layer with the largest |rho| (the first on ties)."""
        return self.layers[int(np.argmax(np.abs(self.rho)))]

    @property
    def peak_rho(self) -> float:
        return float(self.rho[self.layers.index(self.peak_layer)])

    @property
    def mean_rho(self) -> float:
        return float(np.mean(self.rho))

    def to_dict(self) -> dict:
        return {
            "sign": self.sign,
            "layers": list(self.layers),
            "rho": [float(r) for r in self.rho],
            "peak_layer": self.peak_layer,
            "peak_rho": self.peak_rho,
            "mean_rho": self.mean_rho,
        }


def find_bands(
    layers: Sequence[int], rho: Sequence[float], significant: Sequence[bool], min_length: int = 1
) -> list[Band]:
    """Maximal runs of consecutive layer indices that are significant with the same sign of rho.

    Layers are sorted first; a gap in the indices (an unmeasured layer), a non-significant layer, or a sign change
    ends a run. Runs shorter than `min_length` are dropped. Returned in layer order.
    """
    if min_length < 1:
        raise UsageError(f"min band length must be >= 1, got {min_length}")
    if not len(layers) == len(rho) == len(significant):
        raise ValueError("layers, rho and significant must have the same length")
    order = np.argsort(np.asarray(layers, dtype=np.int64), kind="stable")
    bands: list[Band] = []
    run: list[tuple[int, float]] = []  # (layer, rho)

    def close():
        if len(run) >= min_length:
            bands.append(Band(int(np.sign(run[0][1])), tuple(l for l, _ in run), tuple(r for _, r in run)))
        run.clear()

    for i in order:
        layer, r, sig = int(layers[i]), float(rho[i]), bool(significant[i])
        if not sig or not np.isfinite(r) or r == 0:
            close()
            continue
        if run and (layer != run[-1][0] + 1 or np.sign(r) != np.sign(run[-1][1])):
            close()
        run.append((layer, r))
    close()
    return bands


def strongest(bands: Sequence[Band], sign: int) -> Band | None:
    """The band of `sign` with the largest peak |rho| (ties: the longer band, then the earlier one)."""
    candidates = [b for b in bands if b.sign == sign]
    if not candidates:
        return None
    return max(candidates, key=lambda b: (abs(b.peak_rho), len(b.layers), -b.layers[0]))


def choose_layers(bands: Sequence[Band], mode: str = "peak") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(positive_layers, negative_layers) from the strongest positive and negative band.

    mode "peak": the band's representative layer (largest |rho|), as EpiKV's layers 10 and 21; "all": every layer
    of the band (the band-mean score). A sign with no band gives an empty tuple.
    """
    if mode not in BAND_LAYER_MODES:
        raise unknown_choice("band layer mode", mode, BAND_LAYER_MODES)
    chosen: list[tuple[int, ...]] = []
    for sign in (1, -1):
        band = strongest(bands, sign)
        if band is None:
            chosen.append(())
        else:
            chosen.append((band.peak_layer,) if mode == "peak" else band.layers)
    return chosen[0], chosen[1]


def combined_score(
    values: np.ndarray, layer_columns: dict[int, int], positive: Sequence[int], negative: Sequence[int]
) -> np.ndarray:
    """s = mean of the positive layers' columns - mean of the negative layers' columns ([T] from values [T, S]), by
    the band combination the policies and the signals use (`signals.hidden.band_difference`).

    `layer_columns` maps a layer index to its column in `values`. An empty side contributes 0.
    """
    # imported here: it brings torch, which the CLIs' argument checks do not need
    from signals.hidden import band_difference

    missing = [l for l in (*positive, *negative) if l not in layer_columns]
    if missing:
        raise UsageError(f"combined score needs layer(s) {missing}, which the signals do not have")
    score = band_difference([values[:, layer_columns[l]] for l in positive],
                            [values[:, layer_columns[l]] for l in negative])
    return np.asarray(score, dtype=float)


def policy_config(
    policy: str, positive: Sequence[int], negative: Sequence[int], window: int, provenance: dict,
    hidden_hook: str | None = None,
) -> dict:
    """The policy configuration JSON `evictor.run --policy-config` accepts (schema in the module docstring); the
    hidden-state hook the signals were read at joins the parameters when they state it (the policy's default
    otherwise, which is the signals' default too)."""
    if policy not in BAND_POLICIES:
        raise unknown_choice("band policy", policy, BAND_POLICIES)
    params = {"positive_layers": [int(l) for l in positive], "negative_layers": [int(l) for l in negative],
              "window": int(window)}
    if hidden_hook is not None:
        params["hidden_hook"] = hidden_hook
    return {"policy": policy, "params": params, "provenance": provenance}
