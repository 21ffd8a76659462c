"""Occlusion labelling: windows and labels by hand; the fast engine reproduces the naive one token for token."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import DynamicCache

from core.errors import UsageError
from core.schemas import Label, Trace
from labeling import speculative
from labeling.agreement import cohen_kappa, label_agreement
from labeling.estimates import estimate_seconds
from labeling.job import refuse_evicted
from labeling.labeler import OcclusionConfig, OcclusionLabeler, label_traces, make_units, select_traces
from labeling.regenerate import PrefixCache, Row, greedy_extend_with_draft, regenerate_naive, regenerate_rows
from labeling.replacement import pad_problem, resolve_replacement
from labeling.speculative import NgramLookup, _compact, _join, speculative_greedy
from labeling.windows import find_answer_boundary, find_answer_cue, occlude, occlusion_windows, rule_labels
from models.tiny import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


PROMPT = "<|bos|><|user|>What is 6*7?<|eos|><|assistant|>"
REASONING = "Let us think. Six times seven: six sevens are forty-two, check 7*6=42 again. So"


def test_occlusion_windows_by_hand():
    assert occlusion_windows(10, 26, 8, 4) == [(10, 18), (14, 22), (18, 26)]
    # the regular windows stop at 12..20; one more window flush with the end covers position 20
    assert occlusion_windows(0, 21, 8, 4) == [(0, 8), (4, 12), (8, 16), (12, 20), (13, 21)]
    assert occlusion_windows(5, 12, 8, 4) == []  # span of 7 < window
    assert occlusion_windows(5, 13, 8, 8) == [(5, 13)]
    with pytest.raises(ValueError, match="untested"):
        occlusion_windows(0, 40, 8, 9)


def test_occlude_replaces_or_deletes():
    ids = [1, 2, 3, 4, 5]
    assert occlude(ids, 1, 3, 0) == [1, 0, 0, 4, 5]
    assert occlude(ids, 1, 3, None) == [1, 4, 5]


def test_rule_labels_or_over_covering_windows():
    windows = [(3, 7), (5, 9), (7, 11)]
    for rule in ("flip", "exclude", "own-class"):  # without a missing answer the rules agree
        labels = rule_labels(3, 12, windows, ["same", "different", "same"], rule)
        # Position 11 is covered by no window: 0 under flip (EpiKV's rule), unlabelled (no evidence) otherwise.
        assert list(labels) == list(range(12 if rule == "flip" else 11))
        assert list(labels.values())[:11] == [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0]


def test_rule_labels_under_each_no_answer_rule():
    # Prompt [0, 2); windows [2, 6) no answer, [4, 8) same, [6, 10) degenerate; reasoning [2, 10).
    windows, outcomes = [(2, 6), (4, 8), (6, 10)], ["no_answer", "same", "degenerate"]
    flip = rule_labels(2, 10, windows, outcomes, "flip")
    assert [flip[p] for p in range(10)] == [1] * 10  # every reasoning position has a silent covering window
    exclude = rule_labels(2, 10, windows, outcomes, "exclude")
    # 2, 3: only the no-answer window covers them; 4..7: the "same" window vouches for 0; 8, 9: only degenerate.
    assert exclude == {0: 1, 1: 1, 4: 0, 5: 0, 6: 0, 7: 0}
    own = rule_labels(2, 10, windows, outcomes, "own-class")
    assert own == {0: 1, 1: 1}  # every reasoning position is touched by a silent window
    changed = rule_labels(2, 10, windows, ["different", "same", "no_answer"], "own-class")
    assert changed == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}  # a change wins over a missing answer
    with pytest.raises(ValueError, match="no-answer rule"):
        rule_labels(2, 10, windows, outcomes, "ignore")


def test_find_answer_cue_boxed_phrase_think_and_none():
    tok = tiny_tokenizer()
    gen = tok.encode("so 5 + 13 = 18. The total is \\boxed{18}.", add_special_tokens=False)
    cue = find_answer_cue(tok, 7, gen)
    assert cue.boundary.kind == "boxed" and tok.decode(gen[cue.boundary.answer_start - 7:cue.end - 7]) == cue.text
    assert cue.text.endswith("\\boxed{") and tok.decode(gen[cue.end - 7:]).startswith("18")
    gen = tok.encode("add them: 18 apples.\nThe answer is 18", add_special_tokens=False)
    cue = find_answer_cue(tok, 0, gen)
    assert cue.boundary.kind == "phrase" and cue.text.strip() == "The answer is"
    assert tok.decode(gen[cue.end:]).strip() == "18"
    gen = tok.encode("abc</think>x. Final answer: 4", add_special_tokens=False)
    cue = find_answer_cue(tok, 0, gen)
    assert cue.boundary.kind == "think" and cue.boundary.answer_start == 3 and cue.text.startswith("</think>")
    assert find_answer_cue(tok, 0, tok.encode("x" * 50 + " 18", add_special_tokens=False)) is None  # no marker
    assert find_answer_cue(tok, 0, tok.encode("so the answer is", add_special_tokens=False)) is None  # nothing after


def test_find_answer_boundary_think_boxed_tail():
    tok = tiny_tokenizer()
    gen = tok.encode("abc</think>x \\boxed{1} y \\boxed{2}", add_special_tokens=False)
    b = find_answer_boundary(tok, 10, gen)
    assert (b.kind, b.answer_start) == ("think", 10 + 3)  # the first </think> (one special token) at index 3
    gen = tok.encode("ab \\boxed{1} c \\boxed{22}", add_special_tokens=False)
    b = find_answer_boundary(tok, 10, gen)
    assert b.kind == "boxed" and tok.decode(gen[b.answer_start - 10:]) == "\\boxed{22}"  # the last box
    gen = tok.encode("x" * 100, add_special_tokens=False)
    assert find_answer_boundary(tok, 10, gen, tail=64) == find_answer_boundary(tok, 10, gen)
    assert find_answer_boundary(tok, 10, gen).answer_start == 10 + 36


def test_resolve_replacement():
    tok = tiny_tokenizer()
    space, dot = (tok.encode(text, add_special_tokens=False)[0] for text in (" ", "."))
    assert resolve_replacement(tok, "pad").token_id == tok.pad_token_id
    assert resolve_replacement(tok, "space").token_id == space
    assert resolve_replacement(tok, "dot").to_json() == {"spec": "dot", "chosen": "dot", "token_id": dot, "text": "."}
    assert resolve_replacement(tok, "delete").token_id is None
    assert resolve_replacement(tok, "7").to_json() == {"spec": "7", "chosen": "id", "token_id": 7,
                                                       "text": tok.decode([7])}
    with pytest.raises(UsageError, match="out of range"):
        resolve_replacement(tok, "100000")
    with pytest.raises(UsageError, match="valid choices"):
        resolve_replacement(tok, "blank")


def test_auto_replacement_keeps_a_dedicated_pad_token():
    tok = tiny_tokenizer()  # pad <|pad|>: neither EOS, BOS, a stop token nor in the chat template
    assert pad_problem(tok, [tok.eos_token_id]) is None
    auto = resolve_replacement(tok, "auto", [tok.eos_token_id])
    assert (auto.chosen, auto.token_id, auto.text, auto.note) == ("pad", tok.pad_token_id, "<|pad|>", None)


@pytest.mark.parametrize("pad, problem", [
    ("<|eos|>", "end-of-sequence"),  # SmolLM2: pad = <|im_end|> = EOS
    ("<|bos|>", "beginning-of-sequence"),
    ("<|user|>", "chat template"),  # a turn marker
    ("</think>", "stop token"),  # stands for Qwen's pad <|endoftext|>, one of its stop tokens
])
def test_auto_replacement_avoids_a_structural_pad_token(pad, problem):
    tok = tiny_tokenizer()
    tok.pad_token = pad
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("</think>")]
    assert problem in pad_problem(tok, stops)
    auto = resolve_replacement(tok, "auto", stops)
    space = tok.encode(" ", add_special_tokens=False)
    assert (auto.spec, auto.chosen, [auto.token_id], auto.text) == ("auto", "space", space, " ")
    assert problem in auto.to_json()["note"]
    literal = resolve_replacement(tok, "pad", stops)  # asked for explicitly: honoured, with the warning recorded
    assert literal.token_id == tok.convert_tokens_to_ids(pad) and problem in literal.note


def test_auto_replacement_falls_back_to_a_dot_then_refuses():
    tok = tiny_tokenizer()
    tok.pad_token = tok.eos_token
    real_encode = tok.encode

    def encode(text, **kw):  # a vocabulary where " " is not one token (it splits, as some SentencePiece ones do)
        return real_encode(text, **kw) * 2 if text == " " else real_encode(text, **kw)

    tok.encode = encode
    assert resolve_replacement(tok, "auto").chosen == "dot"
    with pytest.raises(UsageError, match="space.*not a single token"):
        resolve_replacement(tok, "space")
    tok.encode = lambda text, **kw: real_encode(text, **kw) * 2
    with pytest.raises(UsageError, match="neither ' ' nor '.'.*token id"):
        resolve_replacement(tok, "auto")


def test_occlusion_config_checks_and_identity():
    config = OcclusionConfig(window=8, stride=4, batch_size=2, traces_per_batch=1, method="naive")
    assert config.identity() == {"window": 8, "stride": 4, "replacement": "auto", "max_answer_tokens": 64,
                                 "include_incorrect": False, "allow_evicted": False, "tail": 64, "dtype": "float32",
                                 "force_answer": True, "no_answer": "exclude", "stop_at_answer": True,
                                 "generic_cue": True}
    assert config.graded and OcclusionConfig(force_answer=False).max_answer_tokens == 512
    # how the work is grouped and computed is not part of what the labels mean
    assert OcclusionConfig(window=8, stride=4).identity() == config.identity()
    # a run made before graded labels keeps its identity, so it resumes
    legacy = OcclusionConfig(window=8, stride=4, force_answer=False, stop_at_answer=False, generic_cue=False)
    assert legacy.identity() == {"window": 8, "stride": 4, "replacement": "auto", "max_answer_tokens": 512,
                                 "include_incorrect": False, "allow_evicted": False, "tail": 64, "dtype": "float32",
                                 "force_answer": False, "no_answer": "exclude"}
    assert not legacy.graded and not OcclusionConfig(stop_at_answer=False).graded
    for bad, message in [({"stride": 40}, "untested"), ({"replacement": "blank"}, "valid choices"),
                         ({"method": "quick"}, "valid choices"), ({"window": 0}, "positive"),
                         ({"dtype": "int8"}, "valid choices"),
                         ({"no_answer": "ignore"}, "no-answer rule 'ignore'; valid choices: exclude, flip, own-class")]:
        with pytest.raises(UsageError, match=message):
            OcclusionConfig(**bad)


def _trace(prompt, generated, trace_id="t", **fields) -> Trace:
    return Trace(id=trace_id, dataset="gsm8k", model="tiny", prompt_ids=list(prompt), generated_ids=list(generated),
                 **fields)


def test_select_traces_and_refuse_evicted():
    dense = [_trace([1], [2], "a", correct=True), _trace([1], [2], "b", correct=False)]
    assert [t.id for t in select_traces(dense, OcclusionConfig())] == ["a"]
    assert [t.id for t in select_traces(dense, OcclusionConfig(include_incorrect=True))] == ["a", "b"]
    never_evicted = _trace([1], [2], "c", policy="h2o", eviction={"rounds": 0})  # ran with a policy, lost nothing
    evicted = [_trace([1], [2], f"e{i}", policy="h2o", eviction={"rounds": 3}) for i in range(2)]
    refuse_evicted([*dense, never_evicted], OcclusionConfig(), "x")
    with pytest.raises(UsageError, match=r"x: 2 of 4 traces were generated under eviction \(policy h2o \(2\)\).*"
                                         "--allow-evicted"):
        refuse_evicted([*dense, *evicted], OcclusionConfig(), "x")
    refuse_evicted(evicted, OcclusionConfig(allow_evicted=True), "x")


def test_make_units_groups_in_order():
    traces = [_trace([1], [2], str(i)) for i in range(5)]
    assert [unit.ids for unit in make_units(traces, 2)] == [["0", "1"], ["2", "3"], ["4"]]
    assert make_units([], 2) == []


def test_estimate_by_hand():
    config = OcclusionConfig(window=32, stride=16, max_answer_tokens=512)
    # 10 problems of 512 tokens at 8 tokens/s: 640 s of generation. Reasoning span 512 - 64 = 448: windows at
    # 0, 16, ..., 416 (27), + 1 reference, each regenerating min(512, 64) tokens: 10 * 28 * 64 / 8 = 2240 s.
    assert estimate_seconds(10, 512, config, 8.0) == (640.0, 2240.0)
    assert estimate_seconds(10, 80, config, 8.0) == (100.0, 0)  # span 16 < window: nothing to label


def test_decode_tokens_counts_regenerations_times_answer_span():
    tok = tiny_tokenizer()
    labeler = OcclusionLabeler(model=None, tokenizer=tok, answer_of=str, same=str.__eq__, stop_ids=[],
                               config=OcclusionConfig(window=8, stride=4, max_answer_tokens=5, force_answer=False))
    # reasoning 20 tokens (windows at 0, 4, 8, 12 = 4, + 1 reference), answer span "\\boxed{42}" = 10 tokens
    trace = _trace(tok.encode("Q"), tok.encode("x" * 20 + "\\boxed{42}", add_special_tokens=False))
    assert labeler.regenerations(trace) == 5
    assert labeler.decode_tokens(trace) == 5 * 5  # capped at max_answer_tokens
    labeler.config = OcclusionConfig(window=8, stride=4, max_answer_tokens=512, force_answer=False)
    assert labeler.decode_tokens(trace) == 5 * 10
    # graded (forced) labels score the unoccluded context once more; the forced answer follows the cue "\\boxed{"
    labeler.config = OcclusionConfig(window=8, stride=4, max_answer_tokens=512)
    assert labeler.regenerations(trace) == 6 and labeler.decode_tokens(trace) == 6 * 3


def _label(labels, trace_id="t", reasoning_start=2, status="labelled", token_ids=None) -> Label:
    return Label(id=trace_id, dataset="gsm8k", model="m", status=status, labels=labels, reasoning_start=reasoning_start,
                 answer_start=len(labels), token_ids=token_ids or list(range(len(labels) + 3)),
                 positions=list(range(len(labels))))


def test_cohen_kappa_by_hand():
    # observed 0.75; p_a = 0.5, p_b = 0.25: chance 0.5 * 0.25 + 0.5 * 0.75 = 0.5; kappa (0.75 - 0.5) / 0.5 = 0.5
    assert cohen_kappa([1, 1, 0, 0], [1, 0, 0, 0]) == 0.5
    assert cohen_kappa([1, 0, 1, 0], [0, 1, 0, 1]) == -1.0
    assert cohen_kappa([0, 1], [0, 1]) == 1.0
    assert cohen_kappa([1, 1], [1, 1]) is None  # chance agreement 1: undefined
    assert cohen_kappa([], []) is None
    with pytest.raises(ValueError, match="length"):
        cohen_kappa([1], [1, 0])


def test_label_agreement_pools_reasoning_positions_of_shared_traces():
    a = [_label([1, 1, 1, 1, 0, 0], "t1"), _label([1, 1, 0, 1], "t2"), _label([1, 1, 1], "only-a"),
         _label([1, 1, 0], "skipped-b")]
    b = [_label([1, 1, 1, 0, 0, 0], "t1"), _label([1, 1, 0, 0], "t2"), _label([1, 1, 0], "only-b"),
         Label(id="skipped-b", dataset="gsm8k", model="m", status="skipped", reason="no answer")]
    result = label_agreement(a, b)
    # reasoning positions (from 2): t1 a=[1,1,0,0] b=[1,0,0,0]; t2 a=[0,1] b=[0,0] -> 4 of 6 equal
    # p_a = 3/6, p_b = 1/6, chance = 1/12 + 5/12 = 1/2, kappa = (2/3 - 1/2) / (1/2) = 1/3; prompt 1s are ignored
    assert (result.traces, result.positions) == (2, 6)
    assert result.agreement == pytest.approx(4 / 6) and result.kappa == pytest.approx(1 / 3)
    assert result.important_a == pytest.approx(0.5) and result.important_b == pytest.approx(1 / 6)
    assert result.only_a == ("only-a", "skipped-b") and result.only_b == ("only-b",)
    with pytest.raises(ValueError, match="differs"):
        label_agreement([_label([1, 1, 0])], [_label([1, 1, 0], token_ids=[9, 9, 9])])


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def chaotic_tiny(request):
    """Larger init than the default, so occlusion changes greedy continuations part-way (a mix of agreeing,
    diverging-late and diverging-at-once windows exercises every path of draft verification)."""
    return tiny_model(request.param, seed=0, initializer_range=0.1)


def test_greedy_decode_matches_hf_generate(tiny_llama):
    from tasks.generation import generate, stop_token_ids

    prompt = tiny_llama.tokenizer.encode(PROMPT + REASONING)
    ours = regenerate_naive(tiny_llama.model, [prompt], 12, stop_token_ids(tiny_llama.tokenizer, tiny_llama.model))
    assert ours[0] == generate(tiny_llama, prompt, 12).generated_ids


def _contexts_and_naive(lm, replacement, max_new=10):
    tok, model = lm.tokenizer, lm.model
    ids = tok.encode(PROMPT + REASONING)  # 99 tokens: longer than the gemma3 tiny's 16-token sliding window
    filler = None if replacement == "delete" else tok.pad_token_id
    windows = occlusion_windows(16, len(ids), 8, 4)
    rows = [(s, occlude(ids, s, e, filler)[s:]) for s, e in windows]
    naive = regenerate_naive(model, [ids] + [ids[:s] + t for s, t in rows], max_new, [tok.eos_token_id])
    return ids, rows, naive


@pytest.mark.parametrize("replacement", ["pad", "delete"])
def test_fast_engine_reproduces_naive_continuations(chaotic_tiny, replacement):
    """Llama / Qwen3 take the speculative engine, Gemma3 (sliding layers) the chunked draft verification."""
    ids, rows, naive = _contexts_and_naive(chaotic_tiny, replacement)
    stops = [chaotic_tiny.tokenizer.eos_token_id]
    prefix = PrefixCache(chaotic_tiny.model, ids)
    # The reference row's draft is an unfinished prefix of its continuation (a trace cut short), then open decoding.
    (reference,) = regenerate_rows([Row(prefix, 15, tuple(ids[15:]), tuple(naive[0][:4]))], 10, stops)
    fast = regenerate_rows([Row(prefix, s, tuple(t), tuple(reference)) for s, t in rows], 10, stops, batch_size=3)
    assert reference == naive[0]
    assert fast == naive[1:]
    if replacement == "pad":  # the case really mixes agreeing and diverging windows
        agreed = [next((j for j, (a, b) in enumerate(zip(o, reference)) if a != b), len(o)) for o in naive[1:]]
        assert len(set(agreed)) > 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_both_draft_engines_with_short_drafts(family):
    """Tiny drafts force many verification rounds, rejected slots and ragged rows in the speculative engine."""
    lm = tiny_model(family, seed=0, initializer_range=0.1)
    ids, rows, naive = _contexts_and_naive(lm, "pad", max_new=14)
    stops = [lm.tokenizer.eos_token_id]
    prefix = PrefixCache(lm.model, ids)
    start = rows[0][0]
    for batch_size in (None, 2):  # all rows at once; two at a time, refilled as rows finish
        finished = []
        spec = speculative_greedy(lm.model, [partial(prefix.copy_at, start, 1)] * len(rows),
                                  [ids[start:s] + list(t) for s, t in rows], [ids[:s] + list(t) for s, t in rows],
                                  14, stops, references=[naive[0]] * len(rows), draft_len=1, reference_draft_len=3,
                                  batch_size=batch_size, progress=finished.append)
        assert spec == naive[1:]
        assert sum(finished) == len(rows)
    inputs = torch.tensor([ids[start:s] + list(t) for s, t in rows])
    chunked = greedy_extend_with_draft(lm.model, prefix.copy_at(start, len(rows)), inputs, naive[0], 14, stops,
                                       chunk=3)
    assert chunked == naive[1:]


def test_join_pads_rows_and_compact_gathers_real_slots_in_order():
    def one_row(values: list[float]) -> DynamicCache:
        cache = DynamicCache()
        t = torch.tensor(values)[None, None, :, None]  # [1, kv_head, slots, d_head]
        cache.update(t, t + 100, 0)
        return cache

    cache, valid = _join(None, None, [one_row([1, 2, 3])], [[True, False, True]])
    cache, valid = _join(cache, valid, [one_row([4, 5, 6, 7, 8])], [[True, True, False, False, True]])
    assert valid.tolist() == [[True, False, True, False, False], [True, True, False, False, True]]
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    valid = _compact(cache, valid)
    assert valid.tolist() == [[True, True, False], [True, True, True]]
    assert cache.layers[0].keys[:, 0, :2, 0].tolist() == [[1, 3], [4, 5]] and cache.layers[0].keys[1, 0, 2, 0] == 8
    assert cache.layers[0].values[1, 0, :, 0].tolist() == [104, 105, 108]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the speculative engine's (full-attention) families
def test_speculative_engine_exact_when_compacting_every_step(family, monkeypatch):
    """Long regenerations with rejected drafts and a refilled batch, compacted at every step, stay exact."""
    chaotic_tiny = tiny_model(family, seed=0, initializer_range=0.1)
    monkeypatch.setattr(speculative, "COMPACT_MIN_DEAD", 0)
    monkeypatch.setattr(speculative, "COMPACT_DEAD_RATIO", 0.0)
    compactions = []
    monkeypatch.setattr(speculative, "_compact", lambda cache, valid: compactions.append(1) or _compact(cache, valid))
    ids, rows, naive = _contexts_and_naive(chaotic_tiny, "pad", max_new=24)
    stops = [chaotic_tiny.tokenizer.eos_token_id]
    prefix = PrefixCache(chaotic_tiny.model, ids)
    starts = [min(s, len(ids) - 1) for s, _ in rows]
    spec = speculative_greedy(chaotic_tiny.model, [partial(prefix.copy_at, s, 1) for s in starts],
                              [ids[s0:s] + list(t) for s0, (s, t) in zip(starts, rows)],
                              [ids[:s] + list(t) for s, t in rows], 24, stops, references=[naive[0]] * len(rows),
                              draft_len=8, batch_size=3)
    assert spec == naive[1:]
    assert len(compactions) > 5


def test_ngram_lookup_proposes_what_followed_the_last_occurrence():
    lookup = NgramLookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2])
    assert lookup.draft(3) == [3, 7, 5]  # (1, 2) last occurred before 3, 7, 5 (order 3 has no earlier match)
    lookup.extend([3])
    assert lookup.draft(2) == [7, 5]  # (1, 2, 3) latest earlier occurrence: followed by 7
    assert NgramLookup([4, 5, 6]).draft(2) == []
    assert NgramLookup([8, 8, 8]).draft(5) == [8]  # the match may run into the current suffix


def test_prefix_cache_cuts_full_attention_and_only_extends_sliding(tiny_llama, tiny_gemma3):
    ids = list(range(40, 80))  # 40 tokens: past the gemma3 tiny's 16-token sliding window
    prefix = PrefixCache(tiny_llama.model, ids)
    late, early = prefix.copy_at(30, 1), prefix.copy_at(9, 2)  # full attention: any order
    fresh = DynamicCache(config=tiny_llama.model.config)
    with torch.no_grad():
        tiny_llama.model(input_ids=torch.tensor([ids[:9]]), cache=fresh, use_cache=True)
    assert early.get_seq_length() == 9 and late.get_seq_length() == 30
    assert early.layers[0].keys.shape[:3] == (2, 2, 9)
    assert torch.allclose(early.layers[3].values[1], fresh.layers[3].values[0], atol=1e-5)
    sliding = PrefixCache(tiny_gemma3.model, ids)
    assert sliding.copy_at(30, 1).get_seq_length() == 30
    with pytest.raises(ValueError, match="cannot go back"):
        sliding.copy_at(20, 1)


def _labeler(lm, method, **kw):
    tok = lm.tokenizer
    config = OcclusionConfig(**{"window": 8, "stride": 4, "replacement": "pad", "max_answer_tokens": 8,
                                "batch_size": 4, "method": method, "force_answer": False, **kw})
    return OcclusionLabeler(model=lm.model, tokenizer=tok, answer_of=lambda text: text[:4] or None,
                            same=lambda a, b: a == b, stop_ids=[tok.eos_token_id], config=config)


def test_labeler_fast_equals_naive_and_is_deterministic(chaotic_tiny):
    tok = chaotic_tiny.tokenizer
    trace = _trace(tok.encode(PROMPT), tok.encode(REASONING + " \\boxed{42}.<|eos|>", add_special_tokens=False),
                   answer="42", gold="42", correct=True)
    fast = _labeler(chaotic_tiny, "fast").label(trace)
    naive = _labeler(chaotic_tiny, "naive").label(trace)
    again = _labeler(chaotic_tiny, "fast").label(trace)
    assert fast.status == "labelled" and fast.boundary == "boxed"
    assert fast == naive == again  # every field: labels, windows with their answers, reference text, replacement
    assert (fast.id, fast.trace_answer, fast.gold, fast.correct) == ("t", "42", "42", True)
    assert fast.replacement == {"spec": "pad", "chosen": "pad", "token_id": tok.pad_token_id, "text": "<|pad|>"}
    prompt = len(trace.prompt_ids)
    assert fast.labels[:prompt] == [1] * prompt
    assert len(fast.labels) == fast.answer_start
    flipped = {p for w in fast.windows if w["flipped"] for p in range(w["start"], w["end"])}
    assert [i for i, v in enumerate(fast.labels) if v and i >= prompt] == sorted(flipped)
    assert Label.from_json(fast.to_json()) == fast


def test_forced_answer_appends_the_cue_and_fast_equals_naive(chaotic_tiny):
    """With a forced answer every context ends with the trace's cue ('\\boxed{'), the reference is regenerated from
    the unoccluded context plus the cue, answers are read from cue + continuation, and both methods agree, for a
    filler token and for deletion."""
    tok = chaotic_tiny.tokenizer
    trace = _trace(tok.encode(PROMPT), tok.encode(REASONING + " \\boxed{42}.<|eos|>", add_special_tokens=False),
                   answer="42", gold="42", correct=True)
    seen = []

    def answer_of(text):
        seen.append(text)
        return text[:12] or None

    for replacement in ("pad", "delete"):
        labels = []
        for method in ("fast", "naive"):
            labeler = _labeler(chaotic_tiny, method, force_answer=True, stop_at_answer=False, replacement=replacement)
            labeler.answer_of = answer_of
            labels.append(labeler.label(trace))
        fast, naive = labels
        assert fast == naive and fast.status == "labelled"
        cue = fast.forced_cue
        assert cue["kind"] == "boxed" and cue["text"].endswith("\\boxed{") and cue["start"] == fast.answer_start
        assert tok.decode(trace.token_ids[cue["start"]:cue["end"]]) == cue["text"]
        assert all(text.startswith(cue["text"]) for text in seen)  # every answer is read after the cue
        assert sum(fast.outcome_counts.values()) == len(fast.windows)
        assert {w["outcome"] for w in fast.windows} <= {"same", "different", "no_answer", "degenerate"}
        seen.clear()


def test_an_engine_regenerating_every_context_gives_the_fast_labels(chaotic_tiny):
    """The engine path (every occluded context handed to `tasks.engines.greedy_continuations` at once, as vLLM gets
    them) labels like kvscope's own fast labeller; HF's engine stands in for vLLM, which is not installed here."""
    from tasks.engines import HFEngine

    tok = chaotic_tiny.tokenizer
    traces = [_trace(tok.encode(PROMPT), tok.encode(REASONING + " \\boxed{42}.<|eos|>", add_special_tokens=False),
                     trace_id, answer="42", gold="42", correct=True) for trace_id in ("a", "b")]
    legacy = {"force_answer": True, "stop_at_answer": False}  # the tiny model never closes a box
    fast = label_traces(_labeler(chaotic_tiny, "fast", traces_per_batch=2, **legacy), traces)
    labeler = _labeler(chaotic_tiny, "fast", traces_per_batch=2, **legacy)
    labeler.engine = HFEngine(chaotic_tiny, batch_size=4)
    calls = []
    labeler.engine.stream = lambda requests, stops=None, stream=labeler.engine.stream: (
        calls.append(len(requests)) or stream(requests, stops))
    assert label_traces(labeler, traces) == fast
    assert calls == [2 * (len(fast[0].windows) + 1)]  # both traces' contexts and references in one submission


def test_window_outcomes_and_the_no_answer_rule(tiny_llama):
    tok = tiny_llama.tokenizer
    labeler = _labeler(tiny_llama, "naive", replacement="pad")
    pad, eos = tok.pad_token_id, tok.eos_token_id
    words = tok.encode(" the apples cost", add_special_tokens=False)
    assert labeler.outcome("42", "42", words) == "same"
    assert labeler.outcome("41", "42", words) == "different"
    assert labeler.outcome(None, "42", words) == "no_answer"
    assert labeler.outcome(None, "42", [pad] * 12 + words) == "degenerate"  # repeats the filler
    assert labeler.outcome(None, "42", [eos]) == "degenerate"  # stops at once
    assert labeler.outcome(None, "42", tok.encode("   ", add_special_tokens=False)) == "degenerate"
    # An answer after filler is an answer: the outcome follows the answer, not the filler.
    assert labeler.outcome("42", "42", [pad] * 12) == "same"


def test_traces_labelled_together_equal_each_labelled_naively(chaotic_tiny):
    """Windows of traces of different lengths share batches (ragged rows); a too-short trace is skipped in place;
    the labels do not depend on how traces are grouped into units."""
    tok = chaotic_tiny.tokenizer
    prompt = tok.encode(PROMPT)
    traces = [_trace(prompt, tok.encode(REASONING + " \\boxed{42}.<|eos|>", add_special_tokens=False), "a"),
              _trace(prompt, tok.encode("ok \\boxed{1}", add_special_tokens=False), "b"),
              _trace(prompt, tok.encode(REASONING[:50] + " \\boxed{7}", add_special_tokens=False), "c")]
    together = label_traces(_labeler(chaotic_tiny, "fast", batch_size=16, traces_per_batch=3), traces)
    pairs = label_traces(_labeler(chaotic_tiny, "fast", batch_size=16, traces_per_batch=2), traces)
    alone = [_labeler(chaotic_tiny, "naive").label(trace) for trace in traces]
    assert [r.status for r in together] == ["labelled", "skipped", "labelled"]
    assert [r.id for r in together] == ["a", "b", "c"]
    assert together == pairs == alone


def test_labeler_skips_short_spans(tiny_llama):
    tok = tiny_llama.tokenizer
    trace = _trace(tok.encode(PROMPT), tok.encode("ok \\boxed{1}", add_special_tokens=False))
    record = _labeler(tiny_llama, "fast").label(trace)
    assert record.status == "skipped" and "reasoning span 3 < window 8" in record.reason
    assert record.labels is None and record.replacement["token_id"] == tok.pad_token_id


def test_old_label_records_still_read():
    old = {"trace_id": 7, "dataset": "gsm8k", "model": "m", "status": "skipped", "reason": "no answer"}
    assert Label.from_json(old).id == "7"
