"""Write the kvscope notebooks (``notebooks/*.ipynb``) from the cell sources below, without outputs.

    .venv/bin/python notebooks/make_notebooks.py            # rewrite every notebook
    .venv/bin/python notebooks/make_notebooks.py --out DIR  # write them elsewhere (the tests compare the two)

This file is the source of the notebooks: edit the cells here and rerun it, so the committed notebooks never carry
outputs or execution counts. Each notebook's first code cell is tagged ``parameters`` (papermill injects values
after it); every later cell only calls the library (CLIs in-process through their ``main(argv)``, plotting
functions from ``figures``) and displays what they wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent

# Shared by every notebook: threads, output folder, in-process CLI runner, figure saver.
SETUP = '''\
import importlib
import json
import os
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Image, Markdown, display

from figures.save import save_figure
from core.records import read_jsonl

# One thread: on a shared or small CPU, torch's spinning worker threads cost far more than they give.
torch.set_num_threads(torch_threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if data_dir is not None:
    os.environ["KVSCOPE_DATA_DIR"] = str(data_dir)
out = Path(out_dir)
fig_dir = out / "figures"
fig_dir.mkdir(parents=True, exist_ok=True)


def run(module, argv):
    """`python -m module argv...`, run in this process (no re-import per call); a usage error stops the notebook."""
    cli = importlib.import_module(module)
    main = cli.main if hasattr(cli, "main") else importlib.import_module(f"{module}.__main__").main
    argv = [str(a) for a in argv]
    print("$ python -m", module, " ".join(argv))
    status = main(argv)
    if status:
        raise RuntimeError(f"python -m {module} exited with status {status} (its error is printed above)")


def show(fig, stem):
    """Save `fig` as PNG + PDF under fig_dir and display the PNG."""
    png, _ = save_figure(fig, fig_dir, stem)
    display(Image(filename=str(png)))'''

COMMON_PARAMS = '''\
torch_threads = 1  # torch CPU threads
data_dir = None  # benchmark data directory (default: $KVSCOPE_DATA_DIR, set by scripts/env.sh)'''


def layer_anatomy() -> list[tuple[str, str]]:
    return [
        ("md", """\
# Layer anatomy: occlusion labels → per-layer signals → Spearman ρ → bands

Reproduces EpiKV's signal-validation pipeline (§3.2, §4.2, Appendices 6, 8, 10, 12) on one model:

1. **Traces and labels** (`labeling.occlusion`): dense greedy traces, then counterfactual occlusion labels — a window
   slides over each trace's reasoning, is replaced by a filler token, the answer is regenerated, and positions whose
   window flips the answer are important. Small models rarely answer correctly, so `include_incorrect` labels every
   trace against the model's own regenerated answer.
2. **Signals** (`probes.signals`): the hidden-state change g_l(t) = ‖h_l(t) − h_l(t−1)‖ at every layer, smoothed
   causally by a rolling mean (EpiKV Eq. 1) and by a rolling z-score (Eq. 2).
3. **Validation** (`validation.layers`): per-layer Spearman ρ with occlusion labels, within-trace with Fisher-z
   intervals on n_eff = traces and a multiple-comparison correction; bands of significant layers; the positional
   confound (ρ with token position) of the raw and the z-scored signal; a runnable policy configuration.
