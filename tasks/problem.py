"""A benchmark problem: the record every task module passes around, whichever dataset made it (`tasks.datasets`).

It sits below the modules that make, prompt and grade problems so that none of them imports another to name what
it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One benchmark problem. `answer` is the gold final answer (for GSM8K, the number after ``####``)."""

    id: str
    question: str
    answer: str
    dataset: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
