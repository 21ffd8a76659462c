"""kvscope's kept sets against kvpress's (bench/kvpress_compare.py kept), where bench/.venv-kvpress exists.

Every method the two libraries define alike keeps the same prompt positions in every (layer, KV head) after prefill
compression; each method listed with a definitional difference says what it is. Skipped, saying why, where the
kvpress environment was not built.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import kvpress_compare as compare  # noqa: E402  (bench/ is a scripts folder, not a package)

pytestmark = [
    pytest.mark.skipif(not compare.VENV_PYTHON.exists(),
                       reason="bench/.venv-kvpress is not built (bash bench/setup_kvpress.sh builds it: kvpress 0.5.5 "
                       "pins transformers < 5.3, so it cannot share kvscope's environment)"),
    pytest.mark.usefixtures("one_thread"),
]


def test_jaccard_by_hand():
    assert compare.jaccard({1, 2, 3}, {2, 3, 4}) == 0.5 and compare.jaccard(set(), set()) == 1.0


def check(summary: list[dict], pairs: list[dict], layers: int, heads: int) -> None:
    by_name = {row["method"]: row for row in summary}
    assert set(by_name) == {m.name for m in compare.METHODS}
    for method in compare.METHODS:
        row = by_name[method.name]
        assert row["pairs"] == layers * heads and row["n_kept"] > 0
        if method.difference is None:
            failing = [(p["layer"], p["head"], p["jaccard"]) for p in pairs
                       if p["method"] == method.name and p["jaccard"] < 1.0]
            assert not failing, f"{method.name}: kept sets differ from kvpress's at {failing[:5]}"
    # BlockPress's schedule coincides with the block prefill when a multiple of the block is kept, so layer 0 (keys
    # independent of attention) must agree; deeper layers need not (kvpress does not prefill block by block)
    assert by_name["keydiff_block128"]["layer0_identical"] == heads


def test_every_matched_method_keeps_the_same_positions_on_the_tiny_llama(tmp_path):
    lm, directory = compare.load_side_by_side("tiny-llama", str(tmp_path))
    prompt = compare.context_prompt(lm, 512)
    summary, pairs = compare.compare_kept(lm, directory, prompt, 0.75)
    assert {row["n_kept"] for row in summary} == {128}
    check(summary, pairs, lm.model.config.num_hidden_layers, lm.model.config.num_key_value_heads)


@pytest.mark.slow
def test_every_matched_method_keeps_the_same_positions_on_smollm2(tmp_path):
    lm, directory = compare.load_side_by_side("smollm2-135m", str(tmp_path))
    summary, pairs = compare.compare_kept(lm, directory, compare.context_prompt(lm, 1024), 0.75)
    check(summary, pairs, lm.model.config.num_hidden_layers, lm.model.config.num_key_value_heads)
