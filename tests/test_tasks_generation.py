"""Plain generation (tasks/generation.py): greedy equals an argmax loop, stop tokens, seeded sampling, timings."""

from __future__ import annotations

import copy

import pytest
import torch

from tasks.generation import GenerationResult, generate, stop_token_ids


def _argmax_loop(model, prompt_ids, steps):
    """Independent greedy decode: full forward over the growing sequence each step (no cache)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


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


def test_bad_arguments(tiny_llama):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_llama, [1, 2], 0)
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny_llama, [1, 2], 4, temperature=-0.5)


def test_stop_tokens_include_chat_end_markers(tiny_llama):
    tok = tiny_llama.tokenizer
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|eos|>")]


@pytest.mark.realmodel
def test_smollm2_greedy_generation(smollm2):
    tok = smollm2.tokenizer
    stops = stop_token_ids(tok, smollm2.model)
    assert {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")} <= set(stops)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    result = generate(smollm2, prompt, 6)
    assert result.generated_ids == _argmax_loop(smollm2.model, prompt, len(result.generated_ids))
    assert result.text == tok.decode(result.generated_ids, skip_special_tokens=True)
    assert result.text.strip()


@pytest.mark.realmodel
def test_gemma3_stop_tokens(gemma3_270m):
    tok = gemma3_270m.tokenizer
    stops = stop_token_ids(tok, gemma3_270m.model)
    assert tok.eos_token_id in stops and tok.convert_tokens_to_ids("<end_of_turn>") in stops
