"""The scorer contracts every stage that scores tokens shares: what a scorer reads and how it is registered.

- `scoring.policy`: an eviction policy (what it declares it needs, what it is given at each round, its traits);
- `scoring.signal`: a per-token signal (what it reads from each forward, how that becomes one value per position);
- `scoring.registry`: the registry both are made by name from, which finds every module of its package.

`scoring` sits just above `tasks` and imports only `core`: the signals (`signals`) and the engine and its policies
(`evictor`) import these contracts from here, never from each other.
"""
