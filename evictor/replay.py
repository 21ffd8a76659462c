"""Dense replay: the score every registered policy gives each reasoning token of a stored trace, without evicting.

One scorer, two uses: the scores that validation ranks against the occlusion labels are computed by the same code a
real eviction round runs (`evictor.engine.Session.round_scores`), on the same state, so a policy chosen by its
replayed scores is the policy deployed.

For each trace (``prompt_ids + generated_ids``, `core.schemas.Trace`) and policy, the replay

1. opens the policy's own engine `Session` and teacher-forces the trace: the prompt as a prefill (in blocks of
   `ReplayConfig.block`, one block by default), then the generated tokens up to the answer boundary
   (`labeling.windows.find_answer_boundary`, the boundary the occlusion labels use), one decode step per token or,
   with `ReplayConfig.teacher_block` > 1, that many per forward (`Session.teacher_force`): `observe`, the attention
   feed and every per-slot state see each token as in a real decode, and no round fires on the way. Blocks give
   the step-by-step scores to float32 rounding at a fraction of the time (a block forward reads the weights once);
2. holds one scoring round there, after the forward of position ``answer_start - 1``, and returns every layer's
   scores without selecting or compacting anything.

The replay protocol (`ReplayConfig.protocol`, whatever the policy's own protocol defaults): the prompt is protected
(never a candidate, whatever the policy's default protection), no buffer, no recency window, step trigger, no
eviction before the round. So the candidates of the held round are exactly the reasoning span
``[len(prompt_ids), answer_start)`` and each of its positions gets a score; prompt and answer positions get none.
``ScoreInputs.keep`` (read by VaSE only) is `ReplayConfig.keep` survivors: tokens, or a fraction of the span; every
candidate when unset. Random policies draw from the session generator seeded with ``derive_seed(seed, [trace id])``.
Sliding-window layers score their out-of-window candidates too (a round would evict those first, whatever their
score), and scores are reported before the engine's NaN-ranks-last rule.

Output: one `core.schemas.Signal` per trace, ``positions = 0..n_tokens-1``, None where a position has no score
(prompt, answer span) or its score is not finite. For a policy named P:

- ``signals[P][str(layer)]``: the mean over KV heads of the layer's scores (the engine's own score for shared keep
  sets), for every layer;
- ``signals[P]["agg"]``: the mean over layers and KV heads (the engine's keep score of policies shared across
  layers and heads); a layer-independent policy (EpiKV's hidden-state family: one score per token) has only "agg";
- ``signals["P.h<k>"][str(layer)]``: KV head k's scores at each layer, for policies with per-head keep sets.

``extra`` holds ``reasoning_start``, ``answer_start``, ``boundary`` (think / boxed / tail), the replay settings and
``policies``: for each replayed policy P, ``{"policy": P, "params": {...}}`` with the constructor parameters it was
built with (a policy configuration file's, not `Policy.config`), so `validation.select` writes that configuration and
``evictor.run --policy-config`` deploys the very scorer that was ranked.

Library: ``replay_signals(lm, build_engines(lm, {"h2o": {}, "r_kv": {"lam": 0.5}}, ReplayConfig()), traces,
ReplayConfig())`` yields the records; `chosen_policies` reads the command line's --policies and --policy-config.

Command line::

    python -m evictor.replay --traces dense/generations.jsonl --policies all --out runs/replay/signals.jsonl
    python -m evictor.replay --traces T --policies triattention --policy-config tri.json --out S

`--out` is a JSONL file, resumable, with ``<stem>.config.json`` and a lock beside it (like ``python -m signals``); a
rerun with other traces, model, policies (with their parameters), replay settings or dtype is refused.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from core.cli import ArgumentParser, add_device_arguments, main_guard, non_negative_int, positive_int, seed_int
from core.errors import UsageError
from core.limits import MemoryLimit
from core.schemas import Signal, Trace
from core.seeds import derive_seed
from evictor.calibration import CalibratedPolicy
from evictor.policies import get_policy
from evictor.policy import configured_policy, left_out_line, read_policy_configs, select_policies
from evictor.protocol import WHOLE_PROMPT, Budget, EvictionConfig, parse_budget
from labeling.windows import DEFAULT_TAIL, find_answer_boundary
from scoring.policy import Policy

AGGREGATE = "agg"


def head_key(policy: str, head: int) -> str:
    """The signal name of KV head `head`'s scores of `policy`."""
    return f"{policy}.h{head}"