4. **Figures**: per-layer ρ with CIs and bands, raw vs z-scored ρ, positional confound."""),
        ("params", f'''\
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
dataset = "gsm8k"  # math500, aime24 or gsm8k (answer extraction rules)
data_file = None  # problems JSONL instead of the dataset's copy
limit = 8  # problems (traces)
max_new_tokens = 256  # length of each dense trace
include_incorrect = True  # label wrongly answered traces too (against the model's own answer)
window = 32  # occlusion window, tokens
stride = 16  # step between windows
max_answer_tokens = 64  # regeneration limit per occluded context
signals = "hidden_diff"  # probes.signals --signals (comma list)
smoothing_window = 64  # rolling window of both smoothings
stat = "within"  # rho drawn in the figures: "within" (mean within-trace) or "pooled"
traces_file = None  # reuse these dense traces (tasks.run or evictor.run --policy full output)
labels_file = None  # reuse these occlusion labels of traces_file (skips labelling)
{COMMON_PARAMS}
out_dir = "runs/notebooks/layer_anatomy"'''),
        ("code", SETUP),
        ("md", "## 1. Dense traces and occlusion labels"),
        ("code", '''\
if labels_file is None:
    labels_dir = out / "labels"
    argv = ["--model", model, "--dataset", dataset, "--limit", limit, "--max-new-tokens", max_new_tokens,
            "--window", window, "--stride", stride, "--max-answer-tokens", max_answer_tokens, "--out", labels_dir]
    argv += ["--traces", traces_file] if traces_file else []
    argv += ["--data-file", data_file] if data_file else []
    argv += ["--include-incorrect"] if include_incorrect else []
    run("labeling.occlusion", argv)
    labels_path = labels_dir / "labels.jsonl"
    traces_path = Path(traces_file) if traces_file else labels_dir / "traces" / "generations.jsonl"
else:
    if traces_file is None:
        raise ValueError("labels_file needs the traces_file the labels were made from")
    labels_path, traces_path = Path(labels_file), Path(traces_file)

label_records = list(read_jsonl(labels_path))
pd.DataFrame([{"trace": r["trace_id"], "status": r.get("status"), "correct": r.get("correct"),
               "tokens": r.get("n_tokens"), "reasoning": (r.get("answer_start") or 0) - (r.get("reasoning_start") or 0),
               "windows": len(r.get("windows", [])), "important_fraction": r.get("important_fraction"),
               "skipped_because": r.get("reason")} for r in label_records])'''),
        ("md", "## 2. Per-layer signals: rolling mean (Eq. 1) and rolling z-score (Eq. 2) of g_l(t)"),
        ("code", '''\
signal_files = []
for smoothing in ("mean", "z"):
    path = out / "signals" / f"{smoothing}.jsonl"
    run("probes.signals", ["--traces", traces_path, "--out", path, "--model", model, "--signals", signals,
                       "--smoothing", smoothing, "--window", smoothing_window])
    signal_files.append(path)'''),
        ("md", "## 3. Validation: per-layer ρ with intervals, bands, positional confound"),
        ("code", '''\
val_dir = out / "validation"
argv = ["--labels", labels_path, "--signals", *signal_files, "--out", val_dir, "--window", smoothing_window]
argv += ["--include-incorrect"] if include_incorrect else []
run("validation.layers", argv)

setup = json.loads((val_dir / "config.json").read_text())
summary = json.loads((val_dir / "summary.json").read_text())
family, raw_t, z_t = setup["family"], setup["raw_transform"], setup["detrended_transform"]
raw_signal, z_signal = f"{family}.{raw_t}", f"{family}.{z_t}"
display(Markdown(f"**{summary['n_traces']} traces**; bands in `{family}.{setup['band_transform']}` "
                 f"({setup['band_stat']} ρ, {setup['correction']}): "
                 + (", ".join(f"{'+' if b['sign'] > 0 else '−'} layers {b['layers'][0]}–{b['layers'][-1]} "
                              f"(peak L{b['peak_layer']}, ρ {b['peak_rho']:+.3f})" for b in summary["bands"])
                    or "none significant")))
policy_path = val_dir / "policy.json"
if policy_path.exists():
    display(Markdown("Policy configuration (`evictor.run --policy-config`): `"
                     + json.dumps(json.loads(policy_path.read_text())["params"]) + "`"))
layers_table = pd.read_csv(val_dir / "layers.csv")
layers_table[["signal", "pooled_rho", "within_rho", "within_lo", "within_hi", "within_n_eff",
              "within_significant", "position_rho"]]'''),
        ("md", "## 4. Figures"),
        ("code", '''\
from figures.layer_rho import from_validation_table, plot_layer_rho

rho_table = from_validation_table(layers_table, stat)
show(plot_layer_rho(rho_table, band_signal=f"{family}.{setup['band_transform']}",
                    title=f"{model}: {stat}-trace ρ of $g_l$ with occlusion labels"), "layer_rho")'''),
        ("code", '''\
from figures.raw_vs_z import plot_raw_vs_z

show(plot_raw_vs_z(rho_table, raw=raw_signal, z=z_signal,
                   labels=(f"rolling mean ({raw_signal})", f"rolling z-score ({z_signal})"),
                   title=f"{model}: raw vs z-scored signal"), "raw_vs_z")'''),
        ("md", """\
