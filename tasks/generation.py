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

`generate_batch` decodes many prompts together with continuous batching: up to ``batch_size`` rows share each
decode forward, a finished row leaves the batch and the next prompt takes its place. Each prompt is prefilled alone
into its own cache and then joins the batch cache, whose rows have different lengths: rows are padded on the right,
``valid [rows, slots]`` marks each row's real slots, a 4D attention mask hides the rest and explicit position ids
keep each row's positions contiguous (`join_rows`; `compact_rows` gathers the real slots to the front when padding
outgrows them; the labeller's speculative engine shares both). Every row draws from its own generator seeded with its
own seed, one draw per token as in `generate`, so a batched run reproduces the single-sequence one: greedy tokens are
identical except where the top two logits are within the floating-point noise of a different summation order
(padded, batched forwards), and sampled tokens likewise. Sliding-window layers index their window by slot, not
position, so models with them decode one prompt at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from core.limits import Footprint
from models.footprint import ModelShape
from tasks.sampling import check_sampling

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
    lm,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
) -> GenerationResult:
    """Generate a continuation of `prompt_ids` with `lm` (a `models.lm.LoadedModel`): one prompt forward,
    then one forward per new token over a `DynamicCache`, each token chosen by `pick_tokens`, until a token of
    `stop_ids` (default `stop_token_ids`; kept) or `max_new_tokens`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling(temperature, top_p)
    model, tokenizer = lm.model, lm.tokenizer
    device = next(model.parameters()).device
    stops = set(stop_token_ids(tokenizer, model) if stop_ids is None else stop_ids)
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


@dataclass(frozen=True)
class Request:
    """One prompt to continue and how its tokens are drawn (`pick_tokens`'s settings and the seed of its generator)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def has_sliding_layers(cache: DynamicCache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in cache.layers)


def _pad_slots(t: torch.Tensor, slots: int) -> torch.Tensor:
    """``[batch, kv_head, own slots, d_head]`` zero-padded on the right to `slots`."""
    return torch.nn.functional.pad(t, (0, 0, 0, slots - t.shape[2]))


def join_rows(batch: DynamicCache | None, valid: torch.Tensor | None, caches: list[DynamicCache],
              valids: list[list[bool]]) -> tuple[DynamicCache, torch.Tensor]:
    """Append single-row caches (consumed) to the batch cache; every row is padded on the right to the longest, and
    ``valid [rows, slots]`` marks the real slots (the caller masks the rest)."""
    slots = max([len(v) for v in valids] + ([valid.shape[1]] if valid is not None else []))
    # transformers types a layer as possibly keyless (linear attention) or not yet filled; these are prefilled
    # attention layers
    device = caches[0].layers[0].keys.device  # type: ignore[union-attr]
    new_valid = torch.tensor([v + [False] * (slots - len(v)) for v in valids], dtype=torch.bool, device=device)
    parts = ([batch] if batch is not None else []) + caches
    joined = parts[0]
    for index, layer in enumerate(joined.layers):
        for name in ("keys", "values"):
            setattr(layer, name, torch.cat([_pad_slots(getattr(c.layers[index], name), slots) for c in parts], dim=0))
    if valid is not None:
        new_valid = torch.cat([torch.nn.functional.pad(valid, (0, slots - valid.shape[1])), new_valid], dim=0)
    return joined, new_valid


def compact_rows(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Gather each row's real slots, in order, to the front of the cache and drop the slots no row uses; returns the
    new ``valid``. Masked slots contribute nothing to attention, so this changes only the summation order."""
    counts = valid.sum(1)
    keep = int(counts.max())
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # real slots first
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [rows, kv_head, slots, d_head]
            setattr(layer, name, t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])))
    return torch.arange(keep, device=valid.device)[None, :] < counts[:, None]


# Compact the batch cache when its slots beyond the longest row's real ones exceed both this count and this ratio of
# the real ones: gathering costs a copy of the cache, attending over dead slots costs every later step.
COMPACT_MIN_DEAD, COMPACT_DEAD_RATIO = 64, 1.0


def generation_footprint(shape: ModelShape, prompt_lens: Sequence[int], max_new_tokens: int, batch_size: int, *,
                         queries: int = 1, prefix_tokens: int = 0) -> Footprint:
    """The peak memory of `generate_batch` over prompts of `prompt_lens` tokens, each continued by up to
    `max_new_tokens` (`models.footprint` says what each part counts).

    One row, or a model with sliding-window layers, decodes alone: its cache grows to its prompt plus its tokens.
    Rows decoding together share a ragged cache whose slots reach the longest row plus the dead slots compaction
    tolerates (`COMPACT_MIN_DEAD`, `COMPACT_DEAD_RATIO`), and a joining row's own prefill cache sits beside it.
    Either way a `torch.cat` or a gather copies one layer of the cache at a time. `queries` new tokens per row and
    step (the labeller's drafts, verified in one forward with logits at every one) and `prefix_tokens` of caches
    kept to copy rows from (the labeller's trace prefixes) describe the batched decoders built the same way."""
    prompt = max(prompt_lens)
    longest = prompt + max_new_tokens
    rows = min(batch_size, len(prompt_lens))
    if rows == 1 or any(window is not None for window in shape.windows):
        rows, slots, joining = 1, longest + queries, 0
    else:
        slots = longest + max(COMPACT_MIN_DEAD, math.ceil(COMPACT_DEAD_RATIO * longest)) + queries
        joining = prompt
    prefill = shape.kv_bytes(1, joining) + shape.forward_bytes(1, prompt, prompt)
    decode = shape.forward_bytes(rows, queries, slots, logits=queries)
    return shape.weights() + Footprint((
        ("KV cache", shape.kv_bytes(rows, slots) + shape.layer_kv_bytes(rows, slots)
         + shape.kv_bytes(1, prefix_tokens)),
        ("forward", max(prefill, decode)),
    ))


class _Row:
    def __init__(self, request: Request, device: torch.device):
        self.request = request
        self.generator = torch.Generator(device=device).manual_seed(request.seed)
        self.out: list[int] = []
        self.started = self.first = 0.0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        return pick_tokens(logits, self.request.temperature, self.request.top_p, self.generator)

    def result(self, tokenizer, stops: set[int]) -> GenerationResult:
        return GenerationResult(
            generated_ids=self.out,
            text=tokenizer.decode(self.out, skip_special_tokens=True),
            finish_reason="eos" if self.out[-1] in stops else "length",
            prefill_s=self.first - self.started,
            decode_s=time.perf_counter() - self.first,
        )


@torch.no_grad()
def generate_batch(lm, requests: Sequence[Request], batch_size: int,
                   stop_ids: Sequence[int] | None = None) -> Iterator[tuple[int, GenerationResult]]:
    """Continue every request with `lm` (a `models.lm.LoadedModel`), up to `batch_size` rows decoding together;
    yields ``(index into requests, result)`` as each finishes (not in request order).

    `stop_ids` defaults to `stop_token_ids`; the stop token is kept. A row's ``prefill_s`` is its own prompt forward
    and first token, its ``decode_s`` the wall time from then until it finished, while it shared the batch.
    ``batch_size`` 1, and models with sliding-window layers, decode each request alone with `generate`'s loop.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for request in requests:
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        check_sampling(request.temperature, request.top_p)
    model, tokenizer = lm.model, lm.tokenizer
    device = next(model.parameters()).device
    stops = set(stop_token_ids(tokenizer, model) if stop_ids is None else stop_ids)
    if batch_size == 1 or has_sliding_layers(DynamicCache(config=model.config)):
        for i, request in enumerate(requests):
            yield i, generate(lm, list(request.prompt_ids), request.max_new_tokens, temperature=request.temperature,
                                  top_p=request.top_p, seed=request.seed, stop_ids=sorted(stops))
        return
    rows = [_Row(request, device) for request in requests]
    waiting = iter(range(len(rows)))
    live: list[int] = []
    cache: DynamicCache | None = None
    valid: torch.Tensor | None = None  # [live, slots]: the slots each live row attends to
    blocked = torch.finfo(model.dtype).min

    def finished(row: _Row) -> bool:
        return row.out[-1] in stops or len(row.out) >= row.request.max_new_tokens

    while True:
        joining: list[tuple[int, DynamicCache]] = []
        done: list[int] = []
        while len(live) + len(joining) < batch_size and (index := next(waiting, None)) is not None:
            row = rows[index]
            row.started = time.perf_counter()
            own = DynamicCache(config=model.config)
            prompt = torch.tensor([row.request.prompt_ids], dtype=torch.long, device=device)
            logits = model(input_ids=prompt, cache=own, use_cache=True, logits_to_keep=1).logits
            row.out.append(int(row.pick(logits[:, -1])))
            row.first = time.perf_counter()
            if finished(row):
                done.append(index)
            else:
                joining.append((index, own))
        for index in done:
            yield index, rows[index].result(tokenizer, stops)
        if joining:
            cache, valid = join_rows(cache if live else None, valid if live else None, [c for _, c in joining],
                                     [[True] * len(rows[i].request.prompt_ids) for i, _ in joining])
            live += [index for index, _ in joining]
        if not live:
            return
        assert cache is not None and valid is not None  # set when the first rows joined
        longest = int(valid.sum(1).max())
        if valid.shape[1] - longest > max(COMPACT_MIN_DEAD, COMPACT_DEAD_RATIO * longest):
            valid = compact_rows(cache, valid)
        inputs = torch.tensor([[rows[index].out[-1]] for index in live], device=device)  # [live, 1]
        positions = valid.sum(1, keepdim=True)  # each row's next position: the count of its real slots
        allowed = torch.cat([valid, valid.new_ones(len(live), 1)], dim=1)[:, None, None, :]  # [live, 1, 1, slots + 1]
        mask = torch.zeros(allowed.shape, dtype=model.dtype, device=device).masked_fill(~allowed, blocked)
        logits = model(input_ids=inputs, position_ids=positions, attention_mask=mask, cache=cache,
                       use_cache=True).logits[:, -1]  # [live, vocab]
        if all(rows[index].request.temperature == 0 for index in live):
            tokens = pick_tokens(logits).tolist()
        else:
            tokens = [int(rows[index].pick(logits[i:i + 1])) for i, index in enumerate(live)]
        for index, token in zip(live, tokens):
            rows[index].out.append(token)
        valid = torch.cat([valid, valid.new_ones(len(live), 1)], dim=1)
        keep = [i for i, index in enumerate(live) if not finished(rows[index])]
        for i in sorted(set(range(len(live))) - set(keep)):
            yield live[i], rows[live[i]].result(tokenizer, stops)
        if len(keep) < len(live):
            live = [live[i] for i in keep]
            if keep:
                selected = torch.tensor(keep, device=device)
                cache.batch_select_indices(selected)
                valid = valid[selected]
