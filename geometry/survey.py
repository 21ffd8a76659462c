"""Survey a model's KV geometry and attention-sink statistics over a calibration set (ValueDiff Tables 4-8).

    python -m geometry.survey --model smollm2-135m --prompts 20 --ctx 2048 --out runs/geometry/smollm2-135m

Writes into --out: ``config.json`` (resolved settings, calibration hash, what position 0 is), ``records.jsonl``
(one record of per-head statistics per calibration sequence; a rerun resumes after the last finished one),
and the tables ``heads_kv``, ``heads_q``, ``layers``, ``model`` as ``.csv`` and ``.json``. Prints the model-level
rows. Definitions: `geometry.stats`, `geometry.measure`, aggregation rules: `geometry.summary`.

From Python: ``run_survey(SurveyConfig(model="smollm2-135m", prompts=20), out)`` returns the same tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from core.cli import DTYPES, ArgumentParser, add_device_arguments, atomic_write, main_guard, positive_int, thread_count
from core.errors import UsageError, unknown_choice
from core.limits import Footprint, MemoryLimit
from core.records import JsonlStore
from core.rundir import RunDir, check_identity
from geometry.calibration import CATEGORIES, calibration_digest, calibration_prompts
from geometry.measure import KEY_SPACES, MeasureSettings, measure_sequence, weight_norms
from geometry.stats import JACCARD_MARGIN
from geometry.summary import MODEL_COLUMNS, GeometryAccumulator, build_tables
from models.hooks import layer_specs
from models.loading import load_model
from models.registry import DEFAULT_MODEL

TABLES = ("heads_kv", "heads_q", "layers", "model")
# Settings a resumed run must share with the records already on disk: the prompt count only extends the run, and
# tau and chunk enter the aggregation or the memory use, not a record.
RUN_KEYS = ("ctx", "topk", "queries", "key_space", "dtype")


@dataclass(frozen=True, kw_only=True)
class SurveyConfig:
    """A geometry survey; every field is the command-line flag of the same name (``key_space``: ``--key-space``)."""

    model: str = DEFAULT_MODEL
    prompts: int = 20  # calibration sequences, cycling through the categories; a finished run may be extended
    ctx: int = 2048  # tokens per calibration sequence
    tau: float = 0.3  # sink threshold on the mean attention to position 0
    topk: int = 256  # k of the top-k attention Jaccard
    queries: int = 128  # query positions of the Jaccard statistic
    key_space: str = "post_rope"
    chunk: int = 256  # query rows per attention block (memory only)
    device: str | None = None
    dtype: str = "float32"
    max_memory: int | None = None  # bytes the survey may use (None: the device's memory; `core.limits.MemoryLimit`)

    def check(self) -> None:
        """Refuse settings that are wrong before anything is loaded or written."""
        for name in ("prompts", "ctx", "topk", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name} must be a positive integer, got {value!r}")
        if self.key_space not in KEY_SPACES:
            raise unknown_choice("key space", self.key_space, KEY_SPACES)
        if self.dtype not in DTYPES:
            raise unknown_choice("dtype", self.dtype, DTYPES)
        if not 0 < self.tau < 1:
            raise UsageError(f"--tau must be in (0, 1), got {self.tau}")
        if self.queries < 2:
            raise UsageError(f"--queries must be at least 2, got {self.queries}")
        minimum = self.topk + JACCARD_MARGIN + 2
        if self.ctx < minimum:
            raise UsageError(
                f"--ctx {self.ctx} is too small for --topk {self.topk}: the Jaccard statistic samples queries in "
                f"[topk+{JACCARD_MARGIN}, ctx-1] and needs two of them, so --ctx must be at least {minimum}"
            )

    def check_limits(self) -> None:
        """Refuse, from the model's config and before it loads, a --ctx beyond its context and a survey whose peak
        memory exceeds the device's or --max-memory: one forward of --ctx tokens with every layer's q, k (before
        and after RoPE) and v captured, then one block of --chunk query rows' attention logits, probabilities and
        top-k ranks at a time (`models.footprint` says what the rest counts)."""
        from models.footprint import FP32, model_shape
        from models.loading import model_limits

        model_limits(self.model).check_flags({"--ctx": self.ctx})
        shape = model_shape(self.model, self.dtype, self.device)
        captured = shape.layers * self.ctx * (shape.q_heads + 3 * shape.kv_heads) * shape.head_dim * shape.itemsize
        rows = 3 * shape.q_heads * min(self.chunk, self.ctx) * self.ctx * FP32
        footprint = shape.weights() + Footprint((("forward", shape.forward_bytes(1, self.ctx, self.ctx)),
                                                 ("captured q/k/v", captured), ("attention rows", rows)))
        footprint.check(f"{self.model} surveying sequences of --ctx {self.ctx} tokens (--chunk {self.chunk})",
                        MemoryLimit.of(self.device, self.max_memory), "lower --ctx or --chunk")

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share with the records already on disk."""
        return {"model": self.model, **{k: getattr(self, k) for k in RUN_KEYS}}


