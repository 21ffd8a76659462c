"""Shared fixtures: tiny random-init models (every family, and the three the integration tests run on) and the real
SmolLM2 / Gemma3-270M, loaded once."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two threads on an idle 2-core CI machine; KVSCOPE_TEST_THREADS=1 is much faster on a machine shared with other jobs.
torch.set_num_threads(int(os.environ.get("KVSCOPE_TEST_THREADS", max(1, min(2, os.cpu_count() or 1)))))

from models.families import family_names  # noqa: E402
from models.loading import load_model  # noqa: E402
from models.tiny import save_tiny_model, tiny_model  # noqa: E402

# The code paths of the stages branch on three structural features, which these span: grouped-query attention (Llama),
# QK-norm (Qwen3) and mixed sliding-window / full layers (Gemma3). What differs between families beyond them (hook
# modules, fused projections, sinks, soft caps, MoE) is checked on every family through `family_lm`.
INTEGRATION_FAMILIES = ("llama", "qwen3", "gemma3")


@pytest.fixture(scope="session", params=INTEGRATION_FAMILIES)
def tiny(request):
    """A tiny model of each integration family (Llama, Qwen3, Gemma3 with sliding-window layers)."""
    return tiny_model(request.param, seed=0)


@pytest.fixture(scope="session", params=family_names())
def family_lm(request):
    """A tiny model of every family kvscope knows (`models.families`), for the tests of per-family facts."""
    return tiny_model(request.param, seed=0)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny_model("gemma3", seed=0)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many small forwards (request it with ``pytestmark = pytest.mark.usefixtures("one_thread")``):
    one thread avoids oversubscribing a CPU that other jobs share."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny Llama as a local HuggingFace directory."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def write_arithmetic_problems(path, n: int) -> str:
    """`n` problems "What is i + i?" (ids p1..pn, answer 2i) as a JSONL data file at `path`; its path as a string."""
    import json

    rows = [{"id": f"p{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, n + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_traces(model: str) -> list[dict]:
    """Three hand-made dense trace records of the tiny Llama's tokenizer (`model`: the name they are recorded with),
    the first and last marked correct: each reasons a step and answers ``\\boxed{42}``."""
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    prompt = tok.encode("<|bos|><|user|>What is 6*7?<|eos|><|assistant|>")
    return [{"kind": "trace", "id": f"t{i}", "dataset": "gsm8k", "model": model, "prompt_ids": prompt,
             "generated_ids": tok.encode(f"Step {i}: six sevens make forty-two, so we get 42. \\boxed{{42}}<|eos|>",
                                         add_special_tokens=False),
             "answer": "42", "gold": "42", "correct": correct} for i, correct in enumerate([True, False, True])]


@pytest.fixture(scope="session")
def smollm2():
    """The default real model (SmolLM2-135M-Instruct), fp32 SDPA on CPU."""
    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def gemma3_270m():
    return load_model("gemma3-270m", device="cpu", dtype="float32")


@pytest.fixture
def data_dir():
    """The offline benchmark data directory (CI points KVSCOPE_DATA_DIR at ../shared/data)."""
    path = os.environ.get("KVSCOPE_DATA_DIR")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "shared", "data")
    return os.path.abspath(path)
