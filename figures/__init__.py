"""kvscope figures: one plotting function and one CLI per figure, all drawn from plain tables.

Each `plot_*` function takes a pandas DataFrame (or a dict of columns / list of records), validates it (a missing
column or an empty table is a `core.errors.UsageError`), and returns a `matplotlib.figure.Figure`;
`figures.save.save_figure(fig, out_dir, stem)` writes PNG (200 dpi) and PDF. Each module also runs as
`python -m figures.<module> --input TABLE --out DIR`. Input columns are in each function's docstring.

| # | module | function | input columns |
|---|---|---|---|
| 1 | layer_rho | plot_layer_rho | layer, signal, rho, ci_low, ci_high[, p_adj] |
| 2 | raw_vs_z | plot_raw_vs_z | layer, signal, rho[, ci_low, ci_high] |
| 3 | sink_ratio | plot_sink_vs_ratio | model, sink_rate, ratio (or sigma_k, sigma_v) |
| 4 | bos_ratio | plot_bos_vs_ratio | model, bos_cos, gap, ratio (or sigma_k, sigma_v) |
| 5 | layer_geometry | plot_layer_geometry | layer, sigma_k, sigma_v, sink_rate[, layer_kind] |
| 6 | accuracy_budget | plot_accuracy_vs_budget | policy, budget, accuracy, ci_low, ci_high |
| 7 | cost_budget | plot_cost_vs_budget | policy, budget, wall_s or tokens_per_s, peak_mem_mb |
| 8 | prefill_memory | plot_prefill_memory | kernel, ctx, peak_mem_mb[, oom] (from models.memory) |
| 9 | head_sets | plot_head_set_retrieval | head_set, n_heads, retrieval, ci_low, ci_high[, recall_R] |
| 10 | projection | plot_projection, concurrent_requests | ctx, budget, requests (from projection_table) |
"""
