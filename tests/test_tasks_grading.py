"""Answer extraction and equivalence grading (tasks/grading.py), on answers taken from MATH-500 and GSM8K."""

from __future__ import annotations

import threading

import pytest

from tasks.grading import MathVerifier, extract_answer, extract_answer_with_rule, grade, is_equivalent, normalize_answer
from tasks.problem import Problem


@pytest.mark.parametrize(
    "text, dataset, expected, rule",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", None, "\\frac{1}{2}", "boxed"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", None, "\\left( 3, \\frac{\\pi}{2} \\right)", "boxed"),
        ("first \\boxed{1}, then corrected: \\boxed{2}", None, "2", "boxed"),
        ("nested \\boxed{\\frac{\\sqrt{3}}{\\left(2\\right)}} end", None,
         "\\frac{\\sqrt{3}}{\\left(2\\right)}", "boxed"),
        ("The answer is $\\boxed 5$.", None, "5", "boxed"),
        ("\\fbox{7}", None, "7", "boxed"),
        ("\\boxed{12} but then \\boxed{3", None, "12", "boxed"),  # a truncated box does not count
        ("put your final answer within \\boxed{}. The answer is 4.", None, "4", "phrase"),  # echoed instruction
        ("She makes 9 * 2 = $18.\n#### 18", "gsm8k", "18", "hashes"),
        ("#### 1,234", "gsm8k", "1234", "hashes"),
        ("Total: \\boxed{\\$18}", "gsm8k", "18", "boxed"),
        ("\\boxed{18 \\text{ dollars}}", "gsm8k", "18", "boxed"),
        ("Therefore the answer is $\\frac{3}{4}$.", None, "\\frac{3}{4}", "phrase"),
        ("Final Answer: 3/4", None, "3/4", "phrase"),
        ("**Answer:** 10 inches", None, "10 inches", "phrase"),
        ("First 12 apples, then 15 pears", None, "15", "last_number"),
        ("it costs -2.5 dollars", None, "-2.5", "last_number"),
        ("no digits at all", None, None, None),
        ("", None, None, None),
    ],
)
def test_extract_answer(text, dataset, expected, rule):
    assert extract_answer_with_rule(text, dataset) == (expected, rule)
    assert extract_answer(text, dataset) == expected


