"""Plain generation (tasks/generation.py): the token-picking rule on hand-made logits, greedy equals an argmax loop,
stop tokens, seeded temperature and nucleus sampling, timings."""

from __future__ import annotations

import copy

import pytest
import torch

from tasks.generation import GenerationResult, generate, nucleus_mask, pick_tokens, stop_token_ids


def _logits(*rows):
    """Logits whose softmax at temperature 1 is exactly each row of probabilities."""
    return torch.tensor(rows, dtype=torch.float64).log()


def _support(logits, temperature, top_p, draws=4000, seed=0):
    """Which tokens `pick_tokens` drew in `draws` rounds, per row, and how often."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.stack([pick_tokens(logits, temperature, top_p, generator) for _ in range(draws)])
    return [torch.bincount(picks[:, row], minlength=logits.shape[1]) for row in range(logits.shape[0])]


@pytest.mark.parametrize(
    "probs, top_p, nucleus",
    [
        ([0.5, 0.2, 0.15, 0.1, 0.05], 0.45, {0}),  # the most probable token alone reaches it
        ([0.5, 0.2, 0.15, 0.1, 0.05], 0.6, {0, 1}),  # 0.5 < 0.6 <= 0.7
        ([0.5, 0.2, 0.15, 0.1, 0.05], 0.8, {0, 1, 2}),  # 0.7 < 0.8 <= 0.85
        ([0.05, 0.1, 0.15, 0.2, 0.5], 0.8, {4, 3, 2}),  # order in the vocabulary does not matter
        ([0.3, 0.2, 0.3, 0.2], 0.65, {0, 2, 1}),  # tie at the boundary: the lower token id joins
        ([0.2, 0.3, 0.2, 0.3], 0.65, {1, 3, 0}),
        ([0.25, 0.25, 0.25, 0.25], 0.3, {0, 1}),
        ([0.5, 0.2, 0.15, 0.1, 0.05], 1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_nucleus_is_the_smallest_most_probable_set_reaching_top_p(probs, top_p, nucleus):
    mask = nucleus_mask(torch.tensor([probs]), top_p)
    assert set(mask[0].nonzero().flatten().tolist()) == nucleus
    counts = _support(_logits(probs), 1.0, top_p)[0]
    assert set(counts.nonzero().flatten().tolist()) == nucleus  # drawn: every nucleus token and nothing else
    inside = torch.tensor(probs)[sorted(nucleus)]
    expected = inside / inside.sum()  # the nucleus renormalised
    assert counts[sorted(nucleus)].double() / counts.sum() == pytest.approx(expected.double(), abs=0.03)


def test_each_row_has_its_own_nucleus():
    mask = nucleus_mask(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.1, 0.2, 0.5]]), 0.6)
    assert mask.tolist() == [[True, True, False, False, False], [False, False, False, True, True]]


def test_temperature_zero_is_argmax_with_the_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 2.0, 4.0]])
    assert pick_tokens(logits).tolist() == [1, 0]
    assert pick_tokens(logits, 0.0, 0.5, torch.Generator().manual_seed(3)).tolist() == [1, 0]


def test_top_p_one_is_plain_temperature_sampling_with_the_same_generator():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    plain, nucleus = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(200):
        expected = torch.multinomial(torch.softmax(logits / 0.6, dim=-1), 1, generator=plain).squeeze(-1)
        assert torch.equal(pick_tokens(logits, 0.6, 1.0, nucleus), expected)


def test_temperature_sharpens_before_the_nucleus_is_cut():
    """At T = 0.5 the probabilities [0.5, 0.3, 0.2] become [25, 9, 4] / 38: 0.66 alone reaches top-p 0.6."""
    logits = _logits([0.5, 0.3, 0.2])
    assert set(_support(logits, 1.0, 0.6)[0].nonzero().flatten().tolist()) == {0, 1}
    assert set(_support(logits, 0.5, 0.6)[0].nonzero().flatten().tolist()) == {0}


def test_bad_sampling_settings_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        pick_tokens(torch.zeros(1, 4), -0.1)
    for top_p in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            pick_tokens(torch.zeros(1, 4), 1.0, top_p)


def _argmax_loop(model, prompt_ids, steps):
    """Independent greedy decode: full forward over the growing sequence each step (no cache)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_greedy_equals_argmax_loop_and_runs_to_length(tiny):
    prompt = [257, 259, 40, 41, 42, 258, 260]
    result = generate(tiny, prompt, 10)
    assert isinstance(result, GenerationResult)
    stops = set(stop_token_ids(tiny.tokenizer, tiny.model))
    expected = _argmax_loop(tiny.model, prompt, 10)
    if not stops.intersection(expected):
        assert result.generated_ids == expected and result.finish_reason == "length"
    else:  # the random model happened to emit a stop token: generation must end right there
        cut = next(i for i, t in enumerate(expected) if t in stops) + 1
        assert result.generated_ids == expected[:cut] and result.finish_reason == "eos"
    assert generate(tiny, prompt, 10).generated_ids == result.generated_ids
    assert result.prefill_s > 0 and result.decode_s >= 0
    assert result.tokens_per_s == pytest.approx((len(result.generated_ids) - 1) / result.decode_s)


