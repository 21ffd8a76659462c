"""Teacher-forced eviction: without eviction (or with a budget no round reaches) it scores the reference answer as
teacher forcing from scratch does; under eviction every policy sees the same tokens; the command line end to end."""

from __future__ import annotations

import json

import pytest

from core.schemas import Label
from evictor.engine import EvictionEngine
from evictor.protocol import resolve_protocol
from evictor.teacher_forced import ForcedPlan, force_through, main, summarize
from labeling.answer import teacher_forced_scores
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("<|bos|><|user|>What is 6*7?<|eos|><|assistant|>Let us think. Six sevens are forty-two, and seven sixes too, "
        "so the product is forty-two. \\boxed{42}")


def _label(lm, label_id: str = "t") -> Label:
    ids = lm.tokenizer.encode(TEXT)
    prompt = len(lm.tokenizer.encode("<|bos|><|user|>What is 6*7?<|eos|><|assistant|>"))
    cue_start, answer_start = len(ids) - 8, len(ids) - 3
    return Label(id=label_id, dataset="gsm8k", model="tiny", status="labelled", token_ids=ids,
                 reasoning_start=prompt, answer_start=cue_start, n_tokens=len(ids),
                 forced_cue={"start": cue_start, "end": answer_start, "text": "", "kind": "boxed", "box": True},
                 graded={"answer_ids": ids[answer_start:], "reference_logp": -1.0})


def test_without_eviction_the_score_is_teacher_forcing_from_scratch():
    lm = tiny_model("llama", seed=0, initializer_range=0.1)
    plan = ForcedPlan.from_label(_label(lm))
    assert plan is not None and plan.prompt + plan.stream + plan.answer == _label(lm).token_ids  # the trace's own
    expected = teacher_forced_scores(lm.model, [plan.prompt + plan.stream], [plan.answer])[0]
    protocol = resolve_protocol("epikv", {"protect": "prompt"}).config
    for policy, budget in (("full", plan.generated), ("valuediff", 10_000)):  # no round ever fires
        result = force_through(EvictionEngine(lm, policy, protocol), plan, budget, block=7, seed=0)
        assert result["logp"] == pytest.approx(expected.logp, abs=1e-4) and result["rounds"] == 0
        assert result["effect"] == pytest.approx(expected.logp + 1.0, abs=1e-4)


def test_under_eviction_the_cache_stays_at_the_budget_and_random_is_seeded():
    lm = tiny_model("llama", seed=0, initializer_range=0.1)
    plan = ForcedPlan.from_label(_label(lm))
    assert plan is not None
    protocol = resolve_protocol("epikv", {"protect": "prompt"}).config
    runs = [force_through(EvictionEngine(lm, "random", protocol), plan, 6, block=4, seed=3) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]["rounds"] > 0
    assert runs[0]["peak_slots"] < len(plan.prompt) + len(plan.stream)


def test_summary_by_hand():
    records = [{"policy": "p", "budget": 0.5, "greedy": g, "effect": e, "peak_slots": 9}
               for g, e in ((True, 0.0), (False, -2.0), (True, -1.0), (True, -1.0))]
    (row,) = summarize(records)
    assert (row["traces"], row["accuracy"], row["effect"]) == (4, 0.75, -1.0)
    assert row["ci_lo"] < 0.75 < row["ci_hi"] and row["effect_lo"] <= -1.0 <= row["effect_hi"]


def test_command_line_end_to_end_and_refusals(tmp_path, tiny_dir, capsys):
    lm = tiny_model("llama", seed=0)
    labels = tmp_path / "labels.jsonl"
    records = [{**_label(lm, f"t{i}").to_json(), "model": str(tiny_dir)} for i in range(2)]
    labels.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "forced"
    argv = ["--labels", str(labels), "--policy", "full,random,recency", "--budget", "0.5", "--teacher-block", "4",
            "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "forced.jsonl").read_text().splitlines()]
    assert sorted({r["id"].split("/")[0] for r in rows}) == ["full", "random@0.5", "recency@0.5"]
    assert (out / "summary.csv").is_file() and main(argv) == 0  # resumes: nothing recomputed
    assert len((out / "forced.jsonl").read_text().splitlines()) == 6
    capsys.readouterr()
    ungraded = tmp_path / "ungraded.jsonl"
    ungraded.write_text(json.dumps({**records[0], "graded": None}) + "\n")
    assert main(["--labels", str(ungraded), "--policy", "random", "--budget", "0.5", "--out",
                 str(tmp_path / "x")]) == 2
    assert "no labelled record is graded" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main([*argv[:-2], "--temperature", "0.6", "--out", str(tmp_path / "y")]) == 2
    assert "teacher-forced" in capsys.readouterr().err