@dataclass(frozen=True)
class ReplayConfig:
    """How the held round is set up (see the module docstring for the replay protocol)."""

    keep: Budget | None = None  # survivors of the round: tokens, or a fraction of the span; None: every candidate
    block: int = WHOLE_PROMPT  # prefill block size (one block by default: rounding as a plain prefill)
    teacher_block: int = 32  # generated tokens per teacher-forced forward (1: one decode step per token)
    query_window: int | None = None  # attention queries kept per slot (None: each policy's own)
    seed: int = 0
    tail: int = DEFAULT_TAIL  # the answer span of a trace with neither </think> nor \boxed{ (as the labels)

    def __post_init__(self) -> None:
        if self.block < 1 or self.teacher_block < 1 or self.tail < 0:
            raise UsageError(f"block and teacher_block must be >= 1 and tail >= 0, got {self.block}, "
                             f"{self.teacher_block} and {self.tail}")

    def protocol(self) -> EvictionConfig:
        """The engine settings of a replay: prompt protected, no buffer, no recency window, step trigger."""
        return EvictionConfig(budget=WHOLE_PROMPT, buffer=0, recency=0, trigger="step", protect="prompt",
                              block=self.block, query_window=self.query_window, seed=self.seed)

    def survivors(self, span: int) -> int:
        """``ScoreInputs.keep`` of a round over `span` candidates."""
        if self.keep is None:
            return span
        return min(span, self.keep.resolve(span))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "keep": None if self.keep is None else self.keep.to_json()}


def replay_scores(engine, prompt_ids: list[int], generated_ids: list[int], answer_start: int, *, keep: int,
                  seed: int, teacher_block: int = 1) -> torch.Tensor:
    """``[layer, kv_head, answer_start - len(prompt_ids)]`` float32 (CPU): every layer's scores of the reasoning
    positions at a round held after the forward of position ``answer_start - 1`` of a teacher-forced session of
    `engine` (an `evictor.engine.EvictionEngine` with `ReplayConfig.protocol`), `keep` survivors, seeded `seed`,
    the generated tokens fed `teacher_block` per forward. Every registered policy scores the same whatever the block
    (to float32 rounding of the block matmuls; tests/test_replay.py), since the engine observes and feeds attention
    one query row at a time within a forward, as in a block-wise prefill."""
    start = len(prompt_ids)
    span = answer_start - start
    if not 0 <= span <= len(generated_ids):
        end = start + len(generated_ids)
        raise ValueError(f"answer_start {answer_start} is outside the generation [{start}, {end}]")
    n_layers, n_kv = engine.n_layers, engine.model.config.num_key_value_heads
    if span == 0:
        return torch.zeros(n_layers, n_kv, 0)
    fed = [int(token) for token in generated_ids[:span]]
    # K = every fed token: the step trigger (no buffer) fires only above it, so no round runs before the held one
    with torch.inference_mode(), engine.session([list(prompt_ids)], [answer_start], max_new_tokens=span,
                                                seed=seed) as session:
        session.prefill()
        session.teacher_force(fed, teacher_block)
        candidate = torch.ones(1, 1, span, dtype=torch.bool, device=session.device)
        scores = session.round_scores((start, answer_start), candidate, keep)  # no padding, no eviction: slot = pos
    return torch.stack([layer[0] for layer in scores]).float().cpu()


def _values(row: torch.Tensor, start: int, n_tokens: int) -> list[float | None]:
    values: list[float | None] = [None] * n_tokens
    for offset, value in enumerate(row.tolist()):
        values[start + offset] = value if math.isfinite(value) else None
    return values


def policy_signals(name: str, policy: Policy, scores: torch.Tensor, start: int,
                   n_tokens: int) -> dict[str, dict[str, list[float | None]]]:
    """The signal entries of one policy's replayed `scores` ``[layer, kv_head, span]`` (module docstring)."""
    entry = {AGGREGATE: _values(scores.mean((0, 1)), start, n_tokens)}
    if policy.layer_independent:
        return {name: entry}
    entry.update({str(layer): _values(scores[layer].mean(0), start, n_tokens) for layer in range(scores.shape[0])})
    signals = {name: entry}
    if not policy.shared_across_heads:
        for head in range(scores.shape[1]):
            signals[head_key(name, head)] = {str(layer): _values(scores[layer, head], start, n_tokens)
                                             for layer in range(scores.shape[0])}
    return signals


@dataclass
class ReplayedPolicy:
    """One policy of a replay: the constructor parameters it is built with (what a policy configuration file's
    ``params`` holds, so what ``evictor.run --policy-config`` deploys) and its engine under the replay protocol."""

    params: dict[str, Any]
    engine: Any  # evictor.engine.EvictionEngine

    def deployed(self, name: str) -> dict[str, Any]:
        """The ``{"policy", "params"}`` configuration of these scores."""
        return {"policy": name, "params": self.params}


