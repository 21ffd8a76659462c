"""Run instrumentation: timed spans (CUDA events on GPU, wall clock on CPU), peak memory, keep-logs.

Keep-log format (one per sequence, saved as ``.npz`` by the runner): every eviction is one entry of four parallel
int32 arrays ``round``, ``layer``, ``head``, ``position`` plus a per-round table ``round_step`` (decode step, 0 =
prefill) and ``round_next_pos`` (positions ``0..next_pos-1`` existed at that round). The positions a head kept
after round i are ``{0..round_next_pos[i]-1}`` minus every position it evicted in rounds ``<= i``
(`kept_positions`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import psutil
import torch


class SpanTimer:
    """Named spans; on CUDA recorded with events and resolved once at the end (no sync in the hot path)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = defaultdict(list)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._spans[name].append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._spans[name].append(time.perf_counter() - began)

    def seconds(self, name: str) -> list[float]:
        spans = self._spans.get(name, [])
        if self.cuda and spans:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1000.0 for start, end in spans]
        return list(spans)

    def total(self, name: str) -> float:
        return float(sum(self.seconds(name)))


class MemoryMeter:
    """Peak memory of one batch: the CUDA allocator peak on GPU; on CPU the process RSS, sampled at each call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.process = psutil.Process()
        self.peak_rss = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self.sample()

    def sample(self) -> None:
        if not self.cuda:
            self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)

    def report(self) -> dict[str, int]:
        self.sample()
        if self.cuda:
            return {"cuda_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device))}
        return {"peak_rss_bytes": int(self.peak_rss)}


class KeepLog:
    """Evicted positions per round, per layer and head, for every sequence of a batch."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.round_step: list[int] = []
        self.round_next_pos: list[list[int]] = []
        self._entries: list[tuple[int, int, np.ndarray]] = []  # (round, layer, [n, 3] = seq, head, position)

    def begin_round(self, step: int, next_pos: list[int]) -> None:
        self.round_step.append(step)
        self.round_next_pos.append(list(next_pos))

    def add(self, layer: int, old_positions: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Record what compaction with (`index`, `valid`) drops from `old_positions` ``[b, kv, slots]``."""
        kept = torch.zeros(old_positions.shape, dtype=torch.bool, device=old_positions.device)
        kept.scatter_(2, index, valid)
        dropped = (old_positions >= 0) & ~kept
        seq, head, slot = dropped.nonzero(as_tuple=True)
        table = torch.stack([seq, head, old_positions[seq, head, slot].long()], dim=1)
        self._entries.append((len(self.round_step) - 1, layer, table.cpu().numpy().astype(np.int32)))

    def for_sequence(self, seq: int) -> dict[str, np.ndarray]:
        rounds, layers, heads, positions = [], [], [], []
        for round_index, layer, table in self._entries:
            rows = table[table[:, 0] == seq]
            rounds.append(np.full(len(rows), round_index, dtype=np.int32))
            layers.append(np.full(len(rows), layer, dtype=np.int32))
            heads.append(rows[:, 1])
            positions.append(rows[:, 2])
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)  # noqa: E731
        return {
            "round": cat(rounds),
            "layer": cat(layers),
            "head": cat(heads),
            "position": cat(positions),
            "round_step": np.asarray(self.round_step, dtype=np.int32),
            "round_next_pos": np.asarray([row[seq] for row in self.round_next_pos], dtype=np.int32),
        }


def kept_positions(log: dict[str, np.ndarray], round_index: int, layer: int, head: int) -> np.ndarray:
    """Positions a (layer, head) held right after round `round_index` of a per-sequence keep-log (sorted)."""
    upto = int(log["round_next_pos"][round_index])
    chosen = (log["round"] <= round_index) & (log["layer"] == layer) & (log["head"] == head)
    evicted = log["position"][chosen]
    alive = np.ones(upto, dtype=bool)
    alive[evicted[evicted < upto]] = False
    return np.flatnonzero(alive).astype(np.int32)
