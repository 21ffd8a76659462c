"""The policy contract, checked for every registered policy on synthetic inputs built from its own `needs`."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from evictor.calibration import CalibratedPolicy
from evictor.policies import POLICIES, get_policy, policy_names
from scoring.policy import Needs, ObserveInputs, Policy, ScoreInputs
from signals import SIGNALS
from signals.attention import raas_timestamps

B, H, D, D_MODEL, T, PROMPT = 2, 3, 8, 16, 48, 32
FIRST, BUFFER = 4, 8  # candidates are positions FIRST .. T-BUFFER-1 (sinks before, the recent buffer after)
PADDING = 3  # sequence 1 has 3 padding candidate slots and 2 padding cache slots
DEPTH = 8
KEEP = 12


@dataclass
class Stream:
    keys: torch.Tensor  # [batch, kv_head, T, d_head], different per head
    values: torch.Tensor
    hidden: dict[int, torch.Tensor]  # layer -> [batch, T, d_model]


def make_stream(needs: Needs, seed: int = 0, dtype: torch.dtype = torch.float32) -> Stream:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, T, D, generator=gen)
    values = torch.randn(B, H, T, D, generator=gen) * torch.linspace(0.5, 2.0, T)[:, None]
    hidden = {layer: torch.randn(B, T, D_MODEL, generator=gen).cumsum(1).to(dtype) for layer in needs.hidden_layers}
    return Stream(keys.to(dtype), values.to(dtype), hidden)


def observe_all(policy: Policy, stream: Stream, state: dict) -> torch.Tensor | None:
    """Feed the prompt as one block, then one token per decode step, as the engine does; scores per position."""
    needs = policy.needs
    blocks = [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, T)]
    outputs = []
    for start, stop in blocks:
        inputs = ObserveInputs(
            layer=0,
            positions=torch.arange(start, stop).expand(B, -1),
            keys=stream.keys[:, :, start:stop] if needs.keys else None,
            values=stream.values[:, :, start:stop] if needs.values else None,
            hidden={layer: h[:, start:stop] for layer, h in stream.hidden.items()},
            state=state,
        )
        out = policy.observe(inputs)
        if out is None:
            return None
        assert out.dim() == 3 and out.shape[0] == B and out.shape[1] in (1, H) and out.shape[2] == stop - start
        outputs.append(out)
    return torch.cat(outputs, dim=-1).expand(B, H, T)


def score_inputs(policy: Policy, stream: Stream, seed: int = 0) -> ScoreInputs:
    needs = policy.needs
    state: dict = {}
    frozen_all = observe_all(policy, stream, state)
    positions = torch.arange(FIRST, T - BUFFER).expand(B, H, -1).clone()  # [batch, kv_head, candidates]
    mask = torch.ones_like(positions, dtype=torch.bool)
    mask[1, :, -PADDING:] = False
    positions[1, :, -PADDING:] = 0
    cache_mask = torch.ones(B, H, T, dtype=torch.bool)
    cache_mask[1, :, -2:] = False

    def gather(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, positions[..., None].expand(-1, -1, -1, x.shape[-1]))

    attention = query_positions = refreshed = None
    if needs.attention:
        queries = needs.queries_window or T
        query_positions = torch.arange(T - queries, T).expand(B, -1)
        logits = torch.randn(B, H, queries, T, generator=torch.Generator().manual_seed(seed + 1))
        causal = torch.arange(T)[None, :] > query_positions[0][:, None]  # [queries, T]
        # A query before the first key (window longer than the stream) sees nothing: a zero row, as the engine gives.
        probs = logits.masked_fill(causal, float("-inf")).softmax(-1).nan_to_num(0.0).to(stream.keys.dtype)
        attention = probs.gather(3, positions[:, :, None, :].expand(-1, -1, queries, -1))
        if needs.refresh_threshold is not None:  # what the feed keeps: query p saw the p + 1 keys 0..p
            share = needs.refresh_threshold / (query_positions[:, None, :, None] + 1).clamp_min(1)
            stamps = raas_timestamps(probs, query_positions[:, None, :], torch.arange(T).expand(B, H, T), share)
            refreshed = stamps.gather(2, positions)
    return ScoreInputs(
        layer=0,
        step=T - PROMPT,
        positions=positions,
        candidate_mask=mask,
        keys=gather(stream.keys) if needs.keys else None,
        values=gather(stream.values) if needs.values else None,
        cache_keys=stream.keys if needs.cache and needs.keys else None,
        cache_values=stream.values if needs.cache and needs.values else None,
        cache_mask=cache_mask if needs.cache else None,
        cache_positions=torch.arange(T, dtype=positions.dtype).expand(B, H, T) if needs.cache else None,
        attention=attention,
        query_positions=query_positions,
        refreshed=refreshed,
        next_positions=torch.full((B,), T),
        frozen=None if frozen_all is None else frozen_all.gather(2, positions),
        state=state,
        keep=KEEP,
        generator=torch.Generator().manual_seed(seed),
    )


def synthetic_calibration(method: str, directory) -> str:
    """A calibration file sized to the synthetic stream (DEPTH layers, H KV heads of dimension D, two query heads per
    KV head), in the format `python -m evictor.calibrate` writes; the values only need to be well-formed."""
    gen = torch.Generator().manual_seed(7)
    record = {"kind": f"{method}_calibration", "version": 1, "model": "synthetic", "n_layers": DEPTH, "traces": [],
              "tokens": 0}
    if method == "triattention":
        q_mean = torch.randn(DEPTH, 2 * H, D // 2, 2, generator=gen)
        record.update({
            "n_heads": 2 * H, "n_kv_heads": H, "head_dim": D,
            "rope": {"omega": [[1.0 / 10_000 ** (2 * f / D) for f in range(D // 2)]] * DEPTH,
                     "scale": [[1.0] * (D // 2)] * DEPTH},
            "q_mean_real": q_mean[..., 0].tolist(), "q_mean_imag": q_mean[..., 1].tolist(),
            "q_abs_mean": (q_mean.norm(dim=-1) + 0.5).tolist(),
        })
    else:
        record.update({"tau": 128, "band_order": ["R", "E", "T"], "thresholds": [[0.4, 0.6]] * DEPTH})
    path = directory / f"{method}.json"
    path.write_text(json.dumps(record))
    return str(path)


CALIBRATIONS: dict[str, str] = {}  # policy -> its synthetic calibration file, written once per module


@pytest.fixture(scope="module", autouse=True)
def calibrations(tmp_path_factory):
    directory = tmp_path_factory.mktemp("calibrations")
    CALIBRATIONS.update({name: synthetic_calibration(cls.method, directory)
                         for name, cls in POLICIES.items() if issubclass(cls, CalibratedPolicy)})


def build(name: str) -> Policy:
    params = {"calibration": CALIBRATIONS[name]} if name in CALIBRATIONS else {}
    return get_policy(name, **params).for_depth(DEPTH)


def run(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Policy, ScoreInputs, torch.Tensor]:
    policy = build(name)
    inputs = score_inputs(policy, make_stream(policy.needs, dtype=dtype), seed)
    return policy, inputs, policy.score(inputs)


@pytest.mark.parametrize("name", policy_names())
def test_metadata(name):
    policy = get_policy(name)
    assert isinstance(policy, POLICIES[name]) and policy.name == name
    assert policy.citation, "every policy cites its paper and equation"
    assert policy.default_protection in ("prompt", "sinks", "none")
    assert policy.defined_for is None or (set(policy.defined_for) <= {"prompt", "sinks", "none"} and policy.defined_by)
    assert policy.kept_recent(256) >= 0
    assert policy.needs.queries_window >= 0
    assert policy.needs.cache <= (policy.needs.keys or policy.needs.values), "cache means need keys or values"
    json.dumps(policy.config())  # saved with every run's config
    assert policy.config()["name"] == name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", policy_names())
def test_score_shape_finite_and_deterministic(name, dtype):
    """Half-precision caches (bf16 on GPUs) are scored in float32."""
    policy, inputs, scores = run(name, dtype=dtype)
    assert scores.shape == (B, H, T - FIRST - BUFFER)
    assert scores.dtype in (torch.float32, torch.float64)
    assert torch.isfinite(scores[inputs.candidate_mask]).all()
    _, _, again = run(name, dtype=dtype)  # fresh state, a generator seeded the same way
    assert torch.equal(scores, again)


@pytest.mark.parametrize("name", policy_names())
def test_per_head_or_shared(name):
    policy, inputs, scores = run(name)
    if policy.scores_nothing:
        return
    real = inputs.candidate_mask[:, 0]
    same = [torch.equal(scores[:, 0][real], scores[:, h][real]) for h in range(1, H)]
    if policy.shared_across_heads:
        assert all(same), "a shared policy gives every KV head the same scores"
    else:
        assert not any(same), "a per-head policy scores heads with different K/V/attention differently"


@pytest.mark.parametrize("name", policy_names())
def test_fa_compatibility_is_exactly_not_reading_attention(name):
    policy = get_policy(name)
    if policy.needs.fa_compatible:
        assert policy.needs.attention is False
        _, inputs, _ = run(name)
        assert inputs.attention is None  # it scored without any attention map
    else:
        stream = make_stream(policy.needs)
        inputs = score_inputs(policy, stream)
        inputs.attention = inputs.refreshed = None  # everything the attention feed delivers
        with pytest.raises(ValueError, match=r"ScoreInputs\.(attention|refreshed)"):
            policy.score(inputs)


@pytest.mark.parametrize("name", [n for n in policy_names() if n not in ("full",)])
def test_scores_depend_on_what_the_policy_reads(name):
    """Changing the generator seed and the K/V/hidden/attention data changes the scores, unless the policy reads
    only positions (then nothing may change)."""
    policy = build(name)
    first = policy.score(score_inputs(policy, make_stream(policy.needs, seed=0), seed=0))
    second = policy.score(score_inputs(policy, make_stream(policy.needs, seed=5), seed=5))
    position_only = name in ("recency", "streaming_llm")
    assert torch.equal(first, second) == position_only


@pytest.mark.parametrize("name", [n for n in policy_names() if get_policy(n).signal])
def test_a_policys_signal_is_its_score_on_a_dense_trace(name):
    """A policy that declares a per-token signal scores, with nothing evicted, what the signal computes over the
    same forwards (prompt block, then one query per step) averaged over heads: the study computes only one of them."""
    policy = build(name)
    signal = SIGNALS[policy.signal]()
    groups = 2  # query heads per KV head
    logits = torch.randn(B, groups * H, T, T, generator=torch.Generator().manual_seed(3))
    probs = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    signal.add(probs[:, :, :PROMPT, :PROMPT])
    for t in range(PROMPT, T):
        signal.add(probs[:, :, t:t + 1, :t + 1])
    queries = policy.needs.queries_window or T
    positions = torch.arange(T).expand(B, H, T)
    inputs = ScoreInputs(layer=0, step=T - PROMPT, positions=positions,
                         candidate_mask=torch.ones(B, H, T, dtype=torch.bool),
                         attention=probs.view(B, H, groups, T, T).mean(2)[:, :, T - queries:],
                         query_positions=torch.arange(T - queries, T).expand(B, -1), next_positions=torch.full((B,), T))
    torch.testing.assert_close(policy.score(inputs).mean(1), signal.result(), rtol=1e-5, atol=1e-6)
