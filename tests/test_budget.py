"""Budgets as asked (`evictor.protocol.Budget`): one grammar and one range check for every CLI, and resolution to
tokens, on hand-made values."""

from __future__ import annotations

import json
import re

import pytest

from core.errors import UsageError
from evictor.protocol import FRACTION, TOKENS, Budget, EvictionConfig, parse_budget, parse_budgets
from evictor.summary import SweepCell


@pytest.mark.parametrize("text, amount, unit", [
    ("0.5", 0.5, FRACTION), (" 0.25 ", 0.25, FRACTION), ("1", 1.0, FRACTION), ("1.0", 1.0, FRACTION),
    ("2", 2, TOKENS), ("256", 256, TOKENS), ("2.0", 2, TOKENS), ("1e3", 1000, TOKENS),
    ("123456789012345678901234567", 123456789012345678901234567, TOKENS),  # as written, not rounded by a float
])
def test_a_number_in_0_1_is_a_fraction_and_a_whole_number_from_2_is_tokens(text, amount, unit):
    budget = parse_budget(text)
    assert (budget.amount, budget.unit) == (amount, unit) and type(budget.amount) is type(amount)


@pytest.mark.parametrize("text, message", [
    ("0", "--budget '0' is neither a fraction in (0, 1]"), ("-0.5", "is neither"), ("1.5", "is neither"),
    ("inf", "is neither"), ("nan", "is neither"), ("half", "--budget 'half' is not a number"),
    ("", "--budget '' is not a number"),
])
def test_anything_else_is_one_line_naming_the_value_and_the_valid_forms(text, message):
    with pytest.raises(UsageError, match=re.escape(message)) as refused:
        parse_budget(text)
    assert "\n" not in str(refused.value) and "0.25,0.5" in str(refused.value) and "256,1024" in str(refused.value)


def test_a_list_keeps_its_order_refuses_a_repeat_and_names_its_flag():
    assert parse_budgets("256,0.5,1") == (Budget(256, TOKENS), Budget(0.5, FRACTION), Budget(1.0, FRACTION))
    for repeated in ("256,256.0", "1,1.0", "0.5, 0.5"):
        with pytest.raises(UsageError, match="twice"):
            parse_budgets(repeated)
    with pytest.raises(UsageError, match="^--keep '1.5' is neither"):
        parse_budgets("0.5,1.5", "--keep")


def test_the_value_checks_its_own_range():
    assert Budget(1, FRACTION).amount == 1.0 and isinstance(Budget(1, FRACTION).amount, float)
    assert Budget(2.0, TOKENS).amount == 2 and isinstance(Budget(2.0, TOKENS).amount, int)
    for amount, unit in ((1, TOKENS), (2.5, TOKENS), (True, TOKENS), (0, FRACTION), (1.5, FRACTION),
                         (float("nan"), FRACTION), ("3", TOKENS)):
        with pytest.raises(UsageError, match="is neither a fraction"):
            Budget(amount, unit)
    with pytest.raises(UsageError, match="did you mean 'tokens'"):
        Budget(256, "token")


def test_resolution_to_tokens_by_hand():
    assert Budget(512, TOKENS).resolve(7) == 512  # tokens whatever the reference length
    assert Budget(0.25, FRACTION).resolve(1000) == 250
    assert Budget(0.3, FRACTION).resolve(10) == 3  # 0.3 * 10 is 3.0000000000000004 in floats: still 3
    assert Budget(0.5, FRACTION).resolve(7) == 4  # ceil(3.5)
    assert Budget(1.0, FRACTION).resolve(123) == 123  # the whole reference length, not one token
    assert Budget(0.001, FRACTION).resolve(10) == 1  # at least one token
    assert (Budget(64, TOKENS).tokens, Budget(0.5, FRACTION).tokens) == (64, None)


def test_written_as_before_and_ordered_by_amount():
    budgets = [Budget(192, TOKENS), Budget(0.5, FRACTION), Budget(1.0, FRACTION)]
    assert json.dumps([b.to_json() for b in budgets]) == "[192, 0.5, 1.0]"  # records, CSVs and identities
    assert [f"{b:g}" for b in budgets] == ["192", "0.5", "1"] and [str(b) for b in budgets] == ["192", "0.5", "1.0"]
    assert [SweepCell("random", {}, b).label for b in budgets] == ["random-K192", "random-K0.5", "random-K1"]
    assert sorted(budgets) == [Budget(0.5, FRACTION), Budget(1.0, FRACTION), Budget(192, TOKENS)]


def test_an_engine_protocol_holds_k_in_tokens_or_none():
    assert EvictionConfig(budget=None).budget is None  # each sequence is given its own K
    with pytest.raises(UsageError, match="Budget.resolve"):
        EvictionConfig(budget=0.5)


def test_a_protocol_without_its_own_k_needs_each_prompts(tiny_llama):
    from evictor.engine import EvictionEngine

    engine = EvictionEngine(tiny_llama, "recency", EvictionConfig(budget=None, buffer=2))
    with pytest.raises(UsageError, match="give each prompt its K"):
        engine.generate([[5, 6, 7]], 2)
    assert engine.generate([[5, 6, 7]], 2, budgets=[Budget(0.5, FRACTION).resolve(8)]).sequences[0].budget == 4
