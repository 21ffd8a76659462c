"""Seeds that depend only on the run seed and the unit of work, so a resumed or re-sharded run redraws the same."""

from __future__ import annotations

import zlib
from collections.abc import Iterable


def derive_seed(seed: int, keys: Iterable[object]) -> int:
    """A 63-bit seed from the run `seed` and the unit's `keys` (problem ids, instance indices), stable across
    processes and Python versions (CRC-32 of the keys, not `hash`, which is salted per process)."""
    digest = zlib.crc32("\x1f".join(map(str, keys)).encode())
    return (seed * 1_000_003 + digest) % (2**63)
