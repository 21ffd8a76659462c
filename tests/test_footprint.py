"""The memory estimate (`models.footprint`, and the estimates the stages compose from it) against hand-derived sizes
and against the peaks PyTorch's allocator measures (`models.memory.own_peak_bytes`).

The estimate is an upper bound of the tensors a request allocates: each measured peak lies at or below it, and above
``1 / FACTOR`` of it (docs/limits.md gives the table these bounds come from). Weights and the runtime allowance are
left out of the comparison on both sides: the weights are counted exactly (checked on their own), the runtime is not
a tensor.
"""

from __future__ import annotations

import pytest
import torch

from core.limits import Footprint
from evictor.engine import EvictionEngine, cache_capacity, eviction_footprint
from evictor.policies import get_policy
from evictor.protocol import EvictionConfig
from models.footprint import FP32, RUNTIME_BYTES, ModelShape, forward_footprint, model_shape
from models.memory import own_peak_bytes
from tasks.generation import COMPACT_MIN_DEAD, Request, generate_batch, generation_footprint

pytestmark = pytest.mark.usefixtures("one_thread")

# measured <= estimated <= FACTOR x measured, for every request below (docs/limits.md)
FACTOR = 2.5


def shape(**sizes) -> ModelShape:
    """A hand-made shape: 2 layers, hidden 8, MLP 16, 2 query / 1 KV head of 4, vocabulary 10, float32."""
    fields = dict(model="hand", layers=2, hidden=8, mlp=16, q_heads=2, kv_heads=1, head_dim=4, vocab=10,
                  windows=(None, None), weight_bytes=1000, itemsize=4)
    return ModelShape(**{**fields, **sizes})


# ---------------------------------------------------------------------------------------------------- by hand
def test_the_kv_cache_counts_keys_and_values_of_every_layer_and_a_sliding_layer_its_window():
    # per token and layer: keys and values of 1 head of 4 floats = 2 * 4 * 4 = 32 bytes
    assert shape().kv_bytes(rows=3, tokens=10) == 3 * 10 * 2 * 32
    assert shape(windows=(None, 4)).kv_bytes(rows=1, tokens=10) == (10 + 4) * 32
    assert shape().layer_kv_bytes(rows=1, tokens=10) == 10 * 32


def test_a_forward_counts_activations_the_mask_the_eager_maps_and_the_logits():
    s = shape()
    # per token: 2 * hidden + the wider phase, max(5 * 2 * 4 + 3 * 1 * 4 = 52, 4 * 16 = 64) floats
    assert s.token_bytes() == 4 * (16 + 64)
    plain = 2 * 3 * s.token_bytes() + 2 * 3 * 5 * 4 + 2 * 1 * 10 * (4 + FP32)
    assert s.forward_bytes(rows=2, queries=3, keys=5) == plain
    scores = 2 * 2 * 3 * 5  # rows x q_heads x queries x keys
    assert s.forward_bytes(rows=2, queries=3, keys=5, eager=True) == plain + scores * (4 + FP32)
    assert s.forward_bytes(rows=2, queries=3, keys=5, kept_maps=2) == plain + 2 * scores * 4


def test_the_weights_of_a_config_are_counted_exactly_without_loading(tiny_llama):
    loaded = sum(t.numel() * t.element_size() for t in (*tiny_llama.model.parameters(), *tiny_llama.model.buffers()))
    assert model_shape("tiny-llama").weight_bytes == loaded
    assert model_shape("tiny-llama", dtype="bfloat16").weight_bytes == loaded // 2


def test_a_mixture_of_experts_passes_a_token_through_the_experts_it_is_routed_to():
    routed = model_shape("tiny-qwen3_moe")
    assert routed.mlp == 2 * 32  # 2 experts per token, 32 wide each (models.families)


def test_one_row_holds_its_sequence_and_a_batch_the_dead_slots_compaction_allows():
    s = shape()
    alone = generation_footprint(s, [10], 6, batch_size=1)
    assert dict(alone.parts)["KV cache"] == s.kv_bytes(1, 17) + s.layer_kv_bytes(1, 17)  # prompt + tokens + query
    together = generation_footprint(s, [10, 10], 6, batch_size=4)
    slots = 16 + COMPACT_MIN_DEAD + 1
    assert dict(together.parts)["KV cache"] == s.kv_bytes(2, slots) + s.layer_kv_bytes(2, slots)
    assert generation_footprint(s, [10, 10], 6, batch_size=1).total == alone.total  # rows decode one at a time


