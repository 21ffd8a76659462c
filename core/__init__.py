"""What every kvscope stage shares and nothing else: errors, the CLI contract, run directories, seeds, record schemas.

`core` sits below every other package (models, tasks, scoring, signals, geometry, labeling, validation, evictor,
probes, figures, study) and imports none of them; it never imports torch at module level, so a CLI answers bad input
at once.
"""