**Positional confound.** The same paired bars, but ρ with the token *position* instead of the label: a signal
that mostly tracks where a token sits in the trace shows a large |ρ| here; the causal z-score should shrink it."""),
        ("code", '''\
positional = pd.read_csv(val_dir / "positional.csv", dtype={"layer": str})
positional = positional[positional["layer"] != "combined"]
position_table = pd.concat([
    pd.DataFrame({"layer": positional["layer"].astype(int), "signal": name,
                  "rho": positional[f"{prefix}_position_rho"], "ci_low": positional[f"{prefix}_position_lo"],
                  "ci_high": positional[f"{prefix}_position_hi"]})
    for prefix, name in (("raw", raw_signal), ("detrended", z_signal))])
show(plot_raw_vs_z(position_table, raw=raw_signal, z=z_signal, ylabel="Spearman ρ with token position",
                   labels=(f"rolling mean ({raw_signal})", f"rolling z-score ({z_signal})"),
                   title=f"{model}: positional confound"), "positional_confound")'''),
    ]


def geometry_survey() -> list[tuple[str, str]]:
    return [
        ("md", """\
# Geometry survey: key/value spread, attention sinks and the ValueDiff − KeyDiff gap

ValueDiff (§3.1, Appendices C–D) explains when value-based scoring beats key-based scoring by the geometry of the
cache: σ_K and σ_V (spread of the per-token distance of keys / values from their mean), the attention-sink rate, and
the cosine of the BOS key to the mean key. This notebook

1. surveys each model with `geometry.survey` over a small calibration set;
2. measures a **method gap** per model: ValueDiff − KeyDiff accuracy (points) from a small `evictor.run` sweep at one
   budget (with a handful of problems this gap is noisy; on a model that solves none of them it is 0 by construction);
