"""Generation engines (tasks/engines.py): engine choice and the vLLM install check, HF's greedy continuations against
the labeller's reference regeneration, and the vLLM client's pipe protocol against a stand-in worker; vLLM itself
where it is installed."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

import tasks.engines
from core.errors import UsageError
from labeling.regenerate import regenerate_naive
from tasks.engines import HFEngine, VLLMEngine, check_engine, greedy_continuations, vllm_python
from tasks.generation import Request


def test_unknown_engine_is_refused_with_the_choices():
    with pytest.raises(UsageError, match=r"unknown engine 'vlm' \(did you mean 'vllm'\?\); valid choices: hf, vllm"):
        check_engine("vlm")
    check_engine("hf")


def test_vllm_missing_is_one_line_saying_how_to_install(tmp_path, monkeypatch):
    """No side environment and no vLLM here (the project's .venv has none): one line naming the install command."""
    monkeypatch.setattr(tasks.engines, "VLLM_VENV", tmp_path / "no-venv")
    monkeypatch.delenv("KVSCOPE_VLLM_PYTHON", raising=False)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")
    with pytest.raises(UsageError) as caught:
        check_engine("vllm")
    message = str(caught.value)
    assert "needs vLLM" in message and "KVSCOPE_VLLM=1 bash scripts/setup.sh" in message and "\n" not in message
    monkeypatch.setenv("KVSCOPE_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(UsageError, match=r"\$KVSCOPE_VLLM_PYTHON \(.*missing/python\) does not have"):
        vllm_python()


def test_greedy_continuations_equal_the_labellers_reference(tiny_llama):
    """Contexts sharing a long prefix (occluded copies of one trace), continued by the batched HF engine: the same
    tokens, stop token kept, as `labeling.regenerate.regenerate_naive`, for any batch size."""
    ids = list(range(40, 90))
    contexts = [ids] + [ids[:s] + [13] * 8 + ids[s + 8:] for s in (4, 20, 36)] + [ids[:30]]
    stops = [tiny_llama.tokenizer.eos_token_id]
    naive = regenerate_naive(tiny_llama.model, contexts, 12, stops)
    for batch_size in (1, 2, 5):
        assert greedy_continuations(HFEngine(tiny_llama, batch_size), contexts, 12, stops) == naive
    stop = naive[0][4]  # a token the first context emits: with it as the only stop, that row ends there
    cut = greedy_continuations(HFEngine(tiny_llama, 3), contexts[:1], 12, [stop])[0]
    assert cut == naive[0][: naive[0].index(stop) + 1]
    with pytest.raises(ValueError, match="at least one token"):
        greedy_continuations(HFEngine(tiny_llama, 2), [[]], 4, stops)


def test_hf_engine_describes_itself(tiny_llama):
    import transformers

    engine = HFEngine(tiny_llama, 4)
    assert engine.describe() == {"name": "hf", "version": transformers.__version__, "batch_size": 4}
    assert engine.stop_ids == [tiny_llama.tokenizer.convert_tokens_to_ids("<|eos|>")]
    with pytest.raises(UsageError, match="batch size"):
        HFEngine(tiny_llama, 0)


# A stand-in for tasks/vllm_worker.py that speaks its protocol without vLLM: each request's "continuation" is its
# prompt's last token + 1, + 2, ... up to the limit or a stop id, and requests finish in reverse order.
FAKE_WORKER = textwrap.dedent('''
    import json, sys
    setup = json.loads(sys.stdin.readline())
    if setup["dtype"] == "float16":  # stands for any failure to start
        print(json.dumps({"error": "ValueError: no such model"}), flush=True)
        raise SystemExit(1)
    print(json.dumps({"ready": True, "version": "fake", "device": "cpu", "dtype": setup["dtype"]}), flush=True)
    for line in iter(sys.stdin.readline, ""):
        job = json.loads(line)
        for index in reversed(range(len(job["requests"]))):
            request, out = job["requests"][index], []
            while len(out) < request["max_new_tokens"] and not (out and out[-1] in job["stop_ids"]):
                out.append(request["prompt_ids"][-1] + len(out) + 1)
            reason = "eos" if out[-1] in job["stop_ids"] else "length"
            print(json.dumps({"index": index, "generated_ids": out, "finish_reason": reason, "prefill_s": 0.5,
                              "decode_s": 1.0}), flush=True)
        print(json.dumps({"done": True}), flush=True)
''')


@pytest.fixture
def fake_vllm(tmp_path, tiny_dir, monkeypatch):
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(tasks.engines, "vllm_python", lambda: sys.executable)
    monkeypatch.setattr(VLLMEngine, "WORKER", worker)
    return tiny_dir


def test_vllm_client_submits_all_and_reads_results_as_they_finish(fake_vllm):
    with VLLMEngine.load(fake_vllm, batch_size=8) as engine:
        assert engine.describe() == {"name": "vllm", "version": "fake", "batch_size": 8, "device": "cpu",
                                     "dtype": "float32", "prefix_caching": True}
        results = list(engine.stream([Request((40, 41), 3), Request((50,), 5), Request((60,), 4)], stop_ids=[53]))
        assert [index for index, _ in results] == [2, 1, 0]
        by_index = dict(results)
        assert by_index[0].generated_ids == [42, 43, 44] and by_index[0].finish_reason == "length"
        assert by_index[1].generated_ids == [51, 52, 53] and by_index[1].finish_reason == "eos"
        assert by_index[1].text == engine.tokenizer.decode([51, 52, 53], skip_special_tokens=True)
        assert by_index[2].tokens_per_s == pytest.approx(3 / 1.0)
        assert greedy_continuations(engine, [[40, 41], [50]], 3, [53]) == [[42, 43, 44], [51, 52, 53]]
    assert engine.process.returncode == 0  # closed: the worker saw the end of its input and exited


def test_vllm_worker_failure_is_one_usage_error(fake_vllm):
    with pytest.raises(UsageError, match=r"^vLLM failed: ValueError: no such model \(its log is on stderr\)$"):
        VLLMEngine.load(fake_vllm, dtype="float16")


def _vllm_installed() -> bool:
    try:
        vllm_python()
    except UsageError:
        return False
    return True


needs_vllm = pytest.mark.skipif(not _vllm_installed(), reason="vLLM is not installed (docs/engines.md)")


@pytest.mark.slow
@pytest.mark.realmodel
@needs_vllm
def test_vllm_on_smollm2_stops_and_keeps_the_stop_token(smollm2):
    """vLLM's greedy continuation of a SmolLM2 chat prompt: at most the limit, ending at a stop token or the limit,
    and the stop token list is honoured exactly (tokens are compared with HF by bench/engine_agreement.py)."""
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

    prompt = build_prompt_ids(smollm2.tokenizer, Problem("p", "What is 2 + 3?", "5", "gsm8k"))
    with VLLMEngine.load("smollm2-135m", batch_size=2) as engine:
        (tokens,) = greedy_continuations(engine, [prompt], 16, engine.stop_ids)
        assert 1 <= len(tokens) <= 16 and (tokens[-1] in engine.stop_ids or len(tokens) == 16)
        (cut,) = greedy_continuations(engine, [prompt], 16, [tokens[2]])
        assert cut == tokens[: tokens.index(tokens[2]) + 1]
