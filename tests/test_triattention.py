"""TriAttention: the score against the paper's formula on hand-built caches, the calibration command on a tiny
model, the policy inside the engine with the calibration it wrote, and the one-line refusal without one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from core.errors import UsageError
from core.schemas import Trace
from evictor.calibrate import main as calibrate_main
from evictor.engine import EvictionEngine
from evictor.instrument import kept_positions
from evictor.policies import get_policy
from evictor.policies.__main__ import main as policies_main
from evictor.policies.triattention import geometric_offsets, group_max_of_zscores, triattention_scores
from evictor.protocol import EvictionConfig
from models.hooks import capture, hook_name
from scoring.policy import ScoreInputs

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = (("Question: what is 12 + 35?", " Let me add the tens, then the ones: 40 and 7, so 47."),
         ("Question: name a prime above 10.", " Eleven has no divisor but 1 and itself, so 11 is prime."))


def write_calibration(path, omega, scale, q_mean, q_abs_mean, n_kv=1):
    """A calibration file of one layer, by hand (the format `python -m evictor.calibrate triattention` writes)."""
    n_heads, n_freq = q_mean.shape
    path.write_text(json.dumps({
        "kind": "triattention_calibration", "version": 1, "model": "hand-made", "n_layers": 1, "n_heads": n_heads,
        "n_kv_heads": n_kv, "head_dim": 2 * n_freq, "traces": [], "tokens": 0,
        "rope": {"omega": [omega.tolist()], "scale": [scale.tolist()]},
        "q_mean_real": [q_mean.real.tolist()], "q_mean_imag": [q_mean.imag.tolist()],
        "q_abs_mean": [q_abs_mean.tolist()],
    }))
    return str(path)


def score_with(policy, keys, next_position, mask=None):
    b, h, n, _ = keys.shape
    positions = torch.arange(n).expand(b, h, n)
    mask = torch.ones(b, h, n, dtype=torch.bool) if mask is None else mask
    return policy.score(ScoreInputs(layer=0, step=1, positions=positions, candidate_mask=mask, keys=keys,
                                    next_positions=torch.full((b,), next_position)))


def test_score_by_hand(tmp_path):
    # One frequency, omega = pi/2 per token, offsets {1, 2} (max_offset 2), centre qbar = 1, E|q| = 2, s = 1.
    # Pre-RoPE keys 1, 1, 1, 2 at positions 0..3 (post-RoPE: k_pre * i^p); next position t = 4.
    # Trig term, mean over o of |k| cos((4 - p + o) pi/2): p0 (0 - 1)/2 = -.5, p1 (1 + 0)/2 = .5, p2 (0 + 1)/2 = .5,
    # p3 2 (-1 + 0)/2 = -1. Norm term (2 - 1)|k|: 1, 1, 1, 2. Scores .5, 1.5, 1.5, 1.
    path = write_calibration(tmp_path / "hand.json", torch.tensor([math.pi / 2]), torch.tensor([1.0]),
                             torch.tensor([[1 + 0j]]), torch.tensor([[2.0]]))
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -2.0]])[None, None]
    raw = get_policy("triattention", calibration=path, max_offset=2, normalize=False)
    torch.testing.assert_close(score_with(raw, keys, 4)[0, 0], torch.tensor([0.5, 1.5, 1.5, 1.0]))
    # z-scored over the real candidates: the padding slot (last) changes nothing
    z = score_with(get_policy("triattention", calibration=path, max_offset=2), keys, 4)[0, 0]
    expected = torch.tensor([0.5, 1.5, 1.5, 1.0])
    torch.testing.assert_close(z, (expected - expected.mean()) / expected.std(unbiased=False))
    padded = torch.cat([keys, torch.full((1, 1, 1, 2), 9.0)], dim=2)
    mask = torch.tensor([[[True, True, True, True, False]]])
    z_padded = score_with(get_policy("triattention", calibration=path, max_offset=2), padded, 4, mask)[0, 0, :4]
    torch.testing.assert_close(z_padded, z)


def paper_formula(keys_post, positions, t, q_mean, q_abs_mean, omega, scale, max_offset):
    """The released scorer's steps, one key and one query head at a time: un-rotate the key, then
    mean_o sum_f s_f^2 (|qbar_f||k_f| cos((t - p + o) w_f + phi_f) + (m_f - |qbar_f|)|k_f|)."""
    half = keys_post.shape[-1] // 2
    offsets = [2.0**j for j in range(int(math.log2(max_offset)) + 1)]
    out = torch.zeros(q_mean.shape[0], keys_post.shape[0], dtype=torch.float64)
    for h in range(q_mean.shape[0]):
        for c, (key, p) in enumerate(zip(keys_post, positions)):
            k_pre = torch.complex(key[:half], key[half:]) * torch.exp(-1j * p * omega) / scale
            amp, phi = q_mean[h].abs() * k_pre.abs(), torch.angle(q_mean[h] * k_pre.conj())
            extra = (q_abs_mean[h] - q_mean[h].abs()) * k_pre.abs()
            series = [(scale**2 * (amp * torch.cos((t - p + o) * omega + phi) + extra)).sum() for o in offsets]
            out[h, c] = sum(series) / len(series)
    return out


def test_scores_equal_the_released_formula_with_gqa_and_rope_scaling():
    gen = torch.Generator().manual_seed(0)
    n_kv, group, n_freq, n = 2, 2, 4, 6
    omega = 10000.0 ** (-torch.arange(n_freq, dtype=torch.float64) / n_freq)
    scale = torch.full((n_freq,), 1.3, dtype=torch.float64)  # a scaled RoPE (YaRN-like attention_scaling)
    q_mean = torch.complex(torch.randn(n_kv * group, n_freq, generator=gen, dtype=torch.float64),
                           torch.randn(n_kv * group, n_freq, generator=gen, dtype=torch.float64))
    q_abs_mean = q_mean.abs() + torch.rand(n_kv * group, n_freq, generator=gen, dtype=torch.float64)
    keys = torch.randn(1, n_kv, n, 2 * n_freq, generator=gen, dtype=torch.float64)
    positions, t = torch.tensor([3, 5, 8, 13, 21, 34]), 40
    # The released scorer un-rotates each key by its position; the vectorised one never needs the positions
    # (conj(k_pre) e^{i(t-p)w} = conj(k_post) e^{itw} / s), so any positions must give the same scores.
    got = triattention_scores(keys, torch.tensor([t]), q_mean, q_abs_mean, omega, scale, max_offset=64)
    for h in range(n_kv * group):  # query head h reads KV head h // group
        expected = paper_formula(keys[0, h // group], positions, t, q_mean[h : h + 1], q_abs_mean[h : h + 1],
                                 omega, scale, 64)[0]
        torch.testing.assert_close(got[0, h].double(), expected, rtol=1e-5, atol=1e-5)  # float32 vs float64
    # per KV head: the max over its two query heads of each head's z-scores
    z = (got - got.mean(-1, keepdim=True)) / got.std(-1, unbiased=False, keepdim=True)
    pooled = group_max_of_zscores(got, torch.ones(1, n_kv, n, dtype=torch.bool), n_kv)
    torch.testing.assert_close(pooled, z.view(1, n_kv, group, n).max(2).values)


def test_geometric_offsets_follow_the_released_default():
    assert geometric_offsets(65536).tolist() == [2.0**j for j in range(17)]
    assert geometric_offsets(2).tolist() == [1.0, 2.0]


def write_traces(directory, pairs):
    """``directory/generations.jsonl``: dense trace records of tiny-llama, one per (prompt, generation) text pair."""
    from models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    traces = directory / "generations.jsonl"
    with traces.open("w") as handle:
        for index, (prompt, generation) in enumerate(pairs):
            trace = Trace(id=f"p{index}", dataset="toy", model="tiny-llama",
                          prompt_ids=[tokenizer.bos_token_id] + tokenizer(prompt).input_ids,
                          generated_ids=tokenizer(generation).input_ids)
            handle.write(json.dumps(trace.to_json()) + "\n")
    return traces


def calibrated(tmp_path_factory, method: str, pairs, *options: str):
    """The traces of `pairs` (`write_traces`) and the calibration file that ``python -m evictor.calibrate <method>``
    writes from them: ``(traces_path, calibration_path)``."""
    directory = tmp_path_factory.mktemp(method)
    traces = write_traces(directory, pairs)
    out = directory / f"tiny-llama.{method}.json"
    assert calibrate_main([method, "--model", "tiny-llama", "--traces", str(traces), "--out", str(out),
                           "--device", "cpu", *options]) == 0
    return traces, out


@pytest.fixture(scope="module")
def calibrated_files(tmp_path_factory):
    return calibrated(tmp_path_factory, "triattention", TEXTS)


@pytest.fixture(scope="module")
def traces_file(calibrated_files):
    return calibrated_files[0]


@pytest.fixture(scope="module")
def calibration(calibrated_files):
    return calibrated_files[1]


def test_calibration_is_the_mean_pre_rope_query_of_the_traces(calibration, traces_file, tiny_llama):
    data = json.loads(calibration.read_text())
    assert (data["kind"], data["n_layers"], data["n_heads"], data["n_kv_heads"], data["head_dim"]) == (
        "triattention_calibration", 4, 4, 2, 16)
    assert (calibration.parent / "tiny-llama.triattention.config.json").exists()
    inv_freq = tiny_llama.model.model.rotary_emb.inv_freq.double()
    torch.testing.assert_close(torch.tensor(data["rope"]["omega"][2], dtype=torch.float64), inv_freq)
    # direct: every position's query of layer 2, head 3, before RoPE, averaged as complex pairs
    traces = [json.loads(line) for line in traces_file.read_text().splitlines()]
    queries = []
    with torch.inference_mode(), capture(tiny_llama.model, [hook_name(2, "attn.hook_q")]) as seen:
        for trace in traces:
            tiny_llama.model(input_ids=torch.tensor([trace["prompt_ids"] + trace["generated_ids"]]), use_cache=False)
        queries = torch.cat([q[0, 3] for q in seen.calls(hook_name(2, "attn.hook_q"))]).double()  # [tokens, 16]
    pairs = torch.complex(queries[:, :8], queries[:, 8:])
    assert data["tokens"] == queries.shape[0]
    torch.testing.assert_close(torch.tensor(data["q_mean_real"][2][3], dtype=torch.float64), pairs.mean(0).real)
    torch.testing.assert_close(torch.tensor(data["q_mean_imag"][2][3], dtype=torch.float64), pairs.mean(0).imag)
    torch.testing.assert_close(torch.tensor(data["q_abs_mean"][2][3], dtype=torch.float64), pairs.abs().mean(0))


def run_triattention(lm, calibration, pruning):
    policy = get_policy("triattention", calibration=str(calibration), pruning=pruning)
    config = EvictionConfig(budget=40, buffer=4, block=16, keep_log=True)
    engine = EvictionEngine(lm, policy, config)
    prompt = [lm.tokenizer.bos_token_id] + lm.tokenizer("Count: one two three four").input_ids
    with engine.session([prompt], max_new_tokens=40) as session:
        logits = session.prefill()
        session.begin_decode()
        for _ in range(39):
            logits = session.step(logits.argmax(-1))
        session.end_decode()
        result = session.result([[0] * 40], ["length"])
    return prompt, result.sequences[0]


def test_policy_runs_in_the_engine_with_its_calibration(calibration, tiny_llama):
    """Per-head pruning (the default) keeps one set per KV head in every layer; per-layer-per-head lets layers
    differ. The prompt is pinned in both."""
    assert get_policy("triattention").shared_across_layers
    assert not get_policy("triattention", pruning="per_layer_per_head").shared_across_layers
    with pytest.raises(UsageError, match="pruning"):
        get_policy("triattention", pruning="per_layer")
    differs = {}
    for pruning in ("per_head", "per_layer_per_head"):
        prompt, sequence = run_triattention(tiny_llama, calibration, pruning)
        assert sequence.rounds > 0 and max(sequence.cache_sizes[1:]) <= 40 + 2 * 4
        log = sequence.keep_log
        last = len(log["round_next_pos"]) - 1
        kept = {(layer, head): tuple(kept_positions(log, last, layer, head).tolist())
                for layer in range(4) for head in range(2)}
        assert all(set(range(len(prompt))) <= set(positions) for positions in kept.values())  # the prompt is pinned
        assert kept[0, 0] != kept[0, 1]  # per KV head
        differs[pruning] = any(kept[layer, head] != kept[0, head] for layer in range(4) for head in range(2))
    assert differs == {"per_head": False, "per_layer_per_head": True}


def test_a_calibration_from_another_model_is_refused(calibration):
    from models.tiny import tiny_model

    deeper = tiny_model("llama", num_hidden_layers=6)
    with pytest.raises(UsageError, match="made for tiny-llama \\(4 layers\\); this model has 6 layers"):
        EvictionEngine(deeper, get_policy("triattention", calibration=str(calibration)), EvictionConfig(budget=40))


def test_without_a_calibration_the_run_stops_with_one_line_naming_the_command(tmp_path, data_dir, capsys):
    from evictor.run import main as run_main

    with pytest.raises(UsageError, match="python -m evictor.calibrate triattention"):
        get_policy("triattention").for_depth(4)  # what the engine calls first
    out = tmp_path / "run"
    code = run_main(["--model", "tiny-llama", "--dataset", "math500", "--data-file", f"{data_dir}/math500.jsonl",
                     "--limit", "1", "--policy", "triattention", "--budget", "512", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "python -m evictor.calibrate triattention" in err[0]
    assert not out.exists()
    missing = tmp_path / "nowhere.json"
    with pytest.raises(UsageError, match="does not exist: write one with `python -m evictor.calibrate triattention"):
        get_policy("triattention", calibration=str(missing))


def test_calibrate_cli_refuses_bad_input_in_one_line(traces_file, tmp_path, capsys):
    evicted = tmp_path / "evicted.jsonl"
    record = json.loads(traces_file.read_text().splitlines()[0])
    evicted.write_text(json.dumps({**record, "policy": "random", "eviction": {"rounds": 3}}) + "\n")
    cases = [
        (["triattention", "--traces", str(evicted), "--out", str(tmp_path / "a.json")], "under eviction"),
        (["triattention", "--traces", str(traces_file), "--out", str(tmp_path)], "is a directory"),
        (["triattention", "--traces", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "b.json")], "not exist"),
        (["tri", "--traces", str(traces_file), "--out", str(tmp_path / "c.json")], "invalid choice"),
    ]
    for argv, message in cases:
        assert calibrate_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evicted.jsonl"]


def test_policy_listing_shows_both_calibrated_policies(capsys):
    assert policies_main([]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "triattention" in rows and "thinkv" in rows
    assert " keys " in rows["triattention"] and " yes " in rows["triattention"] and " prompt " in rows["triattention"]
    assert " per-head  shared " in rows["triattention"]  # one keep set per KV head, for every layer
    assert "attention (last 128 queries)" in rows["thinkv"] and " no " in rows["thinkv"] and " none " in rows["thinkv"]
