"""Peak memory of one prefill forward per attention kernel and context length (EpiKV §4.4, Fig. 1 microbenchmark).

    python -m models.memory --model smollm2-135m --ctx 512 1024 2048 --kernels sdpa eager+attentions --out runs/mem

Each measurement is one forward over `batch x ctx` random token ids, with the KV cache built (as a real prefill
does) and logits for the last position only (as `generate` asks for; full-vocabulary logits for every position
would dominate the memory of a small model and measure nothing about attention). Kernels:

- `sdpa`, `flash_attention_2`: the fused kernels; never materialise the [heads, n, n] attention matrix on CUDA.
- `eager`: the reference kernel; materialises one layer's attention matrix at a time.
- `eager+attentions`: eager with `output_attentions=True`, which keeps every layer's [batch, heads, n, n] map alive
  until the forward returns; what an attention-score eviction policy needs at prefill.

A caller measures other configurations with a `PrefillSetup`: a kernel plus a `run` that wraps the forward, e.g. to
score the context for eviction from what the forward left behind (`bench/prefill_memory.py` does this for H2O,
ValueDiff and EpiKV); everything `run` allocates counts in the same peak.

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
  rather kill the process than raise) and is marked `oom` with `measured` false. "Would not fit" is decided on a
  lower bound: the maps an eager forward must hold at its last layer (those kept, that layer's logits, and its
  softmax, which transformers computes in fp32), against the memory available or a given `memory_limit`.

`layer_bytes` is what one more decoder layer adds to the peak (its weights, KV cache and any kept map), for
extrapolating a measurement on a shallow copy of a model to its full depth.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from core.cli import ArgumentParser, add_device_arguments, atomic_write, main_guard, positive_int, seed_int
from core.errors import UsageError, unknown_choice
from core.limits import MemoryLimit
from core.rundir import RunDir
from models.footprint import model_shape
from models.hooks import decoder_layers
from models.lm import LoadedModel, attention_kernel
from models.loading import load_model, model_limits

if TYPE_CHECKING:  # transformers' model classes take seconds to import; they are only annotations here
    from transformers import PreTrainedModel

MB = 2**20


@dataclass(frozen=True)
class PrefillSetup:
    """One measured configuration: its row name, the attention implementation, whether the forward returns every
    layer's attention maps, and optionally `run(model, forward)`, which calls ``forward()`` (the plain prefill)
    inside whatever it needs (hooks) and works on the result (scoring); it returns the forward's output."""

    name: str
    implementation: str
    output_attentions: bool = False
    run: Callable[[PreTrainedModel, Callable[[], Any]], Any] | None = None


KERNEL_SETUPS = {
    setup.name: setup
    for setup in (
        PrefillSetup("sdpa", "sdpa"),
        PrefillSetup("flash_attention_2", "flash_attention_2"),
        PrefillSetup("eager", "eager"),
        PrefillSetup("eager+attentions", "eager", output_attentions=True),
    )
}
DEFAULT_KERNELS = ("sdpa", "eager+attentions")
ROW_FIELDS = ("model", "device", "dtype", "kernel", "ctx", "batch", "peak_mem_mb", "forward_mem_mb", "oom",
              "measured", "method")


