# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Planted fact and passcode
#
# Two controlled retrieval probes from the Random Attention notes (§4, Part B):
#
# - **Planted fact** (`probes.planted_fact`, Fig. 3a): a synthetic fact (`Let zq = 4729.`) is planted in real reasoning
#   text `distance` eviction rounds before a question that needs it; everything after a short prefilled stub goes
#   through the engine's decode path, and the experimenter chooses which KV heads keep the fact while the policy evicts
#   everything else. Per head set: retrieval (greedy decode reproduces the 4 digits; Wilson interval), mean log p of
#   the digits, graded recall R = Σ(LP − LP_del) / Σ(LP_kept − LP_del), and `held` (fraction of (layer, head)s that
#   still hold the digits). `kept` / `deleted` are the fact kept in / deleted from every head; `full` is the dense run.
# - **Passcode** (`probes.passcode`, Table 3): a passcode stated once, many eviction rounds before the question; every
#   policy keeps what it likes. Retrieval and mean log p of the correct passcode per policy.

# %% tags=["parameters"]
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
policy = "random"  # the policy that evicts everything but the pinned fact
head_sets = "0;1;2;0,1"  # KV head sets that keep the fact; kept (all heads) and deleted (none) are added
layers = "all"  # layers in which the chosen heads keep the fact
n = 8  # planted-fact instances
budget = 256  # K per KV head, prompt included
buffer = 32  # recent buffer r
distance = "4"  # eviction rounds (N) or filler tokens (Nt) between the fact and the question
lead = 32  # filler tokens before the fact
box = 16  # tokens of the fact box
dataset = "math500"  # benchmark whose reference solutions are the filler text
data_file = None  # problems JSONL instead of the dataset's copy
batch_size = 8
n_boot = 4000
passcode_policies = ["random", "recency", "valuediff"]  # every policy keeps what it likes; full is always added
passcode_rounds = 4  # eviction rounds that see the passcode before the question
passcode_n = 8  # passcode instances per policy
torch_threads = 1  # torch CPU threads
data_dir = None  # benchmark data directory (default: $KVSCOPE_DATA_DIR, set by scripts/env.sh)
out_dir = "runs/notebooks/planted_fact_passcode"

# %%
import pandas as pd

from core.schemas import as_json
from figures.notebook import prepare, show
from probes.passcode import PasscodeConfig, run_passcode
from probes.planted_fact import PlantedFactConfig, run_planted_fact

out = prepare(out_dir, torch_threads=torch_threads, data_dir=data_dir)
fig_dir = out / "figures"

# %% [markdown]
# ## 1. Planted fact: retrieval by the set of KV heads that keep it

# %%
# What both probes share: the model, the budget and buffer, the fact box and the filler text.
shared = {"model": model, "budget": budget, "protocol_settings": {"buffer": buffer}, "lead": lead, "box": box,
          "dataset": dataset, "data_file": data_file, "batch_size": batch_size, "n_boot": n_boot}
planted = run_planted_fact(PlantedFactConfig(n=n, policy=policy, heads=head_sets, layers=layers, distance=distance,
                                             **shared), out / "planted_fact")
fact = pd.DataFrame(as_json(planted.rows))
fact[["condition", "heads", "n_heads", "layers", "n", "retrieval", "retrieval_lo", "retrieval_hi", "mean_lp", "R",
      "R_lo", "R_hi", "held"]]

# %%
from figures.head_sets import plot_head_set_retrieval

# The figure takes head sets of at least one head: the dense run (`full`, no eviction) and `deleted` (no head keeps
# the fact, the floor) stay in the table above, and the floor goes into the printed line.
evicted = fact[fact["n_heads"].fillna(0) >= 1]
floor = fact.loc[fact["condition"] == "deleted", "retrieval"].iloc[0]
print(f"fact {distance} rounds back, {policy} eviction elsewhere, K = {budget}, r = {buffer}; "
      f"retrieval with the fact in no head: {floor:.2f}")
show(plot_head_set_retrieval(evicted, title=f"{model}: planted fact"), fig_dir, "head_set_retrieval")

# %% [markdown]
# ## 2. Passcode: a passcode stated once, every policy keeps what it likes

# %%
passcode_run = run_passcode(PasscodeConfig(n=passcode_n, policies=tuple(passcode_policies), rounds=passcode_rounds,
                                           **shared), out / "passcode")
passcode = pd.DataFrame(as_json(passcode_run.rows))
passcode[["condition", "protection", "fact_rounds", "n", "retrieval", "retrieval_lo", "retrieval_hi", "mean_lp",
          "lp_lo", "lp_hi", "held"]]
