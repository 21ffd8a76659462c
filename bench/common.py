"""Shared pieces of the benchmarks: a fixed prompt, forced-length generation, medians and ratio tables, and the
random-init Llama shapes of the GPU check.

Benchmarks are scripts, not tests: they print medians over repeats and ratios against a baseline measured in the
same run, with the runs of different settings interleaved (repeat-major) so that machine load drifts hit all alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)

BIG = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
           "rope_theta": 500000.0}
SMALL = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 8192}


def llama_config(shape: dict):
    """The transformers config of a random-init Llama of `shape` (a LlamaConfig's fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_llama(shape: dict, kernel: str, device: torch.device, dtype: torch.dtype, name: str):
    """A random-init Llama of `shape` (a LlamaConfig's fields) as a `LoadedModel`, seeded, in eval mode."""
    from transformers import AutoModelForCausalLM

    from models.lm import LoadedModel
    from models.tiny import tiny_tokenizer

    config = llama_config(shape)
    start = time.perf_counter()
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=kernel)
    model.eval()
    tokenizer = tiny_tokenizer()  # only its pad/eos ids are read; prompts are random ids
    return LoadedModel(model, tokenizer, name, "random-init", time.perf_counter() - start)


def fixed_prompt(tokenizer) -> list[int]:
    """The benchmark prompt, formatted the way evaluation runs format it."""
    from tasks.problem import Problem
    from tasks.prompts import build_prompt_ids

    return build_prompt_ids(tokenizer, Problem("bench", QUESTION, "72", "gsm8k"))


def checked_prompt(model: str, budget: int, buffer: int, new_tokens: int) -> list[int]:
    """`fixed_prompt` in `model`'s tokens, its budget, buffer and the prompt plus `new_tokens` checked against the
    model's context (read from its config and tokenizer; nothing is loaded)."""
    from models.loading import load_tokenizer, model_limits

    prompt = fixed_prompt(load_tokenizer(model))
    limits = model_limits(model)
    limits.check_flags({"--budget": budget, "--buffer": buffer})
    limits.check_tokens(f"the {len(prompt)}-token prompt + --new-tokens {new_tokens}", len(prompt) + new_tokens)
    return prompt


def check_engine_memory(shape, policies: Sequence[str], config, prompt: int, new_tokens: int, batch: int,
                        device: str | None, max_memory: int | None, *, eager: bool = False, remedy: str = "",
                        extra=None) -> None:
    """Refuse a benchmark whose largest `evictor.engine.EvictionEngine` run (`batch` copies of a `prompt`-token
    prompt, `new_tokens` decoded, under `config` and each of `policies`), with the `core.limits.Footprint` `extra`
    it holds besides, would need more memory than the device has or --max-memory allows (`models.footprint.ModelShape`
    `shape`)."""
    from core.limits import Footprint, MemoryLimit
    from evictor.engine import eviction_footprint
    from evictor.policies import get_policy

    footprint = max((eviction_footprint(shape, get_policy(name), config, [prompt] * batch, new_tokens, batch,
                                        eager=eager) for name in policies), key=lambda footprint: footprint.total)
    (footprint + (extra or Footprint(()))).check(
        f"{shape.model} decoding {batch} sequence(s) of {prompt} prompt + {new_tokens} new tokens",
        MemoryLimit.of(device, max_memory), remedy or "lower --batch-size or --new-tokens")


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def interleaved(settings: list[str], repeats: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """Run every setting once per repeat, in the same order each repeat; returns setting -> list of results."""
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for repeat in range(repeats):
        for name in settings:
            out = run(name)
            results[name].append(out)
            print(f"  repeat {repeat + 1}/{repeats} {name:<22} " + ", ".join(
                f"{k}={v:.4g}" for k, v in out.items() if isinstance(v, float)), flush=True)
    return results


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Fixed-width table; columns are (key, header, format spec)."""
    widths = [max(len(header), 10) for _, header, _ in columns]
    widths[0] = max([widths[0]] + [len(str(row.get(columns[0][0], ""))) for row in rows]) - 8
    lines = ["  ".join(f"{header:>{w}}" if i else f"{header:<{w + 8}}" for i, ((_, header, _), w) in
                       enumerate(zip(columns, widths)))]
    for row in rows:
        cells = []
        for i, ((key, _, spec), w) in enumerate(zip(columns, widths)):
            value = row.get(key)
            text = "-" if value is None else format(value, spec)
            cells.append(f"{text:>{w}}" if i else f"{text:<{w + 8}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
