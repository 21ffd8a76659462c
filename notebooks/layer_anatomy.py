# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Layer anatomy: occlusion labels → per-layer signals → Spearman ρ → bands
#
# Reproduces EpiKV's signal-validation pipeline (§3.2, §4.2, Appendices 6, 8, 10, 12) on one model:
#
# 1. **Traces and labels** (`labeling.occlusion`): dense greedy traces, then counterfactual occlusion labels — a window
#    slides over each trace's reasoning, is replaced by a filler token, the answer is regenerated, and positions whose
#    window flips the answer are important. Small models rarely answer correctly, so `include_incorrect` labels every
#    trace against the model's own regenerated answer.
# 2. **Signals** (`signals`): the hidden-state change g_l(t) = ‖h_l(t) − h_l(t−1)‖ at every layer, smoothed
#    causally by a rolling mean (EpiKV Eq. 1) and by a rolling z-score (Eq. 2).
# 3. **Validation** (`validation.layers`): per-layer Spearman ρ with occlusion labels, within-trace with Fisher-z
#    intervals on n_eff = traces and a multiple-comparison correction; bands of significant layers; the positional
#    confound (ρ with token position) of the raw and the z-scored signal; a runnable policy configuration.
# 4. **Figures**: per-layer ρ with CIs and bands, raw vs z-scored ρ, positional confound.

# %% tags=["parameters"]
model = "smollm2-135m"  # registry name, HF directory, .gguf, hub id, or tiny-<family>
dataset = "gsm8k"  # math500, aime24 or gsm8k (answer extraction rules)
data_file = None  # problems JSONL instead of the dataset's copy
limit = 8  # problems (traces)
max_new_tokens = 256  # length of each dense trace
include_incorrect = True  # label wrongly answered traces too (against the model's own answer)
window = 32  # occlusion window, tokens
stride = 16  # step between windows
max_answer_tokens = 64  # regeneration limit per occluded context
signals = "hidden_diff"  # the signals to compute (comma list; python -m signals --help names them)
smoothing_window = 64  # rolling window of both smoothings
stat = "within"  # rho drawn in the figures: "within" (mean within-trace) or "pooled"
traces_file = None  # reuse these dense traces (tasks.run or evictor.run --policy full output)
labels_file = None  # reuse these occlusion labels of traces_file (skips labelling)
torch_threads = 1  # torch CPU threads
data_dir = None  # benchmark data directory (default: $KVSCOPE_DATA_DIR, set by scripts/env.sh)
out_dir = "runs/notebooks/layer_anatomy"

# %%
import json
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from core.cli import atomic_write
from core.schemas import Label, read_records
from figures.notebook import prepare, show

out = prepare(out_dir, torch_threads=torch_threads, data_dir=data_dir)
fig_dir = out / "figures"

# %% [markdown]
# ## 1. Dense traces and occlusion labels

# %%
from labeling.job import OcclusionJob, run_occlusion
from labeling.labeler import OcclusionConfig

if labels_file is None:
    occlusion = OcclusionConfig(window=window, stride=stride, max_answer_tokens=max_answer_tokens,
                                include_incorrect=include_incorrect)
    labelled = run_occlusion(OcclusionJob(config=occlusion, traces=traces_file, dataset=dataset, model=model,
                                          data_file=data_file, limit=limit, max_new_tokens=max_new_tokens),
                             out / "labels")
    labels_path, traces_path = labelled.labels_path, labelled.traces_path
else:
    if traces_file is None:
        raise ValueError("labels_file needs the traces_file the labels were made from")
    labels_path, traces_path = Path(labels_file), Path(traces_file)

pd.DataFrame([{"trace": r.id, "status": r.status, "correct": r.correct, "tokens": r.n_tokens,
               "reasoning": (r.answer_start or 0) - (r.reasoning_start or 0), "windows": len(r.windows or []),
               "important_fraction": r.important_fraction, "skipped_because": r.reason}
              for r in read_records(labels_path, Label)])