3. draws sink rate vs σ_V/σ_K and BOS cosine vs σ_V/σ_K next to ValueDiff's reported models (grey; the paper's
   numbers, not measurements of ours — they carry no gap colour), and per-layer σ_K, σ_V and sink rate."""),
        ("params", f'''\
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
{COMMON_PARAMS}
out_dir = "runs/notebooks/geometry_survey"'''),
        ("code", SETUP),
        ("md", "## 1. Geometry survey per model"),
        ("code", '''\
models = [model, *extra_models]
model_rows, layer_tables = [], {}
for name in models:
    survey_dir = out / "survey" / Path(name).name
    run("geometry.survey", ["--model", name, "--prompts", prompts, "--ctx", ctx, "--topk", topk, "--queries", queries,
                      "--tau", tau, "--out", survey_dir])
    rows = pd.read_csv(survey_dir / "model.csv")
    model_rows.append(rows[rows["scope"] == "all"])
    layer_tables[name] = pd.read_csv(survey_dir / "layers.csv")
geometry = pd.concat(model_rows, ignore_index=True)
geometry'''),
        ("md", "## 2. Method gap: ValueDiff − KeyDiff accuracy from a small eviction run"),
        ("code", '''\
gaps = []
for name in models:
    gap_dir = out / "gap" / Path(name).name
    argv = ["--model", name, "--dataset", dataset, "--limit", limit, "--policy", "valuediff,keydiff",
            "--budget", gap_budget, "--budget-scope", "trace", "--buffer", buffer, "--protect", protect,
            "--max-new-tokens", max_new_tokens, "--batch-size", limit, "--out", gap_dir, "--quiet"]
    argv += ["--data-file", data_file] if data_file else []
    run("evictor.run", argv)
    cells = pd.DataFrame(json.loads((gap_dir / "summary.json").read_text())).set_index("policy")
    gaps.append({"model": name, "valuediff_acc": cells.loc["valuediff", "accuracy"],
                 "keydiff_acc": cells.loc["keydiff", "accuracy"], "problems": int(cells.loc["valuediff", "problems"]),
                 "gap": 100 * (cells.loc["valuediff", "accuracy"] - cells.loc["keydiff", "accuracy"])})
gap_table = pd.DataFrame(gaps)
geometry = geometry.merge(gap_table, on="model")
geometry[["model", "sink_rate", "sigma_k", "sigma_v", "sigma_ratio", "bos_cos", "valuediff_acc", "keydiff_acc",
          "problems", "gap"]]'''),
        ("md", "## 3. Figures"),
        ("code", '''\
from figures.sink_ratio import plot_sink_vs_ratio

show(plot_sink_vs_ratio(geometry[["model", "sink_rate", "sigma_k", "sigma_v"]]), "sink_vs_ratio")'''),
        ("code", '''\
from figures.bos_ratio import plot_bos_vs_ratio

print(f"gap: ValueDiff − KeyDiff accuracy in points at K = {gap_budget} on {limit} {dataset} problems")
show(plot_bos_vs_ratio(geometry[["model", "bos_cos", "sigma_k", "sigma_v", "gap"]]), "bos_vs_ratio")'''),
        ("code", '''\
from figures.layer_geometry import plot_layer_geometry

for name, table in layer_tables.items():
    per_layer = table.rename(columns={"layer_type": "layer_kind"})[["layer", "sigma_k", "sigma_v", "sink_rate",
                                                                      "layer_kind"]]
    show(plot_layer_geometry(per_layer, title=f"{name}: per-layer geometry"),
         f"layer_geometry_{Path(name).name}")'''),
    ]


def eviction_budgets() -> list[tuple[str, str]]:
    return [
        ("md", """\
# Accuracy vs KV budget, per policy, with a paired comparison

`evictor.run` decodes every problem with each policy at each budget (physical per-head eviction), plus the dense
`full` baseline; accuracy per (policy, budget) gets a Wilson interval, and two policies are compared problem by
problem with the paired, problem-clustered bootstrap and the exact sign test (Random Attention notes §3.3).

