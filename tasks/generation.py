"""Plain generation with stop tokens, seeded greedy / temperature / nucleus sampling, and prefill/decode timings.

`pick_tokens` is the one token-picking rule of kvscope: plain generation here and the eviction engine
(`evictor.engine`) both draw through it, so a dense trace and an evicted one sample the same way. Greedy by default;
``temperature > 0`` samples from the softmax at that temperature, restricted to the nucleus when ``top_p < 1``
(Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1; temperature first, then the nucleus,
as the Random Attention setting T = 0.6, top-p 0.95 is usually run). Draws come from a `torch.Generator` seeded by
`seed`, so the caller's global RNG is never touched.

Generation stops at any of `stop_token_ids` (the tokenizer's EOS, the model's generation-config EOS, and the chat
end-of-turn tokens the vocabulary has) or after `max_new_tokens`. The model's own generation config (which may carry
sampling defaults) is not used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

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


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[b, vocab]`` bool: per row, the smallest set of most probable tokens whose mass reaches `top_p`.

    Ties are broken by token id (a stable sort puts the lower id first), so the set never depends on the kernel.
    The most probable token is always in the set.
    """
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = torch.nn.functional.pad(ranked.cumsum(dim=-1)[..., :-1], (1, 0))
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)


def pick_tokens(
    logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each row of ``logits [b, vocab]`` -> ``[b]``.

    Temperature 0 is greedy (argmax; the lowest id among equal maxima). Otherwise one draw per row from
    ``softmax(logits / temperature)``, with every token outside the `nucleus_mask` given probability 0 when
    ``top_p < 1``; at ``top_p = 1`` the draw is exactly plain temperature sampling with the same `generator`.
    """
    check_sampling(temperature, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        probs = probs.masked_fill(~nucleus_mask(probs, top_p), 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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


@torch.no_grad()
def generate(
    lm, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
) -> GenerationResult:
    """Generate a continuation of `prompt_ids` with `lm` (a `models.loading.LoadedModel`): one prompt forward,
    then one forward per new token over a `DynamicCache`, each token chosen by `pick_tokens`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling(temperature, top_p)
    model, tokenizer = lm.model, lm.tokenizer
    device = next(model.parameters()).device
    stops = set(stop_token_ids(tokenizer, model))
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=model.config)
    generated: list[int] = []
    start = time.perf_counter()
    logits = model(
        input_ids=torch.tensor([prompt_ids], dtype=torch.long, device=device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits
    token = pick_tokens(logits[:, -1], temperature, top_p, generator)
    generated.append(int(token))  # int() waits for the device: the first token exists now
    first = time.perf_counter()
    while generated[-1] not in stops and len(generated) < max_new_tokens:
        logits = model(input_ids=token[:, None], cache=cache, use_cache=True, logits_to_keep=1).logits
        token = pick_tokens(logits[:, -1], temperature, top_p, generator)
        generated.append(int(token))
    end = time.perf_counter()
    return GenerationResult(
        generated_ids=generated,
        text=tokenizer.decode(generated, skip_special_tokens=True),
        finish_reason="eos" if generated[-1] in stops else "length",
        prefill_s=first - start,
        decode_s=end - first,
    )
