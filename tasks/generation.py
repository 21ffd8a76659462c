"""Plain generation: a thin wrapper around HF `generate` with stop tokens, seeded sampling and prefill/decode timings.

Greedy by default; ``temperature > 0`` samples from the full softmax at that temperature (no top-k / top-p), seeded
by `seed` without disturbing the caller's global RNG. Generation stops at any of `stop_token_ids` (the tokenizer's
EOS, the model's generation-config EOS, and the chat end-of-turn tokens the vocabulary has) or after
`max_new_tokens`. The model's own generation config (which may carry sampling defaults) is not used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

# End-of-turn markers of common chat formats; used as stop tokens when they are single special tokens in the vocab.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "<|end|>", "<|eos|>", "</s>", "<eos>")


@dataclass
class GenerationResult:
    """`generated_ids` are the new tokens only, including the stop token when finish_reason is "eos"."""

    generated_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length"
    prefill_s: float  # prompt forward and first token
    decode_s: float  # every later token

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first per second of decode time (0 when there were none)."""
        later = len(self.generated_ids) - 1
        return later / self.decode_s if later > 0 and self.decode_s > 0 else 0.0


def stop_token_ids(tokenizer, model=None) -> list[int]:
    ids: set[int] = set()
    candidates = [tokenizer.eos_token_id]
    if model is not None and getattr(model, "generation_config", None) is not None:
        candidates.append(model.generation_config.eos_token_id)
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif candidate is not None:
            ids.update(int(c) for c in candidate)
    special = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    for token in CHAT_END_TOKENS:
        if token in special:
            ids.add(tokenizer.convert_tokens_to_ids(token))
    return sorted(ids)


class _FirstTokenClock(StoppingCriteria):
    """Never stops generation; records when the first new token exists (the end of prefill)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.first_token_at: float | None = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first_token_at is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_token_at = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(lm, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> GenerationResult:
    """Generate a continuation of `prompt_ids` with `lm` (a `models.loading.LoadedModel`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    model, tokenizer = lm.model, lm.tokenizer
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, model)
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if sampling else {}),
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0],
    )
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    clock = _FirstTokenClock(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        start = time.perf_counter()
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
    generated = output[0, input_ids.shape[1] :].tolist()
    finish = "eos" if generated and generated[-1] in stops else "length"
    first = clock.first_token_at if clock.first_token_at is not None else end
    return GenerationResult(
        generated_ids=generated,
        text=tokenizer.decode(generated, skip_special_tokens=True),
        finish_reason=finish,
        prefill_s=first - start,
        decode_s=end - first,
    )
