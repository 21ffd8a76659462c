"""TriAttention: keys scored by the attention a calibrated query centre would pay them at future distances.

Mao et al. 2026, "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression" (arXiv 2604.04921;
released code WeianMao/triattention, ``triattention/methods/pruning_utils.py: score_keys_for_round``). With the
head dimension split into ``F = d/2`` rotate-half pairs (complex numbers ``k_f``), a key at position ``i`` scored
when the next token is at ``t``, per query head with calibrated centre ``qbar_f = E[q_f]`` and mean length
``m_f = E|q_f|`` (`evictor.calibration.triattention`), RoPE frequencies ``omega_f`` and amplitude ``s_f``::

    S_i(D) = sum_f s_f^2 * ( |qbar_f| |k_f| cos(D omega_f + phi_f)  +  (m_f - |qbar_f|) |k_f| )
    phi_f  = arg(qbar_f conj(k_f)),   k = the key before RoPE
    s_i    = mean over o in {1, 2, 4, ..., 65536} of S_i(t - i + o)

The first sum is the trigonometric series (the logit a query at the centre would give the key at distance D), the
second the norm term (the query's spread around its centre times the key norm). Because the mean over the
geometric offsets is linear, it is computed exactly as one complex dot product with the *post*-RoPE key:
``s_i = Re sum_f conj(k_f^post) u_f + sum_f s_f (m_f - |qbar_f|) |k_f^post|`` with
``u_f = s_f qbar_f e^{i t omega_f} mean_o e^{i o omega_f}`` (`triattention_scores`), so no key is un-rotated.

Pruning (`pruning`): the repository's experiment runner defaults to ``per_head_pruning`` (scripts/cli.py sets it
when no mode is given; "triattn_ph", the variant Random Attention ran): each query head's scores are z-scored over
the decode candidates, the max over the query heads of a KV head is taken within each layer, and that is averaged
over layers, giving one keep set per KV head shared by every layer. Here a layer's score is the z-score group-max
(`group_max_of_zscores`) and the engine averages the round's per-layer scores (``shared_across_layers``), which is
that computation exactly. ``pruning="per_layer_per_head"`` is the repository's other mode: one keep set per (layer,
KV head) from that layer's group-max alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import UsageError, unknown_choice
from evictor.calibration import CalibratedPolicy
from evictor.calibration.triattention import METHOD, TriAttentionStats, load_triattention
from evictor.policies import register_policy
from evictor.policies._inputs import require
from scoring.policy import Needs, ScoreInputs

MAX_OFFSET = 65536  # the released default (offset_max_length / triattention_frequency_window)
PRUNINGS = ("per_head", "per_layer_per_head")  # one keep set per KV head for all layers; one per (layer, KV head)


def geometric_offsets(max_offset: int) -> torch.Tensor:
    """``1, 2, 4, ...`` up to `max_offset`: the future distances a key's score averages over."""
    return torch.tensor([2.0**j for j in range(max_offset.bit_length())], dtype=torch.float64)


