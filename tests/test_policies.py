"""Individual policies against their papers' formulas on hand-made inputs whose answers are derived in the comments,
the listing CLI, and the per-paper protocol presets (checked from the engine's keep log)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest
import torch

from core.cli import ArgumentParser
from core.errors import UsageError
from evictor.engine import EvictionEngine
from evictor.instrument import kept_positions
from evictor.policies import get_policy, policy_names
from evictor.policies.__main__ import main as cli_main
from evictor.protocol import (
    FRACTION,
    PRESETS,
    Budget,
    EvictionConfig,
    Sampling,
    add_protocol_arguments,
    protocol_overrides,
    resolve_protocol,
    sequence_budgets,
)
from models.hooks import capture, hook_name
from scoring.policy import ObserveInputs, ScoreInputs
from signals import attention as att
from signals.kv import lag_normalised_variance

# One sequence, one KV head, four candidates (the ValueDiff example): mean (1, .125)
VECTORS = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 0.0], [0.0, 0.5]])[None, None]  # [1, 1, 4, 2]


def inputs_for(vectors: torch.Tensor, **extra) -> ScoreInputs:
    b, h, n, _ = vectors.shape
    defaults = dict(
        layer=0,
        step=0,
        positions=torch.arange(n).expand(b, h, n),
        candidate_mask=torch.ones(b, h, n, dtype=torch.bool),
        keys=vectors,
        values=vectors,
        cache_keys=vectors,
        cache_values=vectors,
        cache_mask=torch.ones(b, h, n, dtype=torch.bool),
        cache_positions=torch.arange(n).expand(b, h, n),
    )
    return ScoreInputs(**{**defaults, **extra})


def keep_set(scores: torch.Tensor, k: int) -> set[int]:
    return set(scores.flatten().topk(k).indices.tolist())


@pytest.mark.parametrize(
    "name, kept",
    [
        ("valuediff", {2, 3}),  # distances .125, 1.008, 2.004, 1.068
        ("manifoldkv", {2, 3}),  # the same distances, on keys
        ("valuediff_dir", {1, 3}),  # 1 - cos: .008, 1 (zero vector), .008, .876
        ("keydiff", {1, 3}),
        ("valuediff_norm", {0, 2}),  # norms 1, 0, 3, .5: keep the largest
        ("keynorm", {1, 3}),  # keep the LOWEST key norms: 0 and .5
    ],
)
def test_geometry_keep_sets_by_hand(name, kept):
    assert keep_set(get_policy(name).score(inputs_for(VECTORS)), 2) == kept


def test_valuediff_mean_is_over_the_whole_resident_cache():
    # candidates v0 and v2 only, but the cache also holds a protected slot at (-7, 0) and a padding slot:
    # mean (1 + 3 - 7) / 3 = -1, so the distances are 2 and 4 (the candidates' own mean would give 1 and 1)
    cache = torch.tensor([[1.0, 0.0], [3.0, 0.0], [-7.0, 0.0], [5.0, 5.0]])[None, None]
    cache_mask = torch.tensor([True, True, True, False])[None, None]
    inputs = inputs_for(VECTORS[:, :, [0, 2]], cache_values=cache, cache_mask=cache_mask)
    assert torch.allclose(get_policy("valuediff").score(inputs).flatten(), torch.tensor([2.0, 4.0]))


def test_cache_mean_policies_fail_clearly_without_the_cache():
    inputs = inputs_for(VECTORS, cache_values=None)
    with pytest.raises(ValueError, match="needs ScoreInputs.cache_values"):
        get_policy("valuediff").score(inputs)


def test_recency_and_streaming_score_by_position():
    positions = torch.tensor([[[7, 3, 9]]])
    inputs = ScoreInputs(layer=0, step=0, positions=positions, candidate_mask=torch.ones(1, 1, 3, dtype=torch.bool))
    for name in ("recency", "streaming_llm"):
        assert keep_set(get_policy(name).score(inputs), 2) == {0, 2}
    assert get_policy("streaming_llm").default_protection == "sinks"
    assert get_policy("recency").default_protection == "prompt"


def random_inputs(seed: int, heads: int = 4, n: int = 50) -> ScoreInputs:
    return ScoreInputs(
        layer=0,
        step=0,
        positions=torch.arange(n).expand(1, heads, n),
        candidate_mask=torch.ones(1, heads, n, dtype=torch.bool),
        generator=torch.Generator().manual_seed(seed),
    )


def test_random_is_reproducible_per_head_and_redrawn_each_eviction():
    policy = get_policy("random")
    first = random_inputs(0)
    a = policy.score(first)
    assert torch.equal(a, policy.score(random_inputs(0)))  # same seed, same draw
    assert not torch.equal(a, policy.score(random_inputs(1)))
    assert all(not torch.equal(a[0, 0], a[0, h]) for h in range(1, 4))  # independent per KV head
    assert not torch.equal(a, policy.score(first))  # the generator advanced: a new draw every eviction
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a, policy.score(random_inputs(0)))
    assert ((a > 0) & (a <= 1)).all()


def test_random_needs_the_run_generator():
    inputs = random_inputs(0)
    inputs.generator = None
    with pytest.raises(ValueError, match="generator"):
        get_policy("random").score(inputs)


def test_random_shared_is_one_draw_for_all_heads():
    scores = get_policy("random_shared").score(random_inputs(0))
    assert all(torch.equal(scores[0, 0], scores[0, h]) for h in range(1, 4))
    assert get_policy("random_shared").shared_across_heads
    assert get_policy("random_unprotected").default_protection == "none"
    assert get_policy("random").default_protection == "prompt"


def observe_hidden(policy, blocks: list[torch.Tensor], layers: dict[int, torch.Tensor]) -> torch.Tensor:
    """Feed hidden states [batch, T, d] per layer in the given block sizes; concatenate the frozen scores."""
    state: dict = {}
    outputs, start = [], 0
    for size in blocks:
        hidden = {layer: h[:, start : start + size] for layer, h in layers.items()}
        outputs.append(
            policy.observe(ObserveInputs(0, torch.arange(start, start + size)[None], None, None, hidden, state))
        )
        start += size
    return torch.cat(outputs, dim=-1)


# layer 0 moves by 1, 3, 2, 6 along one axis: g = [nan, 1, 3, 2, 6]; layer 1 never moves: g = [nan, 0, 0, 0, 0]
MOVING = torch.tensor([0.0, 1.0, 4.0, 6.0, 12.0])[None, :, None] * torch.tensor([1.0, 0.0, 0.0])
STILL = torch.ones(1, 5, 3)


def test_epikv_rolling_z_by_hand():
    policy = get_policy("epikv", positive_layers=(0,), negative_layers=(1,), window=3, n_layers=2)
    assert policy.needs.hidden_layers == (0, 1)
    scores = observe_hidden(policy, [3, 1, 1], {0: MOVING, 1: STILL})
    assert scores.shape == (1, 1, 5)  # one score per token, broadcast to every head
    # t=1: window {1} -> 0; t=2: {1,3} mean 2 sd 1 -> 1; t=3: {1,3,2} mean 2 -> 0;
    # t=4: {3,2,6} mean 11/3, sd sqrt(26/9) -> (6 - 11/3) / 1.6997 = 1.3728; t=0 has no predecessor -> 0.
    # Layer 1 (negative band) is constant: z = 0 / (0 + eps) = 0.
    expected = torch.tensor([0.0, 0.0, 1.0, 0.0, (6 - 11 / 3) / math.sqrt(26 / 9)])
    assert torch.allclose(scores.flatten(), expected, atol=1e-4)
    # the bands subtract: swapping them negates the score
    swapped = get_policy("epikv", positive_layers=(1,), negative_layers=(0,), window=3, n_layers=2)
    assert torch.allclose(observe_hidden(swapped, [5], {0: MOVING, 1: STILL}), -scores, atol=1e-4)


def test_epikv_raw_rolling_mean_by_hand():
    policy = get_policy("epikv_raw", positive_layers=[0], negative_layers=[1], window=2, n_layers=2)
    scores = observe_hidden(policy, [1, 1, 1, 1, 1], {0: MOVING, 1: STILL})
    # rolling-2 means of g = [nan, 1, 3, 2, 6]: [nan -> 0, 1, 2, 2.5, 4]
    assert torch.allclose(scores.flatten(), torch.tensor([0.0, 1.0, 2.0, 2.5, 4.0]))


def test_epikv_band_of_several_layers_and_a_one_band_score_by_hand():
    # positive band {0, 2} (MOVING twice: the same g), negative band {1} (STILL: g = 0): rolling-2 means as above
    policy = get_policy("epikv_raw", positive_layers=(0, 2), negative_layers=(1,), window=2, n_layers=3)
    scores = observe_hidden(policy, [5], {0: MOVING, 1: STILL, 2: MOVING})
    assert torch.allclose(scores.flatten(), torch.tensor([0.0, 1.0, 2.0, 2.5, 4.0]))
    # a negative band alone (validation may find only one sign): the empty side contributes 0
    alone = get_policy("epikv_raw", positive_layers=(), negative_layers=(0,), window=2, n_layers=2)
    assert torch.allclose(observe_hidden(alone, [5], {0: MOVING}).flatten(), -torch.tensor([0.0, 1.0, 2.0, 2.5, 4.0]))
    with pytest.raises(UsageError, match="both empty"):
        get_policy("epikv", positive_layers=(), negative_layers=(), n_layers=2)


@pytest.mark.parametrize("name", ["epikv", "epikv_raw"])
def test_epikv_layers_follow_the_model_depth(name):
    assert get_policy(name).needs.hidden_layers == (10, 21)  # the paper's 32-layer model
    assert get_policy(name).for_depth(30).needs.hidden_layers == (9, 20)  # SmolLM2
    assert get_policy(name).for_depth(18).needs.hidden_layers == (6, 12)  # Gemma3-270M
    assert get_policy(name).for_depth(4).needs.hidden_layers == (1, 3)  # tiny models
    explicit = get_policy(name, positive_layers=(2, 3), negative_layers=(5,), n_layers=8).for_depth(6)
    assert explicit.needs.hidden_layers == (2, 3, 5) and explicit.n_layers == 6
    with pytest.raises(UsageError, match="positive_layers"):
        get_policy(name, positive_layers=(2,), n_layers=8).for_depth(2)
    with pytest.raises(UsageError, match="both bands"):
        get_policy(name, positive_layers=(3,), negative_layers=(3,))


def test_epikv_reports_a_missing_hidden_layer():
    policy = get_policy("epikv").for_depth(4)
    with pytest.raises(ValueError, match=r"hidden\[1\]"):
        policy.observe(ObserveInputs(0, torch.zeros(1, 2), None, None, {3: torch.zeros(1, 2, 4)}, {}))


def test_kv_key_rolling_mean_of_head_dim_variance():
    # keys (a, -a) have population variance a^2: 1, 3, 5 -> rolling-2 means 1, 2, 4
    a = torch.tensor([1.0, 3.0, 5.0]).sqrt()
    keys = torch.stack([a, -a], dim=-1)[None, None]  # [1, 1, 3, 2]
    policy = get_policy("kv_key", window=2)
    state: dict = {}
    out = [
        policy.observe(ObserveInputs(0, torch.tensor([[t]]), keys[:, :, t : t + 1], None, {}, state)) for t in range(3)
    ]
    assert torch.allclose(torch.cat(out, -1).flatten(), torch.tensor([1.0, 2.0, 4.0]))
    assert get_policy("kv_val").needs.values and not get_policy("kv_val").needs.keys


def test_lag_kv_streaming_matches_the_offline_signal():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 150, 4), torch.randn(1, 2, 150, 4)
    policy = get_policy("lag_kv")
    state: dict = {}
    positions = torch.arange(150)[None]  # [batch, pos]
    out = [policy.observe(ObserveInputs(0, positions[:, :100], keys[:, :, :100], values[:, :, :100], {}, state))]
    out += [
        policy.observe(
            ObserveInputs(0, positions[:, t : t + 1], keys[:, :, t : t + 1], values[:, :, t : t + 1], {}, state)
        )
        for t in range(100, 150)
    ]
    offline = lag_normalised_variance(keys) + lag_normalised_variance(values)
    assert torch.allclose(torch.cat(out, -1), offline, atol=1e-6)


def attention_inputs(attn: torch.Tensor, vectors: torch.Tensor | None = None, **extra) -> ScoreInputs:
    """One sequence; ``attn [heads, queries, n]`` (or ``[queries, n]`` for one head) over n candidates."""
    attn = attn if attn.dim() == 3 else attn[None]
    heads, _, n = attn.shape
    vectors = torch.ones(1, heads, n, 2) if vectors is None else vectors
    return inputs_for(vectors, attention=attn[None], **extra)


# Three queries (oldest first) over four candidates; each row also gives mass to slots that are not candidates.
ATTN = torch.tensor([[0.3, 0.05, 0.05, 0.1], [0.05, 0.05, 0.35, 0.05], [0.05, 0.25, 0.05, 0.15]])


def test_h2o_sums_every_query_since_entry():
    # column sums .4 .35 .45 .3 (H2O, eq. "s_i = sum_t' alpha_i^(t')")
    scores = get_policy("h2o").score(attention_inputs(ATTN)).flatten()
    assert torch.allclose(scores, ATTN.sum(0)) and torch.allclose(scores, torch.tensor([0.4, 0.35, 0.45, 0.3]))


def test_tova_averages_the_last_query_over_heads():
    # head 0's last row .05 .25 .05 .15, head 1's .35 .05 .05 .05: mean .2 .15 .05 .1, the same for both heads
    second = torch.tensor([[0.1] * 4, [0.1] * 4, [0.35, 0.05, 0.05, 0.05]])
    scores = get_policy("tova").score(attention_inputs(torch.stack([ATTN, second])))
    assert torch.allclose(scores[0, 0], torch.tensor([0.2, 0.15, 0.05, 0.1]))
    assert torch.equal(scores[0, 0], scores[0, 1])
    assert get_policy("tova").shared_across_heads


def test_snapkv_sums_the_window_and_averages_over_five_neighbours():
    policy = get_policy("snapkv")
    assert (policy.window, policy.kernel, policy.pooling) == (32, 5, "avg")  # FasterDecoding/SnapKV's defaults
    attn = torch.zeros(2, 7)
    attn[0, 3], attn[1, 3], attn[1, 0] = 0.5, 0.25, 0.5  # window sums: .5 0 0 .75 0 0 0
    summed = torch.tensor([0.5, 0, 0, 0.75, 0, 0, 0])
    # average over slots j-2..j+2, out-of-range slots counting 0 and the divisor always 5
    expected = torch.tensor([summed[max(0, j - 2) : j + 3].sum().item() / 5 for j in range(7)])
    assert torch.allclose(policy.score(attention_inputs(attn)).flatten(), expected)  # .1 .25 .25 .15 .15 .15 0
    # a window of 1 sees only the newest query: slot 3 gets .25 / 5
    assert torch.allclose(get_policy("snapkv", window=1).score(attention_inputs(attn)).flatten()[3], torch.tensor(0.05))


def test_r_kv_matches_the_authors_formula_by_hand():
    policy = get_policy("r_kv", kernel=3)
    assert (get_policy("r_kv").lam, get_policy("r_kv").window, get_policy("r_kv").kernel) == (0.1, 8, 7)
    # keys: see tests/test_signals_kv.py (R_KV_KEYS): redundancy softmax([1.6, 1.6, 0, 0] / 4)
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.6, 0.8]])[None, None]
    # two queries giving the candidates half their mass: renormalised rows .1 .2 .3 .4 and .4 .2 .2 .2
    attn = torch.tensor([[0.05, 0.1, 0.15, 0.2], [0.2, 0.1, 0.1, 0.1]])
    mean = torch.tensor([0.25, 0.2, 0.25, 0.3])
    pooled = torch.tensor([0.25, 0.25, 0.3, 0.3])  # max over each slot and its neighbours
    column_mean = torch.tensor([0.4, 0.4, 0.0, 0.0])
    redundancy = column_mean.exp() / column_mean.exp().sum()
    inputs = attention_inputs(attn, keys)
    for lam in (0.1, 0.5):  # the authors' default and Random Attention's tables
        expected = lam * pooled - (1 - lam) * redundancy
        got = get_policy("r_kv", kernel=3, lam=lam).score(inputs).flatten()
        assert torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(att.candidate_attention(attn[None, None], 8, inputs.candidate_mask).flatten(), mean)
    # lam .1: -.2444 -.2444 -.1506 -.1506: the redundant pair goes first, and both terms matter (lam 0 ties them all
    # within a pair, lam 1 keeps the attended ones)
    scores = policy.score(inputs).flatten()
    assert scores[2] > scores[0] and scores[3] > scores[1]
    # with the candidates the whole cache, the earlier kvscope port (r_kv_mean) computes the same scores
    assert torch.allclose(get_policy("r_kv_mean", kernel=3).score(inputs), policy.score(inputs))


def test_r_kv_reads_its_redundancy_over_every_resident_key():
    """The authors' cal_similarity runs over the whole cache (observation window included), softmax over it, and is
    read at the candidates; r_kv_mean runs it over the candidates alone."""
    # cache: candidates at positions 0, 1 (keys e1, e2) and a resident window key at position 2 (e1 again)
    cache = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])[None, None]
    # C (diagonal 0): C01 = 0, C02 = 1, C12 = 0. Duplicates > .5: 0 <-> 2; row 0 exempts its newest duplicate,
    # slot 2 (C02 := 0), row 2 exempts slot 0 (C20 := 0): every entry is 0, column means 0, softmax 1/3 each.
    inputs = inputs_for(cache[:, :, :2], cache_keys=cache, cache_mask=torch.ones(1, 1, 3, dtype=torch.bool),
                        cache_positions=torch.arange(3).view(1, 1, 3),
                        attention=torch.tensor([[[[0.5, 0.5]]]]))
    assert torch.allclose(get_policy("r_kv").redundancy(inputs).flatten(), torch.full((2,), 1 / 3))
    # over the candidates alone: C01 = 0 and no duplicate: column means 0, softmax 1/2 each
    assert torch.allclose(get_policy("r_kv_mean").redundancy(inputs).flatten(), torch.full((2,), 1 / 2))
    assert get_policy("r_kv").needs.attention_group == "max_logits"
    assert get_policy("r_kv_mean").needs.attention_group == "mean"
    assert (get_policy("r_kv").kept_recent(512), get_policy("r_kv_mean").kept_recent(512)) == (8, 0)


def test_h2o_split_keeps_its_recent_share_and_no_sinks():
    policy = get_policy("h2o_split")
    assert (policy.default_protection, policy.kept_recent(256), policy.kept_recent(255)) == ("none", 128, 127)
    assert get_policy("h2o").kept_recent(256) == 0 and get_policy("h2o").default_protection == "sinks"
    assert get_policy("h2o_split", recent_share=0.25).kept_recent(100) == 25
    with pytest.raises(UsageError, match="recent_share"):
        get_policy("h2o_split", recent_share=1.0)


def test_vase_pins_sinks_keeps_a_quarter_by_value_range_then_samples_by_attention():
    values = torch.zeros(1, 1, 8, 2)
    values[0, 0, 5] = torch.tensor([4.0, -4.0])  # range 8
    values[0, 0, 2] = torch.tensor([3.0, 0.0])  # range 3
    attn = torch.full((1, 1, 1, 8), 1 / 8)
    inputs = inputs_for(values, attention=attn, keep=8, generator=torch.Generator().manual_seed(0))
    scores = get_policy("vase").score(inputs)
    # keep // 4 = 2 large slots; positions 0..3 are sinks (pinned first), so the large set is two of the sinks
    large = set((scores.flatten() > 0).nonzero().flatten().tolist())
    assert len(large) == 2 and large <= {0, 1, 2, 3}
    assert keep_set(get_policy("vase", sinks=0).score(inputs), 2) == {5, 2}  # no sinks: the two largest ranges
    # the sampled part: log(u) / w with w the pooled renormalised attention (uniform here: 1/8 inside, 3/40 at the
    # edges of the average over five), u the run generator's draws
    weights = att.pool_keys(torch.full((1, 1, 8), 1 / 8), 5)
    u = 1.0 - torch.rand((1, 1, 8), generator=torch.Generator().manual_seed(0))
    sampled = scores.flatten() <= 0
    assert torch.allclose(scores[sampled[None, None]], (u.log() / weights)[sampled[None, None]])


def test_fastcaote_matches_eq_a11():
    attn = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    scores = get_policy("fastcaote").score(attention_inputs(attn, VECTORS))
    distance = torch.tensor([0.125, math.sqrt(1 + 0.125**2), math.sqrt(4 + 0.125**2), math.sqrt(1 + 0.375**2)])
    alpha = attn.flatten()
    assert torch.allclose(scores.flatten(), alpha / (1 - alpha) * distance)  # 0.125, .282, .502, .117


def test_raas_refresh_rule_by_hand():
    """The rule the attention feed applies to every query (`evictor.attention`): a query refreshes the keys it gives
    more than threshold x its uniform share 1 / (keys it saw); a key keeps its own position otherwise."""
    # keys at positions 0..3; query 2 sees keys 0..2 (share 1/3), query 3 sees 0..3 (share 1/4)
    attn = torch.tensor([[0.5, 0.1, 0.4, 0.0], [0.1, 0.6, 0.2, 0.1]])[None, None]  # [1, 1, 2 queries, 4 keys]
    queries, keys = torch.tensor([[2, 3]]), torch.arange(4).view(1, 1, 4)
    share = torch.tensor([1 / 3, 1 / 4]).view(1, 1, 2, 1)
    # q2 refreshes keys 0 (.5) and 2 (.4) to 2; q3 refreshes key 1 (.6 > .25) to 3; key 3 keeps its position 3
    assert att.raas_timestamps(attn, queries[:, None], keys, share).flatten().tolist() == [2.0, 3.0, 2.0, 3.0]
    # threshold 2: only .6 > 2 x .25 refreshes
    assert att.raas_timestamps(attn, queries[:, None], keys, 2 * share).flatten().tolist() == [0.0, 3.0, 2.0, 3.0]
    # the policy keeps the newest timestamps the feed hands it
    refreshed = torch.tensor([[[2.0, 3.0, 2.0, 3.0]]])
    inputs = inputs_for(VECTORS, refreshed=refreshed)
    assert torch.equal(get_policy("raas").score(inputs), refreshed)
    assert get_policy("raas", threshold=2.0).needs.refresh_threshold == 2.0
    with pytest.raises(ValueError, match="refreshed"):
        get_policy("raas").score(inputs_for(VECTORS))


def test_longflow_contribution():
    attn = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    scores = get_policy("longflow").score(attention_inputs(attn, VECTORS))
    assert torch.allclose(scores.flatten(), torch.tensor([0.1, 0.0, 0.9, 0.2]))  # ||alpha_j v_j||_1


def test_geometry_scores_are_the_papers_formulas():
    # VECTORS: mean (1, .125); norms 1, 0, 3, .5
    inputs = inputs_for(VECTORS)
    v, mean = VECTORS[0, 0], torch.tensor([1.0, 0.125])
    cos = lambda x, anchor: (x @ anchor) / (x.norm(dim=-1) * anchor.norm()).clamp_min(1e-12)  # noqa: E731
    unit_mean = torch.nn.functional.normalize(v, dim=-1).mean(0)  # (.5, .25): the zero key stays zero
    expected = {
        "keynorm": -v.norm(dim=-1),  # Devoto et al.: keep LOW norms
        "keydiff": -cos(v, unit_mean),  # KeyDiff: negative cosine to the mean of normalised keys
        "manifoldkv": (v - mean).norm(dim=-1),
        "valuediff": (v - mean).norm(dim=-1),  # eq. 4
        "valuediff_dir": 1 - cos(v, mean),  # §3.2
        "valuediff_norm": v.norm(dim=-1),  # §3.2
    }
    for name, want in expected.items():
        assert torch.allclose(get_policy(name).score(inputs).flatten(), want, atol=1e-6), name
    # KeyDiff's anchor averages directions, not raw keys: a long key does not pull it (scores -.533 -.846 -.846 -.975
    # keep key 0; against the raw mean (2.75, .75) key 1 would look the most distinctive)
    keys = torch.tensor([[10.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]])[None, None]
    assert keep_set(get_policy("keydiff").score(inputs_for(keys)), 1) == {0}


def test_kv_val_and_lag_kv_by_hand():
    # values (a, -a) have variance a^2: 4, 0, 1 -> rolling-2 means 4, 2, .5
    a = torch.tensor([2.0, 0.0, 1.0])
    values = torch.stack([a, -a], dim=-1)[None, None]
    policy, state = get_policy("kv_val", window=2), {}
    out = [policy.observe(ObserveInputs(0, torch.tensor([[t]]), None, values[:, :, t : t + 1], {}, state))
           for t in range(3)]
    assert torch.allclose(torch.cat(out, -1).flatten(), torch.tensor([4.0, 2.0, 0.5]))
    # Lag-KV, chunk 2, one channel pair: keys k = (0,0), (2,4) | (1,1), (3,0); values all zero (variance 0).
    # chunk 0 normalises by the range so far: (0,0) -> (0,0); (2,4) -> (1,1) (range (0..2, 0..4)).
    # chunk 1 by chunk 0's range: (1,1) -> (.5,.25), (3,0) -> (1.5, 0). Variances: 0, 0, .015625, .5625
    keys = torch.tensor([[0.0, 0.0], [2.0, 4.0], [1.0, 1.0], [3.0, 0.0]])[None, None]
    lag = get_policy("lag_kv", chunk=2).observe(
        ObserveInputs(0, torch.arange(4)[None], keys, torch.zeros_like(keys), {}, {}))
    assert torch.allclose(lag.flatten(), torch.tensor([0.0, 0.0, 0.015625, 0.5625]), atol=1e-5)


def test_position_and_random_scores():
    positions = torch.tensor([[[7, 3, 9]]])
    inputs = ScoreInputs(layer=0, step=0, positions=positions, candidate_mask=torch.ones(1, 1, 3, dtype=torch.bool),
                         generator=torch.Generator().manual_seed(4))
    assert get_policy("recency").score(inputs).flatten().tolist() == [7.0, 3.0, 9.0]
    drawn = get_policy("random").score(inputs)
    assert torch.equal(drawn, 1 - torch.rand((1, 1, 3), generator=torch.Generator().manual_seed(4)))  # U(0, 1]
    assert get_policy("full").scores_nothing


def test_unknown_policy_suggests_a_name():
    with pytest.raises(UsageError, match="did you mean 'valuediff'"):
        get_policy("valudiff")


def test_bad_parameters_are_usage_errors():
    with pytest.raises(UsageError, match="kernel"):
        get_policy("snapkv", kernel=4)
    with pytest.raises(UsageError, match="lam"):
        get_policy("r_kv", lam=1.5)


def test_cli_lists_every_policy():
    done = subprocess.run([sys.executable, "-m", "evictor.policies"], capture_output=True, text=True, check=True)
    header, *rows = done.stdout.splitlines()
    assert [row.split()[0] for row in rows] == policy_names()
    assert header.split()[:8] == ["policy", "reads", "FA", "heads", "layers", "protect", "defined-for", "citation"]
    epikv = next(row for row in rows if row.startswith("epikv "))
    assert "hidden resid_pre L10,21" in epikv and " yes " in epikv and " shared " in epikv
    assert " prompt  " in epikv.split("L10,21")[1]  # default protection, and defined for the prompt only
    snapkv = next(row for row in rows if row.startswith("snapkv "))
    assert "none + newest 32 (own)" in snapkv  # its observation window, kept by the policy itself
    assert "group max logit" in next(row for row in rows if row.startswith("r_kv "))


def test_cli_one_policy_and_unknown_name(capsys):
    assert cli_main(["--name", "h2o", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["fa_compatible"] is False and described["protection"] == "sinks"
    assert cli_main(["--name", "epikb"]) == 2
    captured = capsys.readouterr()
    assert "did you mean 'epikv'" in captured.err and not captured.out


@pytest.mark.parametrize("name", ["epikv", "epikv_raw"])
def test_epikv_reads_resid_pre_and_warns_about_rescaled_bands(name):
    policy = get_policy(name)
    assert policy.needs.hidden_hook == "hook_resid_pre" and policy.config()["hidden_hook"] == "hook_resid_pre"
    assert get_policy(name, hidden_hook="hook_resid_post").needs.hidden_hook == "hook_resid_post"
    with pytest.raises(UsageError, match="hook_resid_pre"):
        get_policy(name, hidden_hook="resid_pre")
    with pytest.warns(UserWarning, match=r"rescaled to 30 layers.*python -m validation\.layers"):
        policy.for_depth(30)
    validated = get_policy(name, positive_layers=(8,), negative_layers=(19,), n_layers=30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validated.for_depth(30)  # bands given for the model: no warning


def test_engine_captures_the_policys_hidden_hook(tiny_llama):
    """The frozen scores the engine stores equal the policy fed blocks.{l}.<hidden_hook> captured by hand."""
    prompt = list(range(20, 32))
    for hook in ("hook_resid_pre", "hook_resid_post"):
        policy = get_policy("epikv_raw", positive_layers=(1,), negative_layers=(2,), window=4, n_layers=4,
                            hidden_hook=hook)
        engine = EvictionEngine(tiny_llama, policy, EvictionConfig(budget=10_000, block=len(prompt)))
        with torch.inference_mode(), engine.session([prompt]) as session:
            session.prefill()
            frozen = session.cache.layers[0].slot_tensor("frozen")[0, 0, : len(prompt)].clone()
        with torch.no_grad(), capture(tiny_llama.model, [hook_name(1, hook), hook_name(2, hook)]) as cap:
            tiny_llama.model(input_ids=torch.tensor([prompt]))
        hidden = {layer: cap[hook_name(layer, hook)] for layer in (1, 2)}
        expected = policy.observe(ObserveInputs(0, torch.arange(len(prompt))[None], None, None, hidden, {}))
        assert torch.allclose(frozen, expected.flatten(), atol=1e-5), hook


def test_presets_set_what_their_papers_state():
    ra = resolve_protocol("random_attention", {"budget": 1024})
    assert (ra.config.trigger, ra.config.buffer, ra.config.recency, ra.config.protect) == ("interval", 64, 0, None)
    assert ra.sampling == Sampling(temperature=0.6, top_p=0.95)
    epikv = resolve_protocol("epikv", {"budget": 2048}).config
    assert (epikv.trigger, epikv.buffer, epikv.recency, epikv.recency_share, epikv.budget_scope) == (
        "step", 0, 128, 0.25, "trace")
    assert sequence_budgets([256, 2048], [0, 0], "prompt", epikv).recency == [64, 128]  # min(128, K/4)
    assert resolve_protocol("epikv").sampling == Sampling()  # greedy
    valuediff = resolve_protocol("valuediff", {"budget": 2048}).config
    assert (valuediff.trigger, valuediff.buffer, valuediff.recency, valuediff.block) == ("step", 0, 0, 128)
    assert resolve_protocol("custom").config == EvictionConfig()
    assert all(preset.source for preset in PRESETS.values())


def test_explicit_settings_override_a_preset_and_bad_ones_are_usage_errors():
    resolved = resolve_protocol("epikv", {"budget": 2048, "recency": 10, "buffer": None, "temperature": 0.7})
    assert resolved.config.recency == 10 and resolved.config.buffer == 0  # None = not given
    assert resolved.sampling == Sampling(temperature=0.7) and resolved.explicit == ("budget", "recency", "temperature")
    assert resolved.to_dict()["protocol"] == "epikv" and resolved.to_dict()["recency"] == 10
    with pytest.raises(UsageError, match="did you mean 'epikv'"):
        resolve_protocol("epkv")
    with pytest.raises(UsageError, match="protocol setting"):
        resolve_protocol("epikv", {"bufer": 3})
    per_problem = resolve_protocol("epikv").config  # each problem gets min(128, K_b / 4), whatever its budget
    assert (per_problem.recency, per_problem.recency_share) == (128, 0.25)
    explicit = resolve_protocol("epikv", {"recency": 8}).config  # a fixed window, not a cap
    assert (explicit.recency, explicit.recency_share) == (8, None)
    assert resolve_protocol("epikv", {"recency": 64, "recency_share": 0.5}).config.recency_share == 0.5
    with pytest.raises(UsageError, match="top_p"):
        resolve_protocol("random_attention", {"top_p": 1.5})


def test_protocol_flags_leave_unset_settings_to_the_preset():
    parser = ArgumentParser(prog="x")
    add_protocol_arguments(parser)
    args = parser.parse_args(["--protocol", "epikv", "--recency", "3", "--top-p", "0.9"])
    resolved = resolve_protocol(args.protocol, {**protocol_overrides(vars(args)), "budget": 64})
    assert resolved.config.recency == 3 and resolved.config.trigger == "step" and resolved.sampling.top_p == 0.9
    assert resolved.explicit == ("budget", "recency", "top_p")
    assert parser.parse_args([]).protocol == "custom"  # greedy and the EvictionConfig defaults unless asked


def test_budget_scope_with_buffer_counts_the_buffer_inside_k():
    """Random Attention's released engine: token_budget K holds the buffer, so a round leaves K slots."""
    config = EvictionConfig(budget=24, buffer=4, budget_scope="with_buffer")
    assert sequence_budgets([24], [6], "prompt", config) == ([20], [6], [0])
    with pytest.raises(UsageError, match="exceed the buffer"):
        sequence_budgets([4], [2], "none", config)


