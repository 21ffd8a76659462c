"""Individual policies on hand-made inputs whose keep sets are derived in the comments, plus the listing CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from evictor.policies.__main__ import main as cli_main
from evictor.policy import ObserveInputs, ScoreInputs, get_policy, policy_names
from core.errors import UsageError
from probes.signals.kv import lag_normalised_variance

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


def attention_inputs(attn: torch.Tensor, **extra) -> ScoreInputs:
    n = attn.shape[-1]
    return inputs_for(torch.ones(1, 1, n, 2), attention=attn[None, None], **extra)


def test_h2o_tova_snapkv_on_a_hand_map():
    attn = torch.tensor([[0.6, 0.1, 0.1, 0.2], [0.1, 0.1, 0.7, 0.1], [0.1, 0.5, 0.1, 0.3]])
    # H2O: column sums .8 .7 .9 .6; TOVA: the last row's argmax
    assert torch.allclose(get_policy("h2o").score(attention_inputs(attn)).flatten(), torch.tensor([0.8, 0.7, 0.9, 0.6]))
    assert keep_set(get_policy("tova").score(attention_inputs(attn)), 1) == {1}
    # SnapKV with a window of 2 and no pooling: .2 .6 .8 .4
    snap = get_policy("snapkv", window=2, kernel=1).score(attention_inputs(attn))
    assert torch.allclose(snap.flatten(), torch.tensor([0.2, 0.6, 0.8, 0.4]))


def test_r_kv_penalises_restated_keys():
    # keys 0 and 1 point the same way, key 2 is orthogonal; uniform attention: redundancy alone decides
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]])[None, None]
    inputs = inputs_for(keys, attention=torch.full((1, 1, 1, 3), 1 / 3))
    scores = get_policy("r_kv").score(inputs).flatten()
    # c = [.5, .5, 0] -> .1 * 1/3 + .9 * (1 - c)
    assert torch.allclose(scores, 0.1 / 3 + 0.9 * torch.tensor([0.5, 0.5, 1.0]))


def test_vase_keeps_a_quarter_by_value_range():
    values = torch.zeros(1, 1, 8, 2)
    values[0, 0, 5] = torch.tensor([4.0, -4.0])  # range 8
    values[0, 0, 2] = torch.tensor([3.0, 0.0])  # range 3
    inputs = inputs_for(values, attention=torch.full((1, 1, 1, 8), 1 / 8), keep=8, generator=torch.Generator())
    scores = get_policy("vase").score(inputs)
    assert keep_set(scores, 2) == {5, 2}  # keep // 4 = 2 largest ranges, then sampling


def test_fastcaote_matches_eq_a11():
    attn = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    scores = get_policy("fastcaote").score(attention_inputs(attn, values=VECTORS, cache_values=VECTORS))
    distance = torch.tensor([0.125, math.sqrt(1 + 0.125**2), math.sqrt(4 + 0.125**2), math.sqrt(1 + 0.375**2)])
    alpha = attn.flatten()
    assert torch.allclose(scores.flatten(), alpha / (1 - alpha) * distance)


def test_raas_keeps_recently_refreshed_candidates():
    # 4 candidates at positions 0..3, queries at 10 and 11; uniform share 1/4: refresh above .25
    attn = torch.tensor([[0.5, 0.1, 0.1, 0.3], [0.1, 0.6, 0.2, 0.1]])
    inputs = attention_inputs(attn, query_positions=torch.tensor([[10, 11]]))
    assert get_policy("raas").score(inputs).flatten().tolist() == [10.0, 11.0, 2.0, 10.0]
    inputs.query_positions = None
    with pytest.raises(ValueError, match="query_positions"):
        get_policy("raas").score(inputs)


def test_longflow_contribution():
    attn = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    scores = get_policy("longflow").score(attention_inputs(attn, values=VECTORS))
    assert torch.allclose(scores.flatten(), torch.tensor([0.1, 0.0, 0.9, 0.2]))  # alpha * ||v||_1


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
    assert [row.split()[0] for row in rows] == policy_names() and len(rows) == 25
    assert header.split()[:6] == ["policy", "reads", "FA", "heads", "protect", "citation"]
    epikv = next(row for row in rows if row.startswith("epikv "))
    assert "hidden L10,21" in epikv and " yes " in epikv and " shared " in epikv


def test_cli_one_policy_and_unknown_name(capsys):
    assert cli_main(["--name", "h2o", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["fa_compatible"] is False and described["protection"] == "sinks"
    assert cli_main(["--name", "epikb"]) == 2
    captured = capsys.readouterr()
    assert "did you mean 'epikv'" in captured.err and not captured.out
