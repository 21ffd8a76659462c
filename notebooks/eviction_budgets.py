# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Accuracy vs KV budget, per policy, with a paired comparison
#
# `evictor.run` decodes every problem with each policy at each budget (physical per-head eviction), plus the dense
# `full` baseline; accuracy per (policy, budget) gets a Wilson interval, and two policies are compared problem by
# problem with the paired, problem-clustered bootstrap and the exact sign test (Random Attention notes §3.3).
#
# Budgets count the tokens of the generated trace kept per head (`budget_scope="trace"`: the protected prompt and the
# recent buffer come on top), so a budget means the same compression whatever the prompt length. Every policy runs
# under one protection rule (`protect`, default the whole prompt), so only the ranking of the trace differs.

# %% tags=["parameters"]
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
dataset = "gsm8k"
data_file = None  # problems JSONL instead of the dataset's copy
limit = 6  # problems
max_new_tokens = 192
policies = ["random", "valuediff"]  # evicting policies (python -m evictor.policies lists them)
budgets = [32, 96]  # K per head, tokens of the generated trace
buffer = 16  # recent buffer r, never evicted
protect = "prompt"  # one protection rule for every policy (prompt, sinks, none), so only the ranking differs
batch_size = 6  # problems decoded together
compare_policies = ["valuediff", "random"]  # paired comparison A - B
n_boot = 10000
torch_threads = 1  # torch CPU threads
data_dir = None  # benchmark data directory (default: $KVSCOPE_DATA_DIR, set by scripts/env.sh)
out_dir = "runs/notebooks/eviction_budgets"

# %%
import pandas as pd

from figures.notebook import prepare, show

out = prepare(out_dir, torch_threads=torch_threads, data_dir=data_dir)
fig_dir = out / "figures"

# %% [markdown]
# ## 1. The sweep: `full` once, every policy at every budget

# %%
from core.schemas import as_json
from evictor.protocol import TOKENS, Budget
from evictor.sweep import SweepConfig, run_sweep
from tasks.run import GenerationConfig

sweep_dir = out / "sweep"
generation = GenerationConfig(dataset=dataset, model=model, data_file=data_file, limit=limit,
                              max_new_tokens=max_new_tokens)
sweep = SweepConfig(generation, policies=("full", *policies), budgets=tuple(Budget(k, TOKENS) for k in budgets),
                    protocol_settings={"budget_scope": "trace", "buffer": buffer, "protect": protect},
                    batch_size=batch_size)
cells = run_sweep(sweep, sweep_dir, quiet=True)
pd.DataFrame(as_json(cells))[["id", "problems", "accuracy", "no_answer", "truncated", "mean_generated",
                              "mean_rounds", "max_peak_slots"]]

# %% [markdown]
# ## 2. Accuracy vs budget with 95% Wilson intervals

# %%
from validation.compare import accuracy_table, read_run

accuracy = pd.DataFrame(accuracy_table(read_run(sweep_dir), "sweep", "wilson", 0.95, n_boot, 0))
accuracy.to_csv(out / "accuracy.csv", index=False)
accuracy[["policy", "budget", "problems", "accuracy", "ci_lo", "ci_hi"]]

# %%
from figures.accuracy_budget import plot_accuracy_vs_budget

show(plot_accuracy_vs_budget(accuracy, title=f"{model}, {dataset} (n = {limit})"), fig_dir, "accuracy_vs_budget")

# %% [markdown]
# ## 3. Paired comparison: problem-clustered bootstrap and exact sign test

# %%
from validation.compare import CompareConfig, compare

comparison = pd.DataFrame(compare(CompareConfig(runs=(str(sweep_dir), str(sweep_dir)),
                                                policies=tuple(compare_policies), n_boot=n_boot)).comparisons)
comparison.to_csv(out / "comparison.csv", index=False)
comparison[["policy_a", "policy_b", "budget_a", "n_problems", "accuracy_a", "accuracy_b", "difference", "ci_lo",
            "ci_hi", "bootstrap_p", "sign_a_better", "sign_b_better", "sign_p_value"]]
