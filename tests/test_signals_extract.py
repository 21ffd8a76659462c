"""Signal extraction: streaming during decode equals a teacher-forced pass; per-signal definitions; the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from core.errors import UsageError
from models.hooks import capture
from models.tiny import tiny_model
from probes.signals import kv as kv_scores
from probes.signals.extract import (
    DEFAULT_SIGNALS,
    SIGNALS,
    resolve_layers,
    stream_signals,
    teacher_forced_signals,
)
from probes.signals.hidden import hidden_diffs, resid_post_name


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_traces(tmp_path_factory, tiny_dir):
    path = tmp_path_factory.mktemp("traces") / "generations.jsonl"
    rows = [{"id": f"t{i}", "model": str(tiny_dir), "dataset": "gsm8k", "prompt_ids": list(range(40, 50 + i)),
             "generated_ids": list(range(60, 80))} for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_resolve_layers():
    assert resolve_layers("all", 4) == [0, 1, 2, 3]
    assert resolve_layers("3,1,1", 4) == [1, 3]
    with pytest.raises(UsageError, match="out of range"):
        resolve_layers("4", 4)
    with pytest.raises(UsageError, match="comma-separated"):
        resolve_layers("x", 4)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def tiny_eager(request):
    return tiny_model(request.param, seed=0, attn_implementation="eager")


def test_streaming_equals_teacher_forced_for_every_signal(tiny_eager):
    """One pass during decode vs one forward over the same forwarded ids (the gemma3 tiny slides over 16 tokens)."""
    prompt = list(range(40, 60))
    result, streamed = stream_signals(tiny_eager, prompt, 24, "all", SIGNALS)
    forwarded = prompt + result.generated_ids[:-1]  # the last sampled token is never fed back
    forced = teacher_forced_signals(tiny_eager, forwarded, "all", SIGNALS)
    for signal in SIGNALS:
        for layer, values in forced[signal].items():
            assert streamed[signal][layer].shape == (1, len(forwarded)), signal
            close = torch.allclose(streamed[signal][layer], values, atol=1e-4, rtol=1e-4, equal_nan=True)
            assert close, (signal, layer)


def test_teacher_forced_definitions_on_a_tiny_model(tiny_llama):
    ids = list(range(30, 50))
    got = teacher_forced_signals(tiny_llama, ids, [0, 2], DEFAULT_SIGNALS)
    model = tiny_llama.model
    names = [resid_post_name(2), "blocks.2.attn.hook_cache_k", "blocks.2.attn.hook_cache_v"]
    from transformers import DynamicCache

    with torch.no_grad(), capture(model, names) as cap:
        model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True)
    k, v = cap["blocks.2.attn.hook_cache_k"], cap["blocks.2.attn.hook_cache_v"]  # [1, kv_head, pos, d_head]
    assert torch.allclose(got["hidden_diff"][2], hidden_diffs(cap[resid_post_name(2)]), equal_nan=True)
    assert math.isnan(got["hidden_diff"][2][0, 0])
    assert torch.allclose(got["key_norm"][2], k.norm(dim=-1).mean(1), atol=1e-5)
    assert torch.allclose(got["value_variance"][2], v.var(-1, unbiased=False).mean(1), atol=1e-5)
    # ValueDiff against the causal mean: position t compares with the mean of values 0..t
    t = 7
    causal_mean = v[:, :, : t + 1].mean(2)  # [1, kv_head, d]
    expected = (v[:, :, t] - causal_mean).norm(dim=-1).mean(1)
    assert torch.allclose(got["value_distance_to_mean"][2][:, t], expected, atol=1e-5)
    assert got["value_distance_to_mean"][2][0, 0] == 0  # the first value is its own mean
    assert torch.allclose(got["key_cosine_to_mean"][2][0, 0], torch.tensor(0.0), atol=1e-6)
    expected_lag = kv_scores.lag_normalised_variance(k).mean(1)
    assert torch.allclose(got["lag_key_variance"][2], expected_lag, atol=1e-5)


def test_attention_signals_by_hand(tiny_llama):
    eager = tiny_model("llama", seed=0, attn_implementation="eager")
    ids = list(range(30, 42))
    got = teacher_forced_signals(eager, ids, [1], ["h2o", "tova", "attention_entropy"])
    out = eager.model(input_ids=torch.tensor([ids]), output_attentions=True)
    probs = out.attentions[1].mean(1)[0]  # [queries, keys], averaged over query heads
    assert torch.allclose(got["h2o"][1][0], probs.sum(0), atol=1e-5)
    assert torch.allclose(got["tova"][1][0], probs[-1], atol=1e-5)
    assert got["attention_entropy"][1][0, 0].abs() < 1e-6  # the first query sees one key: entropy 0
    with pytest.raises(UsageError, match="eager"):
        teacher_forced_signals(tiny_llama, ids, [1], ["h2o"])  # the fixture model runs SDPA


def test_kv_signals_are_causal_when_tokens_are_appended(tiny_llama):
    ids = list(range(30, 70))
    full = teacher_forced_signals(tiny_llama, ids, [3], DEFAULT_SIGNALS)
    part = teacher_forced_signals(tiny_llama, ids[:25], [3], DEFAULT_SIGNALS)
    for signal in DEFAULT_SIGNALS:
        assert torch.allclose(part[signal][3], full[signal][3][:, :25], atol=1e-5, equal_nan=True), signal


@pytest.mark.realmodel
def test_smollm2_streaming_hidden_diff_equals_teacher_forced(smollm2):
    """fp32 SmolLM2: g_l from the decode loop vs one forward, all layers; tolerance 1e-4 relative (measured 1.5e-6)."""
    from tasks.prompts import build_prompt_ids
    from tasks.datasets import Problem

    prompt = build_prompt_ids(smollm2.tokenizer, Problem("p", "What is 2 + 3?", "5", "gsm8k"))
    result, streamed = stream_signals(smollm2, prompt, 12, "all", ["hidden_diff", "key_variance"])
    forwarded = prompt + result.generated_ids[:-1]
    forced = teacher_forced_signals(smollm2, forwarded, "all", ["hidden_diff", "key_variance"])
    worst = 0.0
    for signal in ("hidden_diff", "key_variance"):
        for layer in range(smollm2.config.num_hidden_layers):
            a, b = streamed[signal][layer][0, 1:], forced[signal][layer][0, 1:]
            assert a.shape == b.shape == (len(forwarded) - 1,)
            worst = max(worst, ((a - b).abs() / b.abs().clamp_min(1e-3)).max().item())
    assert worst < 1e-4, worst


def test_cli_writes_signals_and_resumes(tmp_path, tiny_dir, tiny_traces):
    from probes.signals.__main__ import main

    out = tmp_path / "signals.jsonl"
    argv = ["--traces", str(tiny_traces), "--model", str(tiny_dir), "--layers", "1,3",
            "--signals", "hidden_diff,key_norm", "--smoothing", "mean", "--window", "4", "--bands", "1,3",
            "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    rec = records[0]
    n = len(rec["positions"])
    assert n == rec["n_tokens"] and set(rec["signals"]) == {"hidden_diff", "key_norm"}
    assert set(rec["signals"]["hidden_diff"]) == {"1", "3"} and len(rec["signals"]["key_norm"]["3"]) == n
    assert rec["signals"]["hidden_diff"]["1"][0] is None  # position 0 has no predecessor
    assert len(rec["band_score"]) == n
    assert (tmp_path / "signals.config.json").exists()
    assert main(argv) == 0  # resume: nothing new appended
    assert len(out.read_text().splitlines()) == 2


def test_cli_bad_input_exits_2_without_output(tmp_path, tiny_dir, tiny_traces, capsys):
    from probes.signals.__main__ import main

    out = tmp_path / "x" / "signals.jsonl"
    base = ["--traces", str(tiny_traces), "--model", str(tiny_dir), "--out", str(out)]
    assert main(base + ["--signals", "hidden_dif"]) == 2
    assert "hidden_diff" in capsys.readouterr().err
    assert main(base + ["--layers", "9"]) == 2
    assert main(base + ["--signals", "h2o", "--layers", "1", "--smoothing", "median"]) == 2
    assert main(["--traces", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert not out.parent.exists()