def test_stops_at_a_stop_token_and_reports_eos(tiny_llama):
    """Make the model's own first greedy token an EOS: generation ends after it with finish_reason 'eos'."""
    prompt = [257, 259, 50, 51, 258, 260]
    first = _argmax_loop(tiny_llama.model, prompt, 1)[0]
    lm = copy.deepcopy(tiny_llama)
    lm.model.generation_config.eos_token_id = first
    result = generate(lm, prompt, 20)
    assert result.generated_ids == [first] and result.finish_reason == "eos"


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(tiny_llama):
    prompt = [257, 259, 60, 61, 258, 260]
    state = torch.random.get_rng_state()
    a = generate(tiny_llama, prompt, 24, temperature=1.0, seed=1)
    b = generate(tiny_llama, prompt, 24, temperature=1.0, seed=1)
    c = generate(tiny_llama, prompt, 24, temperature=1.0, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.generated_ids == b.generated_ids
    assert a.generated_ids != c.generated_ids
    assert a.generated_ids != generate(tiny_llama, prompt, 24).generated_ids  # sampling is not greedy


def test_nucleus_sampling_is_seeded_and_a_tiny_nucleus_is_greedy(tiny_llama):
    prompt = [257, 259, 60, 61, 258, 260]
    a = generate(tiny_llama, prompt, 24, temperature=1.0, top_p=0.9, seed=1)
    assert a.generated_ids == generate(tiny_llama, prompt, 24, temperature=1.0, top_p=0.9, seed=1).generated_ids
    # a nucleus smaller than any probability holds only the most probable token: greedy whatever the seed
    greedy = generate(tiny_llama, prompt, 24).generated_ids
    assert generate(tiny_llama, prompt, 24, temperature=1.0, top_p=1e-6, seed=5).generated_ids == greedy


def test_bad_arguments(tiny_llama):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_llama, [1, 2], 0)
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny_llama, [1, 2], 4, temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        generate(tiny_llama, [1, 2], 4, temperature=1.0, top_p=0.0)


def test_stop_tokens_include_chat_end_markers(tiny_llama):
    tok = tiny_llama.tokenizer
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|eos|>")]


@pytest.mark.realmodel
def test_smollm2_greedy_generation(smollm2):
    tok = smollm2.tokenizer
    stops = stop_token_ids(tok, smollm2.model)
    assert {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")} <= set(stops)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    result = generate(smollm2, prompt, 6)
    assert result.generated_ids == _argmax_loop(smollm2.model, prompt, len(result.generated_ids))
    assert result.text == tok.decode(result.generated_ids, skip_special_tokens=True)
    assert result.text.strip()


@pytest.mark.realmodel
def test_gemma3_stop_tokens(gemma3_270m):
    tok = gemma3_270m.tokenizer
    stops = stop_token_ids(tok, gemma3_270m.model)
    assert tok.eos_token_id in stops and tok.convert_tokens_to_ids("<end_of_turn>") in stops
