"""``--shard I/N``: a labelling run split for job-array schedulers.

Shard I takes the selected traces I, I + N, ... (`shard_traces`) and groups them into units as an unsharded run
does; it writes ``labels.shard-I-of-N.jsonl`` and ``config.shard-I-of-N.json`` under its own lock
(`shard_run_dir`), so the N shards can run at once into one directory, and ``python -m labeling.merge DIR``
combines them into the unsharded run's ``labels.jsonl``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.errors import UsageError
from core.rundir import LOCK_NAME, RunDir
from core.schemas import Trace


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) -> (i, n)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard {text!r} is not of the form I/N (e.g. 0/4)") from None
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard {text!r}: need 0 <= I < N (shards are numbered 0..N-1)")
    return index, count


def shard_traces(traces: Sequence[Trace], shard: tuple[int, int]) -> list[Trace]:
    """Shard I of N: the traces I, I + N, I + 2N, ... (`labeling.merge` restores the order by interleaving), grouped
    into units by `labeling.labeler.make_units` like the traces of an unsharded run."""
    return list(traces[shard[0]::shard[1]])


def shard_suffix(shard: tuple[int, int] | None) -> str:
    return "" if shard is None else f".shard-{shard[0]}-of-{shard[1]}"


def shard_run_dir(out: Path, identity: dict[str, Any], shard: tuple[int, int] | None) -> RunDir:
    """The run directory of one shard: its own config and lock, so the shards of a job can run side by side."""
    suffix = shard_suffix(shard)
    return RunDir(out, identity, config_name=f"config{suffix}.json", lock_name=f"{LOCK_NAME}{suffix}")
