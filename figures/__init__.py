"""kvscope figures: one plotting function and one CLI per figure, all drawn from plain tables.

Each `plot_*` function takes a pandas DataFrame (or a dict of columns / list of records), validates it (a missing
column or an empty table is a `core.errors.UsageError`), and returns a `matplotlib.figure.Figure`;
`figures.save.save_figure(fig, out_dir, stem)` writes PNG (200 dpi) and PDF. Each module also runs as
`python -m figures.<module> --input TABLE --out DIR`. Input columns are in each function's docstring; they are the
names the producing stage writes (`core.schemas`: an interval is ``<name>_lo`` / ``<name>_hi``, ``ci_lo`` /
``ci_hi`` for an accuracy), so a stage's table draws as it is written. figures reads tables only: it never loads a
model.

| module | plot function | input columns | written by |
|---|---|---|---|
| layer_rho | plot_layer_rho | layer, signal, rho, rho_lo, rho_hi[, p_adj] | validation.layers layers.csv |
| raw_vs_z | plot_raw_vs_z | layer, signal, rho[, rho_lo, rho_hi] | validation.layers layers.csv |
| sink_ratio | plot_sink_vs_ratio | model, sink_rate, sigma_ratio (or sigma_k, sigma_v) | geometry.survey model.csv |
| bos_ratio | plot_bos_vs_ratio | model, bos_cos, gap, sigma_ratio (or sigma_k, sigma_v) | model.csv and a gap |
| layer_geometry | plot_layer_geometry | layer, sigma_k, sigma_v, sink_rate[, layer_type] | geometry.survey layers.csv |
| accuracy_budget | plot_accuracy_vs_budget | policy, budget, accuracy, ci_lo, ci_hi | evictor.run summary.csv |
| cost_budget | plot_cost_vs_budget | policy, budget, wall_s or tokens_per_s, peak_mem_mb | one row per trace |
| prefill_memory | plot_prefill_memory | kernel, ctx, peak_mem_mb[, oom, layers, extrapolated] | bench/prefill_memory |
| head_sets | plot_head_set_retrieval | condition, n_heads, retrieval, retrieval_lo, retrieval_hi[, R] | planted_fact |
| projection | plot_projection | ctx, budget, requests | projection_table |

`figures.layer_rho.from_validation_table` turns a layers.csv into table 1's columns; the figure CLIs accept either.
`figures.notebook` holds what the notebooks share.

`figures.trace` (``python -m figures.trace --study DIR``) is no table figure: it writes the trace viewer, one HTML
page showing a study's traces token by token (labels, scores, what each policy kept); it reads the model's tokenizer
to show the tokens as text, never its weights.
"""