def build_engines(lm, policies: Mapping[str, Mapping[str, Any]], config: ReplayConfig) -> dict[str, ReplayedPolicy]:
    """Policy name -> its constructor parameters (`chosen_policies`) in, one engine per policy with the replay
    protocol out; a policy that does not fit the model (a band outside its depth, a calibration of another model) is
    a `UsageError` here."""
    from evictor.engine import EvictionEngine

    return {name: ReplayedPolicy(dict(params), EvictionEngine(lm, configured_policy(name, dict(params)),
                                                              config.protocol()))
            for name, params in policies.items()}


def replay_signals(lm, engines: Mapping[str, ReplayedPolicy], traces: Iterable[Trace], config: ReplayConfig,
                   progress: Callable[[], Any] | None = None) -> Iterator[Signal]:
    """One Signal record per trace, in order, holding every policy's replayed scores (`build_engines`) and the
    configuration each was scored with; `progress()` after each (trace, policy) replay."""
    n_layers = lm.config.num_hidden_layers
    deployed = {name: replayed.deployed(name) for name, replayed in engines.items()}
    for trace in traces:
        start = len(trace.prompt_ids)
        boundary = find_answer_boundary(lm.tokenizer, start, list(trace.generated_ids), config.tail)
        n_tokens = len(trace.token_ids)
        keep = config.survivors(boundary.answer_start - start)
        seed = derive_seed(config.seed, [trace.id])
        signals: dict[str, dict[str, list[float | None]]] = {}
        for name, replayed in engines.items():
            scores = replay_scores(replayed.engine, trace.prompt_ids, trace.generated_ids, boundary.answer_start,
                                   keep=keep, seed=seed, teacher_block=config.teacher_block)
            signals.update(policy_signals(name, replayed.engine.policy, scores, start, n_tokens))
            if progress is not None:
                progress()
        yield Signal(id=trace.id, model=lm.name, dataset=trace.dataset, n_tokens=n_tokens, n_prompt=start,
                     positions=list(range(n_tokens)), signals=signals, layers=list(range(n_layers)),
                     extra={"reasoning_start": start, "answer_start": boundary.answer_start,
                            "boundary": boundary.kind, "replay": config.to_dict(), "policies": deployed})


# --- command line ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m evictor.replay",
        description="Score every reasoning token of stored dense traces with eviction policies, without evicting: "
        "a teacher-forced pass through each policy's own engine session, then one scoring round held at the answer "
        "boundary (the prompt protected, no buffer, no recency window), written as per-token signal records "
        "(signals[POLICY][LAYER] = mean over KV heads, signals[POLICY]['agg'] = mean over layers and heads, "
        "signals['POLICY.hK'][LAYER] = KV head K).",
    )
    parser.add_argument("--traces", required=True,
                        help="dense trace records (tasks.run or evictor.run --policy full generations.jsonl)")
    parser.add_argument("--policies", default=None,
                        help="policy name, comma list or 'all' (every policy that evicts; the calibrated ones only "
                        "with a --policy-config); each --policy-config policy is replayed too")
    parser.add_argument("--policy-config", action="append", default=[],
                        help='JSON file {"policy": name, "params": {...}} configuring one policy (repeatable)')
    parser.add_argument("--out", required=True,
                        help="output JSONL file (resumable; <stem>.config.json and a lock are kept beside it)")
    parser.add_argument("--model", default=None,
                        help="model to run (registry name, directory, .gguf or hub id); default: the traces' model")
    parser.add_argument("--keep", default=None,
                        help="survivors of the held round (ScoreInputs.keep, read by VaSE only): a whole number of "
                        "tokens >= 2, or a fraction in (0, 1] of the reasoning span (default: every candidate)")
    parser.add_argument("--block", type=positive_int, default=WHOLE_PROMPT,
                        help="prefill block size (default: the whole prompt in one block)")
    parser.add_argument("--teacher-block", type=positive_int, default=ReplayConfig.teacher_block,
                        help="generated tokens fed per forward: 1 replays one decode step per token; a larger block "
                        "gives the same scores to float32 rounding, several times faster on CPU (default "
                        f"{ReplayConfig.teacher_block})")
    parser.add_argument("--query-window", type=positive_int, default=None,
                        help="attention queries kept per slot (default: each policy's own)")
    parser.add_argument("--tail", type=non_negative_int, default=DEFAULT_TAIL,
                        help="answer span of a trace with neither </think> nor \\boxed{ (as labeling.occlusion "
                        f"--tail; default {DEFAULT_TAIL})")
    parser.add_argument("--seed", type=seed_int, default=0, help="seeds random policies, per trace (default: 0)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N traces")
    add_device_arguments(parser, dtype_default="float32")
    return parser


