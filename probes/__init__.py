"""The eviction experiments: a fact planted in real reasoning text, then a question that needs it, run through the
eviction engine (`evictor.engine`) to see what each policy, or each choice of KV heads, keeps of it.

- `probes.planted_fact`: which KV heads must hold the fact for the model to still retrieve it;
- `probes.passcode`: whether a policy's own scores keep a passcode through many eviction rounds.

Both are built from the same parts: `probes.instances` (the scripted token sequence and its filler),
`probes.schedule` (when a sequence evicts, and the gap that gives a chosen distance), `probes.forcing` (teacher-forcing
a batch through the engine and reading each row's outcome), `probes.statistics` (retrieval, log p, graded recall),
`probes.config` (the shared settings and flags) and `probes.summary` (the finished run and its files).
"""
