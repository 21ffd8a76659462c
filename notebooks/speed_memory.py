# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Speed and memory
#
# 1. **Time and peak memory vs budget** from `evictor.run` (one problem per batch, so each record's time is its own).
#    On CPU the process RSS is dominated by the weights, so by default the memory panel shows the peak live KV-cache
#    bytes the engine reports (`memory = "cache"`); `"process"` plots the process peak (RSS on CPU, the allocator peak
#    on CUDA).
# 2. **Prefill memory vs context length** (`models.memory`, EpiKV Fig. 1): one prefill forward under SDPA against the
#    eager kernel with `output_attentions=True`, which keeps every layer's attention map alive — what an
#    attention-score policy needs at prefill.
# 3. **Throughput projection** (`figures.projection`, EpiKV App. 14): pure KV-cache arithmetic — how many concurrent
#    requests fit on one GPU with and without a budget, in EpiKV's setting and for this notebook's model.

# %% tags=["parameters"]
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
dataset = "gsm8k"
data_file = None  # problems JSONL instead of the dataset's copy
limit = 3  # problems per cell
max_new_tokens = 128
policies = ["recency", "valuediff"]  # evicting policies, run next to the dense `full` baseline
budgets = [32, 64]  # K per head, tokens of the generated trace (budget_scope "trace")
buffer = 16  # recent buffer r
protect = "prompt"  # one protection rule for every policy (prompt, sinks, none)
time_column = "tokens_per_s"  # "tokens_per_s" (decode throughput) or "wall_s" (per problem)
memory = "cache"  # "cache" (peak live KV-cache bytes) or "process" (RSS on CPU, allocator peak on CUDA)
sweep_dir = None  # reuse this evictor.run sweep instead of running one
ctx_lengths = [256, 512, 1024, 2048]  # prefill memory context lengths
kernels = ["sdpa", "eager+attentions"]
projection_ctx = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
projection_budgets = [None, 1024, 2048]  # None means no eviction
projection_gpu_gb = 80.0  # GPU memory for this model's projection
torch_threads = 1  # torch CPU threads
data_dir = None  # benchmark data directory (default: $KVSCOPE_DATA_DIR, set by scripts/env.sh)
out_dir = "runs/notebooks/speed_memory"

# %%
from pathlib import Path

import pandas as pd

from figures.notebook import prepare, show

out = prepare(out_dir, torch_threads=torch_threads, data_dir=data_dir)
fig_dir = out / "figures"

# %% [markdown]
# ## 1. Time and peak memory vs budget

# %%
from core.schemas import Trace, iter_records
from evictor.protocol import TOKENS, Budget
from evictor.sweep import SweepConfig, run_sweep
from tasks.run import GenerationConfig

if sweep_dir is None:
    sweep_dir = out / "sweep"
    generation = GenerationConfig(dataset=dataset, model=model, data_file=data_file, limit=limit,
                                  max_new_tokens=max_new_tokens)
    run_sweep(SweepConfig(generation, policies=("full", *policies), budgets=tuple(Budget(k, TOKENS) for k in budgets),
                          protocol_settings={"budget_scope": "trace", "buffer": buffer, "protect": protect},
                          batch_size=1), sweep_dir, quiet=True)
memory_field = {"cache": "peak_cache_bytes", "process": "peak_memory_bytes"}[memory]
cost = pd.DataFrame([{"policy": t.policy, "budget": t.budget, "problem": t.id, "generated": len(t.generated_ids),
                      "wall_s": t.timings["wall_s"], "tokens_per_s": t.timings["tokens_per_s"],
                      "rounds": t.eviction["rounds"], "peak_mem_mb": t.eviction[memory_field] / 2**20}
                     for path in sorted(Path(sweep_dir).rglob("generations.jsonl")) for t in iter_records(path, Trace)])
cost.to_csv(out / "cost.csv", index=False)
cost.groupby(["policy", "budget"], dropna=False)[["generated", "wall_s", "tokens_per_s", "rounds",
                                                 "peak_mem_mb"]].median()

# %%
from figures.cost_budget import plot_cost_vs_budget

what = {"cache": "peak KV-cache memory", "process": "process peak memory"}[memory]
speed = {"tokens_per_s": "decode throughput", "wall_s": "wall time per problem"}[time_column]
show(plot_cost_vs_budget(cost, time=time_column, title=f"{model}: {speed} and {what} vs budget"), fig_dir,
     "cost_vs_budget")

# %% [markdown]
# ## 2. Prefill memory vs context length: SDPA vs `output_attentions=True`

# %%
from models.loading import load_model
from models.memory import prefill_peak_memory

lm = load_model(model, dtype="float32")
prefill = pd.DataFrame(prefill_peak_memory(lm, ctx_lengths, kernels))
prefill.to_csv(out / "prefill_memory.csv", index=False)
prefill[["kernel", "ctx", "peak_mem_mb", "forward_mem_mb", "oom", "measured"]]

# %%
from figures.prefill_memory import plot_prefill_memory

show(plot_prefill_memory(prefill, title=f"{model}: one prefill forward ({prefill['device'].iloc[0]})"), fig_dir,
     "prefill_memory")

# %% [markdown]
# ## 3. Throughput projection from KV-cache arithmetic

# %%
from figures.projection import EPIKV_SETTING, plot_projection, projection_table

epikv = projection_table(projection_ctx, projection_budgets, **EPIKV_SETTING)
show(plot_projection(epikv, annotate_ctx=32768,
                     setting_note="R1-Distill-Llama-8B, 80 GB GPU − 16 GB weights − 8 GB reserve",
                     title="EpiKV setting"), fig_dir, "projection_epikv")
epikv.pivot(index="ctx", columns="budget", values="requests")

# %%
info = lm.describe()
weight_gb = sum(p.numel() for p in lm.model.parameters()) * 2 / 2**30  # bf16 weights
own_setting = {"gpu_mem_gb": projection_gpu_gb, "weight_gb": weight_gb, "overhead_gb": 0.1 * projection_gpu_gb,
               "n_layers": info["layers"], "n_kv_heads": info["kv_heads"], "d_head": info["head_dim"],
               "bytes_per_elem": 2}
own = projection_table(projection_ctx, projection_budgets, **own_setting)
show(plot_projection(own, annotate_ctx=32768,
                     setting_note=f"{model} (bf16), {projection_gpu_gb:g} GB GPU − weights − 10% reserve",
                     title=f"{model}"), fig_dir, "projection_model")
own.pivot(index="ctx", columns="budget", values="requests")