Budgets count the tokens of the generated trace kept per head (`budget_scope="trace"`: the protected prompt and the
recent buffer come on top), so a budget means the same compression whatever the prompt length. Every policy runs
under one protection rule (`protect`, default the whole prompt), so only the ranking of the trace differs."""),
        ("params", f'''\
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
compare = ["valuediff", "random"]  # paired comparison A - B
n_boot = 10000
{COMMON_PARAMS}
out_dir = "runs/notebooks/eviction_budgets"'''),
        ("code", SETUP),
        ("md", "## 1. The sweep: `full` once, every policy at every budget"),
        ("code", '''\
sweep_dir = out / "sweep"
argv = ["--model", model, "--dataset", dataset, "--limit", limit, "--policy", ",".join(["full", *policies]),
        "--budget", ",".join(map(str, budgets)), "--budget-scope", "trace", "--buffer", buffer, "--protect", protect,
        "--max-new-tokens", max_new_tokens, "--batch-size", batch_size, "--out", sweep_dir, "--quiet"]
argv += ["--data-file", data_file] if data_file else []
run("evictor.run", argv)
pd.read_csv(sweep_dir / "summary.csv")[["cell", "problems", "accuracy", "no_answer", "truncated", "mean_generated",
                                        "mean_rounds", "max_peak_slots"]]'''),
        ("md", "## 2. Accuracy vs budget with 95% Wilson intervals"),
        ("code", '''\
from validation.compare import accuracy_table, read_run

runs = {policy: read_run(sweep_dir, policy) for policy in ["full", *policies]}
accuracy = pd.DataFrame([row for policy, run_ in runs.items()
                         for row in accuracy_table(run_, policy, "wilson", 0.95, n_boot, 0)])
accuracy = accuracy.rename(columns={"ci_lo": "ci_low", "ci_hi": "ci_high"})
# validation.stats.wilson_interval can miss the estimate by float rounding (lower bound 2.8e-17 at 0/6), which the
# figure's error bars reject; keep every interval around its estimate.
accuracy["ci_low"] = accuracy[["ci_low", "accuracy"]].min(axis=1)
accuracy["ci_high"] = accuracy[["ci_high", "accuracy"]].max(axis=1)
accuracy.to_csv(out / "accuracy.csv", index=False)
accuracy[["policy", "budget", "n_problems", "accuracy", "ci_low", "ci_high"]]'''),
        ("code", '''\
from figures.accuracy_budget import plot_accuracy_vs_budget

show(plot_accuracy_vs_budget(accuracy[["policy", "budget", "accuracy", "ci_low", "ci_high"]],
                             title=f"{model}, {dataset} (n = {limit})"), "accuracy_vs_budget")'''),
        ("md", "## 3. Paired comparison: problem-clustered bootstrap and exact sign test"),
        ("code", '''\
from validation.compare import compare_runs

a, b = compare
comparison = pd.DataFrame(compare_runs(runs[a], runs[b], n_boot, 0.95, 0))
comparison.to_csv(out / "comparison.csv", index=False)
comparison[["policy_a", "policy_b", "budget_a", "n_problems", "accuracy_a", "accuracy_b", "difference", "ci_lo",
            "ci_hi", "bootstrap_p", "sign_a_better", "sign_b_better", "sign_p_value"]]'''),
    ]


def planted_fact_passcode() -> list[tuple[str, str]]:
    return [
        ("md", """\
# Planted fact and passcode

Two controlled retrieval probes from the Random Attention notes (§4, Part B):

- **Planted fact** (`probes.planted_fact`, Fig. 3a): a synthetic fact (`Let zq = 4729.`) is planted in real reasoning
  text `distance` eviction rounds before a question that needs it; everything after a short prefilled stub goes
  through the engine's decode path, and the experimenter chooses which KV heads keep the fact while the policy evicts
  everything else. Per head set: retrieval (greedy decode reproduces the 4 digits; Wilson interval), mean log p of
  the digits, graded recall R = Σ(LP − LP_del) / Σ(LP_kept − LP_del), and `held` (fraction of (layer, head)s that
  still hold the digits). `kept` / `deleted` are the fact kept in / deleted from every head; `full` is the dense run.
