"""Every model family (`models.families`) through kvscope's evictor on its tiny model: with nothing evicted, decoding
is token-identical to transformers' `generate`; after per-head evictions, the logits equal a from-scratch forward
masked to each head's kept tokens; where a family's kernel does more than the plain softmax (soft caps, learned
sinks), the attention an attention policy reads equals the eager kernel's weights. The hooks of every family are
checked in tests/test_hooks.py and tests/test_interop.py. And what a family is: one record, which a test registers
here without touching any other file, while a family with no record is refused in one line naming the known ones.
"""

from __future__ import annotations

import pytest
import torch
from test_evictor_engine import (
    FORCED,
    TEXT,
    EagerWeights,
    LocalRandom,
    RecordAttention,
    _forced_run,
    _run_until_evicted,
    hf_greedy,
    ids_of,
)
from test_models_attention import using_kernel  # tests/ is on sys.path under pytest
from transformers import DynamicCache, OlmoConfig

from core.errors import UsageError
from evictor.engine import EvictionEngine
from evictor.protocol import EvictionConfig
from models.families import FAMILIES, Family, family_names, register_family
from models.hooks import all_hook_names, capture, hook_name, layer_specs
from models.lm import LoadedModel
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# past the tiny models' 16-token sliding windows, so sliding layers mask by position during the decode
LONG_TEXT = TEXT + " and more words to pass the sliding window of sixteen"


def _decodes_as_generate(lm: LoadedModel) -> None:
    """A budget no sequence reaches: the engine's tokens are `generate`'s, for a policy that reads keys and values
    only and for one that reads attention (its feed recomputes every query's attention at every forward)."""
    prompt = ids_of(lm, LONG_TEXT)
    expected = hf_greedy(lm, prompt, 16)
    for policy in ("random", "h2o"):
        result = EvictionEngine(lm, policy, EvictionConfig(budget=10_000, buffer=8, block=16)).generate([prompt], 16)
        assert result.sequences[0].generated_ids == expected, policy
        assert result.stats["decode_rounds"] == 0


def _evicted_logits_equal_a_masked_forward(lm: LoadedModel) -> None:
    """`lm` has one layer, so its keys and values depend only on (token, position): after rounds of per-head
    evictions, the engine's next logits equal a plain forward over the whole sequence at its original positions whose
    mask admits, for the last query, only the positions each head kept (and, in a sliding layer, still sees)."""
    prompt = ids_of(lm)
    engine = EvictionEngine(lm, LocalRandom(), EvictionConfig(budget=20, buffer=4, protect="sinks"))
    with torch.inference_mode():
        session, tokens = _run_until_evicted(engine, prompt, 30)
        store = session.cache.layers[0]
        kept = store.positions[0]  # [kv, S]
        logits = session.step(tokens[-1])
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
        reference = lm.model(input_ids=sequence, position_ids=torch.arange(length)[None], attention_mask=mask).logits
    assert len(set(map(tuple, kept.tolist()))) > 1  # per-head keep sets really differ
    assert (session.next_pos[0] - kept.shape[-1]) > 8  # and many tokens were evicted
    torch.testing.assert_close(logits[0], reference[0, -1], rtol=1e-5, atol=1e-5)


def test_no_eviction_decoding_equals_generate(family_lm):
    _decodes_as_generate(family_lm)


@pytest.mark.parametrize("family", family_names())
def test_per_head_eviction_equals_a_masked_forward_over_the_kept_tokens(family):
    # A one-layer model's one layer is its family's first kind: sliding for Mistral, Gemma2, Gemma3 and gpt-oss.
    _evicted_logits_equal_a_masked_forward(tiny_model(family, seed=1, num_hidden_layers=1))


@pytest.mark.parametrize("family", [family.name for family in FAMILIES.values() if family.softcap or family.sinks])
def test_attention_feed_equals_the_eager_weights_after_evictions(family):
    """Rounds in the block prefill and the decode evict per head; at every round the rows of the last 3 queries the
    feed hands an attention policy are the eager kernel's own weights (filed independently), so the soft cap or the
    sinks the kernel applies are in them."""
    lm = tiny_model(family, seed=1, attn_implementation="eager")
    prompt = ids_of(lm)
    n_layers, n_kv = lm.config.num_hidden_layers, lm.config.num_key_value_heads
    observer = EagerWeights(3, n_layers, n_kv, len(prompt) + len(FORCED) + 1)
    config = EvictionConfig(budget=20, buffer=4, block=8)
    session = _forced_run(lm, RecordAttention(3, observer.check), prompt, FORCED, config, observer)
    assert session.rounds[0] >= 5 and observer.checked == len(session.policy.records) > 0


# --- a family is one record -------------------------------------------------------------------------------------------
@pytest.fixture
def olmo():
    """OLMo (v1) registered as a throwaway family: a record naming its config class, everything else the defaults
    (Llama-style module paths); removed again after the test."""
    family = register_family(Family("olmo", OlmoConfig))
    yield family
    del FAMILIES[family.model_type]


def test_a_family_registered_as_one_record_runs_through_hooks_and_evictor(olmo):
    lm = tiny_model("olmo", seed=0)
    model = lm.model
    config = model.config
    ids = torch.randint(5, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture(model, all_hook_names(model)) as cap:
        model(ids, cache=DynamicCache(config=config), use_cache=True)
    with using_kernel(model, "eager"), torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    for layer in range(config.num_hidden_layers):
        assert cap[hook_name(layer, "attn.hook_k")].shape == (1, config.num_key_value_heads, 12, config.head_dim)
        assert cap[hook_name(layer, "attn.hook_q")].shape == (1, config.num_attention_heads, 12, config.head_dim)
        # RoPE(hook_k), by the module's own rotation, is what the cache stored
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_rot_k")], cap[hook_name(layer, "attn.hook_cache_k")],
                                   rtol=0, atol=0)
        torch.testing.assert_close(cap[hook_name(layer, "attn.hook_pattern")], weights[layer], rtol=1e-5, atol=1e-6)
    assert [spec.window for spec in layer_specs(model)] == [None] * config.num_hidden_layers
    _decodes_as_generate(lm)
    _evicted_logits_equal_a_masked_forward(tiny_model("olmo", seed=1, num_hidden_layers=1))


def test_a_second_record_for_a_family_is_refused(olmo):
    with pytest.raises(UsageError, match="'olmo' .* already registered"):
        register_family(Family("olmo", OlmoConfig))
    with pytest.raises(UsageError, match="already registered"):
        register_family(Family("llama_again", OlmoConfig, tiny_name="llama"))


def test_a_family_without_a_record_is_one_line_naming_the_known_ones(tiny_llama):
    known, tiny_names = ", ".join(sorted(FAMILIES)), ", ".join(sorted(family_names()))
    with pytest.raises(UsageError) as unknown_tiny:
        tiny_model("falcon")
    assert str(unknown_tiny.value) == f"unknown tiny model family 'falcon'; valid choices: {tiny_names}"
    model = tiny_llama.model
    before = model.config.model_type
    model.config.model_type = "falcon"
    try:
        for refused in (lambda: capture(model, ["blocks.0.attn.hook_k"]).__enter__(), lambda: layer_specs(model),
                        lambda: EvictionEngine(tiny_llama, "h2o").generate([[1, 2, 3]], 2)):
            with pytest.raises(UsageError) as error:
                refused()
            assert str(error.value) == f"unknown model family 'falcon'; valid choices: {known}"
    finally:
        model.config.model_type = before
