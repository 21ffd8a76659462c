"""Streaming aggregation of per-sequence measurements into per-head, per-layer and per-model tables.

Aggregation rules (ValueDiff Appendix C/D):

- per-head values are means over the calibration sequences; a head's ``sink_rate`` is the fraction of sequences in
  which its alpha_BOS exceeds tau (so changing tau needs no new forward passes);
- layer and model values are means over the heads (and layers) in scope; every ratio is a ratio of those means
  (Table 4: ``sigma_V / sigma_K`` = mean sigma_V / mean sigma_K), including ``weight_ratio`` (mean ||W_V||_2 over
  the layers in scope / mean ||W_K||_2) and ``sigma1_ratio``;
- Jaccard means skip heads and sequences where it is undefined (a sliding window shorter than k), and
  ``jaccard_layer_std`` is the std across layers of the per-layer mean (Table 8);
- ``valuediff_first_k25`` / ``_k50``: the fraction of sequences (per KV head; of heads and sequences, per layer and
  model) in which ValueDiff's score ranks the leading token among the top quarter / half of the context, i.e. keeps
  the sink at that budget (`geometry.stats.first_token_kept`);
- scope ``all`` covers every layer; when a model mixes layer kinds (Gemma3 sliding / full), one extra row per kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from geometry.measure import FIRST_FIELDS, KV_FIELDS
from models.attention import LayerSpec

MODEL_COLUMNS = (
    "model", "scope", "layers", "sink_rate", "sigma_k", "sigma_v", "sigma_ratio", "alpha_bos", "bos_cos",
    "weight_ratio", "sigma1_ratio", "jaccard", "jaccard_layer_std", "q_heads", "kv_heads", "gqa_ratio",
    *FIRST_FIELDS,
)


class GeometryAccumulator:
    """Per-head running sums over calibration sequences; `add` one `measure_sequence` result at a time."""

    def __init__(self, tau: float):
        self.tau = tau
        self.count = 0
        self.sums: dict[str, np.ndarray] = {}
        self.jaccard_count: np.ndarray | None = None

    def add(self, record: dict[str, Any]) -> None:
        values = {name: np.asarray(record[name], dtype=np.float64) for name in KV_FIELDS + ("alpha_bos",)}
        values["sink"] = (values["alpha_bos"] > self.tau).astype(np.float64)
        jaccard = np.array([[np.nan if v is None else v for v in row] for row in record["jaccard"]], dtype=np.float64)
        values["jaccard"] = np.nan_to_num(jaccard)
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.jaccard_count = (0 if self.jaccard_count is None else self.jaccard_count) + ~np.isnan(jaccard)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "count": self.count,
            "sums": {name: value.tolist() for name, value in self.sums.items()},
            "jaccard_count": None if self.jaccard_count is None else self.jaccard_count.tolist(),
        }

    def means(self) -> dict[str, np.ndarray]:
        """Per-head means: ``[layer, kv_head]`` for `KV_FIELDS`, ``[layer, q_head]`` for alpha_bos, sink, jaccard."""
        if not self.count:
            raise ValueError("no sequences were added")
        assert self.jaccard_count is not None  # set by every `add`
        means = {name: value / self.count for name, value in self.sums.items() if name != "jaccard"}
        with np.errstate(invalid="ignore", divide="ignore"):
            means["jaccard"] = np.where(self.jaccard_count > 0, self.sums["jaccard"] / self.jaccard_count, np.nan)
        return means


def build_tables(
    means: dict[str, np.ndarray], specs: list[LayerSpec], weights: dict[str, list], model: str
) -> dict[str, list[dict[str, Any]]]:
    """The ``heads_kv``, ``heads_q``, ``layers`` and ``model`` tables (lists of flat records)."""
    n_layers, n_kv = means["sigma_k"].shape
    n_q = means["alpha_bos"].shape[1]
    group = n_q // n_kv
    w_k_head, w_v_head = np.asarray(weights["w_k_head"]), np.asarray(weights["w_v_head"])
    heads_kv, heads_q, layers = [], [], []
    for spec in specs:
        layer = spec.index
        for head in range(n_kv):
            heads_kv.append({
                "layer": layer, "layer_type": spec.kind, "kv_head": head,
                **{name: means[name][layer, head] for name in KV_FIELDS},
                "sigma_ratio": means["sigma_v"][layer, head] / means["sigma_k"][layer, head],
                "sigma1_ratio": means["sigma1_v"][layer, head] / means["sigma1_k"][layer, head],
                "w_k": w_k_head[layer, head], "w_v": w_v_head[layer, head],
                "weight_ratio": w_v_head[layer, head] / w_k_head[layer, head],
            })
        for head in range(n_q):
            heads_q.append({
                "layer": layer, "layer_type": spec.kind, "q_head": head, "kv_head": head // group,
                "alpha_bos": means["alpha_bos"][layer, head], "sink_rate": means["sink"][layer, head],
                "jaccard": means["jaccard"][layer, head],
            })
        layers.append({
            "layer": layer, "layer_type": spec.kind, "window": spec.window,
            **_scope_stats(means, weights, [layer]),
            "sigma_k_head_std": means["sigma_k"][layer].std(), "sigma_v_head_std": means["sigma_v"][layer].std(),
            "w_k": weights["w_k"][layer], "w_v": weights["w_v"][layer],
        })
    kinds = list(dict.fromkeys(spec.kind for spec in specs))
    scopes = [("all", list(range(n_layers)))]
    if len(kinds) > 1:
        scopes += [(kind, [s.index for s in specs if s.kind == kind]) for kind in kinds]
    model_rows = []
    for scope, members in scopes:
        per_layer_jaccard = np.array([row["jaccard"] for row in layers if row["layer"] in members])
        defined = per_layer_jaccard[~np.isnan(per_layer_jaccard)]
        model_rows.append({
            "model": model, "scope": scope, "layers": len(members), **_scope_stats(means, weights, members),
            "jaccard_layer_std": defined.std() if len(defined) else np.nan,
            "q_heads": n_q, "kv_heads": n_kv, "gqa_ratio": n_q / n_kv,
        })
    tables = {"heads_kv": heads_kv, "heads_q": heads_q, "layers": layers, "model": model_rows}
    return {name: [{k: _plain(v) for k, v in row.items()} for row in rows] for name, rows in tables.items()}


def _scope_stats(means: dict[str, np.ndarray], weights: dict[str, list], layers: list[int]) -> dict[str, float]:
    def mean(name: str) -> float:
        return float(means[name][layers].mean())

    def weight(name: str) -> float:
        return float(np.mean(np.asarray(weights[name])[layers]))

    jaccard = means["jaccard"][layers]
    return {
        "sink_rate": mean("sink"),
        "sigma_k": mean("sigma_k"),
        "sigma_v": mean("sigma_v"),
        "sigma_ratio": mean("sigma_v") / mean("sigma_k"),
        "alpha_bos": mean("alpha_bos"),
        "bos_cos": mean("bos_cos"),
        "weight_ratio": weight("w_v") / weight("w_k"),
        "sigma1_ratio": mean("sigma1_v") / mean("sigma1_k"),
        "jaccard": float(np.nanmean(jaccard)) if (~np.isnan(jaccard)).any() else np.nan,
        **{name: mean(name) for name in FIRST_FIELDS},
    }


def _plain(value: Any) -> Any:
    """numpy scalars to Python numbers; NaN to None (JSON has no NaN)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value