def test_the_eviction_cache_holds_the_budget_not_the_sequence():
    config = EvictionConfig(budget=64, buffer=8, block=32, protect="sinks")
    assert cache_capacity(config, [64], width=500, steps=1000, never=False) == 64 + 8 + 8 + 32 + 1
    assert cache_capacity(config, [64], width=500, steps=1000, never=True) == 1500
    small = eviction_footprint(shape(), get_policy("random"), config, [500], 1000, 1)
    full = eviction_footprint(shape(), get_policy("full"), config, [500], 1000, 1)
    assert dict(small.parts)["KV cache"] < dict(full.parts)["KV cache"] / 10


def test_a_policy_reading_attention_adds_its_feed():
    config = EvictionConfig(budget=64, buffer=8, block=32, protect="sinks")
    plain = eviction_footprint(shape(), get_policy("random"), config, [500], 100, 1)
    attention = eviction_footprint(shape(), get_policy("h2o"), config, [500], 100, 1)
    assert attention.total > plain.total


# ---------------------------------------------------------------------------------------------------- measured
def _ratio(estimate: Footprint, measured: int, shape_: ModelShape) -> float:
    return (estimate.total - shape_.weight_bytes - RUNTIME_BYTES) / measured


def _generation(lm, name: str, prompt: int, new: int, batch: int) -> float:
    s = model_shape(name)
    g = torch.Generator().manual_seed(0)
    requests = [Request(tuple(torch.randint(10, 200, (prompt,), generator=g).tolist()), new) for _ in range(batch)]
    measured = own_peak_bytes(lambda: list(generate_batch(lm, requests, batch, stop_ids=[])))
    return _ratio(generation_footprint(s, [prompt] * batch, new, batch), measured, s)


def _eviction(lm, name: str, policy: str, prompt: int, new: int, batch: int, budget: int) -> float:
    s = model_shape(name)
    config = EvictionConfig(budget=budget, buffer=16, block=128, protect="sinks")
    engine = EvictionEngine(lm, policy, config)
    prompts = [torch.randint(10, 200, (prompt,), generator=torch.Generator().manual_seed(1)).tolist()] * batch
    measured = own_peak_bytes(lambda: engine.generate(prompts, new, ignore_eos=True))
    return _ratio(eviction_footprint(s, engine.policy, config, [prompt] * batch, new, batch), measured, s)


def _forward(lm, name: str, tokens: int) -> float:
    s = model_shape(name)
    ids = torch.randint(10, 200, (1, tokens), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        measured = own_peak_bytes(lambda: lm.model(input_ids=ids, use_cache=True, logits_to_keep=1))
    return _ratio(forward_footprint(s, 1, tokens), measured, s)


@pytest.mark.parametrize("request_", [("generation", 64, 32, 1), ("generation", 512, 64, 1),
                                      ("generation", 256, 64, 4), ("eviction", "random", 512, 32, 2, 128),
                                      ("eviction", "h2o", 512, 32, 2, 128), ("eviction", "full", 256, 32, 2, 64),
                                      ("forward", 1024)], ids=str)
def test_the_estimate_bounds_the_measured_peak_of_the_tiny_model(tiny_llama, request_):
    kind, *sizes = request_
    ratio = {"generation": _generation, "eviction": _eviction, "forward": _forward}[kind](tiny_llama, "tiny-llama",
                                                                                          *sizes)
    assert 1.0 <= ratio <= FACTOR, f"estimate / measured = {ratio:.2f}"


@pytest.mark.slow
@pytest.mark.parametrize("request_", [("generation", 256, 16, 1), ("generation", 128, 16, 4),
                                      ("eviction", "h2o", 384, 16, 2, 128), ("forward", 1024)], ids=str)
def test_the_estimate_bounds_the_measured_peak_of_smollm2(smollm2, request_):
    kind, *sizes = request_
    ratio = {"generation": _generation, "eviction": _eviction, "forward": _forward}[kind](smollm2, "smollm2-135m",
                                                                                          *sizes)
    assert 1.0 <= ratio <= FACTOR, f"estimate / measured = {ratio:.2f}"