# (prediction, MATH-500 / GSM8K gold) pairs that must grade as equal ...
EQUAL = [
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # tuple, \left( \right)
    ("\\dfrac{14}{3}", "\\frac{14}{3}"),
    ("14/3", "\\frac{14}{3}"),
    ("\\frac{3}{20}", "0.15"),
    ("\\frac54", "1.25"),
    (".5", "\\frac12"),
    ("\\tfrac{1}{2}", "\\frac{1}{2}"),
    ("\\sqrt{117}", "3\\sqrt{13}"),  # radicals
    ("11\\sqrt{2}", "11\\sqrt2"),
    ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}"),
    ("90", "90^\\circ"),  # degrees
    ("90^{\\circ}", "90^\\circ"),
    ("10", "10\\text{ inches}"),  # units
    ("10 \\text{inches}", "10"),
    ("10", "10\\%"),  # percent
    ("Evelyn", "\\text{Evelyn}"),
    ("x=5", "5"),
    ("-2, 1", "1,-2"),  # solution sets
    ("3,5,7", "3, 5, 7"),
    ("6-5i", "6 - 5i"),
    ("x^5-x^4+x^3-x^2+x-1", "x^5 - x^4 + x^3 - x^2 + x - 1"),
    ("p-q", "p - q"),
    ("-\\dfrac{\\pi}{6}", "-\\frac{\\pi}{6}"),
    ("(-\\infty,-2]\\cup[3,\\infty)", "(-\\infty, -2] \\cup [3, \\infty)"),  # intervals
    ("\\left[ -2, 7 \\right]", "[-2,7]"),
    ("\\!12", "12"),  # LaTeX spacing
    ("1\\,000", "1000"),
    ("1{,}000", "1000"),
    ("1,000", "1000"),
    ("52_8", "52_8"),
    ("18.00", "18"),
]
# ... and pairs that must not.
DIFFERENT = [
    ("\\frac{3}{57}", "\\frac{3}{56}"),
    ("(-\\infty, 3)", "(-\\infty, 3]"),  # open vs closed endpoint
    ("[-2,7)", "[-2,7]"),
    ("\\left( \\frac{\\pi}{2}, 3 \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # tuple order matters
    ("(3, \\frac{\\pi}{3})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("2\\sqrt{13}", "3\\sqrt{13}"),
    ("100", "10"),
    ("\\text{Amy}", "\\text{Evelyn}"),
    ("x^5+x^4", "x^5 - x^4"),
    ("0.16", "0.15"),
    ("6+5i", "6 - 5i"),
    ("\\frac{\\pi}{6}", "-\\frac{\\pi}{6}"),
    ("1,2", "1,-2"),
    ("45^\\circ", "90^\\circ"),
    ("12", "10\\text{ inches}"),
    ("42", "52_8"),
    ("p+q", "p - q"),
    ("57", "5\\text{ and }7"),
    ("1001", "1{,}000"),
]


@pytest.mark.parametrize("pred, gold", EQUAL)
def test_known_equal_pairs(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", DIFFERENT)
def test_known_different_pairs(pred, gold):
    assert not is_equivalent(pred, gold)


def test_missing_prediction_is_never_equal():
    assert not is_equivalent(None, "3")
    assert not is_equivalent("  ", "3")


@pytest.mark.parametrize(
    "raw, normal",
    [("\\left( 3, \\dfrac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("10\\text{ inches}", "10"),
     ("90^{\\circ}", "90"), ("\\text{Evelyn}", "Evelyn"), ("1{,}000.50", "1000.5"), ("$x = 5$", "5")],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_grade_reports_answer_correct_and_no_answer():
    problem = Problem(id="p", question="?", answer="\\frac{14}{3}", dataset="math500")
    assert grade("... so it is \\boxed{\\dfrac{14}{3}}.", problem) == {
        "answer": "\\dfrac{14}{3}", "correct": True, "no_answer": False, "extracted_by": "boxed"}
    assert grade("I give up.", problem)["no_answer"] is True
    assert grade("I give up.", problem)["correct"] is False
    gsm = Problem(id="g", question="?", answer="18", dataset="gsm8k")
    assert grade("She makes $18 every day.", gsm)["correct"] is True


def test_each_dataset_supplies_its_grading_rule():
    from tasks import known_answer, ruler
    from tasks.datasets import grade as grade_by_dataset
    from tasks.datasets import grader

    assert grader("math500") is grade and grader("gsm8k") is grade
    assert grader("ruler_niah_single@512") is ruler.grade and grader("known_facts@2") is known_answer.grade
    # One output, two rules: RULER's exact match of 7-digit values refuses an 8-digit one and scores the match; the
    # benchmark rule reads the last number as the answer.
    meta = {"ruler": {"task": "niah_single", "values": ["1234567"], "candidates": None}}
    needle = Problem(id="r", question="?", answer="1234567", dataset="ruler_niah_single@512", meta=meta)
    assert grade_by_dataset("It is 1234567.", needle)["score"] == 1.0
    assert grade_by_dataset("It is 12345678.", needle)["correct"] is False
    benchmark = Problem(id="b", question="?", answer="12345678", dataset="gsm8k")
    assert grade_by_dataset("It is 12345678.", benchmark) == {
        "answer": "12345678", "correct": True, "no_answer": False, "extracted_by": "last_number"}


def test_hanging_comparison_is_killed_and_the_verifier_recovers_off_the_main_thread():
    """9^{9^{9^9}} makes sympy run (practically) forever; the child process is killed after the time limit."""
    verifier = MathVerifier(timeout_s=60)
    try:
        assert verifier.equal("\\frac{1}{2}", "0.5") is True  # starts the worker
        verifier.timeout_s = 1.0
        results = {}

        def work():
            results["hang"] = verifier.equal("9^{9^{9^{9}}}", "1")
            results["graded"] = is_equivalent("9^{9^{9^{9}}}", "1", verifier=verifier)

        thread = threading.Thread(target=work)  # SIGALRM-based timeouts would not work here
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert results == {"hang": None, "graded": False}
        verifier.timeout_s = 60
        assert verifier.equal("\\sqrt{117}", "3\\sqrt{13}") is True  # a fresh worker took over
    finally:
        verifier.close()
