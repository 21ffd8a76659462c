"""Signal extraction: streaming during decode equals a teacher-forced pass; per-signal definitions; the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from core.errors import UsageError
from models.hooks import capture
from models.tiny import tiny_model
from signals import SIGNALS, default_signals
from signals import kv as kv_scores
from signals.extract import resolve_layers, stream_signals, teacher_forced_signals
from signals.hidden import hidden_diffs, hidden_state_name

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


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_streaming_equals_teacher_forced_for_every_signal(family, kernel):
    """One pass during decode vs one forward over the same forwarded ids (the gemma3 tiny slides over 16 tokens),
    on either kernel: the attention signals are recomputed, not read from the eager kernel."""
    lm = tiny_model(family, seed=0, attn_implementation=kernel)
    prompt = list(range(40, 60))
    result, streamed = stream_signals(lm, prompt, 24, "all", SIGNALS)
    forwarded = prompt + result.generated_ids[:-1]  # the last sampled token is never fed back
    forced = teacher_forced_signals(lm, forwarded, "all", SIGNALS)
    for signal in SIGNALS:
        for layer, values in forced[signal].items():
            assert streamed[signal][layer].shape == (1, len(forwarded)), signal
            close = torch.allclose(streamed[signal][layer], values, atol=1e-4, rtol=1e-4, equal_nan=True)
            assert close, (signal, layer)


def test_teacher_forced_definitions_on_a_tiny_model(tiny_llama):
    ids = list(range(30, 50))
    got = teacher_forced_signals(tiny_llama, ids, [0, 2], default_signals())
    model = tiny_llama.model
    names = [hidden_state_name(2), "blocks.2.attn.hook_cache_k", "blocks.2.attn.hook_cache_v"]
    from transformers import DynamicCache

    with torch.no_grad(), capture(model, names) as cap:
        model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True)
    k, v = cap["blocks.2.attn.hook_cache_k"], cap["blocks.2.attn.hook_cache_v"]  # [1, kv_head, pos, d_head]
    assert torch.allclose(got["hidden_diff"][2], hidden_diffs(cap[hidden_state_name(2)]), equal_nan=True)
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
    attention = ["h2o", "tova", "attention_entropy"]
    got = teacher_forced_signals(eager, ids, [1], attention)
    out = eager.model(input_ids=torch.tensor([ids]), output_attentions=True)
    probs = out.attentions[1].mean(1)[0]  # [queries, keys], averaged over query heads
    assert torch.allclose(got["h2o"][1][0], probs.sum(0), atol=1e-5)
    assert torch.allclose(got["tova"][1][0], probs[-1], atol=1e-5)
    assert got["attention_entropy"][1][0, 0].abs() < 1e-6  # the first query sees one key: entropy 0
    on_sdpa = teacher_forced_signals(tiny_llama, ids, [1], attention)  # the fixture model runs SDPA
    for signal in attention:
        torch.testing.assert_close(on_sdpa[signal][1], got[signal][1], rtol=1e-5, atol=1e-6)


def test_kv_signals_are_causal_when_tokens_are_appended(tiny_llama):
    ids = list(range(30, 70))
    full = teacher_forced_signals(tiny_llama, ids, [3], default_signals())
    part = teacher_forced_signals(tiny_llama, ids[:25], [3], default_signals())
    for signal in default_signals():
        assert torch.allclose(part[signal][3], full[signal][3][:, :25], atol=1e-5, equal_nan=True), signal


@pytest.mark.realmodel
def test_smollm2_streaming_hidden_diff_equals_teacher_forced(smollm2):
    """fp32 SmolLM2: g_l from the decode loop vs one forward, all layers; tolerance 1e-4 relative (measured 1.5e-6)."""
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

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


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cli_argv(traces, tiny_dir, out, *extra):
    return ["--traces", str(traces), "--model", str(tiny_dir), "--layers", "1,3", "--signals", "hidden_diff,key_norm",
            "--smoothing", "mean", "--window", "4", "--out", str(out), *extra]


def test_cli_writes_signals_and_resumes(tmp_path, tiny_dir, tiny_traces):
    from core.schemas import Signal
    from signals.__main__ import main

    out = tmp_path / "signals.jsonl"
    argv = _cli_argv(tiny_traces, tiny_dir, out, "--bands", "1,3")
    assert main(argv) == 0
    records = _records(out)
    assert len(records) == 2 and [r["id"] for r in records] == ["t0", "t1"]
    rec = records[0]
    assert rec["kind"] == "signal" and "trace_id" not in rec and Signal.from_json(rec).id == "t0"
    n = len(rec["positions"])
    assert n == rec["n_tokens"] == 30 and rec["n_prompt"] == 10 and set(rec["signals"]) == {"hidden_diff", "key_norm"}
    assert set(rec["signals"]["hidden_diff"]) == {"1", "3"} and len(rec["signals"]["key_norm"]["3"]) == n
    assert rec["signals"]["hidden_diff"]["1"][0] is None  # position 0 has no predecessor
    assert rec["smoothing"] == "mean" and rec["window"] == 4 and rec["layers"] == [1, 3]
    assert rec["hidden_hook"] == "hook_resid_pre"  # where h_l was read, for the band policy configured from it
    assert len(rec["band_score"]) == n
    config = json.loads((tmp_path / "signals.config.json").read_text())
    assert config["identity"]["smoothing"] == "mean" and config["identity"]["window"] == 4
    assert config["identity"]["traces"] == str(tiny_traces.resolve()) and config["layers_measured"] == [1, 3]
    assert {p.name for p in tmp_path.iterdir()} == {"signals.jsonl", "signals.config.json"}  # the lock is gone
    assert main(argv) == 0  # resume: nothing new appended
    assert _records(out) == records
    # without hidden_diff no hidden state is read, so no record names a hook; raw records name no window
    norms = tmp_path / "norms" / "signals.jsonl"
    assert main(["--traces", str(tiny_traces), "--model", str(tiny_dir), "--layers", "1", "--signals", "key_norm",
                 "--out", str(norms)]) == 0
    assert all("hidden_hook" not in r and "window" not in r for r in _records(norms))


def test_cli_reruns_with_other_settings_exit_2_naming_the_setting(tmp_path, tiny_dir, tiny_traces, capsys):
    from signals.__main__ import main

    out = tmp_path / "signals.jsonl"
    assert main(_cli_argv(tiny_traces, tiny_dir, out)) == 0
    before = out.read_text()
    other_traces = tmp_path / "other.jsonl"
    other_traces.write_text(tiny_traces.read_text())
    refusals = {"smoothing": ["--smoothing", "z"], "window": ["--window", "8"], "layers": ["--layers", "0,1,3"],
                "traces": ["--traces", str(other_traces)], "signals": ["--signals", "hidden_diff"]}
    for setting, change in refusals.items():
        capsys.readouterr()
        assert main(_cli_argv(tiny_traces, tiny_dir, out) + change) == 2, setting
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{setting} " in err and "(now " in err, err
        assert out.read_text() == before
    # --alpha is the EMA's: rolling-mean records do not depend on it, so the run resumes.
    assert main(_cli_argv(tiny_traces, tiny_dir, out, "--alpha", "0.5")) == 0
    assert out.read_text() == before
    # Another file in the same directory is another run, with its own configuration.
    assert main(_cli_argv(tiny_traces, tiny_dir, tmp_path / "z.jsonl", "--smoothing", "z")) == 0
    assert json.loads((tmp_path / "z.config.json").read_text())["identity"]["smoothing"] == "z"


def test_cli_resumes_a_file_of_records_keyed_by_trace_id(tmp_path, tiny_dir, tiny_traces):
    from signals.__main__ import main

    out = tmp_path / "signals.jsonl"
    old = {"trace_id": "t0", "model": str(tiny_dir), "n_tokens": 1, "n_prompt": 1, "positions": [0],
           "signals": {"key_norm": {"1": [1.0]}}}
    out.write_text(json.dumps(old) + "\n")
    assert main(_cli_argv(tiny_traces, tiny_dir, out)) == 0
    assert [r.get("id", r.get("trace_id")) for r in _records(out)] == ["t0", "t1"]  # t0 was not made again


def test_cli_second_concurrent_run_exits_2_at_once(tmp_path, tiny_dir, tiny_traces, capsys, monkeypatch):
    import models.loading
    from signals.__main__ import main

    argv = _cli_argv(tiny_traces, tiny_dir, tmp_path / "signals.jsonl")
    real_load = models.loading.load_model
    second = []

    def load_while_a_second_run_starts(*args, **kwargs):
        second.append(main(argv))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(models.loading, "load_model", load_while_a_second_run_starts)
    assert main(argv) == 0
    assert second == [2]
    err = capsys.readouterr().err
    assert "--out 'signals.jsonl' in" in err and "is in use by another run (pid" in err
    assert len(_records(tmp_path / "signals.jsonl")) == 2


def test_cli_out_that_is_a_directory_or_below_a_file_exits_2_writing_nothing(tmp_path, tiny_dir, tiny_traces,
                                                                           capsys):
    from signals.__main__ import main

    file = tmp_path / "taken.jsonl"
    file.write_text("keep me\n")
    before = sorted(tmp_path.rglob("*"))
    for out, message in ((tmp_path, "is a directory"), (file / "signals.jsonl", "is a file, so nothing can be"),
                         (file / "x" / "signals.jsonl", "is a file, so nothing can be")):
        assert main(_cli_argv(tiny_traces, tiny_dir, out)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
    assert sorted(tmp_path.rglob("*")) == before and file.read_text() == "keep me\n"


def test_cli_bad_input_exits_2_without_output(tmp_path, tiny_dir, tiny_traces, capsys):
    from signals.__main__ import main

    out = tmp_path / "x" / "signals.jsonl"
    base = ["--traces", str(tiny_traces), "--model", str(tiny_dir), "--out", str(out)]
    cases = [(["--signals", "hidden_dif"], "hidden_diff"), (["--layers", "9"], "out of range"),
             (["--signals", "h2o", "--layers", "1", "--smoothing", "median"], "unknown smoothing 'median'"),
             (["--device", "bogus"], "'bogus' is not a device"), (["--dtype", "float8"], "invalid choice"),
             (["--alpha", "1.5"], "--alpha"), (["--bands", "1"], "two layers")]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        # One error line (a bad layer is found once the model is loaded, after the loader's progress bar).
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(err) == 1 and message in err[0], err
    assert main(["--traces", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    evicted = tmp_path / "evicted.jsonl"
    rows = [json.loads(line) for line in tiny_traces.read_text().splitlines()]
    evicted.write_text("".join(json.dumps({**r, "policy": "h2o", "eviction": {"rounds": 3}}) + "\n" for r in rows))
    assert main(["--traces", str(evicted), "--out", str(out)]) == 2
    assert "generated under eviction (first 't0', policy h2o)" in capsys.readouterr().err
    assert not out.parent.exists()
