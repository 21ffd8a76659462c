"""The study: kvscope's whole loop in one command, ``python -m study``, downstream of every other package.

    dense traces -> occlusion labels (-> label agreement) -> replayed signals -> statistics and selection
    -> evictor runs at equal cache -> paired comparison with random -> report

- `study.config`: `StudyConfig`, every setting, checked before anything is loaded or written.
- `study.stages`: one function per stage, each wrapping that stage's library (`tasks.run`, `labeling.occlusion`,
  `labeling.agreement`, `evictor.replay`, `signals`, `validation.select`, `evictor.run`, `validation.compare`)
  and writing that library's own files into the stage's directory.
- `study.pipeline`: `run_study`: stage directories keyed by their settings and their inputs' keys (rerunning resumes,
  changing one setting recomputes from its stage on), progress with time estimates.
- `study.report`: ``report.md``, ``figures/``, ``selection.json``, ``configs/``, ``ranking.csv``, ``accuracy.csv``,
  ``compare.csv``.
"""
