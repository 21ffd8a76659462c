"""Cache-level and joint labels: the pruned cache equals a masked forward over the whole sequence, the datamodel on
hand-made draws, and both label kinds end to end on a real model with records that recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import UsageError
from core.schemas import Trace
from labeling.answer import score_answer, teacher_forced_scores
from labeling.datamodel import fit_datamodel, split_half
from labeling.joint import draw_keep_sets, trace_units
from labeling.labeler import OcclusionConfig, OcclusionLabeler
from labeling.pruned import PrunedContext
from labeling.regenerate import regenerate_naive
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "<|bos|><|user|>What is 6*7?<|eos|><|assistant|>Let us think. Six sevens are forty-two. So \\boxed{"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pruned_cache_scores_equal_a_masked_forward_over_the_whole_sequence(family):
    """Removing entries from a dense cache prefilled once is the forward in which the forced tokens may not attend to
    those positions while every earlier position attends to everything (per KV head: that head's query heads)."""
    lm = tiny_model(family, seed=0, initializer_range=0.1)
    ids = lm.tokenizer.encode(TEXT)
    context, cue, answer = ids[:-6], ids[-6:-2], ids[-2:]
    pruned = PrunedContext(lm.model, context)
    heads, group = pruned.kv_heads, pruned.group
    keep = torch.ones(2, heads, len(context), dtype=torch.bool)
    keep[0, :, 5:12] = False  # a window out of every head
    keep[1, heads - 1, 3:9] = False  # a window out of one head only
    scores = pruned.score(keep, cue, answer, batch_size=1)
    sequence = context + cue + answer[:-1]
    n = len(sequence)
    for row in range(2):
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None].repeat(heads * group, 1, 1)
        for q_head in range(heads * group):
            allowed[q_head, len(context):, :len(context)] &= keep[row, q_head // group]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None]
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([sequence]), position_ids=torch.arange(n)[None],
                              attention_mask=mask).logits[0]
        expected = score_answer(logits[len(context) + len(cue) - 1:], answer)
        assert scores[row].logp == pytest.approx(expected.logp, abs=1e-4)
    whole = pruned.score(torch.ones(1, 1, len(context), dtype=torch.bool), cue, answer)[0]
    assert whole.logp == pytest.approx(teacher_forced_scores(lm.model, [context + cue], [answer])[0].logp, abs=1e-4)
    greedy = pruned.greedy(torch.ones(1, 1, len(context), dtype=torch.bool), cue, 6, [lm.tokenizer.eos_token_id])
    assert greedy[0] == regenerate_naive(lm.model, [context + cue], 6, [lm.tokenizer.eos_token_id])[0]


def test_sliding_window_models_are_refused(tiny_gemma3):
    with pytest.raises(UsageError, match="sliding-window.*--intervention token"):
        PrunedContext(tiny_gemma3.model, [1, 2, 3])


def test_datamodel_recovers_planted_coefficients_and_matches_statsmodels():
    rng = np.random.default_rng(0)
    z = (rng.random((400, 5)) < 0.3).astype(float)
    beta = np.array([2.0, 0.0, -1.0, 0.5, 0.0])
    y = 1.0 + z @ beta + rng.normal(0, 0.3, 400)
    fit = fit_datamodel(z, y)
    assert np.allclose(fit.coef, beta, atol=0.15) and fit.intercept == pytest.approx(1.0, abs=0.15)
    assert (fit.lo[[0, 2, 3]] > 0).tolist() == [True, False, True] and fit.hi[2] < 0
    assert fit.reliability is not None and fit.reliability > 0.9
    import statsmodels.api as sm

    reference = sm.OLS(y, sm.add_constant(z)).fit(cov_type="HC3")
    assert np.allclose(fit.coef, reference.params[1:]) and np.allclose(fit.se, reference.bse[1:])
    with pytest.raises(ValueError, match="draws cannot fit"):
        fit_datamodel(z[:6], y[:6])
    assert split_half(z[:10], y[:10]) is None


def test_a_fact_stated_twice_has_two_positive_coefficients():
    """y drops only when both copies are evicted (the redundancy single-window occlusion cannot see): each copy's
    coefficient is positive, about the loss times the chance the other copy is gone."""
    rng = np.random.default_rng(1)
    z = draw_keep_sets(rng, 600, 1, 8, 0.5)[:, 0, :].astype(float)
    y = np.where((z[:, 2] + z[:, 6]) > 0, 0.0, -10.0) + rng.normal(0, 0.1, 600)
    fit = fit_datamodel(z, y)
    assert fit.lo[2] > 0 and fit.lo[6] > 0
    assert fit.coef[2] == pytest.approx(5.0, abs=1.0) and fit.coef[6] == pytest.approx(5.0, abs=1.0)
    assert all(fit.lo[u] < 0 < fit.hi[u] for u in (0, 1, 3, 4, 5, 7))


