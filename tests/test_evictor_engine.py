"""The eviction engine: protocol arithmetic and selection by hand, then tiny-model integration (exactness against
plain `generate`, RoPE/position correctness after evictions, per-policy invariants, block prefill, batching,
attention exact under every kernel, keep-logs) and fast SmolLM2 checks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_models_attention import using_kernel  # tests/ is on sys.path under pytest
from transformers import DynamicCache

from core.errors import UsageError
from evictor.attention import AttentionFeed
from evictor.cache import position_mask
from evictor.calibration import CalibratedPolicy
from evictor.engine import FROZEN, EvictionEngine, select_slots
from evictor.instrument import kept_positions
from evictor.policies import get_policy, policy_names
from evictor.protocol import EvictionConfig, plan_round, resolve_protocol, sequence_budgets
from models.attention import group_mean
from models.hooks import decoder_layers
from models.tiny import tiny_model
from scoring.policy import Needs, ObserveInputs, Policy, ScoreInputs
from tasks.generation import stop_token_ids

TEXT = "Let x = 7 and y = 5. Then x*y = ?"


# --- test-local policies (the contract, independent of evictor.policies) ---------------------------------------------
class LocalRandom(Policy):
    name = "local_random"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return torch.rand(inputs.positions.shape, generator=inputs.generator)


class LocalOldest(Policy):
    """Keeps the oldest candidates: a deterministic, position-only rule shared by every head."""

    name = "local_oldest"
    shared_across_heads = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return -inputs.positions.float()


class LocalKeyNormFrozen(Policy):
    """Frozen per-head key norms through `observe`, plus reads of candidate keys."""

    name = "local_keynorm_frozen"
    default_protection = "sinks"

    @property
    def needs(self) -> Needs:
        return Needs(keys=True, cache=True)

    def observe(self, inputs: ObserveInputs) -> torch.Tensor:
        return inputs.keys.float().norm(dim=-1)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        torch.testing.assert_close(inputs.frozen, inputs.keys.float().norm(dim=-1))
        return inputs.frozen


class LocalAttention(Policy):
    """TOVA-like: the newest query's attention."""

    name = "local_attention"
    default_protection = "none"

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=3)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention[..., -1, :]


LOCAL = {cls.name: cls for cls in (LocalRandom, LocalOldest, LocalKeyNormFrozen, LocalAttention)}
# Calibrated policies (ThinKV, TriAttention) need a per-model file: their own test modules run them in the engine.
REGISTERED = [name for name in policy_names() if not isinstance(get_policy(name), CalibratedPolicy)]
ALL = list(LOCAL) + REGISTERED
ATTENTION_POLICIES = [name for name in REGISTERED if get_policy(name).needs.attention]


def make_policy(name: str) -> Policy:
    return LOCAL[name]() if name in LOCAL else get_policy(name)


def ids_of(lm, text: str = TEXT) -> list[int]:
    return [lm.tokenizer.bos_token_id] + lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_greedy(lm, prompt: list[int], n: int) -> list[int]:
    stops = stop_token_ids(lm.tokenizer, lm.model)
    out = lm.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n,
        do_sample=False, eos_token_id=stops, pad_token_id=lm.tokenizer.pad_token_id,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_llama_eager():
    return tiny_model("llama", seed=0, attn_implementation="eager")


# --- protocol arithmetic, derived by hand ----------------------------------------------------------------------------
def test_plan_round_interval_and_step_by_hand():
    # 10 resident tokens, prompt of 2 protected, K = 5, r = 2: candidates are slots 2..7 (6 of them), K - 2 = 3 survive,
    # so 7 = K + r remain.
    common = dict(slots=10, n_valid=[10], next_pos=[10], limits=[2], budgets=[5], buffer=2, recency=[0])
    plan = plan_round(**common, trigger="interval", boundary=False)
    assert plan.triggered == (True,) and plan.n_keep == (7,) and plan.slots == 7
    assert (plan.cand_start[0], plan.cand_end[0], plan.keep_cand[0]) == (2, 8, 3)
    # interval fires only from K + 2r = 9 resident tokens; step fires from K + r + 1 = 8
    eight = dict(common, slots=8, n_valid=[8], next_pos=[8])
    assert plan_round(**eight, trigger="interval", boundary=False) is None
    assert plan_round(**eight, trigger="step", boundary=False).n_keep == (7,)
    # a recency window of 1 counts in K: the candidates shrink by one slot and one fewer survives
    plan = plan_round(**dict(common, recency=[1]), trigger="interval", boundary=False)
    assert (plan.cand_start[0], plan.cand_end[0], plan.keep_cand[0], plan.n_keep[0]) == (2, 7, 2, 7)


def test_plan_round_interval_period_apart_from_the_buffer_by_hand():
    # R-KV's staging buffer: K = 5, no unscored buffer, a round every 3 steps: fires from K + 0 + 3 = 8 tokens and
    # scores every unprotected token (2 protected: candidates are slots 2..7, K - 2 = 3 survive, 5 remain)
    common = dict(slots=8, n_valid=[8], next_pos=[8], limits=[2], budgets=[5], buffer=0, recency=[0])
    plan = plan_round(**common, trigger="interval", boundary=False, interval=3)
    assert plan.n_keep == (5,) and (plan.cand_start[0], plan.cand_end[0], plan.keep_cand[0]) == (2, 8, 3)
    assert plan_round(**dict(common, slots=7, n_valid=[7], next_pos=[7]), trigger="interval", boundary=False,
                      interval=3) is None
    config = EvictionConfig(buffer=0, interval=128)
    assert config.period == 128 and EvictionConfig(buffer=64).period == 64
    with pytest.raises(UsageError, match="interval must be >= 1"):
        EvictionConfig(interval=0)
    preset = resolve_protocol("r_kv").config
    assert (preset.trigger, preset.interval, preset.buffer, preset.recency) == ("interval", 128, 0, 0)