def prefill_peak_memory(
    lm_or_model: LoadedModel | PreTrainedModel,
    ctx_lengths: Iterable[int],
    kernels: Sequence[str | PrefillSetup] = DEFAULT_KERNELS,
    batch: int = 1,
    *,
    seed: int = 0,
    memory_limit: int | None = None,
) -> list[dict]:
    """One row per (kernel or setup, context length): peak memory of a prefill forward, or `oom`.

    Row fields: model, device, dtype, kernel (the setup's name), ctx, batch, peak_mem_mb (weights included; None
    when oom), forward_mem_mb (the forward's own peak above what was allocated before it), oom (bool), measured
    (False when the row was inferred from a shorter length's OOM or skipped as certain not to fit), method (how it
    was measured). On CPU, `memory_limit` (bytes; default: what is available now) is what a configuration's lower
    bound must fit in to be attempted. The model's attention kernel is restored afterwards. See the module
    docstring for what the numbers include.
    """
    model = lm_or_model.model if isinstance(lm_or_model, LoadedModel) else lm_or_model
    name = lm_or_model.name if isinstance(lm_or_model, LoadedModel) else type(model).__name__
    lengths = sorted(set(_positive_ints(ctx_lengths, "context length")))
    setups = list(dict.fromkeys(_setup(kernel) for kernel in kernels))
    if not setups:
        raise UsageError("no attention kernel to measure")
    if batch < 1:
        raise UsageError(f"batch must be >= 1, got {batch}")
    device = next(model.parameters()).device
    if any(setup.implementation == "flash_attention_2" for setup in setups) and device.type != "cuda":
        raise UsageError("attention kernel 'flash_attention_2' needs a CUDA device")
    method = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler CPU allocator events"
    generator = torch.Generator().manual_seed(seed)
    # multimodal configs keep vocab_size in a sub-config; transformers types the embedding as a bare nn.Module
    vocab: int = model.get_input_embeddings().num_embeddings  # type: ignore[assignment]
    ids = {n: torch.randint(0, vocab, (batch, n), generator=generator) for n in lengths}
    rows = []
    with _restoring_kernel(model):
        for setup in setups:
            _set_kernel(model, setup.implementation)
            failed = False
            for n in lengths:
                row: dict[str, Any] = {
                    "model": name, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
                    "kernel": setup.name, "ctx": n, "batch": batch, "peak_mem_mb": None, "forward_mem_mb": None,
                    "oom": True, "measured": False, "method": method}
                if not failed and not _certain_not_to_fit(model, setup, n, batch, device, memory_limit):
                    result = _measure(model, ids[n].to(device), setup, device)
                    row["measured"] = True
                    if result is not None:
                        peak, extra = result
                        row.update(peak_mem_mb=peak / MB, forward_mem_mb=extra / MB, oom=False)
                failed = row["oom"]
                rows.append(row)
    return rows


def _setup(kernel: str | PrefillSetup) -> PrefillSetup:
    if isinstance(kernel, PrefillSetup):
        return kernel
    if kernel not in KERNEL_SETUPS:
        raise unknown_choice("attention kernel", kernel, KERNEL_SETUPS)
    return KERNEL_SETUPS[kernel]


def attention_map_bytes(model: PreTrainedModel, kernel: str | PrefillSetup, ctx: int, batch: int) -> int:
    """Bytes of the attention maps a kernel holds at once: all layers' for eager+attentions, one layer's for eager.

    [batch, q_heads, ctx, ctx] per layer in the model's dtype; 0 for the fused kernels.
    """
    setup = _setup(kernel)
    if setup.implementation != "eager":
        return 0
    layers = model.config.num_hidden_layers if setup.output_attentions else 1
    return layers * _map_bytes(model, ctx, batch, model.dtype.itemsize)


def _map_bytes(model: PreTrainedModel, ctx: int, batch: int, itemsize: int) -> int:
    return batch * model.config.num_attention_heads * ctx * ctx * itemsize


def layer_bytes(model: PreTrainedModel, kernel: str | PrefillSetup, ctx: int, batch: int) -> int:
    """What one more decoder layer adds to a prefill's peak: its weights, its KV cache ``[batch, kv_heads, ctx,
    head_dim]`` x 2 and, when the setup keeps every layer's attention map, that map. Activations are not counted:
    only the layer being computed holds them, so they do not grow with depth."""
    setup = _setup(kernel)
    config = model.config
    block = decoder_layers(model)[0]
    weights = sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers()))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = 2 * batch * config.num_key_value_heads * ctx * head_dim * model.dtype.itemsize
    maps = _map_bytes(model, ctx, batch, model.dtype.itemsize) if setup.output_attentions else 0
    return weights + cache + maps