- **Passcode** (`probes.passcode`, Table 3): a passcode stated once, many eviction rounds before the question; every
  policy keeps what it likes. Retrieval and mean log p of the correct passcode per policy."""),
        ("params", f'''\
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
{COMMON_PARAMS}
out_dir = "runs/notebooks/planted_fact_passcode"'''),
        ("code", SETUP),
        ("md", "## 1. Planted fact: retrieval by the set of KV heads that keep it"),
        ("code", '''\
fact_dir = out / "planted_fact"
argv = ["--model", model, "--policy", policy, "--heads", head_sets, "--layers", layers, "--n", n, "--budget", budget,
        "--buffer", buffer, "--distance", distance, "--lead", lead, "--box", box, "--dataset", dataset,
        "--batch-size", batch_size, "--n-boot", n_boot, "--threads", torch_threads, "--out", fact_dir]
argv += ["--data-file", data_file] if data_file else []
run("probes.planted_fact", argv)
fact = pd.read_csv(fact_dir / "summary.csv", dtype={"condition": str, "heads": str})
fact[["condition", "heads", "n_heads", "layers", "n", "retrieval", "retrieval_lo", "retrieval_hi", "mean_lp", "R",
      "R_lo", "R_hi", "held"]]'''),
        ("code", '''\
from figures.head_sets import plot_head_set_retrieval

# The figure takes head sets of at least one head: the dense run (`full`, no eviction) and `deleted` (no head keeps
# the fact, the floor) stay in the table above, and the floor goes into the title.
evicted = fact[fact["n_heads"].fillna(0) >= 1]
floor = fact.loc[fact["condition"] == "deleted", "retrieval"].iloc[0]
print(f"fact {distance} rounds back, {policy} eviction elsewhere, K = {budget}, r = {buffer}; "
      f"retrieval with the fact in no head: {floor:.2f}")
show(plot_head_set_retrieval(pd.DataFrame({
        "head_set": evicted["condition"], "n_heads": evicted["n_heads"].astype(int),
        "retrieval": evicted["retrieval"], "ci_low": evicted["retrieval_lo"], "ci_high": evicted["retrieval_hi"],
        "recall_R": evicted["R"]}),
    title=f"{model}: planted fact"),
    "head_set_retrieval")'''),
        ("md", "## 2. Passcode: a passcode stated once, every policy keeps what it likes"),
        ("code", '''\
passcode_dir = out / "passcode"
argv = ["--model", model, "--policy", ",".join(passcode_policies), "--rounds", passcode_rounds, "--n", passcode_n,
        "--budget", budget, "--buffer", buffer, "--lead", lead, "--box", box, "--dataset", dataset,
        "--batch-size", batch_size, "--n-boot", n_boot, "--threads", torch_threads, "--out", passcode_dir]
argv += ["--data-file", data_file] if data_file else []
run("probes.passcode", argv)
passcode = pd.read_csv(passcode_dir / "summary.csv")
passcode.to_csv(out / "passcode_table.csv", index=False)
passcode[["condition", "protection", "fact_rounds", "n", "retrieval", "retrieval_lo", "retrieval_hi", "mean_lp",
          "lp_lo", "lp_hi", "held"]]'''),
    ]


def speed_memory() -> list[tuple[str, str]]:
    return [
        ("md", """\
# Speed and memory