def chosen_policies(text: str | None, config_files: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The policies to replay (`evictor.policy.select_policies`; ``all`` also leaves out `full`, which scores
    nothing), each with its constructor parameters from its configuration file ({} without one). Each is built here,
    so a bad parameter or a missing calibration file is a one-line `UsageError` before anything runs."""
    params = read_policy_configs(config_files)
    names, left_out = select_policies(text or ",".join(params), params, flag="--policies")
    if left_out:
        print(f"evictor.replay: {left_out_line(left_out, '--policies')}", file=sys.stderr)
    if text is not None and text.strip() == "all":
        names = [name for name in names if not get_policy(name).scores_nothing]
    chosen = {name: params.get(name, {}) for name in names}
    for name, values in chosen.items():
        policy = configured_policy(name, values)
        if policy.scores_nothing:
            raise UsageError(f"policy {name!r} evicts nothing and has no score to replay")
        if isinstance(policy, CalibratedPolicy):
            policy.stats()  # without its file: the one-line error naming the calibration command
    return chosen


def check_replay_memory(model: str, policies: Mapping[str, Mapping[str, Any]], config: ReplayConfig,
                        traces: Sequence[Trace], args: argparse.Namespace) -> None:
    """Refuse a replay whose largest policy would need more memory than the device has or --max-memory allows: a
    session holding a whole trace (nothing is evicted) with what the policy reads (`eviction_footprint`)."""
    from evictor.engine import eviction_footprint
    from models.footprint import model_shape

    shape = model_shape(model, args.dtype, args.device)
    prompt = max(len(trace.prompt_ids) for trace in traces)
    longest = max(len(trace.token_ids) for trace in traces)
    eviction = config.protocol()
    footprint = max((eviction_footprint(shape, configured_policy(name, dict(params)), eviction, [prompt],
                                        longest - prompt, 1, budget=longest) for name, params in policies.items()),
                    key=lambda footprint: footprint.total)
    footprint.check(f"{model} replaying traces of up to {longest} tokens (--traces {args.traces})",
                    MemoryLimit.of(args.device, args.max_memory), "use shorter traces or a smaller --query-window")


def _run(argv: list[str] | None) -> int:
    from models.loading import model_limits
    from signals.traces import claim_output, read_dense_traces, traces_model

    args = build_parser().parse_args(argv)
    policies = chosen_policies(args.policies, args.policy_config)
    keep = None if args.keep is None else parse_budget(args.keep, "--keep")
    config = ReplayConfig(keep=keep, block=args.block, teacher_block=args.teacher_block,
                          query_window=args.query_window, seed=args.seed, tail=args.tail)
    traces = read_dense_traces(args.traces, args.limit)
    model_name = traces_model(traces, args.model, f"--traces {args.traces}")
    model_limits(model_name).check_flags({"--teacher-block": config.teacher_block,
                                          "--query-window": config.query_window})
    check_replay_memory(model_name, policies, config, traces, args)
    out = Path(args.out)
    # Policy.config() holds what the parameters resolve to (a calibration file's digest): a changed file is refused.
    identity = {"traces": str(Path(args.traces).resolve()), "model": model_name, "dtype": args.dtype,
                "policies": [configured_policy(name, params).config() for name, params in policies.items()],
                "replay": config.to_dict()}
    with claim_output(out, identity) as run:
        from tqdm import tqdm

        from models.loading import load_model

        lm = load_model(model_name, device=args.device, dtype=args.dtype)
        engines = build_engines(lm, policies, config)
        run.save_config(limit=args.limit, device=str(lm.device), loaded_model=lm.describe(),
                        protocol=config.protocol().to_dict(),
                        engines={name: replayed.engine.describe() for name, replayed in engines.items()})
        store = run.store(out.name, key=lambda record: Signal.from_json(record, str(out)).id)
        todo = [t for t in traces if t.id not in store]
        with tqdm(total=len(todo) * len(engines), desc="replay", unit="policy", file=sys.stderr) as bar:
            for record in replay_signals(lm, engines, todo, config, progress=bar.update):
                store.append(record.to_json())
    print(f"{len(store.records)} signal records in {out}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