@dataclass(frozen=True)
class SurveyResult:
    """A finished survey: its tables (`TABLES`, each a list of rows as in the ``.csv`` files) and where they are."""

    tables: dict[str, list[dict[str, Any]]]
    out: Path


def default_out(model: str) -> Path:
    return Path("runs") / "geometry" / Path(model).name.replace(".gguf", "")


def run_survey(config: SurveyConfig, out: str | os.PathLike | None = None, *, progress: bool = True) -> SurveyResult:
    """Survey `config.model` into `out` (default ``runs/geometry/<model>``), resuming the sequences already measured
    there, and write the tables. Bad settings are a `UsageError` before anything is written; a second run on the
    same `out` is refused at once."""
    config.check()
    config.check_limits()
    out = Path(out) if out is not None else default_out(config.model)
    # Settings known before loading are checked at the claim, so a refused resume does not wait for the model.
    with RunDir(out, config.identity()) as run:
        lm = load_model(config.model, device=config.device, dtype=config.dtype)
        prompts = calibration_prompts(lm.tokenizer, config.prompts, config.ctx)
        resolved = _resolved_config(config, lm, prompts)
        # The weights behind a registry name can change (a reinstalled GGUF): known only once loaded.
        identity = {**run.identity, "weights": resolved["weights"]}
        check_identity(run.config_path, identity, f"--out {str(out)!r}")
        run.identity = identity
        store_path = out / "records.jsonl"
        if store_path.exists():
            _check_records(store_path, {p.id: p.sha256 for p in prompts})
        run.save_config(**resolved)
        store = run.store("records.jsonl", key="prompt")
        settings = MeasureSettings(topk=config.topk, n_queries=config.queries, key_space=config.key_space,
                                   chunk=config.chunk)
        todo = [p for p in prompts if p.id not in store]
        for prompt in tqdm(todo, desc=f"geometry {lm.name}", unit="seq", file=sys.stderr, disable=not progress):
            input_ids = torch.tensor([prompt.input_ids], device=lm.device)
            record = measure_sequence(lm.model, input_ids, settings)
            store.append({"prompt": prompt.id, "category": prompt.category, "sha256": prompt.sha256,
                          "leading_token": prompt.input_ids[0], **record})

        accumulator = GeometryAccumulator(config.tau)
        wanted = {p.id for p in prompts}
        for record in store.records:
            if record["prompt"] in wanted:
                accumulator.add(record)
        tables = build_tables(accumulator.means(), layer_specs(lm.model), weight_norms(lm.model), lm.name)
        for name in TABLES:
            write_table(out / name, tables[name])
    return SurveyResult({name: tables[name] for name in TABLES}, out)