1. **Time and peak memory vs budget** from `evictor.run` (one problem per batch, so each record's time is its own).
   On CPU the process RSS is dominated by the weights, so by default the memory panel shows the peak live KV-cache
   bytes the engine reports (`memory = "cache"`); `"process"` plots the process peak (RSS on CPU, the allocator peak
   on CUDA).
2. **Prefill memory vs context length** (`models.memory`, EpiKV Fig. 1): one prefill forward under SDPA against the
   eager kernel with `output_attentions=True`, which keeps every layer's attention map alive — what an
   attention-score policy needs at prefill.
3. **Throughput projection** (`figures.projection`, EpiKV App. 14): pure KV-cache arithmetic — how many concurrent
   requests fit on one GPU with and without a budget, in EpiKV's setting and for this notebook's model."""),
        ("params", f'''\
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
{COMMON_PARAMS}
out_dir = "runs/notebooks/speed_memory"'''),
        ("code", SETUP),
        ("md", "## 1. Time and peak memory vs budget"),
        ("code", '''\
if sweep_dir is None:
    sweep_dir = out / "sweep"
    argv = ["--model", model, "--dataset", dataset, "--limit", limit, "--policy", ",".join(["full", *policies]),
            "--budget", ",".join(map(str, budgets)), "--budget-scope", "trace", "--buffer", buffer, "--protect", protect,
            "--max-new-tokens", max_new_tokens, "--batch-size", 1, "--out", sweep_dir, "--quiet"]
    argv += ["--data-file", data_file] if data_file else []
    run("evictor.run", argv)
memory_field = {"cache": "peak_cache_bytes", "process": "peak_memory_bytes"}[memory]
cost = pd.DataFrame([{"policy": r["policy"], "budget": r["budget"], "problem": r["id"],
                      "generated": len(r["generated_ids"]), "wall_s": r["timings"]["wall_s"],
                      "tokens_per_s": r["timings"]["tokens_per_s"], "rounds": r["eviction"]["rounds"],
                      "peak_mem_mb": r["eviction"][memory_field] / 2**20}
                     for path in sorted(Path(sweep_dir).rglob("generations.jsonl")) for r in read_jsonl(path)])
cost.to_csv(out / "cost.csv", index=False)
cost.groupby(["policy", "budget"], dropna=False)[["generated", "wall_s", "tokens_per_s", "rounds",
                                                 "peak_mem_mb"]].median()'''),
        ("code", '''\
from figures.cost_budget import plot_cost_vs_budget

what = {"cache": "peak KV-cache memory", "process": "process peak memory"}[memory]
speed = {"tokens_per_s": "decode throughput", "wall_s": "wall time per problem"}[time_column]
show(plot_cost_vs_budget(cost, time=time_column, title=f"{model}: {speed} and {what} vs budget"), "cost_vs_budget")'''),
        ("md", "## 2. Prefill memory vs context length: SDPA vs `output_attentions=True`"),
        ("code", '''\
from models.loading import load_model
from models.memory import prefill_peak_memory

lm = load_model(model, dtype="float32")
prefill = pd.DataFrame(prefill_peak_memory(lm, ctx_lengths, kernels))
prefill.to_csv(out / "prefill_memory.csv", index=False)
prefill[["kernel", "ctx", "peak_mem_mb", "forward_mem_mb", "oom", "measured"]]'''),
        ("code", '''\
from figures.prefill_memory import plot_prefill_memory

show(plot_prefill_memory(prefill, title=f"{model}: one prefill forward ({prefill['device'].iloc[0]})"),
     "prefill_memory")'''),
        ("md", "## 3. Throughput projection from KV-cache arithmetic"),
        ("code", '''\
from figures.projection import EPIKV_SETTING, plot_projection, projection_table

epikv = projection_table(projection_ctx, projection_budgets, **EPIKV_SETTING)
show(plot_projection(epikv, annotate_ctx=32768,
                     setting_note="R1-Distill-Llama-8B, 80 GB GPU − 16 GB weights − 8 GB reserve",
                     title="EpiKV setting"), "projection_epikv")
epikv.pivot(index="ctx", columns="budget", values="requests")'''),
        ("code", '''\
info = lm.describe()
weight_gb = sum(p.numel() for p in lm.model.parameters()) * 2 / 2**30  # bf16 weights
own_setting = {"gpu_mem_gb": projection_gpu_gb, "weight_gb": weight_gb, "overhead_gb": 0.1 * projection_gpu_gb,
               "n_layers": info["layers"], "n_kv_heads": info["kv_heads"], "d_head": info["head_dim"],
               "bytes_per_elem": 2}
own = projection_table(projection_ctx, projection_budgets, **own_setting)
show(plot_projection(own, annotate_ctx=32768,
                     setting_note=f"{model} (bf16), {projection_gpu_gb:g} GB GPU − weights − 10% reserve",
                     title=f"{model}"), "projection_model")
own.pivot(index="ctx", columns="budget", values="requests")'''),
    ]


NOTEBOOKS = {
    "layer_anatomy": layer_anatomy,
    "geometry_survey": geometry_survey,
    "eviction_budgets": eviction_budgets,
    "planted_fact_passcode": planted_fact_passcode,
    "speed_memory": speed_memory,
}


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for index, (kind, source) in enumerate(cells):
        if kind == "md":
            cell = nbformat.v4.new_markdown_cell(source)
        else:
            cell = nbformat.v4.new_code_cell(source)
            if kind == "params":
                cell.metadata["tags"] = ["parameters"]
        cell["id"] = f"cell-{index:02d}"  # stable ids: regenerating gives identical files
        notebook.cells.append(cell)
    nbformat.validate(notebook)
    return notebook


def write_all(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, cells in NOTEBOOKS.items():
        path = directory / f"{name}.ipynb"
        nbformat.write(build(cells()), path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the kvscope notebooks without outputs.")
    parser.add_argument("--out", default=str(HERE), help="directory to write them to (default: notebooks/)")
    args = parser.parse_args(argv)
    for path in write_all(Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
