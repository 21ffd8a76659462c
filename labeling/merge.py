"""Combine the shard outputs of ``python -m labeling.occlusion --shard I/N`` into one ``labels.jsonl``.

``python -m labeling.merge DIR`` checks that all N shards are present, were made with the same identity (the
settings that change a label), and each holds exactly the traces assigned to it, then claims ``DIR`` as an
unsharded run of that identity (so a concurrent merge or unsharded run, or an unsharded run made differently, is
refused) and writes ``DIR/labels.jsonl`` (traces in the order an unsharded run would label them) and
``DIR/config.json``. Nothing is written when a check fails.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from core.cli import ArgumentParser, atomic_write, main_guard
from core.errors import UsageError
from core.rundir import RunDir, identity_differences
from core.schemas import Label, iter_records

_SHARD_CONFIG = re.compile(r"^config\.shard-(\d+)-of-(\d+)\.json$")


def _shard_configs(out: Path) -> dict[int, dict[str, Any]]:
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for path in out.iterdir():
        if match := _SHARD_CONFIG.match(path.name):
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                raise UsageError(f"{path} is not a readable JSON file") from None
            if not isinstance(config, dict) or not isinstance(config.get("identity"), dict) or \
                    not isinstance(config.get("trace_ids"), list) or \
                    not all(isinstance(trace_id, str) for trace_id in config["trace_ids"]):
                raise UsageError(f"{path} is not a labeling.occlusion shard configuration (an object with an "
                                 "identity object and a trace_ids list)")
            found[(int(match.group(1)), int(match.group(2)))] = config
    if not found:
        raise UsageError(f"no shard outputs (config.shard-I-of-N.json) in {str(out)!r}")
    counts = {n for _, n in found}
    if len(counts) > 1:
        raise UsageError(f"{str(out)!r} mixes shard counts {sorted(counts)}")
    (count,) = counts
    missing = [i for i in range(count) if (i, count) not in found]
    if missing:
        raise UsageError(f"shards {missing} of {count} are missing in {str(out)!r}")
    return {index: config for (index, _), config in found.items()}


def merge(out: Path) -> tuple[Path, int]:
    """Merge the shards in `out`; returns the merged file and its record count."""
    if not out.is_dir():
        raise UsageError(f"{str(out)!r} is not a directory")
    configs = _shard_configs(out)
    count, identity = len(configs), configs[0]["identity"]
    for index, config in sorted(configs.items()):
        differences = identity_differences(identity, config["identity"])
        if differences:
            raise UsageError(f"shard {index} was made with other settings than shard 0: {'; '.join(differences)}")
    by_id: dict[str, Label] = {}
    for index in range(count):
        path = out / f"labels.shard-{index}-of-{count}.jsonl"
        records = list(iter_records(path, Label)) if path.exists() else []
        expected = configs[index]["trace_ids"]
        if sorted(r.id for r in records) != sorted(expected):
            raise UsageError(f"shard {index} holds {len(records)} of its {len(expected)} traces; finish it first "
                             "(rerun its command to resume)")
        for record in records:
            if record.id in by_id:
                raise UsageError(f"trace {record.id!r} appears in more than one shard")
            by_id[record.id] = record
    # Shard i labels the traces i, i + N, i + 2N, ... of the unsharded selection (`labeling.shards.shard_traces`):
    # interleaving restores its order.
    order = [configs[index]["trace_ids"][j] for j in range(max(len(c["trace_ids"]) for c in configs.values()))
             for index in range(count) if j < len(configs[index]["trace_ids"])]
    with RunDir(out, identity) as run:
        target = out / "labels.jsonl"
        with atomic_write(target) as handle:
            for trace_id in order:
                handle.write(json.dumps(by_id[trace_id].to_json()) + "\n")
        first = configs[0]
        run.save_config(config=first.get("config"), replacement=first.get("replacement"), merged_shards=count,
                        n_traces=len(order), trace_ids=order)
    return target, len(order)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m labeling.merge",
                            description="Combine labels.shard-I-of-N.jsonl files of one occlusion run into "
                            "labels.jsonl.")
    parser.add_argument("out", help="the --out directory the shards wrote to")
    return parser


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    target, n = merge(Path(args.out))
    print(f"merged {n} trace records into {target}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
