"""Prompt formatting: the model's chat template when it has one, a plain completion prompt otherwise.

Chat models get one user turn, ``<question>\\n\\n<INSTRUCTION>``, followed by the template's generation prompt.
Base models without a chat template (Gemma3-270M) get the plain completion format::

    Problem: <question>

    <INSTRUCTION>

    Solution:

so the model continues with a solution. The instruction is the standard math-reasoning one (step-by-step reasoning,
final answer in ``\\boxed{}``) that `tasks.grading.extract_answer` reads back. Synthetic long-context problems
(RULER, `tasks.ruler`) carry their own instruction in the question, so they get none added, and the plain format
ends with ``Answer:``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.problem import Problem

if TYPE_CHECKING:  # transformers takes a second to import; the tokenizer class is only an annotation here
    from transformers import PreTrainedTokenizerBase

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PLAIN_TEMPLATE = "Problem: {question}\n\n{instruction}\n\nSolution:"


def uses_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt_text(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> str:
    """The prompt as text (chat template rendered, or the plain fallback), ready to be continued by the model."""
    own_instruction = "ruler" in problem.meta
    if uses_chat_template(tokenizer):
        content = problem.question if own_instruction else f"{problem.question}\n\n{INSTRUCTION}"
        message = {"role": "user", "content": content}
        # transformers' return type does not depend on `tokenize`: without tokenizing it is the rendered text
        return tokenizer.apply_chat_template(  # type: ignore[return-value]
            [message], tokenize=False, add_generation_prompt=True)
    if own_instruction:
        return f"{problem.question}\n\nAnswer:"
    return PLAIN_TEMPLATE.format(question=problem.question, instruction=INSTRUCTION)


def build_prompt_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    """Token ids of `build_prompt_text`.

    A rendered chat template already spells out its own BOS token where the model wants one, so the tokenizer must
    not add another; the plain prompt gets the tokenizer's usual special tokens (Gemma's BOS).
    """
    text = build_prompt_text(tokenizer, problem)
    add_special = not uses_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
