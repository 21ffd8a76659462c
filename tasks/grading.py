"""Final-answer extraction and grading by mathematical equivalence: the benchmarks' grading rule (`grade`).

Extraction (`extract_answer`), first rule that matches wins:

1. the last non-empty ``\\boxed{...}`` / ``\\fbox{...}`` (balanced nested braces), or the brace-less ``\\boxed 5``;
2. the last GSM8K-style ``#### <answer>`` line;
3. fallback: the last "the (final) answer is X" / "Answer: X" phrase, up to the end of its line;
4. fallback: the last number in the text.

For GSM8K an extracted answer holding exactly one number (``\\$18``, ``18 dollars``) is reduced to that number.

Equivalence (`is_equivalent`): equal after `normalize_answer` (LaTeX spacing, ``\\left``/``\\right``, ``\\dfrac``,
units in ``\\text{}``, degrees, percent, thousands separators, ``x=`` prefixes), otherwise math-verify (sympy)
decides. math-verify can take unbounded time on some inputs and its own timeouts rely on SIGALRM, which only works
on the main thread; it therefore runs in a child process (`MathVerifier`) that is killed and restarted when a
comparison exceeds its time limit, in which case the string comparison's answer (not equal) stands.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

from tasks.problem import Problem

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_HASHES = re.compile(r"####\s*([^\n]+)")
_PHRASE = re.compile(
    r"(?:(?:final\s+)?answer\s+is|final\s+answer\s*[:=]|^\W*answer\W*?:)[\s:*]*([^\n]+)",
    re.IGNORECASE | re.MULTILINE,
)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed_contents(text: str) -> list[tuple[int, str]]:
    """(position, content) of every complete ``\\boxed``/``\\fbox`` in `text`; truncated ones are skipped."""
    found = []
    for match in _BOX.finditer(text):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, start = 0, i
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    if text[start + 1 : j].strip():  # an empty `\boxed{}` is the instruction echoed back
                        found.append((match.start(), text[start + 1 : j]))
                    break
        elif i > match.end():  # `\boxed 5`: the token up to whitespace or a closing `$`
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                found.append((match.start(), token.group(0)))
    return found


def _clean(answer: str) -> str:
    answer = answer.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left) : len(answer) - len(right)].strip()
    return answer.rstrip(".").strip().strip("$").strip()


def extract_answer_with_rule(text: str, dataset: str | None = None) -> tuple[str | None, str | None]:
    """(answer, rule) where rule is one of "boxed", "hashes", "phrase", "last_number"; (None, None) if nothing."""
    answer, rule = None, None
    if boxed := _boxed_contents(text):
        answer, rule = boxed[-1][1], "boxed"
    elif hashes := _HASHES.findall(text):
        answer, rule = hashes[-1], "hashes"
    elif (phrases := [_clean(p) for p in _PHRASE.findall(text)]) and phrases[-1]:
        answer, rule = phrases[-1], "phrase"
    elif numbers := _NUMBER.findall(text):
        answer, rule = numbers[-1], "last_number"
    if answer is None:
        return None, None
    answer = _clean(answer)
    if dataset == "gsm8k":
        numbers = _NUMBER.findall(answer.replace("{,}", ","))
        if len(numbers) == 1:
            answer = numbers[0].replace(",", "")
    return (answer or None), (rule if answer else None)


def extract_answer(text: str, dataset: str | None = None) -> str | None:
    """The final answer stated in a model's output (rules in the module docstring), or None."""
    return extract_answer_with_rule(text, dataset)[0]


_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_TRAILING_TEXT = re.compile(r"(?:\\(?:text|textbf|textrm|mathrm|mbox)\{[^{}]*\}\s*)+$")
_SPACING = re.compile(r"\\[!,;:> ]|~|\\quad|\\qquad")
_ASSIGNMENT = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?!.*=)")


def normalize_answer(answer: str) -> str:
    """A canonical string for cheap comparison; equal outputs mean equal answers (never the other way round)."""
    s = _clean(answer)
    s = _SPACING.sub("", s)
    s = re.sub(r"\\left\b|\\right\b", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("{,}", ",")
    unitless = _TRAILING_TEXT.sub("", s).strip()
    s = unitless if re.search(r"\d", unitless) else s  # `10\text{ inches}`: a unit after a number
    s = _TEXT.sub(r"\1", s)  # `\text{Evelyn}`: the answer itself
    s = _ASSIGNMENT.sub("", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    return s


class MathVerifier:
    """math-verify in a child process, so a hanging comparison is killed after `timeout_s` from any thread."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue[str] = queue.Queue()

    def _start(self) -> subprocess.Popen:
        script = Path(__file__).with_name("_verify_worker.py")
        proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1,
        )
        replies: queue.Queue[str] = queue.Queue()  # one queue per child: a killed child's late reply cannot leak

        def pump() -> None:
            assert proc.stdout is not None  # started with stdout=PIPE
            for line in proc.stdout:
                replies.put(line)

        threading.Thread(target=pump, daemon=True).start()
        self._proc, self._replies = proc, replies
        return proc

    def equal(self, pred: str, gold: str) -> bool | None:
        """True/False as math-verify decides; None when it failed or ran out of time (the caller falls back)."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            assert proc.stdin is not None  # started with stdin=PIPE
            try:
                proc.stdin.write(json.dumps({"pred": f"\\boxed{{{pred}}}", "gold": f"\\boxed{{{gold}}}"}) + "\n")
                proc.stdin.flush()
                reply = json.loads(self._replies.get(timeout=self.timeout_s))
            except (queue.Empty, BrokenPipeError, OSError, ValueError):
                self.close()
                return None
            return reply.get("equal")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.close()


_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier `is_equivalent` uses (its child process starts on the first hard comparison)."""
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier()
        return _default_verifier


def is_equivalent(pred: str | None, gold: str, *, verifier: MathVerifier | None = None) -> bool:
    """Whether answer `pred` equals `gold` mathematically (see the module docstring for how)."""
    if pred is None or not pred.strip():
        return False
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    return bool((verifier or default_verifier()).equal(pred, gold))


def grade(text: str, problem: Problem) -> dict:
    """Grade a model output against a benchmark problem (MATH-500, AIME, GSM8K): answer (extracted or None),
    correct, no_answer, extracted_by. Other datasets supply their own rule (`tasks.datasets.grader`)."""
    answer, rule = extract_answer_with_rule(text, problem.dataset)
    return {
        "answer": answer,
        "correct": is_equivalent(answer, problem.answer),
        "no_answer": answer is None,
        "extracted_by": rule,
    }
