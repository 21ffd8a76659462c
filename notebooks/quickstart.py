# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quickstart: which cached tokens matter, and which cheap signal finds them?
#
# One trace, start to end, each step a call or two of kvscope's library: load a model and read its KV cache through
# hooks; take a trace whose answer depends on one fact planted at a known position (`tasks.known_answer`); score its
# tokens with two eviction scorers; label which tokens the answer depends on by occluding them; evict the cache at a
# budget and compare what each policy answers; look at all of it token by token. About a minute on a laptop CPU.

# %% tags=["parameters"]
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
dataset = "known_facts@1"  # a constructed trace: one needed fact, one decoy of the same form, digit-free filler
problem_index = 0
scorers = ["keydiff", "h2o"]  # any two of `python -m evictor.policies`
window = 16  # occlusion window (and stride), tokens
budget = 96  # K: the trace's tokens each KV head keeps (the prompt is kept beside them)
torch_threads = 1  # torch CPU threads
out_dir = "runs/notebooks/quickstart"

# %%
from figures.notebook import prepare

out = prepare(out_dir, torch_threads=torch_threads)

# %% [markdown]
# ## 1. A model, and its cache through hooks
# Hook names are TransformerLens-style and the same for every family; `hook_cache_k` is exactly what the KV cache
# stores (post-RoPE), `[batch, kv_head, position, d_head]`.

# %%
from models.hooks import capture
from models.loading import load_model

lm = load_model(model, device="cpu", dtype="float32")
ids = lm.tokenizer("The code for Elena is 4817.", return_tensors="pt").input_ids
with capture(lm.model, ["blocks.0.attn.hook_cache_k", "blocks.0.hook_resid_post"]) as cap:
    lm.model(ids)
{name: tuple(cap[name].shape) for name in ("blocks.0.attn.hook_cache_k", "blocks.0.hook_resid_post")}

# %% [markdown]
# ## 2. A trace whose answer depends on a known fact
# The reasoning is constructed, so where the needed code sits is known; the model answers after it.

# %%
from tasks.known_answer import answer_traces, problem_trace
from tasks.run import GenerationConfig

problem = GenerationConfig(dataset=dataset, model=model, limit=problem_index + 1).problems()[problem_index]
(trace,) = answer_traces(lm, [problem_trace(problem, lm.tokenizer, model)])
print(f"{len(trace.token_ids)} tokens; the model answers {trace.answer!r} (gold {trace.gold!r})")

# %% [markdown]
# ## 3. Two scorers, replayed over every token
# The same code an eviction round runs, held once at the answer boundary: one score per token and layer (higher =
# keep), and each scorer's aggregate.

# %%
from evictor.replay import ReplayConfig, build_engines, replay_signals

replay = ReplayConfig()
(scores,) = replay_signals(lm, build_engines(lm, {name: {} for name in scorers}, replay), [trace], replay)

# %% [markdown]
# ## 4. Which tokens the answer depends on: occlusion labels
# Each window of the reasoning is replaced by a filler token and the answer forced again; a window *flips* when the
# answer changes. Each window also records the change in the answer's log-probability (`effect`).

# %%
from labeling.labeler import OcclusionConfig, OcclusionLabeler, label_traces

labeler = OcclusionLabeler.for_model(lm, OcclusionConfig(window=window, stride=window, include_incorrect=True),
                                     dataset=dataset)
(label,) = label_traces(labeler, [trace])
print(label.status, label.reason or label.outcome_counts)

# %% [markdown]
# ## 5. Evict at a budget, and compare
# The evictor reads the same trace through a cache that keeps `budget` of its tokens per KV head, evicting as it
# goes, then lets the model answer from what is left; `full` keeps everything, `random` is the reference every
# scorer must beat. The keep-log records which positions each head dropped.

# %%
import pandas as pd

from core.schemas import as_json
from evictor.protocol import TOKENS, Budget
from evictor.sweep import SweepConfig, run_sweep

generation = GenerationConfig(dataset=dataset, model=model, limit=problem_index + 1, problem_ids=(trace.id,),
                              max_new_tokens=8)
sweep = SweepConfig(generation, policies=("full", "random", *scorers), budgets=(Budget(budget, TOKENS),),
                    protocol="epikv", protocol_settings={"protect": "prompt"}, keep_log=True)
cells = run_sweep(sweep, out / "evict", quiet=True)
pd.DataFrame(as_json(cells))[["policy", "budget", "correct", "max_peak_slots", "mean_rounds"]]

# %% [markdown]
# ## 6. See it: the trace, token by token
# Colour by the labels, each scorer's score or rank at any layer, or the planted/decoy/filler classes; pick a policy
# to see which tokens each KV head still held when it answered. Hover a token for its numbers.

# %%
from figures.trace import sweep_runs, trace_viewer

viewer = trace_viewer([trace], tokenizer=lm.tokenizer, labels=[label], signals=[scores],
                      runs=sweep_runs(out / "evict"))
viewer.save(out / "trace-viewer.html")
viewer
