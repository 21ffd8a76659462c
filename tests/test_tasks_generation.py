"""Plain generation (tasks/generation.py): the token-picking rule on hand-made logits, greedy equals an argmax loop,
stop tokens, seeded temperature and nucleus sampling, timings; batched generation (continuous batching) reproduces
single-sequence decoding token for token."""

from __future__ import annotations

import copy

import pytest
import torch

import tasks.generation
from models.tiny import tiny_model
from tasks.generation import (
    GenerationResult,
    Request,
    generate,
    generate_batch,
    nucleus_mask,
    pick_tokens,
    stop_token_ids,
)


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


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    """`n` random prompts of different lengths (3 to 30 tokens) from the tiny vocabulary's ordinary ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 30, 3, 12, 21, 8][:n]
    return [torch.randint(40, 250, (length,), generator=generator).tolist() for length in lengths]


def _batched(lm, requests, batch_size, **kwargs) -> dict[int, GenerationResult]:
    results = dict(generate_batch(lm, requests, batch_size, **kwargs))
    assert sorted(results) == list(range(len(requests)))  # every request, each once
    return results


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])  # gemma3's sliding layers: one prompt at a time
def test_batched_greedy_equals_single_sequence_decoding(family):
    """7 prompts of different lengths and limits, 3 at a time, one of them ending early at a stop token: each row's
    tokens are exactly those of decoding it alone, and a finished row's place is refilled."""
    lm = copy.deepcopy(tiny_model(family, seed=0, initializer_range=0.1))  # larger weights: varied greedy tokens
    prompts = _prompts(7)
    alone = [generate(lm, p, 30).generated_ids for p in prompts]
    lm.model.generation_config.eos_token_id = alone[1][6]  # row 1 now stops at its 7th token (or earlier)
    requests = [Request(tuple(p), 12 + 3 * i) for i, p in enumerate(prompts)]
    single = [generate(lm, list(r.prompt_ids), r.max_new_tokens) for r in requests]
    batched = _batched(lm, requests, 3)
    assert [batched[i].generated_ids for i in range(7)] == [r.generated_ids for r in single]
    assert [batched[i].finish_reason for i in range(7)] == [r.finish_reason for r in single]
    assert single[1].finish_reason == "eos" and len(single[1].generated_ids) <= 7
    assert all(r.text == lm.tokenizer.decode(r.generated_ids, skip_special_tokens=True) for r in batched.values())


def test_batched_rows_come_back_as_they_finish(tiny_llama):
    requests = [Request(tuple(p), n) for p, n in zip(_prompts(4), [20, 3, 12, 1])]
    order = [index for index, _ in generate_batch(tiny_llama, requests, 4)]
    assert order == [3, 1, 2, 0]  # a one-token request finishes at its prefill, then by length
    batched = _batched(tiny_llama, requests, 4)
    assert [len(batched[i].generated_ids) for i in range(4)] == [20, 3, 12, 1]
    assert all(r.prefill_s > 0 and r.decode_s >= 0 for r in batched.values())


def test_batched_sampling_draws_what_each_sequence_draws_alone(tiny_llama):
    """Each row has its own generator: the same seeded draws as decoding it alone, whatever else shares the batch."""
    requests = [Request(tuple(p), 16, temperature=1.0, top_p=0.9, seed=i) for i, p in enumerate(_prompts(5))]
    single = [generate(tiny_llama, list(r.prompt_ids), 16, temperature=1.0, top_p=0.9, seed=r.seed).generated_ids
              for r in requests]
    batched = _batched(tiny_llama, requests, 2)
    assert [batched[i].generated_ids for i in range(5)] == single
    greedy = _batched(tiny_llama, [Request(r.prompt_ids, 16) for r in requests], 2)
    assert [greedy[i].generated_ids for i in range(5)] != single  # sampling is not greedy


def test_batched_decoding_stays_exact_when_compacting_every_step(monkeypatch):
    lm = tiny_model("llama", seed=0, initializer_range=0.1)
    monkeypatch.setattr(tasks.generation, "COMPACT_MIN_DEAD", 0)
    monkeypatch.setattr(tasks.generation, "COMPACT_DEAD_RATIO", 0.0)
    compactions = []
    compact = tasks.generation.compact_rows
    monkeypatch.setattr(tasks.generation, "compact_rows",
                        lambda cache, valid: compactions.append(1) or compact(cache, valid))
    # Slots beyond the longest live row appear when it leaves; these limits make the longest leave twice mid-run.
    limits = [6, 18, 10, 14, 8, 22, 12, 16]
    requests = [Request(tuple(p), n) for p, n in zip(_prompts(8), limits)]
    single = [generate(lm, list(r.prompt_ids), r.max_new_tokens).generated_ids for r in requests]
    batched = _batched(lm, requests, 3)
    assert [batched[i].generated_ids for i in range(8)] == single
    assert len(compactions) >= 2


def test_batched_stop_ids_override_the_models(tiny_llama):
    prompt = _prompts(1)[0]
    tokens = generate(tiny_llama, prompt, 10).generated_ids
    requests = [Request(tuple(prompt), 10), Request(tuple(_prompts(2)[1]), 10)]
    batched = _batched(tiny_llama, requests, 2, stop_ids=[tokens[3]])
    cut = tokens.index(tokens[3]) + 1
    assert batched[0].generated_ids == tokens[:cut] and batched[0].finish_reason == "eos"
    assert generate(tiny_llama, prompt, 10, stop_ids=[tokens[3]]).generated_ids == tokens[:cut]


def test_batched_bad_arguments(tiny_llama):
    with pytest.raises(ValueError, match="batch_size"):
        list(generate_batch(tiny_llama, [Request((1, 2), 4)], 0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(generate_batch(tiny_llama, [Request((1, 2), 0)], 2))
    with pytest.raises(ValueError, match="top_p"):
        list(generate_batch(tiny_llama, [Request((1, 2), 4, temperature=1.0, top_p=0.0)], 2))


@pytest.mark.realmodel
def test_smollm2_batched_gsm8k_prompts_equal_single_sequence(smollm2, data_dir):
    """Real chat prompts of six GSM8K problems, 4 at a time: the same greedy tokens as one at a time."""
    from tasks.datasets import load_problems
    from tasks.prompts import build_prompt_ids

    problems = load_problems("gsm8k", data_file=f"{data_dir}/gsm8k_test.jsonl", limit=6)
    requests = [Request(tuple(build_prompt_ids(smollm2.tokenizer, p)), 24) for p in problems]
    single = [generate(smollm2, list(r.prompt_ids), 24).generated_ids for r in requests]
    batched = _batched(smollm2, requests, 4)
    assert [batched[i].generated_ids for i in range(6)] == single


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