def test_plan_round_batch_with_padding_by_hand():
    # sequence 0 has 10 tokens, sequence 1 has 6 (4 padding slots on the left); only sequence 0 is over budget
    plan = plan_round(slots=10, n_valid=[10, 6], next_pos=[10, 6], limits=[2, 2], budgets=[5, 5], buffer=2,
                      recency=[0, 0], trigger="step", boundary=False)
    assert plan.triggered == (True, False)
    assert plan.n_keep == (7, 6) and plan.slots == 7
    assert plan.span == (2, 8)
    assert (plan.cand_start[1], plan.cand_end[1]) == (6, 8)  # padding 4 + 2 protected; 2 candidates before the buffer


def test_select_slots_by_hand():
    inf = float("inf")
    priority = torch.tensor([[[inf, 0.1, 0.9, 0.5, inf]], [[-inf, -inf, inf, 0.2, inf]]])
    index, valid = select_slots(priority, torch.tensor([4, 3]), 4)
    # sequence 0 keeps slots {0, 2, 3, 4}; sequence 1 keeps {2, 3, 4} right-aligned behind one padding slot
    assert index[0, 0].tolist() == [0, 2, 3, 4] and valid[0, 0].all()
    assert index[1, 0, 1:].tolist() == [2, 3, 4] and valid[1, 0].tolist() == [False, True, True, True]


def test_position_mask_by_hand():
    mask = position_mask(torch.tensor([[[0, 3, -1, 5]]]), torch.tensor([[5]]), window=3, n_rep=2, dtype=torch.float32)
    low = torch.finfo(torch.float32).min
    assert mask.shape == (1, 2, 1, 4)
    assert mask[0, 0, 0].tolist() == [low, 0.0, low, 0.0]  # 5 - 0 >= 3 out of window; -1 padding
    assert torch.equal(mask[0, 0], mask[0, 1])  # both query heads of the group


def test_kept_positions_by_hand():
    log = {"round": np.array([0, 0, 1]), "layer": np.array([0, 0, 0]), "head": np.array([0, 1, 0]),
           "position": np.array([1, 2, 3]), "round_next_pos": np.array([5, 7])}
    assert kept_positions(log, 0, 0, 0).tolist() == [0, 2, 3, 4]
    assert kept_positions(log, 1, 0, 0).tolist() == [0, 2, 4, 5, 6]
    assert kept_positions(log, 1, 0, 1).tolist() == [0, 1, 3, 4, 5, 6]


def test_long_prompts_and_bad_settings():
    config = EvictionConfig(budget=8)
    with pytest.raises(UsageError, match="10 protected tokens"):
        sequence_budgets([8], [10], "prompt", config)
    assert sequence_budgets([8], [10], "prompt", EvictionConfig(budget=8, on_long_prompt="expand")) == (
        [10], [10], [0])
    assert sequence_budgets([8], [10], "prompt", EvictionConfig(budget=8, on_long_prompt="sinks")) == ([8], [4], [0])
    trace_scope = EvictionConfig(budget=8, budget_scope="trace", recency=2)
    assert sequence_budgets([8], [10], "prompt", trace_scope) == ([20], [10], [2])
    for bad in (dict(budget=0), dict(budget=2.5), dict(budget=0.5), dict(buffer=0), dict(block=0),
                dict(trigger="often")):
        with pytest.raises(UsageError):
            EvictionConfig(**bad)


def test_per_sequence_recency_by_hand():
    # EpiKV: w_b = min(128, floor(K_b / 4)) from each sequence's own K; budget scope "trace" adds prompt + w_b to K_b.
    # K 100 -> w 25, K_b 100 + 10 + 25 = 135; K 1000 -> w 128 (capped), K_b 1000 + 10 + 128 = 1138.
    epikv = EvictionConfig(budget=None, recency=128, recency_share=0.25, budget_scope="trace")
    assert sequence_budgets([100, 1000], [10, 10], "prompt", epikv) == ([135, 1138], [10, 10], [25, 128])
    # without a share the window is the same fixed w for every sequence
    fixed = EvictionConfig(budget=None, recency=8)
    assert sequence_budgets([100, 1000], [10, 10], "prompt", fixed).recency == [8, 8]
    # plan_round takes one window per sequence: 20 resident, prompt 2, K 12, no buffer, windows 2 and 6.
    # Sequence 0: candidates 2..17 (16), keeps 12 - 2 - 2 = 8; sequence 1: candidates 2..13 (12), keeps 4.
    plan = plan_round(slots=20, n_valid=[20, 20], next_pos=[20, 20], limits=[2, 2], budgets=[12, 12], buffer=0,
                      recency=[2, 6], trigger="step", boundary=False)
    assert plan.cand_end == (18, 14) and plan.keep_cand == (8, 4) and plan.n_keep == (12, 12)
    with pytest.raises(UsageError, match="recency_share"):
        EvictionConfig(recency_share=1.5)


# --- exactness: K larger than the sequence == plain generate ----------------------------------------------------------
_REFERENCES: dict[str, tuple[list[int], list[int]]] = {}