def check_epikv_accounting(lm, sequence, prompt: list[int], k: int, window: int, steps: int) -> None:
    """EpiKV's accounting, read from one problem's keep log: after every round that evicts it (one per step once
    past prompt + w + K) each head holds the whole prompt, the w newest tokens and exactly K other tokens; a round
    that evicts only another problem of the batch leaves it whole."""
    assert sequence.recency == window and sequence.protected == len(prompt)
    assert sequence.budget == k + len(prompt) + window
    log = sequence.keep_log
    evicting = 0
    for index in range(len(log["round_step"])):
        produced = int(log["round_next_pos"][index])
        if produced <= sequence.budget:
            assert set(kept_positions(log, index, 0, 0).tolist()) == set(range(produced))
            continue
        evicting += 1
        recent = set(range(produced - window, produced))
        for layer in range(lm.config.num_hidden_layers):
            for head in range(lm.config.num_key_value_heads):
                kept = set(kept_positions(log, index, layer, head).tolist())
                assert set(range(len(prompt))) <= kept and recent <= kept
                assert len(kept - set(range(len(prompt))) - recent) == k
    assert evicting == sequence.rounds == len(prompt) + steps - 1 - sequence.budget
    assert max(sequence.cache_sizes) == sequence.budget + 1  # the step's new token on top, never more