def triattention_scores(
    keys: torch.Tensor,
    next_position: torch.Tensor,
    q_mean: torch.Tensor,
    q_abs_mean: torch.Tensor,
    omega: torch.Tensor,
    scale: torch.Tensor,
    max_offset: int = MAX_OFFSET,
) -> torch.Tensor:
    """Per query head, the TriAttention score of post-RoPE `keys` ``[b, kv_head, C, d]`` when the next token is at
    `next_position` ``[b]``: ``[b, q_head, C]`` (query head h reads KV head ``h // group``).

    `q_mean` ``[q_head, F]`` complex, `q_abs_mean` ``[q_head, F]``, `omega` and `scale` ``[F]``.
    """
    b, n_kv, _, d = keys.shape
    n_q, n_freq = q_mean.shape
    # The per-query-head vectors are tiny: built in float64 on the CPU, as phases t * omega reach 1e4-1e5 radians;
    # the products with the keys run in float32 where the keys are.
    omega, scale, q_mean, q_abs_mean = (x.detach().cpu().to(torch.complex128 if x.is_complex() else torch.float64)
                                        for x in (omega, scale, q_mean, q_abs_mean))
    offset_mean = torch.exp(1j * geometric_offsets(max_offset)[:, None] * omega).mean(0)  # [F]
    turn = torch.exp(1j * next_position.detach().cpu().double()[:, None] * omega)  # [b, F]
    u = ((scale * q_mean * offset_mean)[None] * turn[:, None, :]).view(b, n_kv, n_q // n_kv, n_freq)
    spread = (scale * (q_abs_mean - q_mean.abs())).view(n_kv, n_q // n_kv, n_freq)
    keys = keys.float()
    real, imag = keys[..., : d // 2], keys[..., d // 2 :]
    u_real, u_imag, spread = (x.float().to(keys.device) for x in (u.real, u.imag, spread))
    trig = torch.einsum("bkcf,bkgf->bkgc", real, u_real) + torch.einsum("bkcf,bkgf->bkgc", imag, u_imag)
    norm = torch.einsum("bkcf,kgf->bkgc", torch.sqrt(real**2 + imag**2), spread)
    return (trig + norm).reshape(b, n_q, -1)


def group_max_of_zscores(scores: torch.Tensor, mask: torch.Tensor, n_kv: int, normalize: bool = True) -> torch.Tensor:
    """``[b, q_head, C]`` -> ``[b, kv_head, C]``: each query head's scores z-scored over the real candidates
    (`mask` ``[b, kv_head, C]``), then the max over each KV head's query group."""
    b, n_q, n = scores.shape
    grouped = scores.view(b, n_kv, n_q // n_kv, n)
    if normalize:
        real = mask[:, :, None, :].expand_as(grouped)
        count = real.sum(-1, keepdim=True).clamp_min(1)
        mean = grouped.where(real, 0).sum(-1, keepdim=True) / count
        std = ((grouped - mean).where(real, 0).pow(2).sum(-1, keepdim=True) / count).sqrt().clamp_min(1e-6)
        grouped = (grouped - mean) / std
    return grouped.max(2).values


@register_policy("triattention")
@dataclass
class TriAttention(CalibratedPolicy):
    """TriAttention per KV head: z-scored trigonometric + norm scores of each query head, max over the KV head's
    query group, averaged over layers into one keep set per KV head (`pruning` "per_head", the released default; or
    one per layer and KV head, "per_layer_per_head"); the prompt is protected. `calibration` is the file
    ``python -m evictor.calibrate triattention`` wrote for this model (required)."""

    max_offset: int = MAX_OFFSET
    normalize: bool = True
    pruning: str = "per_head"
    method = METHOD

    citation = (
        "Mao et al. 2026, TriAttention (arXiv 2604.04921; WeianMao/triattention score_keys_for_round): s_i = "
        "mean_o sum_f s_f^2 [|qbar_f||k_f| cos((t-i+o) w_f + phi_f) + (E|q_f| - |qbar_f|)|k_f|], o = 2^0..2^16"
    )
    deviations = (
        "Follows the repository's per-head pruning by default (z-score per query head over the candidates, max over "
        "the KV head's group, mean over layers, one keep set per KV head for every layer); per_layer_per_head "
        "selectable. Calibration: query centres from teacher-forced dense traces read before RoPE (the repository "
        "inverts RoPE on one plain-text forward); RoPE frequencies from the model's own rotary embedding. No 1e-6 "
        "tie-breaking noise. Trigger, budget accounting and the recent window are the engine's protocol (the "
        "repository compresses at K + 128 with K counting the prompt and scores the newest tokens too). The prompt is "
        "protected, as in the repository and Random Attention. On sliding-window layers, keep sets shared across "
        "layers keep out-of-window slots like any other (a layer's own keep set would evict them first)."
    )
    default_protection = "prompt"
    defined_for = ("prompt",)
    defined_by = "WeianMao/triattention and Random Attention §4: the prompt is protected"

    def __post_init__(self) -> None:
        if self.max_offset < 1:
            raise UsageError(f"{self.name}: max_offset must be >= 1, got {self.max_offset}")
        if self.pruning not in PRUNINGS:
            raise unknown_choice(f"{self.name} pruning", self.pruning, PRUNINGS)
        self.load_calibration()

    @property
    def shared_across_layers(self) -> bool:  # type: ignore[override]
        return self.pruning == "per_head"

    def read_calibration(self, path: str) -> TriAttentionStats:
        return load_triattention(path, self.name)

    @property
    def needs(self) -> Needs:
        return Needs(keys=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        keys, next_positions = require(self, inputs, "keys", "next_positions")
        stats = self.stats()
        stats.check_keys(keys)
        layer = inputs.layer
        per_query_head = triattention_scores(
            keys, next_positions, stats.q_mean[layer], stats.q_abs_mean[layer], stats.omega[layer],
            stats.rope_scale[layer], self.max_offset,
        )
        return group_max_of_zscores(per_query_head, inputs.candidate_mask, keys.shape[1], self.normalize)
