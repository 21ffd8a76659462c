"""The prefill memory wall (EpiKV §4.4, Fig. 1): peak memory of scoring a context for eviction as it grows, on a
random-init model shaped like Llama-3-8B, attention-requiring against FA-compatible policies.

    .venv/bin/python bench/prefill_memory.py --out runs/prefill-memory            # CPU: 2 layers, bf16, 1k..16k
    .venv/bin/python -m figures.prefill_memory --input runs/prefill-memory/prefill_memory.csv --out figs \\
        --capacity-gb 80

Each setup is one prefill forward over ``--batch x ctx`` random tokens plus the policy's scoring of every context
token in every layer, measured by `models.memory.prefill_peak_memory` (CPU: allocator events; CUDA: peak allocated):

- ``eager+attentions+h2o`` (attention-requiring): the eager kernel with ``output_attentions=True``, which holds
  every layer's ``[batch, heads, n, n]`` map, and H2O's score (the attention each key received, summed over the
  queries and averaged over each KV head's query group) from those maps.
- ``sdpa+valuediff`` (FA-compatible, KV scoring): SDPA, then ValueDiff's ``||v_j - v_bar||`` from the prefill's
  value cache.
- ``sdpa+epikv`` (FA-compatible, hidden-state scoring): SDPA with EpiKV's two residual streams captured, then its
  band score (the bands' layers are the first and last of the measured model: which two does not change the
  memory).

Depth. On CPU the model keeps the 8B's width (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
128256) but only ``--layers`` decoder layers (default 2; the 8B has 32 and needs 16 GB of bf16 weights). Each
measured row is also written at ``--target-layers`` (default 32) by adding, per missing layer, exactly what one
more layer holds at the end of the forward: its weights, its KV cache, its kept attention map
(`models.memory.layer_bytes`, checked against measurements at two depths in the tests) and its kept scores. The
activations of the layer being computed, the embeddings and the last position's logits do not grow with depth.
Those rows have ``extrapolated`` true; the figure draws them hollow. A configuration whose attention maps cannot
fit in ``--max-memory`` is not run (marked oom, not measured), nor extrapolated. With a GPU
(`bench/gpu_check.sh`) the full-depth model is measured directly.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.cli import ArgumentParser, add_device_arguments, main_guard, positive_int  # noqa: E402

CONTEXTS = (1024, 2048, 4096, 8192, 16384)
GB = 2**30


class Scoring:
    """A policy's prefill scoring as a `models.memory.PrefillSetup` ``run``. `score_layers(model, policy, forward)`
    returns the forward's output and the scores it keeps per layer; their bytes per layer are remembered for the
    depth extrapolation."""

    def __init__(self, policy: str, score_layers: Callable[[Any, Any, Any], tuple[Any, list[torch.Tensor]]]):
        self.policy = policy
        self.score_layers = score_layers
        self.layer_score_bytes = 0

    def __call__(self, model, forward):
        from evictor.policies import get_policy

        out, scores = self.score_layers(model, get_policy(self.policy), forward)
        self.layer_score_bytes = sum(s.numel() * s.element_size() for s in scores) // max(1, len(scores))
        return out


class _Candidates(TypedDict):
    positions: torch.Tensor
    candidate_mask: torch.Tensor


def _candidates(batch: int, n_kv: int, n: int, device) -> _Candidates:
    positions = torch.arange(n, device=device).expand(batch, n_kv, n)
    return {"positions": positions, "candidate_mask": torch.ones((), dtype=torch.bool, device=device).expand(
        batch, n_kv, n)}


def h2o_scores(model, policy, forward) -> tuple[Any, list[torch.Tensor]]:
    from models.attention import group_mean
    from scoring.policy import ScoreInputs

    out = forward()
    n_kv = model.config.num_key_value_heads
    scores = []
    for layer, maps in enumerate(out.attentions):
        batch, _, n, _ = maps.shape
        # Summing over the queries first gives H2O's score without an fp32 copy of the map.
        received = group_mean(maps.sum(dim=2, keepdim=True, dtype=torch.float32), n_kv)
        inputs = ScoreInputs(layer=layer, step=0, attention=received, **_candidates(batch, n_kv, n, maps.device))
        scores.append(policy.score(inputs))
    return out, scores


def valuediff_scores(model, policy, forward) -> tuple[Any, list[torch.Tensor]]:
    from scoring.policy import ScoreInputs

    out = forward()
    scores = []
    for layer, cached in enumerate(out.cache.layers):
        values = cached.values
        batch, n_kv, n, _ = values.shape
        candidates = _candidates(batch, n_kv, n, values.device)
        inputs = ScoreInputs(layer=layer, step=0, values=values, cache_values=values,
                             cache_mask=candidates["candidate_mask"], **candidates)
        scores.append(policy.score(inputs))
    return out, scores


def epikv_scores(model, policy, forward) -> tuple[Any, list[torch.Tensor]]:
    from models.hooks import capture, hook_name
    from scoring.policy import ObserveInputs

    depth = model.config.num_hidden_layers
    policy = type(policy)(positive_layers=(0,), negative_layers=(depth - 1,)).for_depth(depth)
    names = {hook_name(layer, policy.needs.hidden_hook): layer for layer in policy.needs.hidden_layers}
    hidden: dict[int, torch.Tensor] = {}
    with capture(model, list(names), callback=lambda name, tensor: hidden.__setitem__(names[name], tensor)):
        out = forward()
    batch, n, _ = next(iter(hidden.values())).shape
    positions = torch.arange(n, device=out.logits.device).expand(batch, n)
    policy.observe(ObserveInputs(layer=0, positions=positions, keys=None, values=None, hidden=hidden, state={}))
    return out, []  # one score per token for every layer: it does not grow with depth


def setups():
    """The three measured configurations, as `PrefillSetup`s whose runs remember their per-layer score bytes."""
    from models.memory import PrefillSetup

    return [
        PrefillSetup("eager+attentions+h2o", "eager", output_attentions=True, run=Scoring("h2o", h2o_scores)),
        PrefillSetup("sdpa+valuediff", "sdpa", run=Scoring("valuediff", valuediff_scores)),
        PrefillSetup("sdpa+epikv", "sdpa", run=Scoring("epikv", epikv_scores)),
    ]


def measure(lm, contexts, *, batch: int = 1, target_layers: int | None = None,
            memory_limit: int | None = None) -> list[dict]:
    """`models.memory.prefill_peak_memory` rows for every setup, each with ``layers`` and ``extrapolated``; with a
    `target_layers` deeper than the model, every measured row again at that depth (see the module docstring)."""
    from models.memory import MB, attention_map_bytes, layer_bytes, prefill_peak_memory

    model = lm.model
    depth = model.config.num_hidden_layers
    deeper = target_layers is not None and target_layers > depth
    resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    rows = []
    for setup in setups():
        weights = layer_bytes(model, setup, 0, batch)
        for row in prefill_peak_memory(lm, contexts, [setup], batch, memory_limit=memory_limit):
            # the setup's run last scored this length: its per-layer score bytes belong to this row
            scores = None if row["oom"] else setup.run.layer_score_bytes
            row.update(layers=depth, extrapolated=False, layer_score_mb=None if scores is None else scores / MB)
            rows.append(row)
            if deeper and not row["measured"]:
                assert target_layers is not None  # deeper
                # not run: at the target depth it needs at least its weights and the maps it keeps
                maps = attention_map_bytes(model, setup, row["ctx"], batch)
                maps = maps * target_layers // depth if setup.output_attentions else maps
                row["target_floor_mb"] = (resident + (target_layers - depth) * weights + maps) / MB
            if not deeper or row["oom"]:
                continue
            assert target_layers is not None and scores is not None  # deeper, and not an OOM row
            grown = (target_layers - depth) * (layer_bytes(model, setup, row["ctx"], batch) + scores)
            rows.append({**row, "layers": target_layers, "extrapolated": True, "measured": False,
                         "peak_mem_mb": row["peak_mem_mb"] + grown / MB,
                         "forward_mem_mb": row["forward_mem_mb"] + (grown - (target_layers - depth) * weights) / MB,
                         "method": f"{row['method']} at {depth} layers + {target_layers - depth} x "
                                   "(models.memory.layer_bytes + the layer's scores)"})
    return rows


def print_table(rows: list[dict]) -> None:
    by_key = {(r["kernel"], r["ctx"], r["layers"]): r for r in rows}
    depths = sorted({r["layers"] for r in rows})
    header = f"{'setup':<22} {'ctx':>6} " + " ".join(f"{f'{d} layers GB':>16}" for d in depths)
    print(header)
    print("-" * len(header))
    for setup in dict.fromkeys(r["kernel"] for r in rows):
        for ctx in sorted({r["ctx"] for r in rows if r["kernel"] == setup}):
            shallow = by_key[setup, ctx, depths[0]]
            cells = []
            for d in depths:
                row = by_key.get((setup, ctx, d))
                if row is None:  # not run at the shallow depth: what the deeper model would need at least
                    floor = shallow.get("target_floor_mb")
                    cells.append(f"{'-' if floor is None else f'>= {floor / 1024:.0f}':>16}")
                elif row["oom"]:
                    cells.append(f"{'OOM' if row['measured'] else 'not run':>16}")
                else:
                    cells.append(f"{row['peak_mem_mb'] / 1024:>15.2f}{'*' if row['extrapolated'] else ' '}")
            print(f"{setup:<22} {ctx:>6} " + " ".join(cells))
    if any(r["extrapolated"] for r in rows):
        print("* extrapolated in depth. not run: the attention maps alone would not fit in the memory limit; "
              ">= X: the weights and kept maps alone at that depth")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bench/prefill_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=positive_int, nargs="+", default=list(CONTEXTS),
                        help=f"context lengths (default: {' '.join(map(str, CONTEXTS))})")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="decoder layers of the measured model (default: 2 on CPU, 32 on CUDA)")
    parser.add_argument("--target-layers", type=positive_int, default=32,
                        help="depth the measured rows are extrapolated to when --layers is smaller (default: 32)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per forward (default: 1)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default: 1)")
    add_device_arguments(parser, dtype_default="bfloat16")
    parser.add_argument("--out", default="runs/prefill-memory",
                        help="directory for prefill_memory.csv and config.json (default: runs/prefill-memory)")
    return parser


def _run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import psutil

    from bench.common import BIG, build_llama, llama_config
    from core.limits import MemoryLimit, ModelLimits
    from core.rundir import RunDir
    from models.footprint import config_shape
    from models.loading import default_device
    from models.memory import write_rows

    torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    layers = args.layers or (2 if device.type == "cpu" else BIG["num_hidden_layers"])
    config = llama_config({**BIG, "num_hidden_layers": layers})
    ModelLimits("the random-init 8B-shaped Llama", context=config.max_position_embeddings).check_flags(
        {"--ctx": max(args.ctx)})
    shape = config_shape(f"random-llama-8b-shape-{layers}-layers", config, getattr(torch, args.dtype).itemsize)
    shape.weights().check(f"building {shape.model}", MemoryLimit.of(args.device, args.max_memory), "lower --layers")
    # A context whose maps would not fit is a row marked oom, what this measures; without --max-memory the CPU limit
    # is half the memory available at start, as the machine may be shared.
    limit = (args.max_memory if args.max_memory is not None
             else psutil.virtual_memory().available // 2 if device.type == "cpu" else None)
    identity = {**{k: v for k, v in vars(args).items() if k not in ("out", "threads")}, "layers": layers}
    with RunDir(args.out, identity) as run:
        lm = build_llama({**BIG, "num_hidden_layers": layers}, "sdpa", device, getattr(torch, args.dtype),
                         f"random-llama-8b-shape-{layers}-layers")
        print(f"{lm.name} on {device} ({args.dtype}, {args.threads} thread(s)), batch {args.batch}, memory limit "
              f"{'none' if limit is None else f'{limit / GB:.1f} GB'}; contexts {args.ctx}", flush=True)
        rows = measure(lm, args.ctx, batch=args.batch, target_layers=args.target_layers, memory_limit=limit)
        write_rows(run.path / "prefill_memory.csv", rows)
        run.save_config(model=lm.describe(), memory_limit_bytes=limit)
    print_table(rows)
    print(f"\nwritten to {run.path}/prefill_memory.csv; draw it with python -m figures.prefill_memory --input "
          f"{run.path}/prefill_memory.csv --out figs --capacity-gb 80")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
