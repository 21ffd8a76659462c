"""Running probe instances: a batch teacher-forced through the eviction engine's decode path, or without eviction
(the `full` reference), and each row's outcome.

Backends (`core.backend`): the unit of work is one batch of instances (and, in the passcode test, one policy); with
``--backend ray --workers N`` each worker (`ProbeWorker`) loads the model once and the driver alone writes the
records, in the order a serial run writes them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from core.backend import BackendConfig

if TYPE_CHECKING:
    from probes.config import ProbeConfig


@dataclass
class Forced:
    """Teacher-forced results of one batch, per row."""

    logprobs: np.ndarray  # [rows, value] log p of each digit token of the value
    argmax: np.ndarray  # [rows, value] the greedy token at each digit position
    resident: np.ndarray  # [rows, layers, kv_heads] every digit of the fact visible when the value is first predicted
    rounds: list[int]  # next_pos of every decode-time eviction round (all rows share the schedule)
    peak_slots: int  # the most cache slots a KV head held at any forward (all rows share it)


def resident_heads(cache, watch: Sequence[int], query: int) -> np.ndarray:
    """``[batch, layers, kv_heads]``: can a query at position `query` attend to every position of `watch` in that
    (layer, head)? The slots must be cached and, in a sliding-window layer, inside the window (the engine may leave
    out-of-window slots cached when the budget has room, but the mask hides them)."""
    wanted = torch.tensor(list(watch), dtype=torch.int32)
    held = []
    for layer in cache.layers:
        positions = layer.positions  # [batch, kv_head, slots]
        hit = (positions[..., None] == wanted.to(positions.device)).any(dim=2)  # [batch, kv_head, len(watch)]
        if layer.sliding_window is not None:
            hit &= (query - wanted.to(positions.device)) < layer.sliding_window
        held.append(hit.all(dim=-1))
    return torch.stack(held, dim=1).cpu().numpy()


def run_forced(engine, prompt: Sequence[int], bodies: Sequence[Sequence[int]], value_len: int,
               watch: Sequence[int], seed: int, progress: Callable[[int], None] | None = None) -> Forced:
    """Prefill `prompt` and teacher-force every row's body through the engine's decode path.

    All rows share the prompt and the body length (so they share positions and the eviction schedule). The last
    `value_len` body tokens are the value; the log-probs of those tokens are collected as they are forced.
    """
    body = torch.tensor([list(b) for b in bodies], dtype=torch.long)  # [rows, T]
    rows, length = body.shape
    first = length - value_len  # body index of the value's first token
    logprobs, argmax, rounds, resident = [], [], [], None
    with torch.inference_mode(), engine.session([list(prompt)] * rows, max_new_tokens=length, seed=seed) as session:
        session.prefill()
        session.begin_decode()
        for j in range(length - 1):  # the value's last token is never fed
            if j == first - 1:  # this forward predicts the value's first token: what does it attend to?
                resident = resident_heads(session.cache, watch, session.next_pos[0])
            before = session.rounds[0]
            logits = session.step(body[:, j])
            if session.rounds[0] > before:
                rounds.append(session.next_pos[0])
            if j >= first - 1:
                scores = logits.float().log_softmax(-1)  # [rows, vocab]
                target = body[:, j + 1].to(scores.device)
                logprobs.append(scores.gather(-1, target[:, None])[:, 0].cpu())
                argmax.append(scores.argmax(-1).cpu())
            if progress is not None:
                progress(1)
        session.end_decode()
        peak = max(session.cache_sizes[0])
    assert resident is not None  # read at the forward that predicts the value's first token (body precedes value)
    return Forced(torch.stack(logprobs, 1).numpy(), torch.stack(argmax, 1).numpy(), resident, rounds, peak)


@torch.inference_mode()
def dense_logprobs(lm, prompt: Sequence[int], bodies: Sequence[Sequence[int]], value_len: int,
                   watch: Sequence[int]) -> Forced:
    """The same rows without eviction (one ordinary forward each): the `full` reference. Every layer holds the
    fact, but a sliding-window layer sees it only while it is inside the window."""
    ids = torch.tensor([list(prompt) + list(b[:-1]) for b in bodies], dtype=torch.long, device=lm.device)
    logits = lm.model(input_ids=ids, logits_to_keep=value_len).logits.float().log_softmax(-1)  # [rows, value, vocab]
    target = torch.tensor([list(b[-value_len:]) for b in bodies], dtype=torch.long, device=logits.device)
    logprobs = logits.gather(-1, target[..., None])[..., 0].cpu().numpy()
    cfg = lm.config
    query = len(prompt) + len(bodies[0]) - value_len - 1  # the position whose forward predicts the first digit
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    visible = [t != "sliding_attention" or query - min(watch) < cfg.sliding_window for t in types]
    resident = np.broadcast_to(np.array(visible)[None, :, None],
                               (len(bodies), cfg.num_hidden_layers, cfg.num_key_value_heads)).copy()
    return Forced(logprobs, logits.argmax(-1).cpu().numpy(), resident, [], ids.shape[1])


def outcome(tokenizer, forced: Forced, row: int, target: Sequence[int]) -> dict[str, Any]:
    """One row's result: log p(value), per-token log-probs, retrieval, the greedy continuation up to and including
    its first wrong token (exactly what greedy decoding would have produced), and the peak cache slots per head."""
    picks = [int(t) for t in forced.argmax[row]]
    agree = [p == t for p, t in zip(picks, target)]
    greedy = picks if all(agree) else picks[: agree.index(False) + 1]
    return {
        "lp": float(forced.logprobs[row].sum()),
        "token_lp": [round(float(x), 5) for x in forced.logprobs[row]],
        "retrieved": all(agree),
        "greedy": tokenizer.decode(greedy),
        "resident": float(forced.resident[row].mean()),
        "resident_heads": forced.resident[row].astype(int).tolist(),
        "peak_slots": forced.peak_slots,
    }


def chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(s, min(n, s + size))) for s in range(0, n, size)]


SERIAL = BackendConfig()  # the default backend: every unit in this process


@dataclass
class ProbeWorker:
    """What runs a probe's units: the loaded model, and whether to show a per-token bar (only the driver's own
    worker has a terminal)."""

    lm: Any
    progress: bool = False

    def decode_bar(self, steps: int, desc: str):
        return tqdm(total=steps, unit="tok", leave=False, file=sys.stderr, desc=desc, disable=not self.progress)


def load_probe_worker(config: ProbeConfig) -> ProbeWorker:
    """A Ray worker's `ProbeWorker`: the probe's model, loaded once."""
    return ProbeWorker(config.load_model())