def test_keep_sets_are_drawn_at_the_budget_per_head():
    chosen = draw_keep_sets(np.random.default_rng(0), 2000, 3, 10, 0.25)
    assert chosen.shape == (2000, 3, 10) and chosen.mean() == pytest.approx(0.25, abs=0.01)
    assert not (chosen[:, 0] == chosen[:, 1]).all()  # heads draw on their own


def test_units_cut_the_reasoning_span():
    from labeling.labeler import TracePlan
    from labeling.windows import Boundary

    plan = TracePlan(Boundary(45, "boxed"), None, tuple(range(45)), [(10, 42)])
    assert trace_units(plan, 10, 16) == [(10, 26), (26, 42), (42, 45)]


def test_joint_and_cache_configs_refuse_what_cannot_run():
    with pytest.raises(UsageError, match="budget 0 is not a share"):
        OcclusionConfig(intervention="joint", budget=0)
    with pytest.raises(UsageError, match="budget 1.5"):
        OcclusionConfig(intervention="joint", budget=1.5)
    with pytest.raises(UsageError, match="draws must be a positive"):
        OcclusionConfig(intervention="joint", draws=0)
    with pytest.raises(UsageError, match="intervention 'pruning'"):
        OcclusionConfig(intervention="pruning")
    with pytest.raises(UsageError, match="forces the answer from a pruned cache"):
        OcclusionConfig(intervention="cache", force_answer=False)
    joint = OcclusionConfig(intervention="joint", budget=0.5)
    assert "replacement" not in joint.identity() and joint.identity()["budget"] == 0.5
    assert "budget" not in OcclusionConfig().identity()


# --- end to end on the default real model --------------------------------------------------------------------------
def _trace(smollm2) -> Trace:
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

    tok = smollm2.tokenizer
    problem = Problem(id="p", dataset="gsm8k", question="Tom has 3 bags with 7 apples each. How many apples?",
                      answer="21")
    text = ("Tom has 3 bags. Each bag holds 7 apples. So the total is 3 times 7, which is 21 apples. Let me double "
            "check: 7 + 7 + 7 = 21. The answer is \\boxed{21}.")
    return Trace(id="t", dataset="gsm8k", model="smollm2-135m", prompt_ids=build_prompt_ids(tok, problem),
                 generated_ids=tok.encode(text, add_special_tokens=False) + [tok.eos_token_id], gold="21",
                 answer="21", correct=True)


def test_cache_labels_on_smollm2(smollm2):
    trace = _trace(smollm2)
    label = OcclusionLabeler.for_model(smollm2, OcclusionConfig(window=16, stride=16, intervention="cache"),
                                       "gsm8k").label(trace)
    token = OcclusionLabeler.for_model(smollm2, OcclusionConfig(window=16, stride=16), "gsm8k").label(trace)
    assert label.status == "labelled" and label.intervention == "cache" and label.replacement is None
    assert label.reference_answer == token.reference_answer == "21"
    assert [(w["start"], w["end"]) for w in label.windows] == [(w["start"], w["end"]) for w in token.windows]
    assert label.graded["reference_logp"] == pytest.approx(token.graded["reference_logp"], abs=1e-4)
    for window in label.windows:
        assert window["logp"] == pytest.approx(label.graded["reference_logp"] + window["effect"], abs=1e-5)
        assert window["greedy"] or window["outcome"] != "same" or window["answer_after"] == "21"
    each = OcclusionLabeler.for_model(smollm2, OcclusionConfig(window=16, stride=16, intervention="cache",
                                                               heads="each"), "gsm8k").label(trace)
    assert len(each.windows) == 3 * len(label.windows) and {w["head"] for w in each.windows} == {0, 1, 2}


def test_joint_labels_on_smollm2_recompute_from_their_records(smollm2):
    trace = _trace(smollm2)
    config = OcclusionConfig(window=16, stride=16, intervention="joint", budget=0.5, unit=8, draws=40)
    label = OcclusionLabeler.for_model(smollm2, config, "gsm8k").label(trace)
    again = OcclusionLabeler.for_model(smollm2, config, "gsm8k").label(trace)
    assert label.status == "labelled" and label.intervention == "joint" and label == again  # seeded draws
    joint = label.joint
    units = [(w["start"], w["end"]) for w in label.windows]
    assert units[0][0] == label.reasoning_start and units[-1][1] == label.answer_start and joint["draws"] == 40
    z = np.zeros((40, len(units)))
    for m, draw in enumerate(joint["records"]):
        for head in draw["kept"]:
            z[m, head] += 1 / len(draw["kept"])
    refit = fit_datamodel(z, np.array([draw["logp"] for draw in joint["records"]]))
    assert np.allclose(refit.coef, [w["coef"] for w in label.windows], atol=1e-4)
    assert all(w["effect"] == -w["coef"] and w["effect_hi"] == -w["coef_lo"] for w in label.windows)
    assert [bool(lo > 0) for lo in refit.lo] == [w["flipped"] for w in label.windows]
    positions = dict(zip(label.positions, label.labels))
    assert all(positions[p] == int(w["flipped"]) for w in label.windows for p in range(w["start"], w["end"]))