def test_epikv_protocol_keeps_prompt_recency_and_k_scored_tokens(tiny_llama):
    """An integer K: recency min(128, K/4) = 4 of K = 16."""
    protocol = resolve_protocol("epikv", {"budget": 16, "keep_log": True})
    engine = EvictionEngine(tiny_llama, "kv_key", protocol.config)  # prefill-protecting, as EpiKV App. 9 runs it
    prompt = list(range(20, 30))
    sequence = engine.generate([prompt], 30, ignore_eos=True).sequences[0]
    check_epikv_accounting(tiny_llama, sequence, prompt, 16, 4, 30)


def test_epikv_protocol_gives_each_problem_of_a_batch_its_own_recency_and_budget(tiny_llama):
    """A fractional budget resolves to a K per problem; with --protocol epikv each problem of one batch (left-padded
    together) gets its own min(128, K/4) window and K."""
    protocol = resolve_protocol("epikv", {"keep_log": True})
    prompts = [list(range(20, 30)), list(range(40, 56))]
    budgets = [Budget(0.5, FRACTION).resolve(length) for length in (32, 48)]  # dense lengths 32, 48: K = 16, 24
    engine = EvictionEngine(tiny_llama, "kv_key", protocol.config)
    sequences = engine.generate(prompts, 60, budgets=budgets, ignore_eos=True).sequences
    for prompt, k, window, sequence in zip(prompts, budgets, (4, 6), sequences):
        check_epikv_accounting(tiny_llama, sequence, prompt, k, window, 60)


