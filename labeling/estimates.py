"""How long a labelling run takes, an order of magnitude, from the greedy decode rate r (tokens/s) measured on the
first problem's prompt (`probe_decode_rate`, `PROBE_TOKENS` tokens):

    generation  <= P * T / r                  P problems, T = --max-new-tokens (traces that stop early cost less)
    labelling   ~= P * (W + 1) * min(A, 64) / r
                                              W windows over a reasoning span of T - 64 tokens (the boundary's
                                              fallback), + 1 reference, each regenerating about min(A, 64) tokens,
                                              A = --max-answer-tokens: the naive method's decode cost; the fast
                                              method verifies most of them in batches and is usually several times
                                              faster (bench/README.md), so this is an order of magnitude

`labeling.job.run_occlusion` prints it before generating and refines it after the first trace (its measured
seconds times the traces left), after generation (the traces to label, each regeneration as long as its trace's
answer span: `labeling.labeler.OcclusionLabeler.decode_tokens`) and after the first labelled unit (its measured
seconds per regeneration).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labeling.labeler import OcclusionConfig
from labeling.windows import occlusion_windows

if TYPE_CHECKING:
    from tasks.problem import Problem

PROBE_TOKENS = 16


def estimate_seconds(problems: int, max_new_tokens: int, config: OcclusionConfig,
                     tokens_per_s: float) -> tuple[float, float]:
    """(generation upper bound, labelling order of magnitude) in seconds for `problems` traces generated first."""
    windows = len(occlusion_windows(0, max(0, max_new_tokens - config.tail), config.window, config.stride))
    generation = problems * max_new_tokens / tokens_per_s
    labelling = problems * (windows + 1) * min(config.answer_cap, config.tail) / tokens_per_s if windows else 0
    return generation, labelling


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def probe_decode_rate(lm, problem: Problem) -> float | None:
    """Greedy decode tokens/s on `problem`'s prompt over `PROBE_TOKENS` tokens (None when it stops at once)."""
    from tasks.generation import generate
    from tasks.prompts import build_prompt_ids

    rate = generate(lm, build_prompt_ids(lm.tokenizer, problem), PROBE_TOKENS).tokens_per_s
    return rate or None
