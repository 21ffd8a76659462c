"""Peak memory of one prefill forward per attention kernel and context length (EpiKV §4.4, Fig. 1 microbenchmark).

    python -m models.memory --model smollm2-135m --ctx 512 1024 2048 --kernels sdpa eager+attentions --out runs/mem

Each measurement is one forward over `batch x ctx` random token ids, with the KV cache built (as a real prefill
does) and logits for the last position only (as `generate` asks for; full-vocabulary logits for every position
would dominate the memory of a small model and measure nothing about attention). Kernels:

- `sdpa`, `flash_attention_2`: the fused kernels; never materialise the [heads, n, n] attention matrix on CUDA.
- `eager`: the reference kernel; materialises one layer's attention matrix at a time.
- `eager+attentions`: eager with `output_attentions=True`, which keeps every layer's [batch, heads, n, n] map alive
  until the forward returns; what an attention-score eviction policy needs at prefill.

What the numbers are:

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`: the peak bytes held in live tensors
  (weights included), not the allocator's reserved pool nor the CUDA context. Deterministic for a given input
  up to the kernels' workspace choices; an out-of-memory error is caught and the row marked `oom`.
- CPU: the allocation and free events of PyTorch's CPU allocator recorded by `torch.profiler(profile_memory=True)`;
  the peak of their running sum is the forward's extra memory (`forward_mem_mb`), added to the bytes of the
  model's parameters and buffers for `peak_mem_mb`. Exact for tensors PyTorch allocates and repeatable run to run
  (no sampling), but blind to memory allocated outside PyTorch's allocator (oneDNN / BLAS scratch buffers, the
  Python heap) and to allocator fragmentation, so it is a lower bound on the growth of the process's RSS. On CPU
  a configuration whose attention maps alone would not fit in the memory available now is not run (Linux would
  rather kill the process than raise) and is marked `oom` with `measured` false.

Once a kernel runs out of memory at some length, longer lengths for that kernel are marked `oom` without running.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil
import torch
from transformers import PreTrainedModel

from core.cli import atomic_write, main_guard, positive_int, save_config
from core.errors import UsageError, unknown_choice
from models.loading import LoadedModel, attention_kernel, load_model

MB = 2**20
# kernel name -> (attn_implementation, output_attentions)
KERNEL_SETUPS = {
    "sdpa": ("sdpa", False),
    "flash_attention_2": ("flash_attention_2", False),
    "eager": ("eager", False),
    "eager+attentions": ("eager", True),
}
DEFAULT_KERNELS = ("sdpa", "eager+attentions")
ROW_FIELDS = ("model", "device", "dtype", "kernel", "ctx", "batch", "peak_mem_mb", "forward_mem_mb", "oom",
              "measured", "method")


def prefill_peak_memory(
    lm_or_model: LoadedModel | PreTrainedModel,
    ctx_lengths: Iterable[int],
    kernels: Sequence[str] = DEFAULT_KERNELS,
    batch: int = 1,
    *,
    seed: int = 0,
) -> list[dict]:
    """One row per (kernel, context length): peak memory of a prefill forward, or `oom`.

    Row fields: model, device, dtype, kernel, ctx, batch, peak_mem_mb (weights included; None when oom),
    forward_mem_mb (the forward's own peak above what was allocated before it), oom (bool), measured (False when
    the row was inferred from a shorter length's OOM or skipped as certain not to fit), method (how it was
    measured). The model's attention kernel is restored afterwards. See the module docstring for what the
    numbers include.
    """
    model = lm_or_model.model if isinstance(lm_or_model, LoadedModel) else lm_or_model
    name = lm_or_model.name if isinstance(lm_or_model, LoadedModel) else type(model).__name__
    lengths = sorted(set(_positive_ints(ctx_lengths, "context length")))
    kernels = list(dict.fromkeys(kernels))
    if not kernels:
        raise UsageError("no attention kernel to measure")
    for kernel in kernels:
        if kernel not in KERNEL_SETUPS:
            raise unknown_choice("attention kernel", kernel, KERNEL_SETUPS)
    if batch < 1:
        raise UsageError(f"batch must be >= 1, got {batch}")
    device = next(model.parameters()).device
    if "flash_attention_2" in kernels and device.type != "cuda":
        raise UsageError("attention kernel 'flash_attention_2' needs a CUDA device")
    method = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler CPU allocator events"
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings  # multimodal configs keep vocab_size in a sub-config
    ids = {n: torch.randint(0, vocab, (batch, n), generator=generator) for n in lengths}
    rows = []
    with _restoring_kernel(model):
        for kernel in kernels:
            implementation, maps = KERNEL_SETUPS[kernel]
            _set_kernel(model, implementation)
            failed = False
            for n in lengths:
                row = {"model": name, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
                       "kernel": kernel, "ctx": n, "batch": batch, "peak_mem_mb": None, "forward_mem_mb": None,
                       "oom": True, "measured": False, "method": method}
                if not failed and not _certain_not_to_fit(model, kernel, n, batch, device):
                    result = _measure(model, ids[n].to(device), maps, device)
                    row["measured"] = True
                    if result is not None:
                        peak, extra = result
                        row.update(peak_mem_mb=peak / MB, forward_mem_mb=extra / MB, oom=False)
                failed = row["oom"]
                rows.append(row)
    return rows


def attention_map_bytes(model: PreTrainedModel, kernel: str, ctx: int, batch: int) -> int:
    """Bytes of the attention maps a kernel holds at once: all layers' for eager+attentions, one layer's for eager.

    [batch, q_heads, ctx, ctx] per layer in the model's dtype; 0 for the fused kernels.
    """
    implementation, maps = KERNEL_SETUPS[kernel]
    if implementation != "eager":
        return 0
    config = model.config
    layers = config.num_hidden_layers if maps else 1
    return layers * batch * config.num_attention_heads * ctx * ctx * model.dtype.itemsize


def _certain_not_to_fit(model, kernel: str, ctx: int, batch: int, device: torch.device) -> bool:
    """On CPU, a forward whose attention maps alone exceed the memory available now is not attempted."""
    if device.type != "cpu":
        return False
    return attention_map_bytes(model, kernel, ctx, batch) > psutil.virtual_memory().available


def _measure(model, ids: torch.Tensor, output_attentions: bool, device: torch.device) -> tuple[int, int] | None:
    """(peak bytes including what was allocated before, the forward's own peak bytes), or None on OOM."""

    def forward():
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1, output_attentions=output_attentions)

    try:
        if device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            out = forward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            if output_attentions:
                _check_maps(out, model)
            del out
            return peak, peak - before
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out = forward()
            if output_attentions:
                _check_maps(out, model)
            del out
        extra = _cpu_peak_bytes(prof)
        resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return resident + extra, extra
    except RuntimeError as err:
        if not _is_oom(err):
            raise
    # Only an OOM gets here. The cache is emptied outside the handler: its traceback held the failed tensors.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return None