def _certain_not_to_fit(model, setup: PrefillSetup, ctx: int, batch: int, device: torch.device,
                        limit: int | None) -> bool:
    """On CPU, a forward whose attention maps alone exceed `limit` (default: the memory available now) is not
    attempted. The eager kernel's last layer holds, besides the maps kept so far, its logits and their fp32
    softmax at once, so that softmax is added to `attention_map_bytes` (which counts the logits as a kept map)."""
    if device.type != "cpu" or setup.implementation != "eager":
        return False
    floor = attention_map_bytes(model, setup, ctx, batch) + _map_bytes(model, ctx, batch, 4)
    return floor > (limit if limit is not None else psutil.virtual_memory().available)


def _measure(model, ids: torch.Tensor, setup: PrefillSetup, device: torch.device) -> tuple[int, int] | None:
    """(peak bytes including what was allocated before, the forward's own peak bytes), or None on OOM."""

    def forward():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1, output_attentions=setup.output_attentions)

    def call() -> None:
        with torch.inference_mode():
            out = forward() if setup.run is None else setup.run(model, forward)
            if setup.output_attentions:
                _check_maps(out, model)

    try:
        before, peak = _peak(call, device)
    except RuntimeError as err:
        if not _is_oom(err):
            raise
    else:
        if device.type == "cuda":
            return peak, peak - before
        resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return resident + peak, peak
    # Only an OOM gets here. The cache is emptied outside the handler: its traceback held the failed tensors.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return None


def own_peak_bytes(call: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """The peak bytes of the tensors `call()` allocates on `device` above those live before it (the module
    docstring says how each device measures them); what `models.footprint` estimates is checked against it."""
    before, peak = _peak(call, torch.device(device))
    return peak - before


def _peak(call: Callable[[], Any], device: torch.device) -> tuple[int, int]:
    """(bytes live before, peak bytes) of `call()`: CUDA's allocator counts both; on the CPU the profiler sees only
    the call's own allocations, so before is 0 and the peak is the call's own."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return before, torch.cuda.max_memory_allocated(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    return 0, _cpu_peak_bytes(prof)


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
    """The rows as CSV: the `ROW_FIELDS` first, then any column a caller added, in order of first appearance."""
    fields = list(dict.fromkeys([*ROW_FIELDS, *(key for row in rows for key in row)]))
    with atomic_write(path) as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
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
    add_device_arguments(parser)
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the random token ids (default 0)")
    parser.add_argument("--out", required=True, help="output directory for prefill_memory.csv and config.json")
    return parser


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for kernel in args.kernels:
        _setup(kernel)
    model_limits(args.model).check_flags({"--ctx": max(args.ctx)})  # before a model loads or --out is claimed
    # A length that does not fit is a row marked oom, what this measures; the model itself must fit.
    limit = MemoryLimit.of(args.device, args.max_memory)
    model_shape(args.model, args.dtype, args.device).weights().check(f"loading {args.model}", limit,
                                                                     "raise --max-memory")
    identity = {key: value for key, value in vars(args).items() if key != "out"}
    with RunDir(args.out, identity) as run:
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
        rows = prefill_peak_memory(lm, args.ctx, args.kernels, args.batch, seed=args.seed,
                                   memory_limit=args.max_memory)
        write_rows(run.path / "prefill_memory.csv", rows)
        run.save_config(model_info=lm.describe())
    for row in rows:
        value = "OOM" if row["oom"] else f"{row['peak_mem_mb']:.1f} MB (forward {row['forward_mem_mb']:.1f} MB)"
        print(f"{row['kernel']:>18}  ctx {row['ctx']:>6}  {value}")
    return 0


main = main_guard(_main)

if __name__ == "__main__":
    raise SystemExit(main())
