"""Statistics that validate eviction signals and compare policies (numpy/scipy; no model, evictor or figures; the
band combination is the one `signals.hidden` defines).

- `validation.stats`: Spearman rho, the Fisher-z mean of per-trace rho with its Fisher-z, t and bootstrap intervals on
  n_eff traces, multiple-comparison correction, Wilson, t and percentile intervals, the bootstrap over units, a
  permutation test of a rank correlation over few units.
- `validation.signals`: label and signal records (`core.schemas`), alignment by id and position, signal names.
- `validation.correlation`: pooled and within-trace rho per signal, positional confound check.
- `validation.bands`: band selection, combined band score, band policy configuration JSON.
- `validation.paired`: paired problem-clustered bootstrap, exact sign test, accuracy intervals.
- `validation.predictive`: each scorer's offline rho beside its deployed difference against random, and the rank
  correlation between the two across scorers and budgets.
- CLIs: `python -m validation.layers` (`validate_layers`), `python -m validation.select` (`select`: ranks any
  scorer, a policy's replayed scores included, and writes the ``{"policy", "params"}`` configurations that deploy the
  best), `python -m validation.compare` (`compare`, at equal peak cache).
"""
