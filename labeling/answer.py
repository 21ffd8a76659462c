"""The forced answer: where it ends, what it says, and how likely a context makes it (the graded label).

A forced answer continues a trace's answer cue (`labeling.windows.Cue`). What it says is read from the continuation
alone, never from the cue or from text the continuation writes after the answer:

- after a cue that opens a box (``\\boxed{``, the generic cue too): the text up to the brace that closes that box
  (`answer_end` counts braces from the open one); a continuation that never closes it stated no answer;
- after an answer phrase (``The answer is``, ``Final answer:``, ``####``): the first line holding text.

`answer_end` is also when a forced answer is *complete*: regeneration stops there (`OcclusionConfig.stop_at_answer`),
since nothing after it can change what the answer says.

**The graded label** (`score_answer`) is computed from one teacher-forced forward of a context followed by the
reference answer's tokens (the unoccluded context's forced answer, up to and including the token that completes
it): the sum of their log-probabilities (``logp``), the first token's margin (its log-probability minus the best
other token's: positive when greedy decoding would start the reference answer), and whether every reference token
is the argmax (``greedy``): then greedy decoding reproduces the reference answer exactly, so the same forward
decides the outcome of most windows without decoding. A window's *effect* is its ``logp`` minus the unoccluded
context's: negative when the occlusion made the reference answer less likely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a score is computed, so the labeller's command line starts fast
    import torch

BOX_OPEN = "{"
BOX_CLOSE = "}"


def answer_end(text: str, box: bool, opened: bool = True) -> int | None:
    """The index just past the end of the forced answer in continuation `text`, or None while it is open: the brace
    closing the box (`box`; `opened` when the cue already holds the box's opening brace, else the continuation's
    first brace opens it, as when a tokenizer merges ``{(`` into one token), else the end of the first line that holds
    non-space text."""
    if box:
        depth, started = (1, True) if opened else (0, False)
        for index, char in enumerate(text):
            if not started and not char.isspace() and char != BOX_OPEN:
                return None  # a box the cue named but never opens: no answer in it
            depth += {BOX_OPEN: 1, BOX_CLOSE: -1}.get(char, 0)
            started = started or char == BOX_OPEN
            if started and depth == 0:
                return index + 1
        return None
    started = False
    for index, char in enumerate(text):
        if char == "\n" and started:
            return index
        started = started or not char.isspace()
    return None


def forced_answer_text(text: str, box: bool, opened: bool = True) -> str | None:
    """What the forced answer says, from its continuation `text` alone (see the module docstring); None when it
    never completes, or completes empty."""
    end = answer_end(text, box, opened)
    if end is None:
        return None
    said = (text[: end - 1] if opened else text[text.index(BOX_OPEN) + 1: end - 1]) if box else text[:end]
    return said.strip() or None


@dataclass(frozen=True)
class AnswerScore:
    """The reference answer under teacher forcing after one context (see the module docstring)."""

    logp: float  # sum of the reference tokens' log-probabilities
    margin: float  # first token: its log-probability minus the best other token's
    greedy: bool  # every reference token is the argmax: greedy decoding reproduces the reference answer
    diverges_at: int | None  # the first reference token that is not the argmax (None when `greedy`)

    def to_json(self) -> dict[str, float | bool | int | None]:
        return {"logp": round(self.logp, 6), "margin": round(self.margin, 6), "greedy": self.greedy,
                "diverges_at": self.diverges_at}


def score_answer(logits: torch.Tensor, reference: Sequence[int]) -> AnswerScore:
    """`AnswerScore` from ``logits [len(reference), vocab]``: row j the logits predicting ``reference[j]`` (the
    logits at the context's last token, then at each reference token but the last)."""
    import torch

    if logits.ndim != 2 or logits.shape[0] != len(reference) or not len(reference):
        raise ValueError(f"need logits [{len(reference)}, vocab] for a non-empty reference, got {tuple(logits.shape)}")
    logprobs = logits.float().log_softmax(-1)  # [n, vocab]
    target = torch.tensor(list(reference), dtype=torch.long, device=logprobs.device)
    picked = logprobs.gather(1, target[:, None])[:, 0]  # [n]
    first = logprobs[0].clone()
    first[target[0]] = -torch.inf
    agree = (logprobs.argmax(-1) == target).tolist()
    return AnswerScore(logp=float(picked.sum()), margin=float(picked[0] - first.max()), greedy=all(agree),
                       diverges_at=None if all(agree) else agree.index(False))


def teacher_forced_scores(model, contexts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
                          batch_size: int = 8) -> list[AnswerScore]:
    """`score_answer` of each reference after its context, each prefilled from scratch (right-padded batches): the
    reference implementation the labellers' shared-prefix scoring must match."""
    import torch

    with torch.no_grad():
        return _teacher_forced_scores(model, contexts, references, batch_size)


def _teacher_forced_scores(model, contexts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
                           batch_size: int) -> list[AnswerScore]:
    import torch

    device = next(model.parameters()).device
    scores: list[AnswerScore] = []
    for first in range(0, len(contexts), batch_size):
        rows = [list(c) + list(r) for c, r in zip(contexts[first:first + batch_size],
                                                   references[first:first + batch_size])]
        width = max(map(len, rows))
        ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=device)  # [rows, width]
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows], device=device)
        logits = model(input_ids=ids, attention_mask=mask).logits  # [rows, width, vocab]
        for row, (context, reference) in enumerate(zip(contexts[first:first + batch_size],
                                                       references[first:first + batch_size])):
            start = len(context) - 1
            scores.append(score_answer(logits[row, start:start + len(reference)], reference))
    return scores


