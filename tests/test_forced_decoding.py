"""`EvictionEngine.generate(forced=...)`: a scripted trace teacher-forced through the decode path, then generation.

Without eviction, forcing a trace after the prompt and then decoding greedily is decoding greedily from the prompt
and the trace together; under eviction, the forced tokens go through the same rounds as generated ones, so a budget
smaller than the trace evicts some of them and the peak cache stays at the budget's.
"""

from __future__ import annotations

import pytest

from core.errors import UsageError
from evictor.engine import EvictionEngine
from evictor.protocol import EvictionConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_forced_prefix_then_greedy_equals_greedy_after_prompt_and_prefix(tiny_llama):
    prompt, forced = list(range(5, 17)), [40, 41, 42, 43, 44, 45, 46, 47, 48]
    engine = EvictionEngine(tiny_llama, "full", EvictionConfig(budget=10_000))
    scripted = engine.generate([prompt], 6, forced=[forced], ignore_eos=True).sequences[0]
    plain = engine.generate([prompt + forced], 6, ignore_eos=True).sequences[0]
    assert scripted.generated_ids[:len(forced)] == forced
    assert scripted.generated_ids[len(forced):] == plain.generated_ids  # 6 tokens after the forced ones
    batch = engine.generate([prompt, prompt[:7]], 6, forced=[forced, forced[:3]], ignore_eos=True).sequences
    assert [len(s.generated_ids) for s in batch] == [len(forced) + 6, 3 + 6]


def test_forced_tokens_are_evicted_like_generated_ones(tiny_llama):
    prompt, forced = list(range(5, 13)), list(range(60, 100))
    engine = EvictionEngine(tiny_llama, "random", EvictionConfig(budget=16, buffer=4, protect="sinks"))
    sequence = engine.generate([prompt], 4, forced=[forced], ignore_eos=True).sequences[0]
    assert sequence.generated_ids[:len(forced)] == forced and len(sequence.generated_ids) == len(forced) + 4
    assert sequence.rounds > 0 and max(sequence.cache_sizes) <= 16 + 2 * 4 + 1
    with pytest.raises(UsageError, match="2 forced prefixes for 1 prompts"):
        engine.generate([prompt], 4, forced=[forced, forced])


def test_forced_blocks_feed_the_shared_prefix_per_forward_and_keep_the_tokens(tiny_llama):
    prompts, forced = [list(range(5, 17)), list(range(5, 12))], [list(range(40, 63)), list(range(70, 88))]
    full = EvictionEngine(tiny_llama, "full", EvictionConfig(budget=10_000))
    stepwise = full.generate(prompts, 5, forced=forced, ignore_eos=True).sequences
    blocked = full.generate(prompts, 5, forced=forced, forced_block=8, ignore_eos=True).sequences
    # without eviction a block forward is a prefill of the same tokens: the same greedy continuation
    assert [s.generated_ids for s in blocked] == [s.generated_ids for s in stepwise]
    assert [s.generated_ids[:len(f)] for s, f in zip(blocked, forced)] == forced
    evicting = EvictionEngine(tiny_llama, "random", EvictionConfig(budget=16, buffer=4, protect="sinks"))
    sequence = evicting.generate(prompts[:1], 4, forced=forced[:1], forced_block=8, ignore_eos=True).sequences[0]
    assert sequence.generated_ids[:len(forced[0])] == forced[0] and sequence.rounds > 0
    # a round after every block: at most a block above what step-by-step forcing holds (16 + 2 * 4 + 1)
    assert max(sequence.cache_sizes) <= 16 + 2 * 4 + 8
    with pytest.raises(UsageError, match="forced_block must be >= 1"):
        full.generate(prompts, 2, forced=forced, forced_block=0)
