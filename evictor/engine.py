"""The decode-time eviction engine: batched greedy/sampled generation over an `EvictingCache`, driving a `Policy`.

One `Session` runs a batch of left-padded prompts: a chunked prefill in blocks of ``B`` (ValueDiff §2.2), then one
token per step, with every forward given the tokens' true absolute positions (``position_ids``) and an eviction
round (`evictor.protocol.plan_round`) after it. A round scores each layer's candidates with the policy and keeps,
per (sequence, layer, KV head), the protected tokens, the recency window, the buffer and the top-scoring candidates,
by a gather into the cache's preallocated storage. Budget semantics: `evictor.protocol`.

Masks. Full-attention layers use HF's own mask builder fed with a 2D validity mask (None when nothing is padded):
slots are right-aligned and appended in order, so HF's index-causal masks stay correct after any eviction.
Sliding-window layers get, once some query could be out of a window, a per-head mask built from slot positions
(`evictor.cache.position_mask`) swapped in by a forward pre-hook on their attention modules; and out-of-window
candidates are evicted first there. FlashAttention-2 cannot take per-head masks, so it is refused for models with
sliding-window layers.

Policy plumbing: `Needs.keys/values/cache` -> views of the cache; `Needs.hidden_layers` -> a scoped
`models.hooks.capture` of exactly those residual streams, passed to `policy.observe` after each forward, whose
scores are stored per slot and handed back as `ScoreInputs.frozen`; `Needs.attention` -> an `evictor.attention`
feed, which recomputes each new query's attention over the cache at every forward (exact under every kernel) and
keeps it per slot (and RaaS's refresh timestamps, `Needs.refresh_threshold`). Per-layer policy state lives in the
session; random policies draw from its seeded generator.

Scoring and selection are separate: `Session.round_scores` computes every layer's scores of a round's candidates
(the policy's output, averaged over heads for shared keep sets), which `evictor.replay` calls too; the round then
averages them over layers for `Policy.shared_across_layers`, ranks NaN last, evicts out-of-window slots of
sliding-window layers first, and selects.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.errors import UsageError
from core.limits import Footprint
from evictor.attention import AttentionFeed
from evictor.cache import EvictingCache, position_mask
from evictor.instrument import KeepLog, MemoryMeter, SpanTimer
from evictor.policies import get_policy
from evictor.protocol import EvictionConfig, RoundPlan, SequenceBudgets, plan_round, sequence_budgets
from models.attention import layer_kinds
from models.footprint import FP32, ModelShape
from models.hooks import capture, decoder_layers, hook_name
from models.kernels import require_flash
from models.lm import LoadedModel, attention_kernel
from scoring.policy import ObserveInputs, Policy, ScoreInputs
from tasks.generation import pick_tokens, stop_token_ids

FROZEN = "frozen"
_NEVER = 1 << 62  # the budget of a policy that never evicts


def select_slots(priority: torch.Tensor, n_keep: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices for compaction: per (sequence, head) the `n_keep[b]` highest-priority slots of
    ``priority [b, kv, S]``, in slot order and right-aligned into `slots` outputs; the left
    ``slots - n_keep[b]`` outputs are padding. Returns ``(index [b, kv, slots], valid [b, kv, slots])``."""
    top = priority.topk(slots, dim=-1).indices
    keep = torch.arange(slots, device=priority.device) < n_keep[:, None, None]
    key = torch.where(keep, top, -1).sort(dim=-1).values
    return key.clamp_min(0), key >= 0


@dataclass
class SequenceResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    finish_reason: str  # "eos" | "length"
    budget: int | None  # effective K of this sequence (None: the policy never evicts)
    protected: int  # positions below this were protected
    recency: int  # the recency window of this sequence
    rounds: int  # eviction rounds that removed tokens of this sequence while it was live (prefill blocks included)
    cache_sizes: list[int]  # resident tokens attended over at each of its live forwards (prefill blocks, then decode)
    keep_log: dict[str, np.ndarray] | None = None
    # why this sequence ran outside its policy's protocol (`Policy.outside_protocol`), None when inside
    outside_protocol: str | None = None


