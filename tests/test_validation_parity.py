"""Teacher-forced greedy parity (`validation.parity`): hand-made logits, the tiny models' own greedy traces, a trace
with one token changed, SmolLM2's greedy trace, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from core.errors import UsageError
from core.schemas import Trace
from tasks.generation import generate
from tasks.problem import Problem
from tasks.prompts import build_prompt_ids
from validation.parity import Divergence, check_greedy, describe, greedy_divergence, main, summarize, trace_parity

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_divergence_on_hand_made_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0],   # argmax 1, trace 1: agrees
                           [2.0, 2.0, 0.0],   # tie between 0 and 1, trace 1: agrees (it attains the maximum)
                           [5.0, 1.0, 4.5],   # argmax 0, trace 2: behind by 0.5, the runner-up
                           [0.0, 0.0, 9.0]])  # later rows do not matter
    assert greedy_divergence(logits, torch.tensor([1, 1, 2, 0])) == Divergence(position=2, margin=0.5, rank=1)
    assert greedy_divergence(logits, torch.tensor([1, 0, 0, 2])) is None
    # The trace's token third from the top: two logits above it.
    assert greedy_divergence(logits[2:3], torch.tensor([1])) == Divergence(position=0, margin=4.0, rank=2)


def _trace(lm, prompt, generated, **fields) -> Trace:
    return Trace(id=fields.pop("id", "t0"), dataset="gsm8k", model=lm.name, prompt_ids=list(prompt),
                 generated_ids=list(generated), **fields)


def test_the_models_own_greedy_trace_is_identical_and_a_changed_token_diverges_there(tiny):
    prompt = [5, 17, 42, 9, 33, 8]
    generated = generate(tiny, prompt, 12, stop_ids=[]).generated_ids
    record = trace_parity(tiny, _trace(tiny, prompt, generated))
    assert record["identical"] and record["first_divergence"] is None and record["generated"] == 12

    changed = list(generated)
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([prompt + generated[:7]])).logits[0, -1]
    changed[7] = int(logits.argsort(descending=True)[1])  # the runner-up at position 7
    record = trace_parity(tiny, _trace(tiny, prompt, changed))
    assert not record["identical"]
    assert (record["first_divergence"], record["rank"]) == (7, 1)
    assert record["margin"] == pytest.approx(float(logits.max() - logits[changed[7]]), rel=1e-4, abs=1e-5)


def test_summary_counts_identical_traces_and_where_the_others_diverge():
    records = [{"id": "a", "engine": "vllm", "generated": 100, "identical": True, "first_divergence": None,
                "margin": None, "rank": None},
               {"id": "b", "engine": "vllm", "generated": 200, "identical": False, "first_divergence": 50,
                "margin": 0.01, "rank": 1},
               {"id": "c", "engine": "vllm", "generated": 100, "identical": False, "first_divergence": 90,
                "margin": 0.03, "rank": 2}]
    summary = summarize(records)
    assert (summary["traces"], summary["identical"], summary["generated_tokens"]) == (3, 1, 400)
    assert summary["first_divergences"] == [50, 90] and summary["median_first_divergence"] == 70
    assert summary["median_divergence_fraction"] == pytest.approx((0.25 + 0.9) / 2)
    assert (summary["median_margin"], summary["max_margin"], summary["runner_up"]) == (0.02, 0.03, 1)
    assert summary["identical_lo"] < 1 / 3 < summary["identical_hi"]
    assert describe(summary).startswith("1 of 3 traces (33%, 95% Wilson [")


def test_sampled_traces_are_refused(tiny):
    trace = _trace(tiny, [1, 2], [3], sampling={"temperature": 0.6, "top_p": 0.95})
    with pytest.raises(UsageError, match=r"1 trace\(s\) were sampled \(first 't0', temperature 0.6\)"):
        check_greedy([trace], "--traces x")


def test_cli_on_the_tiny_models_traces(tiny_dir, tmp_path, capsys):
    from models.loading import load_model

    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
    prompts = [[5, 17, 42, 9], [8, 8, 3, 11, 40]]
    traces = [_trace(lm, p, generate(lm, p, 8, stop_ids=[]).generated_ids, id=f"p{i}") for i, p in enumerate(prompts)]
    traces[1].generated_ids[3] = (traces[1].generated_ids[3] + 1) % lm.config.vocab_size
    path = tmp_path / "generations.jsonl"
    path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in traces))
    assert main(["--traces", str(path), "--out", str(tmp_path / "parity"), "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("1 of 2 traces (50%")
    summary = json.loads((tmp_path / "parity" / "summary.json").read_text())
    assert (summary["identical"], summary["first_divergences"]) == (1, [3])
    assert len((tmp_path / "parity" / "parity.jsonl").read_text().splitlines()) == 2
    assert main(["--traces", str(path), "--out", str(tmp_path / "parity"), "--quiet"]) == 0  # resumes: nothing left


def test_sampled_traces_exit_2_with_one_line(tiny_dir, tmp_path, capsys):
    record = Trace(id="s", dataset="gsm8k", model=str(tiny_dir), prompt_ids=[1, 2], generated_ids=[3],
                   sampling={"temperature": 0.6, "top_p": 0.95}).to_json()
    path = tmp_path / "sampled.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert main(["--traces", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "were sampled" in err and not (tmp_path / "out").exists()


def test_smollm2_own_greedy_trace_is_identical(smollm2):
    prompt = build_prompt_ids(smollm2.tokenizer, Problem("p", "What is 12 + 30?", "42", "gsm8k"))
    generated = generate(smollm2, prompt, 24).generated_ids
    assert trace_parity(smollm2, _trace(smollm2, prompt, generated))["identical"]
