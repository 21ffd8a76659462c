"""Statistics that validate eviction signals and compare policies (pure numpy/scipy; no model, evictor or figures).

- `validation.stats`: Spearman rho, Fisher-z intervals on n_eff traces, multiple-comparison correction, Wilson
  intervals, streaming moments.
- `validation.signals`: label / signal file formats, alignment by trace and position, signal-name parsing.
- `validation.correlation`: pooled and within-trace rho per signal, positional confound check.
- `validation.bands`: band selection, combined band score, policy configuration JSON.
- `validation.paired`: paired problem-clustered bootstrap, exact sign test, accuracy intervals.
- CLIs: `python -m validation.layers`, `python -m validation.compare`.
"""
