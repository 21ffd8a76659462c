"""How the viewer's arrays travel inside the page: base64 of their little-endian bytes, which the page's script reads
back into typed arrays (JSON numbers would take two to three times the bytes and the parse time)."""

from __future__ import annotations

import base64

import numpy as np


def floats(values: np.ndarray) -> str:
    """float32 values (NaN where there is none) as base64; read back with ``new Float32Array``."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def bits(flags: np.ndarray) -> str:
    """Booleans as base64 of their bits, first flag in the lowest bit of the first byte."""
    packed = np.packbits(np.ascontiguousarray(flags, dtype=bool).ravel(), bitorder="little")
    return base64.b64encode(packed.tobytes()).decode("ascii")