@pytest.mark.parametrize("name", ALL)
def test_every_policy_with_a_large_budget_matches_generate(name, tiny):
    if tiny.name not in _REFERENCES:  # one plain-generate reference per tiny family
        prompt = ids_of(tiny, TEXT + " and more words to pass the sliding window of sixteen")
        _REFERENCES[tiny.name] = prompt, hf_greedy(tiny, prompt, 16)
    prompt, expected = _REFERENCES[tiny.name]
    config = EvictionConfig(budget=10_000, buffer=8, block=16)
    result = EvictionEngine(tiny, make_policy(name), config).generate([prompt], 16)
    assert result.sequences[0].generated_ids == expected
    assert result.stats["decode_rounds"] == 0


def test_attention_policies_on_the_eager_kernel_match_generate(tiny_llama_eager):
    prompt = ids_of(tiny_llama_eager)
    expected = hf_greedy(tiny_llama_eager, prompt, 20)
    for name in ["local_attention"] + ATTENTION_POLICIES:
        engine = EvictionEngine(tiny_llama_eager, make_policy(name), EvictionConfig(budget=10_000, buffer=4))
        assert engine.generate([prompt], 20).sequences[0].generated_ids == expected, name


# --- RoPE and masks after evictions -----------------------------------------------------------------------------------
def _run_until_evicted(engine, prompt, steps):
    """A session after `steps` greedy decode steps (at least one round done); returns (session, next token)."""
    session = engine.session([prompt], max_new_tokens=steps + 1)
    session.__enter__()
    logits = session.prefill()
    tokens = [logits.argmax(-1)]
    for _ in range(steps):
        logits = session.step(tokens[-1])
        tokens.append(logits.argmax(-1))
    assert session.rounds[0] >= 2
    return session, tokens


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_layer_logits_equal_a_from_scratch_forward_over_kept_tokens(family):
    """With one layer, K/V depend only on (token, position): a plain forward over the whole sequence at its original
    positions, with a per-head mask admitting only each head's kept positions, must give the engine's logits."""
    overrides = {"num_hidden_layers": 1}
    if family == "gemma3":
        overrides["layer_types"] = ["sliding_attention"]
    lm = tiny_model(family, seed=1, **overrides)
    prompt = ids_of(lm)
    engine = EvictionEngine(lm, LocalRandom(), EvictionConfig(budget=20, buffer=4, protect="sinks"))
    with torch.inference_mode():
        session, tokens = _run_until_evicted(engine, prompt, 30)
        store = session.cache.layers[0]
        kept = store.positions[0]  # [kv, S]
        token = tokens[-1]
        logits = session.step(token)
        session.__exit__(None, None, None)
        sequence = torch.tensor([prompt + [int(t) for t in tokens]])
        length = sequence.shape[1]
        query = length - 1
        heads = lm.config.num_attention_heads
        allowed = torch.zeros(1, heads, length, length, dtype=torch.bool)
        allowed[0, :, torch.arange(length), torch.arange(length)] = True  # every row attends at least itself
        group = heads // lm.config.num_key_value_heads
        for head in range(heads):
            visible = kept[head // group]
            visible = visible[visible >= 0].long()
            if store.sliding_window:
                visible = visible[query - visible < store.sliding_window]
            allowed[0, head, query, visible] = True
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        mask_arg = {"full_attention": mask, "sliding_attention": mask} if family == "gemma3" else mask
        reference = lm.model(input_ids=sequence, position_ids=torch.arange(length)[None],
                             attention_mask=mask_arg).logits
    assert len(set(map(tuple, kept.tolist()))) > 1  # per-head keep sets really differ
    torch.testing.assert_close(logits[0], reference[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_shared_keep_set_logits_equal_a_dynamic_cache_at_the_true_position(family):
    """Multi-layer: a plain DynamicCache filled with the engine's kept K/V and the next token at its true position_id
    gives the engine's logits (the new token's RoPE comes from its position, not from the cache length)."""
    lm = tiny_model(family, seed=2)
    prompt = ids_of(lm, TEXT + " plus a longer tail for windows")
    engine = EvictionEngine(lm, LocalRandom(), EvictionConfig(budget=24, buffer=4, protect="sinks", shared=True))
    with torch.inference_mode():
        session, tokens = _run_until_evicted(engine, prompt, 24)
        cache = DynamicCache(config=lm.config)
        position = session.next_pos[0]
        for index, store in enumerate(session.cache.layers):
            assert (store.positions == store.positions[:, :1]).all()  # shared: identical across heads
            if store.sliding_window:  # out-of-window slots are what the engine masks; drop them for HF
                inside = (position - store.positions[0, 0]) < store.sliding_window
                cache.update(store.keys[:, :, inside].clone(), store.values[:, :, inside].clone(), index)
            else:
                cache.update(store.keys.clone(), store.values.clone(), index)
        gaps = position - session.cache.slots
        logits = session.step(tokens[-1])
        session.__exit__(None, None, None)
        reference = lm.model(input_ids=tokens[-1].view(1, 1), position_ids=torch.tensor([[position]]), cache=cache,
                             use_cache=True).logits
    assert gaps > 0  # evictions happened, so cache length and position differ
    torch.testing.assert_close(logits[0], reference[0, -1], rtol=1e-5, atol=1e-5)


# --- invariants on every policy --------------------------------------------------------------------------------------
def _recording(policy: Policy, calls: list) -> Policy:
    base = type(policy)

    class Recorded(base):
        def score(self, inputs: ScoreInputs) -> torch.Tensor:
            # candidate tensors are views of the cache, which the round then compacts in place: copy what we check
            calls.append((inputs.layer, inputs.positions[inputs.candidate_mask].clone(), inputs.attention is None))
            return base.score(self, inputs)

    Recorded.__name__ = base.__name__
    recorded = copy.copy(policy)
    recorded.__class__ = Recorded
    return recorded


K, R = 40, 4


@pytest.fixture(scope="module")
def peaked_llama():
    """The tiny Llama with larger initial weights: its attention is far from uniform. Near-uniform attention (the
    default initialisation) ranks every head's keys alike for the exact attention policies -- by age for H2O's sums
    since entry, by recency for RaaS -- so per-head keep sets could not be told from shared ones."""
    return tiny_model("llama", seed=0, initializer_range=0.1)


@pytest.mark.parametrize("name", ALL)
def test_engine_invariants_for_every_policy(name, peaked_llama):
    calls: list[tuple[int, torch.Tensor, bool]] = []
    policy = _recording(make_policy(name), calls)
    engine = EvictionEngine(peaked_llama, policy, EvictionConfig(budget=K, buffer=R, block=8, recency=2))
    prompt = ids_of(peaked_llama)
    protect = engine.protect
    limit = {"prompt": len(prompt), "sinks": 4, "none": 0}[protect]
    differs = False
    with torch.inference_mode(), engine.session([prompt], max_new_tokens=70) as session:
        logits = session.prefill()
        for _ in range(70):
            rounds = session.rounds[0]
            calls.clear()
            logits = session.step(logits.argmax(-1))
            nxt = session.next_pos[0]
            for store in session.cache.layers:
                pos = store.positions[0]  # [kv, S]
                assert (pos >= 0).all() and (pos[:, 1:] > pos[:, :-1]).all()  # valid, sorted, distinct
                assert set(range(limit)) <= set(pos[0].tolist())  # protected never evicted
                assert set(range(nxt - R - 2, nxt)) <= set(pos[0].tolist())  # buffer and recency window kept
                same = (pos == pos[:1]).all()
                differs |= not bool(same)
                if engine.shared:
                    assert same
            if policy.scores_nothing:
                assert not calls and session.cache.slots == nxt and session.rounds[0] == 0
                continue
            if session.rounds[0] > rounds:
                assert session.cache.slots == K + R  # kept-set size per head
                assert sorted({layer for layer, _, _ in calls}) == list(range(peaked_llama.config.num_hidden_layers))
                for _, candidates, _ in calls:
                    assert candidates.numel() > 0
                    assert candidates.max() < nxt - R - 2  # the buffer and the window are never scored
                    assert candidates.min() >= limit  # protected tokens are never candidates
            else:
                assert not calls
        assert policy.scores_nothing or session.rounds[0] >= 3
        if engine.needs.fa_compatible:
            assert session.feed is None and all(no_attention for _, _, no_attention in calls)
        else:
            assert session.feed.requests > 0
    if not policy.scores_nothing and not engine.shared:
        assert differs, f"{name} is per-head but every head kept the same positions"


class LocalLayerShared(Policy):
    """Per-head key norms weighted by depth, one keep set per KV head for every layer (`shared_across_layers`)."""

    name = "local_layer_shared"
    default_protection = "sinks"
    shared_across_layers = True

    @property
    def needs(self) -> Needs:
        return Needs(keys=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.keys.float().norm(dim=-1) * (inputs.layer + 1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_keep_sets_shared_across_layers_are_the_top_of_the_layer_mean(family):
    """Every layer (sliding-window ones too) keeps the same positions per KV head, and at each round those are the
    top candidates of the mean over layers of the scores the round computed."""
    lm = tiny_model(family, seed=1)
    engine = EvictionEngine(lm, LocalLayerShared(), EvictionConfig(budget=24, buffer=4, block=8, keep_log=True))
    rounds: list[torch.Tensor] = []
    with torch.inference_mode(), engine.session([ids_of(lm)], max_new_tokens=41) as session:
        scorer = session.round_scores

        def recorded(span, candidate, keep):
            scores = scorer(span, candidate, keep)
            positions = session.cache.layers[0].positions[:, :, span[0]:span[1]]
            rounds.append((positions.clone(), candidate.expand_as(positions).clone(), torch.stack(scores).mean(0)))
            return scores

        session.round_scores = recorded
        logits = session.prefill()
        for _ in range(40):
            logits = session.step(logits.argmax(-1))
            layers = [store.positions for store in session.cache.layers]
            assert all(torch.equal(positions, layers[0]) for positions in layers)
        log = session.keep_log.for_sequence(0)
        assert len(rounds) >= 3 and not torch.equal(layers[0][0, 0], layers[0][0, 1])  # per KV head
    for index, (positions, candidate, mean) in enumerate(rounds):
        for head in range(positions.shape[1]):
            kept = torch.tensor(np.isin(positions[0, head].numpy(), kept_positions(log, index, 0, head)))
            real = candidate[0, head]
            assert mean[0, head][real & kept].min() >= mean[0, head][real & ~kept].max()


@pytest.mark.parametrize("name", [n for n in REGISTERED if get_policy(n).layer_independent])
def test_layer_independent_observe_once_equals_observing_every_layer(name, tiny_llama):
    """The engine's once-per-forward shortcut changes nothing: the same keep sets as observing every layer."""
    policy = make_policy(name)

    class EveryLayer(type(policy)):
        layer_independent = False

    every_layer = copy.copy(policy)
    every_layer.__class__ = EveryLayer
    config = EvictionConfig(budget=24, buffer=4, block=8, protect="sinks", keep_log=True, seed=3)
    logs = [EvictionEngine(tiny_llama, p, config).generate([ids_of(tiny_llama)], 40, ignore_eos=True)
            .sequences[0].keep_log for p in (policy, every_layer)]
    assert len(logs[0]["round_step"]) >= 2
    assert np.array_equal(logs[0]["position"], logs[1]["position"])


def test_fa_compatible_policies_never_request_attention_even_on_the_eager_kernel(tiny_llama_eager):
    for name in ["local_random", "local_keynorm_frozen"] + [n for n in REGISTERED if get_policy(n).needs.fa_compatible]:
        config = EvictionConfig(budget=30, buffer=4, protect="sinks")
        result = EvictionEngine(tiny_llama_eager, make_policy(name), config).generate(
            [ids_of(tiny_llama_eager)], 40, ignore_eos=True)
        assert result.stats["attention_requests"] == 0 and result.stats["query_window"] is None, name
        assert result.stats["attention_s"] == 0, name  # not even recomputed


# --- attention: exact under every kernel ---------------------------------------------------------------------------
REFRESH = 1.0  # RaaS's refresh threshold, in uniform shares, asked by `RecordAttention`


class RecordAttention(Policy):
    """Hands every round's `ScoreInputs` to `check` and keeps a copy of its attention and refresh timestamps; its
    per-head selection depends on positions only, so that runs on different kernels evict exactly the same slots."""

    name = "record_attention"
    default_protection = "sinks"

    def __init__(self, window: int, check=None) -> None:
        self.window = window
        self.check = check
        self.records: list[tuple[torch.Tensor, ...]] = []

    @property
    def needs(self) -> Needs:
        return Needs(attention=True, queries_window=self.window, refresh_threshold=REFRESH)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        if self.check is not None:
            self.check(inputs)
        self.records.append((inputs.positions.clone(), inputs.attention.clone(), inputs.query_positions.clone(),
                             inputs.refreshed.clone()))
        head = torch.arange(inputs.positions.shape[1])[None, :, None]
        return ((inputs.positions * (head + 3)) % 11).float()


class EagerWeights:
    """An independent account of what every query attended to: the eager kernel's own weights, read by a forward hook
    on each attention module (over exactly the slots resident at that forward), GQA-averaged and filed by absolute
    position -- the sum since entry of every position, every query's row, and RaaS's refresh timestamps (the newest
    query that gave a position more than `REFRESH` / the number of keys it saw)."""

    def __init__(self, window: int, n_layers: int, n_kv: int, length: int) -> None:
        self.window = window
        self.session = None  # set by `_forced_run`
        self.total = torch.zeros(n_layers, n_kv, length)
        self.stamp = torch.arange(length, dtype=torch.float32).expand(n_layers, n_kv, length).clone()
        self.row: dict[tuple[int, int], torch.Tensor] = {}  # (layer, query position) -> [kv, length]
        self.n_kv = n_kv
        self.checked = 0

    def hook(self, layer: int):
        def record(module, args, output):
            weights = group_mean(output[1].float(), self.n_kv)[0]  # [kv, Q, slots]
            store = self.session.cache.layers[layer]
            positions = store.positions[0].long()  # [kv, slots]
            for index, query in enumerate(self.session.pending[0].tolist()):
                row = torch.zeros_like(self.total[layer]).scatter_(1, positions.clamp_min(0), weights[:, index])
                self.total[layer] += row
                self.row[layer, query] = row
                if query < 0:
                    continue
                seen = (positions >= 0) & (positions <= query)
                if store.sliding_window:
                    seen &= query - positions < store.sliding_window
                refreshed = (row > REFRESH / seen.sum(-1, keepdim=True)) & (row > 0)
                self.stamp[layer] = torch.where(refreshed, torch.maximum(self.stamp[layer], torch.tensor(query)),
                                                self.stamp[layer])

        return record

    def check(self, inputs: ScoreInputs) -> None:
        positions = inputs.positions[0].long()  # [kv, candidates]
        real = inputs.candidate_mask[0]
        if self.window == 0:
            expected = self.total[inputs.layer].gather(1, positions)[:, None]  # [kv, 1, candidates]
        else:
            rows = [self.row[inputs.layer, query] for query in inputs.query_positions[0].tolist()]
            expected = torch.stack([row.gather(1, positions) for row in rows], dim=1)  # [kv, queries, candidates]
        got = inputs.attention[0]
        assert got.shape == expected.shape
        torch.testing.assert_close(got.masked_fill(~real[:, None], 0), expected.masked_fill(~real[:, None], 0),
                                   rtol=1e-5, atol=1e-6)
        stamps = self.stamp[inputs.layer].gather(1, positions)  # [kv, candidates]
        assert torch.equal(inputs.refreshed[0][real], stamps[real])
        self.checked += 1


def _forced_run(lm, policy, prompt, tokens, config, observer=None):
    """A session fed `tokens` one step at a time (the same tokens on every kernel); returns the session."""
    engine = EvictionEngine(lm, policy, config)
    with torch.inference_mode(), engine.session([prompt], max_new_tokens=len(tokens) + 1) as session:
        handles = []
        if observer is not None:
            observer.session = session
            handles = [block.self_attn.register_forward_hook(observer.hook(layer))
                       for layer, block in enumerate(decoder_layers(lm.model))]
        session.prefill()
        for token in tokens:
            session.step(torch.tensor([token]))
        for handle in handles:
            handle.remove()
    return session


FORCED = [int(t) for t in torch.randint(5, 200, (48,), generator=torch.Generator().manual_seed(5))]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_attention_feed_equals_the_eager_kernels_weights_after_evictions(family, window):
    """Rounds during the block prefill and the decode evict per head; at every round the feed must hand the policy
    exactly what the queries saw (the eager kernel's weights, filed independently): since entry, each slot's sum over
    every query since it entered; with a window, the rows of the last queries, 0 where a query never saw a slot. On
    SDPA the feed recomputes the same numbers. Tiny Gemma3 slides over 16 tokens, so later queries miss old slots."""
    eager = tiny_model(family, seed=1, attn_implementation="eager")
    prompt = ids_of(eager)
    config = EvictionConfig(budget=20, buffer=4, block=8)
    n_layers, n_kv = eager.config.num_hidden_layers, eager.config.num_key_value_heads
    observer = EagerWeights(window, n_layers, n_kv, len(prompt) + len(FORCED) + 1)
    session = _forced_run(eager, RecordAttention(window, observer.check), prompt, FORCED, config, observer)
    assert session.rounds[0] >= 5 and observer.checked == len(session.policy.records)
    assert session.cache.layers[0].positions[0].unique(dim=0).shape[0] > 1  # heads kept different slots
    on_sdpa = _forced_run(tiny_model(family, seed=1), RecordAttention(window), prompt, FORCED, config).policy.records
    assert len(on_sdpa) == len(session.policy.records)
    refreshed_any = False
    for (positions, attention, queries, refreshed), (sdpa_positions, sdpa_attention, sdpa_queries, sdpa_refreshed) \
            in zip(session.policy.records, on_sdpa):
        assert torch.equal(positions, sdpa_positions) and torch.equal(queries, sdpa_queries)
        torch.testing.assert_close(sdpa_attention, attention, rtol=1e-5, atol=1e-6)
        assert torch.equal(sdpa_refreshed, refreshed)
        refreshed_any |= bool((refreshed > positions).any())
    assert refreshed_any  # some token was refreshed after its entry, so the timestamps were really tested


@pytest.mark.parametrize("name", ATTENTION_POLICIES)
def test_eager_and_sdpa_keep_the_same_slots(name, peaked_llama):
    """Every attention-requiring policy, fed the same tokens, evicts the same (round, layer, head, position)s whether
    the model runs the eager kernel or SDPA."""
    eager = tiny_model("llama", seed=0, initializer_range=0.1, attn_implementation="eager")
    prompt = ids_of(peaked_llama, "Let x = 7")
    config = EvictionConfig(budget=24, buffer=4, block=8, keep_log=True, seed=3)
    # SnapKV keeps its observation window inside K: its default 32 tokens would not fit K = 24
    params = {"window": 8} if name == "snapkv" else {}
    logs = [_forced_run(lm, get_policy(name, **params), prompt, FORCED, config).keep_log.for_sequence(0)
            for lm in (eager, peaked_llama)]
    assert len(logs[0]["round_step"]) >= 3
    for field_name in ("round", "layer", "head", "position", "round_step"):
        assert np.array_equal(logs[0][field_name], logs[1][field_name]), field_name


def test_registered_attention_policies_and_their_query_windows(tiny_llama):
    assert {"h2o", "tova", "snapkv", "r_kv", "vase", "fastcaote", "raas", "longflow"} <= set(ATTENTION_POLICIES)
    # "every query since entry" is what SDPA gets too: no fallback to a window of recent queries
    for name in ("h2o", "raas"):
        assert EvictionEngine(tiny_llama, get_policy(name), EvictionConfig()).query_window == 0


# --- block prefill ---------------------------------------------------------------------------------------------------
def test_block_at_least_prompt_is_ordinary_prefill_and_small_blocks_bound_the_cache(tiny_llama):
    prompt = ids_of(tiny_llama, TEXT * 4)
    with torch.inference_mode():
        plain = tiny_llama.model(input_ids=torch.tensor([prompt]), cache=DynamicCache(config=tiny_llama.config),
                                 use_cache=True, logits_to_keep=1).logits[0, -1]  # generate's own prefill
        engine = EvictionEngine(tiny_llama, LocalRandom(), EvictionConfig(budget=10_000, block=len(prompt)))
        with engine.session([prompt]) as session:
            assert torch.equal(session.prefill()[0], plain)  # exactly, bit for bit
        engine = EvictionEngine(tiny_llama, LocalRandom(), EvictionConfig(budget=10_000, block=16))
        with engine.session([prompt]) as session:
            torch.testing.assert_close(session.prefill()[0], plain, rtol=1e-5, atol=1e-5)
        config = EvictionConfig(budget=32, buffer=4, block=16, protect="none")
        engine = EvictionEngine(tiny_llama, LocalRandom(), config)
        with engine.session([prompt]) as session:
            session.prefill()
            assert session.peak_slots <= 32 + 4 + 16
            assert session.cache.slots == 32 + 4 and session.rounds[0] >= len(prompt) // 16 - 2


# --- batching --------------------------------------------------------------------------------------------------------
def test_batched_left_padded_decoding_matches_single_sequences(tiny):
    prompts = [ids_of(tiny, TEXT), ids_of(tiny, "Short one"), ids_of(tiny, TEXT + " with a much longer tail here")]
    config = EvictionConfig(budget=10_000, buffer=4, block=8)
    single = [EvictionEngine(tiny, LocalRandom(), config).generate([p], 16).sequences[0].generated_ids for p in prompts]
    batched = EvictionEngine(tiny, LocalRandom(), config).generate(prompts, 16)
    assert [s.generated_ids for s in batched.sequences] == single


@pytest.mark.parametrize("name", ["epikv", "epikv_raw", "kv_key", "lag_kv"])
def test_frozen_scores_of_a_left_padded_sequence_equal_its_scores_alone(name, tiny_llama):
    short, long = ids_of(tiny_llama), ids_of(tiny_llama, TEXT * 3)
    engine = EvictionEngine(tiny_llama, get_policy(name), EvictionConfig(budget=10_000, block=16))

    decode = {id(short): [5, 7, 13], id(long): [9, 11, 3]}  # three forced decode steps per sequence

    def frozen_by_position(prompts: list[list[int]]) -> list[dict[int, float]]:
        tokens = torch.tensor([decode[id(prompt)] for prompt in prompts]).T  # [step, batch]
        with torch.inference_mode(), engine.session(prompts, max_new_tokens=3) as session:
            session.prefill()
            for step in tokens:
                session.step(step)
            store = session.cache.layers[1]
            return [{int(p): float(f) for p, f in zip(store.positions[b, 0], store.extra[FROZEN][b, 0]) if p >= 0}
                    for b in range(len(prompts))]

    batched = frozen_by_position([short, long])
    for alone, together in zip([frozen_by_position([short])[0], frozen_by_position([long])[0]], batched):
        assert alone.keys() == together.keys()
        assert np.allclose([alone[p] for p in alone], [together[p] for p in alone], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [0, 3])
def test_attention_of_a_left_padded_sequence_equals_its_attention_alone(window, tiny_llama):
    """Padding slots and padding queries of a batch neither receive nor give attention: per position, the feed's
    since-entry sums (and last query rows) and refresh timestamps of each sequence are what it accumulates alone."""
    short, long = ids_of(tiny_llama), ids_of(tiny_llama, TEXT * 3)
    engine = EvictionEngine(tiny_llama, RecordAttention(window), EvictionConfig(budget=10_000, block=16))
    decode = {id(short): [5, 7, 13, 17], id(long): [9, 11, 3, 4]}
    name = AttentionFeed.SUM if window == 0 else AttentionFeed.ROWS

    def attention_by_position(prompts: list[list[int]], name: str) -> list[dict[int, np.ndarray]]:
        tokens = torch.tensor([decode[id(prompt)] for prompt in prompts]).T  # [step, batch]
        with torch.inference_mode(), engine.session(prompts, max_new_tokens=4) as session:
            session.prefill()
            for step in tokens:
                session.step(step)
            store = session.cache.layers[2]
            values = store.slot_tensor(name)  # [b, kv, slots] or [b, kv, ring rows, slots]
            if name == AttentionFeed.ROWS:
                values = values[:, :, session.feed.ring.order()]  # oldest query first, as policies read them
            return [{int(p): values[b, :, ..., slot].numpy() for slot, p in enumerate(store.positions[b, 0]) if p >= 0}
                    for b in range(len(prompts))]

    for kind in (name, AttentionFeed.REFRESHED):
        batched = attention_by_position([short, long], kind)
        alone = [attention_by_position([short], kind)[0], attention_by_position([long], kind)[0]]
        for one, together in zip(alone, batched):
            assert one.keys() == together.keys()
            assert sum(value.sum() for value in one.values()) > 0
            for position, value in one.items():
                np.testing.assert_allclose(together[position], value, rtol=1e-5, atol=1e-6)


def test_batched_eviction_keeps_per_sequence_budgets(tiny_llama):
    prompts = [ids_of(tiny_llama, "Hi"), ids_of(tiny_llama, TEXT)]
    config = EvictionConfig(budget=24, buffer=4, trigger="step", protect="sinks")
    engine = EvictionEngine(tiny_llama, LocalRandom(), config)
    result = engine.generate(prompts, 40, budgets=[24, 30], ignore_eos=True)
    for seq, budget in zip(result.sequences, (24, 30)):
        assert max(seq.cache_sizes) == budget + 4 + 1  # step trigger: K + r, plus the token being attended
        assert seq.rounds > 0


def test_a_sequence_that_stops_early_counts_only_its_own_rounds_and_forwards(tiny_llama):
    """The batch decodes until its longest member is done; the short one rides along, evicted to keep the batch's
    tensors aligned, but its rounds and cache sizes are those of decoding it alone."""
    prompt = ids_of(tiny_llama, TEXT)
    config = EvictionConfig(budget=16, buffer=4, trigger="step", protect="sinks")
    engine = EvictionEngine(tiny_llama, LocalRandom(), config)
    # the same prompt twice; the second forces 30 tokens first, so it decodes 30 steps after the first stops
    short, long = engine.generate([prompt, prompt], 6, forced=[[], list(range(40, 70))], ignore_eos=True).sequences
    alone = engine.generate([prompt], 6, ignore_eos=True).sequences[0]
    assert len(short.generated_ids) == 6 and len(long.generated_ids) == 36
    assert short.rounds == alone.rounds > 0 and short.cache_sizes == alone.cache_sizes
    blocks = -(-len(prompt) // config.block)
    assert len(short.cache_sizes) == blocks + 5  # the prompt's blocks, then 5 steps: the 6th token is never fed
    assert len(long.cache_sizes) == blocks + 35 and long.rounds > short.rounds + 20  # a step round every token


# --- keep-logs, determinism, memory ----------------------------------------------------------------------------------
def test_keep_log_reconstructs_the_cache_and_runs_are_seeded(tiny_llama):
    prompt = ids_of(tiny_llama)
    config = EvictionConfig(budget=24, buffer=4, protect="sinks", keep_log=True, seed=3)
    engine = EvictionEngine(tiny_llama, LocalRandom(), config)
    with torch.inference_mode(), engine.session([prompt], max_new_tokens=40) as session:
        logits = session.prefill()
        for _ in range(40):
            logits = session.step(logits.argmax(-1))
        final = [store.positions[0].clone() for store in session.cache.layers]
        log = session.keep_log.for_sequence(0)
        rounds = len(log["round_step"])
    for layer, positions in enumerate(final):
        for head in range(positions.shape[0]):
            alive = kept_positions(log, rounds - 1, layer, head)
            tail = np.arange(log["round_next_pos"][-1], session.next_pos[0])  # appended after the last round
            assert positions[head].tolist() == np.concatenate([alive, tail]).tolist()
    first = engine.generate([prompt], 40, ignore_eos=True).sequences[0]
    again = engine.generate([prompt], 40, ignore_eos=True).sequences[0]
    other = engine.generate([prompt], 40, ignore_eos=True, seed=4).sequences[0]
    assert np.array_equal(first.keep_log["position"], again.keep_log["position"])
    assert not np.array_equal(first.keep_log["position"], other.keep_log["position"])


def test_storage_is_bounded_by_the_budget_not_the_length(tiny_llama):
    engine = EvictionEngine(tiny_llama, LocalRandom(), EvictionConfig(budget=16, buffer=4, block=8, protect="sinks"))
    result = engine.generate([ids_of(tiny_llama, TEXT * 3)], 200, ignore_eos=True)
    bytes_per_slot = 4 * 2 * 2 * 16 * 4 + 4 * 2 * 4  # layers x (K+V) x kv heads x d_head x fp32 + int32 positions
    assert result.stats["peak_slots"] <= 16 + 4 + 8
    assert result.stats["cache_allocated_peak_bytes"] <= bytes_per_slot * (16 + 2 * 4 + 8 + 1) * 2
    full = EvictionEngine(tiny_llama, get_policy("full"), EvictionConfig()).generate(
        [ids_of(tiny_llama, TEXT * 3)], 200, ignore_eos=True)
    assert full.stats["peak_slots"] > 4 * result.stats["peak_slots"]


def test_bad_setups_are_usage_errors(tiny_llama):
    class Deep(LocalRandom):
        @property
        def needs(self):
            return Needs(hidden_layers=(7,))

    with pytest.raises(UsageError, match="hidden layers"):
        EvictionEngine(tiny_llama, Deep())
    with pytest.raises(UsageError, match="exceed the budget"):
        EvictionEngine(tiny_llama, LocalRandom(), EvictionConfig(budget=4)).generate([ids_of(tiny_llama)], 4)
    with pytest.raises(UsageError, match="unknown policy"):
        EvictionEngine(tiny_llama, "randon")


# --- real model ------------------------------------------------------------------------------------------------------
@pytest.mark.realmodel
def test_smollm2_exact_with_large_budget_and_position_correct_after_eviction(smollm2):
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

    prompt = build_prompt_ids(smollm2.tokenizer, Problem("t", "What is 3 + 4?", "7", "gsm8k"))
    expected = hf_greedy(smollm2, prompt, 12)
    engine = EvictionEngine(smollm2, "random", EvictionConfig(budget=4096, buffer=8))
    assert engine.generate([prompt], 12).sequences[0].generated_ids == expected
    engine = EvictionEngine(smollm2, "random_shared", EvictionConfig(budget=len(prompt) + 6, buffer=4))
    with torch.inference_mode():
        session, tokens = _run_until_evicted(engine, prompt, 20)
        cache = DynamicCache(config=smollm2.config)
        for index, store in enumerate(session.cache.layers):
            cache.update(store.keys.clone(), store.values.clone(), index)
        position = session.next_pos[0]
        logits = session.step(tokens[-1])
        session.__exit__(None, None, None)
        reference = smollm2.model(input_ids=tokens[-1].view(1, 1), position_ids=torch.tensor([[position]]),
                                  cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits[0], reference[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["h2o", "raas", "tova"])
def test_smollm2_eager_and_sdpa_generate_the_same_tokens_while_evicting(smollm2, name):
    """fp32 on the CPU: the attention the policy reads is recomputed the same way under both kernels, so the kernels'
    rounding differences must not change a single kept slot or token."""
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

    problem = Problem("t", "What is 12 times 13? Think step by step.", "156", "gsm8k")
    prompt = build_prompt_ids(smollm2.tokenizer, problem)
    config = EvictionConfig(budget=len(prompt) + 8, buffer=8, keep_log=True)
    runs = {}
    for kernel in ("eager", "sdpa"):
        with using_kernel(smollm2.model, kernel):
            runs[kernel] = EvictionEngine(smollm2, name, config).generate([prompt], 48, ignore_eos=True).sequences[0]
    assert runs["eager"].rounds >= 3 and runs["sdpa"].rounds == runs["eager"].rounds
    assert runs["sdpa"].generated_ids == runs["eager"].generated_ids
    assert np.array_equal(runs["sdpa"].keep_log["position"], runs["eager"].keep_log["position"])


@pytest.mark.slow
@pytest.mark.realmodel
def test_gemma3_270m_exact_with_large_budget(gemma3_270m):
    prompt = ids_of(gemma3_270m, "Problem: What is 12 times 13?\n\nSolution:")
    expected = hf_greedy(gemma3_270m, prompt, 24)
    for name in ("random", "valuediff", "epikv", "snapkv"):
        engine = EvictionEngine(gemma3_270m, name, EvictionConfig(budget=4096, buffer=8))
        assert engine.generate([prompt], 24).sequences[0].generated_ids == expected, name


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_every_policy_exact_with_large_budget(smollm2):
    prompt = ids_of(smollm2, "The capital of France is")
    expected = hf_greedy(smollm2, prompt, 16)
    for name in REGISTERED:
        engine = EvictionEngine(smollm2, name, EvictionConfig(budget=4096, buffer=8))
        assert engine.generate([prompt], 16).sequences[0].generated_ids == expected, name