@pytest.mark.realmodel
def test_r_kv_keeps_neither_a_pure_redundancy_nor_a_pure_attention_ranking(smollm2):
    """On a real trace both normalised terms move R-KV's keep sets (the unnormalised mix was key diversity alone)."""
    text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
            "clips did Natalia sell altogether in April and May? First, in April she sold 48 clips. In May she sold "
            "half of that, which is 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips in April and May.")
    prompt = smollm2.tokenizer(text)["input_ids"]
    config = EvictionConfig(budget=len(prompt) // 2, buffer=8, block=len(prompt), keep_log=True)
    logs = {}
    for lam in (0.0, 0.1, 1.0):  # redundancy only, the authors' mix, attention only: one round at the prefill end
        engine = EvictionEngine(smollm2, get_policy("r_kv", lam=lam), config)
        logs[lam] = engine.generate([prompt], 1, ignore_eos=True).sequences[0].keep_log
    layers, heads = smollm2.config.num_hidden_layers, smollm2.config.num_key_value_heads

    def same_share(a: float, b: float) -> float:
        kept = [(set(kept_positions(logs[a], 0, layer, head)), set(kept_positions(logs[b], 0, layer, head)))
                for layer in range(layers) for head in range(heads)]
        return sum(x == y for x, y in kept) / len(kept)

    assert same_share(0.1, 0.0) < 0.5 and same_share(0.1, 1.0) < 0.5
