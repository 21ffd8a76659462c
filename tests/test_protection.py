"""Each policy carries the protection its method defines, under every protocol, and says when a run is outside the
protocol it is defined for: SnapKV's and R-KV's observation windows, H2O's recent share, EpiKV's prompt."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch

from evictor.engine import EvictionEngine
from evictor.instrument import kept_positions
from evictor.policies import get_policy
from evictor.protocol import PRESETS, EvictionConfig, resolve_protocol, sequence_budgets
from evictor.run import main as run_main
from signals.attention import group_max_probabilities

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sequence_budgets_widen_the_window_to_what_the_policy_keeps():
    # no buffer: the window is the policy's 32; a buffer of 64 holds the newest 32 already: the window stays 0;
    # a buffer of 20 leaves 12 to the window; a larger protocol window (128) wins
    window = get_policy("snapkv").kept_recent
    for buffer, recency, expected in ((0, 0, 32), (64, 0, 0), (20, 0, 12), (0, 128, 128)):
        config = EvictionConfig(budget=256, buffer=buffer, recency=recency, trigger="step")
        assert sequence_budgets([256], [10], "none", config, kept_recent=window).recency == [expected]
    # H2O's split keeps floor(K / 2) of each sequence's own budget
    config = EvictionConfig(budget=100, buffer=0, trigger="step")
    split = get_policy("h2o_split").kept_recent
    assert sequence_budgets([100, 51], [10, 10], "none", config, kept_recent=split).recency == [50, 25]


def test_group_max_probabilities_take_the_groups_largest_logit_before_the_softmax():
    # two query heads of one KV head, one query over three keys; the third key is invisible (-inf) to both
    inf = float("-inf")
    logits = torch.tensor([[[[0.0, 2.0, inf]], [[1.0, 0.0, inf]]]])  # [b=1, q_head=2, Q=1, S=3]
    # group max: (1, 2, -inf) -> softmax (e^1, e^2, 0) / (e^1 + e^2)
    expected = torch.tensor([1.0, 2.0]).exp() / torch.tensor([1.0, 2.0]).exp().sum()
    got = group_max_probabilities(logits, n_kv=1).flatten()
    assert torch.allclose(got[:2], expected) and got[2] == 0
    # the mean of the probabilities differs: (.5 * (1 + e^1) / ..., ...) is not the same distribution
    mean = logits.softmax(-1).mean(1).flatten()
    assert not torch.allclose(mean, got)
    # a query that sees no key gives a zero row, not NaN
    assert torch.equal(group_max_probabilities(torch.full((1, 2, 1, 3), inf), 1), torch.zeros(1, 1, 1, 3))


PROMPT = torch.randint(5, 200, (300,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("name, window", [("snapkv", 32), ("r_kv", 8), ("h2o_split", 48)])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_policys_own_window_survives_every_round_under_every_protocol(tiny_llama, preset, name, window):
    """The newest `window` tokens at each round are kept in every (layer, KV head), whatever the protocol's buffer
    (0 under valuediff and epikv, 64 under random_attention) and trigger; h2o_split keeps half of K = 96."""
    settings = {"budget": 96, "keep_log": True, "on_long_prompt": "sinks", "block": 64}
    config = resolve_protocol(preset, settings).config
    sequence = EvictionEngine(tiny_llama, name, config).generate([PROMPT], 100, ignore_eos=True).sequences[0]
    log, cfg = sequence.keep_log, tiny_llama.model.config
    assert len(log["round_next_pos"]) >= 2
    for index, next_pos in enumerate(log["round_next_pos"]):
        newest = set(range(next_pos - window, next_pos))
        for layer in range(cfg.num_hidden_layers):
            for head in range(cfg.num_key_value_heads):
                assert newest <= set(kept_positions(log, index, layer, head).tolist()), (index, layer, head)


def test_outside_protocol_names_the_protection_the_method_is_defined_for():
    assert get_policy("epikv").outside_protocol("prompt") is None
    reason = get_policy("epikv").outside_protocol("sinks")
    assert reason.startswith("epikv is defined with protection prompt (EpiKV") and reason.endswith("'sinks'")
    assert get_policy("random").outside_protocol("none") is not None
    assert get_policy("random_unprotected").outside_protocol("none") is None
    assert get_policy("streaming_llm").outside_protocol("none") is not None
    assert get_policy("valuediff").outside_protocol("none") is None and get_policy("valuediff").defined_for is None


def test_the_engine_marks_a_sequence_whose_prompt_fallback_left_its_protocol(tiny_llama):
    """A prompt longer than K with --on-long-prompt sinks gives EpiKV's KV family 4 sinks: outside its protocol;
    a prompt that fits keeps the prompt: inside."""
    config = EvictionConfig(budget=64, buffer=0, trigger="step", block=32, on_long_prompt="sinks")
    engine = EvictionEngine(tiny_llama, "kv_key", config)
    long_result, short_result = (engine.generate([p], 4, ignore_eos=True).sequences[0] for p in (PROMPT, PROMPT[:20]))
    assert "kv_key is defined with protection prompt" in long_result.outside_protocol
    assert short_result.outside_protocol is None


def test_an_evictor_run_cell_outside_its_protocol_says_so_in_the_summary(tiny_dir, tmp_path):
    out = tmp_path / "ruler"
    argv = ["--model", tiny_dir, "--dataset", "ruler_niah_multikey@512", "--limit", "2", "--policy", "kv_key,valuediff",
            "--budget", "128", "--protocol", "valuediff", "--on-long-prompt", "sinks", "--max-new-tokens", "2",
            "--out", str(out), "--quiet"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run_main(argv) == 0
    rows = {row["policy"]: row for row in csv.DictReader((out / "summary.csv").open())}
    assert rows["kv_key"]["outside_protocol"].startswith("2 of 2 problems: kv_key is defined with protection prompt")
    assert rows["valuediff"]["outside_protocol"] == ""