@dataclass
class BatchResult:
    sequences: list[SequenceResult]
    stats: dict[str, Any] = field(default_factory=dict)


class EvictionEngine:
    """A model, a policy and a protocol (`EvictionConfig`); `generate` runs batches, `session` steps manually."""

    def __init__(self, lm: LoadedModel, policy: Policy | str, config: EvictionConfig | None = None, **params: Any):
        self.lm = lm
        self.model = lm.model
        self.config = config or EvictionConfig()
        cfg = self.model.config
        self.n_layers = cfg.num_hidden_layers
        policy = get_policy(policy, **params) if isinstance(policy, str) else policy
        if hasattr(policy, "for_depth"):
            policy = policy.for_depth(self.n_layers)
        self.policy = policy
        self.needs = policy.needs
        bad = [layer for layer in self.needs.hidden_layers if not 0 <= layer < self.n_layers]
        if bad:
            raise UsageError(f"policy {policy.name!r} reads hidden layers {bad}, outside 0..{self.n_layers - 1}")
        self.protect = self.config.protect or policy.default_protection
        self.shared = bool(policy.shared_across_heads or self.config.shared)
        self.shared_layers = bool(policy.shared_across_layers)
        self.observes = observes(policy)
        self.kernel = attention_kernel(self.model)
        self.has_sliding = "sliding_attention" in layer_kinds(cfg)
        if self.kernel == "flash_attention_2" and self.has_sliding:
            raise UsageError("flash_attention_2 cannot take the per-head sliding-window masks eviction needs; use sdpa")
        self.query_window = query_window(policy, self.config)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.policy.config(),
            "protection": self.protect,
            "shared_keep_sets": self.shared,
            "kernel": self.kernel,
            "query_window": self.query_window,
            **self.config.to_dict(),
        }

    def sequence_budgets(self, budgets: Sequence[int], prompt_lens: Sequence[int],
                         names: Sequence[str] | None = None) -> SequenceBudgets:
        """`evictor.protocol.sequence_budgets` under this engine's protection and protocol, with the newest tokens
        the policy itself keeps (`Policy.kept_recent`) in each sequence's recency window."""
        return sequence_budgets(budgets, prompt_lens, self.protect, self.config, names, self.policy.kept_recent)

    def session(
        self,
        prompts: list[list[int]],
        budgets: list[int] | None = None,
        *,
        max_new_tokens: int = 0,
        seed: int | None = None,
    ) -> Session:
        return Session(self, prompts, budgets, max_new_tokens, self.config.seed if seed is None else seed)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        budgets: list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        ignore_eos: bool = False,
        seed: int | None = None,
        forced: list[list[int]] | None = None,
        forced_block: int = 1,
    ) -> BatchResult:
        """Generate up to `max_new_tokens` per prompt (greedy at temperature 0, else nucleus sampling at `top_p`);
        `budgets` overrides K per prompt.

        `forced[b]` (optional) are tokens sequence b emits first, whatever the model predicts: a scripted trace
        teacher-forced through the decode path, each token appended, observed, scored and evicted like a generated
        one; `max_new_tokens` then counts the tokens generated after them, and only those can stop it. With
        `forced_block` > 1 the forced tokens every sequence of the batch has are fed that many per forward, a round
        after each block (a chunked prefill under eviction: the cache may hold up to `forced_block` - 1 tokens more
        between rounds than step by step, the same for every policy), the rest one per step as before."""
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        forced = forced or [[] for _ in prompts]
        if len(forced) != len(prompts):
            raise UsageError(f"{len(forced)} forced prefixes for {len(prompts)} prompts")
        eos = set() if ignore_eos else _eos_ids(self.lm)
        if forced_block < 1:
            raise UsageError(f"forced_block must be >= 1, got {forced_block}")
        steps = max(map(len, forced)) + max_new_tokens
        shared = min(map(len, forced)) if forced_block > 1 else 0  # forced tokens fed in blocks
        with self.session(prompts, budgets, max_new_tokens=steps, seed=seed) as session:
            sampler = torch.Generator(device=session.device).manual_seed(session.seed + 1)
            with require_flash(self.model, "the eviction engine's prefill"):
                logits = session.prefill()
            generated: list[list[int]] = [[] for _ in prompts]
            stopped = [False] * len(prompts)  # at a stop token
            session.begin_decode()
            for start in range(0, shared, forced_block):
                block = [prefix[start : min(start + forced_block, shared)] for prefix in forced]
                with require_flash(self.model, "the eviction engine's forced blocks", when=start == 0):
                    logits = session.append(torch.tensor(block, dtype=torch.long))
                for seq, chunk in enumerate(block):
                    generated[seq].extend(chunk)
            for index in range(shared, steps):
                tokens = pick_tokens(logits, temperature, top_p, sampler)
                for seq, prefix in enumerate(forced):
                    if index < len(prefix):
                        tokens[seq] = prefix[index]
                for seq, token in enumerate(tokens.tolist()):
                    if session.live[seq]:
                        generated[seq].append(token)
                        free = len(generated[seq]) - len(forced[seq])
                        stopped[seq] = free > 0 and token in eos
                        if stopped[seq] or free >= max_new_tokens:  # max_new_tokens counts after the forced prefix
                            session.retire(seq)
                if not any(session.live) or index == steps - 1:
                    break
                with require_flash(self.model, "the eviction engine's decode", when=index == shared):
                    logits = session.step(tokens)
            session.end_decode()
            reasons = ["eos" if done else "length" for done in stopped]
            return session.result(generated, reasons)


