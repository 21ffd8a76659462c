"""Combine the shard outputs of ``python -m labeling.occlusion --shard I/N`` into one ``labels.jsonl``.

``python -m labeling.merge DIR`` checks that all N shards are present, were made with the same label-affecting
settings, and each holds every trace assigned to it, then writes ``DIR/labels.jsonl`` (traces in shard order) and
``DIR/config.json``. Nothing is written when a check fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from labeling.occlusion import LABEL_IDENTITY
from core.cli import ArgumentParser, atomic_write, main_guard, save_config
from core.errors import UsageError
from core.records import read_jsonl

_SHARD_CONFIG = re.compile(r"^config\.shard-(\d+)-of-(\d+)\.json$")



def merge(out: Path) -> tuple[Path, int]:
    """Merge the shards in `out`; returns the merged file and its record count."""
    if not out.is_dir():
        raise UsageError(f"{str(out)!r} is not a directory")
    found = {}
    for path in out.iterdir():
        if match := _SHARD_CONFIG.match(path.name):
            found[(int(match.group(1)), int(match.group(2)))] = json.loads(path.read_text())
    if not found:
        raise UsageError(f"no shard outputs (config.shard-I-of-N.json) in {str(out)!r}")
    counts = {n for _, n in found}
    if len(counts) > 1:
        raise UsageError(f"{str(out)!r} mixes shard counts {sorted(counts)}")
    (count,) = counts
    missing = [i for i in range(count) if (i, count) not in found]
    if missing:
        raise UsageError(f"shards {missing} of {count} are missing in {str(out)!r}")
    first = found[(0, count)]
    for (index, _), config in sorted(found.items()):
        diffs = [k for k in LABEL_IDENTITY if config.get(k) != first.get(k)]
        if diffs:
            raise UsageError(f"shard {index} was made with different settings ({', '.join(diffs)}) than shard 0")
    records, seen = [], set()
    for index in range(count):
        path = out / f"labels.shard-{index}-of-{count}.jsonl"
        shard_records = list(read_jsonl(path)) if path.exists() else []
        expected = found[(index, count)]["n_traces"]
        if len(shard_records) != expected:
            raise UsageError(f"shard {index} holds {len(shard_records)} of its {expected} traces; finish it first "
                             "(rerun its command to resume)")
        for record in shard_records:
            if record["trace_id"] in seen:
                raise UsageError(f"trace {record['trace_id']!r} appears in more than one shard")
            seen.add(record["trace_id"])
            records.append(record)
    target = out / "labels.jsonl"
    with atomic_write(target) as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    save_config(out, {**{k: first.get(k) for k in LABEL_IDENTITY}, "merged_shards": count,
                      "n_traces": len(records)})
    return target, len(records)


def _run(argv: list[str] | None) -> int:
    parser = ArgumentParser(prog="python -m labeling.merge",
                     description="Combine labels.shard-I-of-N.jsonl files of one occlusion run into labels.jsonl.")
    parser.add_argument("out", help="the --out directory the shards wrote to")
    args = parser.parse_args(argv)
    target, n = merge(Path(args.out))
    print(f"merged {n} trace records into {target}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