def build_parser() -> argparse.ArgumentParser:
    defaults = SurveyConfig()
    parser = ArgumentParser(prog="python -m geometry.survey", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=defaults.model,
                        help="registry name (smollm2-135m, gemma3-270m, ...), local HF directory, .gguf file or hub id "
                             f"(default {defaults.model})")
    parser.add_argument("--prompts", type=positive_int, default=defaults.prompts,
                        help=f"number of calibration sequences, cycling through {', '.join(CATEGORIES)} "
                             f"(default {defaults.prompts})")
    parser.add_argument("--ctx", type=positive_int, default=defaults.ctx,
                        help="tokens per calibration sequence; at least topk + 34 so the Jaccard statistic has two "
                             f"query positions in [topk+{JACCARD_MARGIN}, ctx-1] (default {defaults.ctx})")
    parser.add_argument("--out", default=None, help="output directory (default runs/geometry/<model>)")
    parser.add_argument("--tau", type=float, default=defaults.tau,
                        help="sink threshold: a head is a sink in a sequence when its mean attention to position 0 "
                             f"over queries t>=1 exceeds tau; must be in (0, 1) (default {defaults.tau})")
    parser.add_argument("--topk", type=positive_int, default=defaults.topk,
                        help=f"k of the top-k attention Jaccard (default {defaults.topk})")
    parser.add_argument("--queries", type=int, default=defaults.queries,
                        help=f"query positions sampled for the Jaccard statistic, >= 2 (default {defaults.queries})")
    parser.add_argument("--key-space", choices=KEY_SPACES, default=defaults.key_space,
                        help="keys used for sigma_K, BOS cosine and sigma_1(K): post_rope = what the KV cache stores "
                             "(default), pre_rope = the k projection before rotary embedding")
    parser.add_argument("--chunk", type=positive_int, default=defaults.chunk,
                        help="query rows per attention block; peak memory ~ q_heads x chunk x ctx floats "
                             f"(default {defaults.chunk})")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is fastest on a CPU shared with "
                             "other jobs, where extra threads mostly wait on each other")
    add_device_arguments(parser, dtype_default=defaults.dtype)
    return parser


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = SurveyConfig(**{f.name: getattr(args, f.name) for f in fields(SurveyConfig)})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run_survey(config, args.out)
    print(format_model_rows(result.tables["model"]))
    print(f"tables written to {result.out}/", file=sys.stderr)
    return 0


def _resolved_config(config: SurveyConfig, lm, prompts) -> dict[str, Any]:
    import transformers  # for its version; importing it takes a second, which `--help` need not wait for

    tokenizer = lm.tokenizer
    leading = sorted({p.input_ids[0] for p in prompts})
    return {
        "model": lm.name,
        "weights": lm.info.get("gguf_sha256", lm.source),
        "dtype": str(lm.model.dtype),
        "device": str(lm.device),
        "ctx": config.ctx,
        "prompts": config.prompts,
        "topk": config.topk,
        "queries": config.queries,
        "key_space": config.key_space,
        "tau": config.tau,
        "chunk": config.chunk,
        "describe": lm.describe(),
        "layer_types": [spec.kind for spec in layer_specs(lm.model)],
        "calibration_sha256": calibration_digest(prompts),
        "calibration": [{"id": p.id, "sha256": p.sha256, "sources": list(p.sources)} for p in prompts],
        # The leading token is position 0 whatever it is; record whether that is the tokenizer's BOS.
        "leading_token_ids": leading,
        "leading_tokens": tokenizer.convert_ids_to_tokens(leading),
        "leading_token_is_bos": all(t == tokenizer.bos_token_id for t in leading),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }


def _check_records(path: Path, expected: dict[str, str]) -> None:
    for record in JsonlStore(path, key=lambda r: r["prompt"]).records:
        if record["prompt"] in expected and record.get("sha256") != expected[record["prompt"]]:
            raise UsageError(
                f"{path}: prompt {record['prompt']!r} was measured on different text (the calibration sources "
                "changed); use another --out"
            )


def write_table(stem: Path, rows: list[dict[str, Any]]) -> None:
    """``stem.csv`` and ``stem.json`` holding the same records (JSON null / empty CSV cell = undefined)."""
    with atomic_write(stem.with_suffix(".json")) as handle:
        json.dump(rows, handle, indent=1)
        handle.write("\n")
    with atomic_write(stem.with_suffix(".csv"), mode="w") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def format_model_rows(rows: list[dict[str, Any]]) -> str:
    """The model-level rows as an aligned text table (ValueDiff Tables 4-8 columns)."""
    def cell(value: Any) -> str:
        if value is None:
            return "n/a"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    table = [list(MODEL_COLUMNS)] + [[cell(row[c]) for c in MODEL_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(MODEL_COLUMNS))]
    return "\n".join("  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in table)


if __name__ == "__main__":
    raise SystemExit(main())