# %% [markdown]
# ## 2. Per-layer signals: rolling mean (Eq. 1) and rolling z-score (Eq. 2) of g_l(t)

# %%
from models.loading import load_model
from signals.traces import SignalsConfig, read_dense_traces, trace_signals

traces = read_dense_traces(str(traces_path))
lm = load_model(model, dtype="float32")
signal_files = []
for smoothing in ("mean", "z"):
    signal_config = SignalsConfig(signals=tuple(s.strip() for s in signals.split(",") if s.strip()),
                                  smoothing=smoothing, window=smoothing_window)
    path = out / "signals" / f"{smoothing}.jsonl"
    with atomic_write(path) as handle:
        handle.writelines(json.dumps(record.to_json()) + "\n" for record in trace_signals(lm, traces, signal_config))
    signal_files.append(path)

# %% [markdown]
# ## 3. Validation: per-layer ρ with intervals, bands, positional confound

# %%
from validation.layers import LayersConfig, validate_layers
from validation.report import write_csv, write_json

config = LayersConfig(labels=str(labels_path), signals=tuple(map(str, signal_files)), window=smoothing_window)
result = validate_layers(config)
setup = result.setup
raw_signal, z_signal = f"{setup.family}.{setup.raw}", f"{setup.family}.{setup.detrended}"
bands = ", ".join(f"{'+' if b.sign > 0 else '−'} layers {b.layers[0]}–{b.layers[-1]} "
                  f"(peak L{b.peak_layer}, ρ {b.peak_rho:+.3f})" for b in result.bands)
display(Markdown(f"**{result.n_traces} traces**; bands in `{setup.family}.{setup.band}` "
                 f"({config.band_stat} ρ, {config.correction}): {bands or 'none significant'}"))
val_dir = out / "validation"
write_csv(val_dir / "layers.csv", result.rows)
if result.policy:
    write_json(val_dir / "policy.json", result.policy)
    display(Markdown(f"Policy configuration (`evictor.run --policy-config {val_dir / 'policy.json'}`): `"
                     + json.dumps(result.policy["params"]) + "`"))
layers_table = pd.DataFrame(result.rows)
layers_table[["signal", "pooled_rho", "within_rho", "within_lo", "within_hi", "within_n_eff",
              "within_significant", "position_rho"]]

# %% [markdown]
# ## 4. Figures

# %%
from figures.layer_rho import from_validation_table, plot_layer_rho

rho_table = from_validation_table(layers_table, stat)
show(plot_layer_rho(rho_table, band_signal=f"{setup.family}.{setup.band}",
                    title=f"{model}: {stat}-trace ρ of $g_l$ with occlusion labels"), fig_dir, "layer_rho")

# %%
from figures.raw_vs_z import plot_raw_vs_z

legend = (f"rolling mean ({raw_signal})", f"rolling z-score ({z_signal})")
show(plot_raw_vs_z(rho_table, raw=raw_signal, z=z_signal, labels=legend, title=f"{model}: raw vs z-scored signal"),
     fig_dir, "raw_vs_z")

# %% [markdown]
# **Positional confound.** The same paired bars, but ρ with the token *position* instead of the label: a signal
# that mostly tracks where a token sits in the trace shows a large |ρ| here; the causal z-score should shrink it.

# %%
positional = pd.DataFrame([row for row in result.positional if row["layer"] != "combined"])
position_table = pd.concat([
    pd.DataFrame({"layer": positional["layer"].astype(int), "signal": name,
                  "rho": positional[f"{prefix}_position_rho"], "rho_lo": positional[f"{prefix}_position_lo"],
                  "rho_hi": positional[f"{prefix}_position_hi"]})
    for prefix, name in (("raw", raw_signal), ("detrended", z_signal))])
show(plot_raw_vs_z(position_table, raw=raw_signal, z=z_signal, ylabel="Spearman ρ with token position",
                   labels=legend, title=f"{model}: positional confound"), fig_dir, "positional_confound")