def _check_maps(out, model) -> None:
    """eager+attentions must really return every layer's map, or its row would silently measure plain eager."""
    maps = getattr(out, "attentions", None)
    if not maps or len(maps) != model.config.num_hidden_layers or any(m is None for m in maps):
        raise RuntimeError("output_attentions=True returned no attention maps; the eager kernel did not run")


def _cpu_peak_bytes(prof) -> int:
    """Peak of the running sum of allocation (+) and free (-) events recorded during the profile, in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e["ts"], e["args"].get("Ev Idx", 0), e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    running, peak = 0, 0
    for _, _, nbytes in memory:
        running += nbytes
        peak = max(peak, running)
    return peak


def _is_oom(err: RuntimeError) -> bool:
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in text or "not enough memory" in text


def _set_kernel(model, implementation: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:
        model.config._attn_implementation = implementation


@contextlib.contextmanager
def _restoring_kernel(model):
    """Whatever happens inside, the model leaves with the kernel it came with."""
    original = attention_kernel(model)
    try:
        yield
    finally:
        _set_kernel(model, original)


def _positive_ints(values: Iterable[int], what: str) -> list[int]:
    values = list(values)
    if not values:
        raise UsageError(f"no {what} given")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{what} must be a positive integer, got {value!r}")
    return values


def write_rows(path: str | os.PathLike, rows: list[dict]) -> Path:
    with atomic_write(path) as handle:
        writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m models.memory",
        description="Peak memory of one prefill forward per attention kernel and context length "
        "(EpiKV Fig. 1). Writes OUT/prefill_memory.csv for `python -m figures.prefill_memory`.",
    )
    parser.add_argument("--model", default="smollm2-135m", help="registry name, HF directory, .gguf or hub id")
    parser.add_argument("--ctx", type=positive_int, nargs="+", required=True,
                        help="context lengths in tokens, e.g. --ctx 1024 2048 4096")
    parser.add_argument("--kernels", nargs="+", default=list(DEFAULT_KERNELS),
                        help=f"kernels to compare, from {', '.join(KERNEL_SETUPS)} (default: "
                        f"{' '.join(DEFAULT_KERNELS)})")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per forward (default 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    parser.add_argument("--out", required=True, help="output directory for prefill_memory.csv and config.json")
    return parser


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for kernel in args.kernels:
        if kernel not in KERNEL_SETUPS:
            raise unknown_choice("attention kernel", kernel, KERNEL_SETUPS)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = prefill_peak_memory(lm, args.ctx, args.kernels, args.batch, seed=args.seed)
    out = Path(args.out)
    write_rows(out / "prefill_memory.csv", rows)
    save_config(out, {**vars(args), "model_info": lm.describe()})
    for row in rows:
        value = "OOM" if row["oom"] else f"{row['peak_mem_mb']:.1f} MB (forward {row['forward_mem_mb']:.1f} MB)"
        print(f"{row['kernel']:>18}  ctx {row['ctx']:>6}  {value}")
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
