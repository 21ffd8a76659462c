# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Geometry survey: key/value spread, attention sinks and the ValueDiff − KeyDiff gap
#
# ValueDiff (§3.1, Appendices C–D) explains when value-based scoring beats key-based scoring by the geometry of the
# cache: σ_K and σ_V (spread of the per-token distance of keys / values from their mean), the attention-sink rate, and
# the cosine of the BOS key to the mean key. This notebook
#
# 1. surveys each model with `geometry.survey` over a small calibration set;
# 2. measures a **method gap** per model: ValueDiff − KeyDiff accuracy (points) from a small `evictor.run` sweep at one
#    budget (with a handful of problems this gap is noisy; on a model that solves none of them it is 0 by construction);
# 3. draws sink rate vs σ_V/σ_K and BOS cosine vs σ_V/σ_K next to ValueDiff's reported models (grey; the paper's
#    numbers, not measurements of ours — they carry no gap colour), and per-layer σ_K, σ_V and sink rate.

# %% tags=["parameters"]
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
extra_models = []  # more models to survey and compare, e.g. ["gemma3-270m"]
prompts = 4  # calibration sequences
ctx = 512  # tokens per calibration sequence, at least topk + 36
topk = 64  # k of the top-k attention Jaccard
queries = 32  # query positions of the Jaccard statistic
tau = 0.3  # sink threshold on the leading-token attention weight
dataset = "gsm8k"  # problems of the gap run
data_file = None  # problems JSONL instead of the dataset's copy
limit = 5  # problems of the gap run
max_new_tokens = 192
gap_budget = 64  # K of the gap run (tokens of the generated trace: budget_scope "trace")
buffer = 16  # recent buffer r, never evicted
protect = "prompt"  # protection for both policies: prompt, sinks or none (one rule, so only the ranking differs)
torch_threads = 1  # torch CPU threads
data_dir = None  # benchmark data directory (default: $KVSCOPE_DATA_DIR, set by scripts/env.sh)
out_dir = "runs/notebooks/geometry_survey"

# %%
from pathlib import Path

import pandas as pd

from evictor.protocol import TOKENS, Budget
from evictor.sweep import SweepConfig, run_sweep
from figures.notebook import prepare, show
from geometry.survey import SurveyConfig, run_survey
from tasks.run import GenerationConfig

out = prepare(out_dir, torch_threads=torch_threads, data_dir=data_dir)
fig_dir = out / "figures"

# %% [markdown]
# ## 1. Geometry survey per model

# %%
models = [model, *extra_models]
model_rows, layer_tables = [], {}
for name in models:
    survey = run_survey(SurveyConfig(model=name, prompts=prompts, ctx=ctx, topk=topk, queries=queries, tau=tau),
                        out / "survey" / Path(name).name)
    rows = pd.DataFrame(survey.tables["model"])
    model_rows.append(rows[rows["scope"] == "all"])
    layer_tables[name] = pd.DataFrame(survey.tables["layers"])
geometry = pd.concat(model_rows, ignore_index=True)
geometry

# %% [markdown]
# ## 2. Method gap: ValueDiff − KeyDiff accuracy from a small eviction run

# %%
gaps = []
for name in models:
    generation = GenerationConfig(dataset=dataset, model=name, data_file=data_file, limit=limit,
                                  max_new_tokens=max_new_tokens)
    sweep = SweepConfig(generation, policies=("valuediff", "keydiff"), budgets=(Budget(gap_budget, TOKENS),),
                        protocol_settings={"budget_scope": "trace", "buffer": buffer, "protect": protect},
                        batch_size=limit)
    cells = {cell.policy: cell for cell in run_sweep(sweep, out / "gap" / Path(name).name, quiet=True)}
    valuediff, keydiff = cells["valuediff"], cells["keydiff"]
    gaps.append({"model": name, "valuediff_acc": valuediff.accuracy, "keydiff_acc": keydiff.accuracy,
                 "problems": valuediff.problems, "gap": 100 * (valuediff.accuracy - keydiff.accuracy)})
geometry = geometry.merge(pd.DataFrame(gaps), on="model")
geometry[["model", "sink_rate", "sigma_k", "sigma_v", "sigma_ratio", "bos_cos", "valuediff_acc", "keydiff_acc",
          "problems", "gap"]]

# %% [markdown]
# ## 3. Figures

# %%
from figures.sink_ratio import plot_sink_vs_ratio

show(plot_sink_vs_ratio(geometry), fig_dir, "sink_vs_ratio")

# %%
from figures.bos_ratio import plot_bos_vs_ratio

print(f"gap: ValueDiff − KeyDiff accuracy in points at K = {gap_budget} on {limit} {dataset} problems")
show(plot_bos_vs_ratio(geometry), fig_dir, "bos_vs_ratio")

# %%
from figures.layer_geometry import plot_layer_geometry

for name, table in layer_tables.items():
    show(plot_layer_geometry(table, title=f"{name}: per-layer geometry"), fig_dir, f"layer_geometry_{Path(name).name}")