def observes(policy: Policy) -> bool:
    """Whether `policy` freezes a score when a token is produced (`Policy.observe`)."""
    return type(policy).observe is not Policy.observe


def query_window(policy: Policy, config: EvictionConfig) -> int | None:
    """The queries `policy`'s attention covers (0: every query since each slot's entry); None when it reads none."""
    return (config.query_window or policy.needs.queries_window) if policy.needs.attention else None


def slot_tensors(policy: Policy, config: EvictionConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The per-slot tensors a session's cache carries beside keys and values for `policy`: its frozen scores and
    its attention feed's."""
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if observes(policy):
        tensors[FROZEN] = ((), torch.float32)
    if policy.needs.attention:
        tensors.update(AttentionFeed.slot_tensors(query_window(policy, config) or 0, policy.needs.refresh_threshold))
    return tensors


def cache_capacity(config: EvictionConfig, budgets: Sequence[int], width: int, steps: int, never: bool) -> int:
    """The slots a session's cache is allocated for: a policy that never evicts holds the longest prompt (`width`)
    and every step; one that evicts holds its largest effective K, the buffer, a round's period and a prefill block
    between rounds (never more than the sequence itself)."""
    block = width if never else config.block
    steady = width + steps if never else max(budgets) + config.buffer + config.period + block + 1
    return min(steady, width + max(steps, 1))


def eviction_footprint(shape: ModelShape, policy: Policy, config: EvictionConfig, prompt_lens: Sequence[int],
                       steps: int, batch_size: int, *, budget: int | None = None, eager: bool = False) -> Footprint:
    """The peak memory of `EvictionEngine.generate` over prompts of `prompt_lens` tokens in batches of
    `batch_size`, each for `steps` tokens (forced ones included), with `budget` the largest K a sequence is given
    (None: the config's; `models.footprint` says what each part counts).

    The cache holds, per layer and slot, keys, values, their position and the policy's slot tensors
    (`slot_tensors`), for `cache_capacity` slots; a round's gather copies one layer of it. The largest forward is a
    prefill block over the cache (the whole prompt for a policy that never evicts), plus what the policy reads
    there: the attention feed's logits, probabilities and group rows in fp32 (``[rows, q_heads, block, slots]``)
    and the residual streams it captures. `eager`: the model runs the eager kernel."""
    rows = min(batch_size, len(prompt_lens))
    width = max(prompt_lens)
    never = policy.scores_nothing
    budgets: Sequence[int] = []
    if not never:
        asked = budget if budget is not None else config.budget if config.budget is not None else width + steps
        protect = config.protect or policy.default_protection
        budgets = sequence_budgets([asked] * len(prompt_lens), prompt_lens, protect, config, None,
                                   policy.kept_recent).budgets
    capacity = cache_capacity(config, budgets, width, steps, never)
    extra = sum(math.prod(shape_) for shape_, _ in slot_tensors(policy, config).values())
    per_slot = shape.kv_heads * (2 * shape.head_dim * shape.itemsize + FP32 * (1 + extra))  # + int32 position
    layer = rows * capacity * per_slot
    queries = min(width, capacity if never else config.block)
    feed = 3 * rows * shape.q_heads * queries * capacity * FP32 if policy.needs.attention else 0
    hidden = len(policy.needs.hidden_layers) * rows * queries * shape.hidden * shape.itemsize
    return shape.weights() + Footprint((
        ("KV cache", shape.layers * layer + layer),
        ("forward", shape.forward_bytes(rows, queries, capacity, eager=eager) + feed + hidden),
    ))


def _eos_ids(lm: LoadedModel) -> set[int]:
    """The same stop tokens as plain generation (`tasks.generation`): EOS ids and single-token chat end markers."""
    return set(stop_token_ids(lm.tokenizer, lm.model))


class Session:
    """One batch in flight: cache, hooks, per-sequence counters, instrumentation. Use as a context manager."""

    def __init__(self, engine: EvictionEngine, prompts, budgets, max_new_tokens: int, seed: int):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UsageError("every prompt needs at least one token")
        self.engine = engine
        self.model = engine.model
        self.policy = engine.policy
        self.config = config = engine.config
        self.device = engine.lm.device
        self.seed = seed
        self.batch = batch = len(prompts)
        self.prompts = [list(map(int, p)) for p in prompts]
        self.prompt_lens = [len(p) for p in self.prompts]
        self.never = engine.policy.scores_nothing
        if self.never:
            self.budgets, self.limits, self.recency = SequenceBudgets([_NEVER] * batch, [0] * batch, [0] * batch)
        else:
            if budgets is None:
                if config.budget is None:
                    raise UsageError("this protocol has no budget of its own: give each prompt its K "
                                     "(a fraction resolves per prompt: evictor.protocol.Budget.resolve)")
                budgets = [config.budget] * batch
            if len(budgets) != batch:
                raise UsageError(f"{len(budgets)} budgets for {batch} prompts")
            self.budgets, self.limits, self.recency = engine.sequence_budgets(budgets, self.prompt_lens)
        # The protection each sequence really had: the long-prompt fallback gives a prompt-protecting one sinks.
        self.protections = ["sinks" if engine.protect == "prompt" and limit < n else engine.protect
                            for limit, n in zip(self.limits, self.prompt_lens)]
        width = max(self.prompt_lens)
        self.pad = [width - n for n in self.prompt_lens]
        self.block = width if self.never else config.block
        cfg = self.model.config
        self.n_kv = cfg.num_key_value_heads
        self.n_rep = cfg.num_attention_heads // self.n_kv
        capacity = cache_capacity(config, self.budgets, width, max_new_tokens, self.never)
        self.cache = EvictingCache(cfg, capacity, slot_tensors(self.policy, config))
        self.feed: AttentionFeed | None = None
        if engine.needs.attention:
            self.feed = AttentionFeed(self.model, self.cache, engine.query_window or 0, batch, self.device,
                                      engine.needs.refresh_threshold, engine.needs.attention_group)
        self.states: list[dict[str, Any]] = [{} for _ in range(engine.n_layers)]
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.n_valid = [0] * batch
        self.next_pos = [0] * batch
        self.step_index = 0
        self.phase = "prefill"
        self.rounds = [0] * batch
        # A batch decodes until its last sequence is done; a finished one still rides along (its rows are computed
        # and evicted to keep the batch's tensors aligned), but its rounds and cache sizes stop counting.
        self.live = [True] * batch
        self.cache_sizes: list[list[int]] = [[] for _ in range(batch)]
        self.peak_slots = 0
        self.peak_live_bytes = 0
        self.hidden: dict[int, torch.Tensor] = {}
        self.window_masks = False
        self.pending: torch.Tensor | None = None
        self.timer = SpanTimer(self.device)
        self.memory = MemoryMeter(self.device)
        self.keep_log = KeepLog(batch) if config.keep_log else None
        self.wall: dict[str, float] = {}
        self._stack = ExitStack()
        pad_id = engine.lm.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else (engine.lm.tokenizer.eos_token_id or 0)
        self.input_ids = torch.tensor(
            [[pad_id] * p + prompt for p, prompt in zip(self.pad, self.prompts)], dtype=torch.long, device=self.device
        )
        self.input_positions = torch.tensor(
            [[-1] * p + list(range(n)) for p, n in zip(self.pad, self.prompt_lens)],
            dtype=torch.int32,
            device=self.device,
        )

    # --- context ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> Session:
        stack = self._stack
        hidden = self.engine.needs.hidden_layers
        if hidden:
            names = {hook_name(layer, self.engine.needs.hidden_hook): layer for layer in hidden}
            stack.enter_context(
                capture(self.model, list(names), callback=lambda name, t: self.hidden.__setitem__(names[name], t))
            )
        if self.feed is not None:
            self.feed.install(stack)
        if self.engine.has_sliding:
            for index, block in enumerate(decoder_layers(self.model)):
                if self.cache.layers[index].is_sliding:
                    # nn.Module.__getattr__ types a submodule as Tensor | Module
                    handle = block.self_attn.register_forward_pre_hook(  # type: ignore[union-attr]
                        self._sliding_mask_hook(index), with_kwargs=True)
                    stack.callback(handle.remove)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _sliding_mask_hook(self, layer: int):
        def hook(module, args, kwargs):
            if not self.window_masks:
                return None
            store = self.cache.layers[layer]
            new = self.pending[:, None, :].expand(-1, self.n_kv, -1)
            keys = new if store.positions is None else torch.cat([store.positions, new], dim=2)
            dtype = kwargs["hidden_states"].dtype if "hidden_states" in kwargs else args[0].dtype
            kwargs["attention_mask"] = position_mask(keys, self.pending, store.sliding_window, self.n_rep, dtype)
            return args, kwargs

        return hook

    # --- forwards --------------------------------------------------------------------------------------------------
    def prefill(self) -> torch.Tensor:
        """Run the prompt in blocks (evicting at each boundary); returns the last position's logits ``[b, vocab]``."""
        start_time = self._now()
        width = self.input_ids.shape[1]
        logits = None
        for start in range(0, width, self.block):
            end = min(start + self.block, width)
            real = [max(0, end - max(start, pad)) for pad in self.pad]
            logits = self._forward(self.input_ids[:, start:end], self.input_positions[:, start:end], real)
            self._after_forward(boundary=True)
        self.wall["prefill_s"] = self._now() - start_time
        self.memory.sample()
        assert logits is not None  # every prompt has a token, so at least one block ran
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence ``[b]`` at its next position; returns the next logits ``[b, vocab]``."""
        return self.append(tokens.view(-1, 1))

    def teacher_force(self, tokens: Sequence[int], block: int = 1) -> None:
        """Append the known `tokens` of a one-sequence session at its next positions, `block` per forward: what
        `block` = 1 calls of `step` do, with the logits dropped. Observe, the attention feed (one row per query) and
        the step count see every token; a round can fire only after a block, so use a budget no round reaches."""
        if self.batch != 1:
            raise ValueError(f"teacher_force feeds one sequence, this session holds {self.batch}")
        for start in range(0, len(tokens), block):
            self.append(torch.tensor([[int(t) for t in tokens[start : start + block]]], dtype=torch.long))

    def append(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append `tokens` ``[b, n]`` (n known tokens per sequence) at their next positions in one forward, observed
        and fed to the attention one query row at a time as in a block-wise prefill; a round can fire only after
        the block. Returns the last position's logits ``[b, vocab]``."""
        n = tokens.shape[1]
        self.step_index += n
        start = torch.tensor(self.next_pos, dtype=torch.int32, device=self.device)[:, None]
        positions = start + torch.arange(n, dtype=torch.int32, device=self.device)[None, :]
        logits = self._forward(tokens.to(self.device), positions, [n] * self.batch)
        self._after_forward(boundary=False)
        return logits

    def retire(self, seq: int) -> None:
        """Sequence `seq` has its last token: later forwards and rounds no longer count as its own."""
        self.live[seq] = False

    def begin_decode(self) -> None:
        self.phase = "decode"
        self._decode_start = self._now()

    def end_decode(self) -> None:
        self.wall["decode_s"] = self._now() - self._decode_start

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, real: list[int]) -> torch.Tensor:
        n = ids.shape[1]
        slots = self.cache.slots
        self.pending = positions
        self.cache.begin_forward(positions)
        self.window_masks = self.engine.has_sliding and max(p + r for p, r in zip(self.next_pos, real)) - 1 >= (
            self.model.config.sliding_window or 0
        )
        self.hidden.clear()
        out = self.model(
            input_ids=ids,
            position_ids=positions.clamp_min(0).long(),
            attention_mask=self._padding_mask(slots, n, real),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for seq, count in enumerate(real):
            self.n_valid[seq] += count
            self.next_pos[seq] += count
            if self.live[seq]:
                self.cache_sizes[seq].append(self.n_valid[seq])
        if self.cache.slots > self.peak_slots:
            self.peak_slots = self.cache.slots
            self.peak_live_bytes = self.cache.nbytes(live=True)
        if self.feed is not None:
            self.feed.end_forward(positions)
        if self.engine.observes:
            with self.timer.span(f"{self.phase}.observe"):
                self._observe(slots, positions)
        return out.logits[:, -1]

    def _padding_mask(self, slots: int, n: int, real: list[int]) -> torch.Tensor | None:
        """2D validity mask ``[b, slots + n]`` for HF's mask builders, or None when nothing is padding."""
        if all(v == slots for v in self.n_valid) and all(r == n for r in real):
            return None
        cached = torch.arange(slots, device=self.device)[None, :] >= torch.tensor(
            [slots - v for v in self.n_valid], device=self.device
        )[:, None]
        assert self.pending is not None  # _forward sets it before building the mask
        return torch.cat([cached, self.pending >= 0], dim=1)

    def _observe(self, start: int, positions: torch.Tensor) -> None:
        needs = self.engine.needs
        scores = None
        for layer, store in enumerate(self.cache.layers):
            if layer == 0 or not self.policy.layer_independent:
                assert store.keys is not None and store.values is not None  # the forward just filled every layer
                scores = self.policy.observe(
                    ObserveInputs(
                        layer=layer,
                        positions=positions.long(),
                        keys=store.keys[:, :, start:] if needs.keys else None,
                        values=store.values[:, :, start:] if needs.values else None,
                        hidden=dict(self.hidden),
                        state=self.states[layer],
                    )
                )
            if scores is not None:
                frozen = store.extra[FROZEN]
                frozen[..., start : store.length] = scores.float().expand(self.batch, self.n_kv, store.length - start)

    # --- eviction --------------------------------------------------------------------------------------------------
    def _after_forward(self, boundary: bool) -> None:
        if self.never:
            return
        plan = plan_round(
            slots=self.cache.slots,
            n_valid=self.n_valid,
            next_pos=self.next_pos,
            limits=self.limits,
            budgets=self.budgets,
            buffer=self.config.buffer,
            recency=self.recency,
            trigger=self.config.trigger,
            boundary=boundary,
            interval=self.config.interval,
        )
        if plan is not None:
            self._evict(plan)

    def _evict(self, plan: RoundPlan) -> None:
        phase = self.phase
        slots = self.cache.slots
        lo, hi = plan.span
        table = torch.tensor(
            [self.n_valid, plan.cand_start, plan.cand_end, plan.triggered, plan.n_keep, self.next_pos],
            dtype=torch.long,
        ).to(self.device)
        n_valid, start, end, triggered, n_keep, next_pos = table
        column = torch.arange(slots, device=self.device)
        inf = torch.tensor(float("inf"), device=self.device)
        base = torch.where(column[None, :] >= (slots - n_valid)[:, None], inf, -inf)[:, None, :]  # [b, 1, S]
        span = column[lo:hi]
        candidate = ((span[None, :] >= start[:, None]) & (span[None, :] < end[:, None]) & triggered[:, None].bool())
        keep = max(k for k, t in zip(plan.keep_cand, plan.triggered) if t)
        if self.keep_log is not None:
            self.keep_log.begin_round(self.step_index, self.next_pos)
        with self.timer.span(f"{phase}.round"):
            with self.timer.span(f"{phase}.score"):
                scores = self.round_scores(plan.span, candidate[:, None, :], keep)
                if self.engine.shared_layers:
                    scores = [torch.stack(scores).mean(0)] * len(scores)
                picks = [self._select(layer, layer_scores, plan, base, candidate[:, None, :], n_keep, next_pos)
                         for layer, layer_scores in enumerate(scores)]
            with self.timer.span(f"{phase}.compact"):
                for store, (index, valid) in zip(self.cache.layers, picks):
                    if self.keep_log is not None:
                        assert store.positions is not None  # a round follows a forward, which filled every layer
                        self.keep_log.add(store.layer_idx, store.positions, index, valid)
                    store.compact(index, valid)
        self.n_valid = list(plan.n_keep)
        self.rounds = [r + int(t and live) for r, t, live in zip(self.rounds, plan.triggered, self.live)]
        self.memory.sample()

    def round_scores(self, span: tuple[int, int], candidate: torch.Tensor, keep: int) -> list[torch.Tensor]:
        """Every layer's scores ``[b, kv, hi - lo]`` of the slots ``span = (lo, hi)`` at a round now, `candidate`
        ``[b, 1 or kv, hi - lo]`` marking the real candidates and `keep` the survivors per (sequence, head): the
        policy's output in float32, averaged over heads for shared keep sets. Rounds and `evictor.replay` both score
        through here; layers are scored in order, so random policies draw the same numbers in both."""
        next_positions = torch.tensor(self.next_pos, dtype=torch.long, device=self.device)
        return [self._layer_scores(layer, span, candidate, keep, next_positions)
                for layer in range(len(self.cache.layers))]

    def _layer_scores(self, layer: int, span: tuple[int, int], candidate: torch.Tensor, keep: int,
                      next_positions: torch.Tensor) -> torch.Tensor:
        needs = self.engine.needs
        store = self.cache.layers[layer]
        lo, hi = span
        # a round (or a replay) follows a forward, which filled every layer
        assert store.positions is not None and store.keys is not None and store.values is not None
        positions = store.positions[:, :, lo:hi]
        shape = positions.shape
        attention = query_positions = refreshed = None
        if needs.attention:
            assert self.feed is not None  # the session makes a feed for every policy that needs attention
            attention, query_positions = self.feed.rows(layer, lo, hi)
            if needs.refresh_threshold is not None:
                refreshed = self.feed.refreshed(layer, lo, hi)
        else:
            assert self.feed is None, "an FA-compatible policy must never receive attention weights"
        inputs = ScoreInputs(
            layer=layer,
            step=self.step_index,
            positions=positions,
            candidate_mask=candidate.expand(shape),
            keys=store.keys[:, :, lo:hi] if needs.keys else None,
            values=store.values[:, :, lo:hi] if needs.values else None,
            cache_keys=store.keys if needs.cache and needs.keys else None,
            cache_values=store.values if needs.cache and needs.values else None,
            cache_mask=store.positions >= 0 if needs.cache else None,
            cache_positions=store.positions if needs.cache else None,
            attention=attention,
            query_positions=query_positions,
            refreshed=refreshed,
            next_positions=next_positions,
            frozen=store.slot_tensor(FROZEN)[:, :, lo:hi] if self.engine.observes else None,
            state=self.states[layer],
            keep=keep,
            generator=self.generator,
        )
        scores = self.policy.score(inputs).float().expand(shape)
        if self.engine.shared:
            scores = scores.mean(1, keepdim=True).expand(shape)
        return scores

    def _select(self, layer: int, scores: torch.Tensor, plan: RoundPlan, base: torch.Tensor, candidate: torch.Tensor,
                n_keep: torch.Tensor, next_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.cache.layers[layer]
        lo, hi = plan.span
        shape = scores.shape
        info = torch.finfo(torch.float32)
        scores = torch.nan_to_num(scores, nan=info.min, posinf=info.max, neginf=info.min)
        # Never attended again by any future query of this layer: evicted first, unless the keep set is shared with
        # other layers, where it may still be read (keep sets must stay equal across layers).
        if store.is_sliding and not self.engine.shared_layers:
            # a sliding layer has a window, and a round follows a forward, which filled every layer
            assert store.sliding_window is not None and store.positions is not None
            stale = (next_pos[:, None, None] - store.positions[:, :, lo:hi]) >= store.sliding_window
            scores = scores.masked_fill(stale, info.min)
        priority = base.expand(shape[0], shape[1], store.length).clone()
        priority[:, :, lo:hi] = torch.where(candidate.expand(shape), scores, priority[:, :, lo:hi])
        return select_slots(priority, n_keep, plan.slots)

    # --- results ---------------------------------------------------------------------------------------------------
    def result(self, generated: list[list[int]], reasons: list[str]) -> BatchResult:
        seconds = {
            name: self.timer.seconds(name)
            for name in ("prefill.round", "decode.round", "decode.score", "decode.compact", "decode.observe",
                         "prefill.observe")
        }
        decode_s = self.wall.get("decode_s", 0.0)
        decode_tokens = sum(max(0, len(g) - 1) for g in generated)
        rounds = seconds["decode.round"]
        round_s = float(sum(rounds))
        stats = {
            "batch_size": self.batch,
            "prompt_tokens": list(self.prompt_lens),
            "prefill_s": self.wall.get("prefill_s", 0.0),
            "decode_s": decode_s,
            "decode_steps": self.step_index,
            "generated_tokens": sum(len(g) for g in generated),
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
            "decode_rounds": len(rounds),
            "round_s": round_s,
            "round_ms_mean": 1000 * round_s / len(rounds) if rounds else None,
            "round_ms_median": 1000 * float(np.median(rounds)) if rounds else None,
            "round_share": round_s / decode_s if decode_s > 0 else None,
            "score_s": float(sum(seconds["decode.score"])),
            "compact_s": float(sum(seconds["decode.compact"])),
            "observe_s": float(sum(seconds["decode.observe"]) + sum(seconds["prefill.observe"])),
            "prefill_rounds": len(seconds["prefill.round"]),
            "prefill_round_s": float(sum(seconds["prefill.round"])),
            "peak_slots": self.peak_slots,
            "peak_cache_bytes": self.peak_live_bytes,
            "cache_allocated_peak_bytes": self.cache.peak_allocated,
            **self.memory.report(),
            "query_window": self.engine.query_window,
            "attention_requests": 0 if self.feed is None else self.feed.requests,
            "attention_s": 0.0 if self.feed is None else self.feed.timer.total("attention"),
        }
        sequences = [
            SequenceResult(
                prompt_ids=self.prompts[seq],
                generated_ids=generated[seq],
                finish_reason=reasons[seq],
                budget=None if self.never else self.budgets[seq],
                protected=self.limits[seq],
                recency=self.recency[seq],
                rounds=self.rounds[seq],
                outside_protocol=self.policy.outside_protocol(self.protections[seq]),
                cache_sizes=self.cache_sizes[seq],
                keep_log=self.keep_log.for_sequence(seq) if self.keep_log is not None else None,
            )
            for seq in range(self.batch)
        ]
        return BatchResult(sequences, stats)
