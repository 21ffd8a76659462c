"""Machine-independent spellings of the paths a run records, so that a run made here resumes, and a study's stages
are reused, in a checkout on another machine.

A run's identity names what it read: the traces file, the data file, the model's weights. On the machine that made
it these are absolute paths (``/home/ada/kvscope/runs/t.jsonl``, ``/home/ada/.cache/kvscope/...``); the same files
in another checkout have other absolute paths. `portable` spells a path under one of three roots relative to that
root, the way the committed results write them:

- the repository (the checkout this module lies in): ``runs/t.jsonl``;
- ``$KVSCOPE_DATA_DIR`` (the benchmark copies, `tasks.datasets`): ``$KVSCOPE_DATA_DIR/math500.jsonl``;
- the home directory (the converted weights under ``~/.cache``): ``~/.cache/kvscope/...``.

The most specific root wins (a data directory or a checkout under the home directory is spelled from itself). A
path counts wherever it stands in a string (a whole value, or one word of a command line); paths outside the three
roots stay absolute, and text without such a path (``hub:...``, a path already portable) is unchanged, so the
spelling is idempotent and a stored spelling compares equal to today's absolute one. Run directories compare
identities (`core.rundir`) and a study keys its stages (`study.pipeline`) in this spelling, and `core.pack` writes
it into committed results; what a run writes keeps the absolute paths it used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
DATA_DIR_ENV = "KVSCOPE_DATA_DIR"
# A root followed by a character that continues a path component is another name (/root vs /rootfs); one preceded by
# such a character or by "/" lies inside a longer path (/mnt/home/ada is not under /home/ada).
_CONTINUES_NAME = r"[\w.\-]"
_INSIDE_PATH = r"[\w.\-/]"


def roots() -> list[tuple[str, str]]:
    """(absolute root, its portable spelling) for this process: the repository, the data directory when
    ``$KVSCOPE_DATA_DIR`` is set and the home directory, longest first."""
    found = [(str(REPOSITORY), "")]
    if data_dir := os.environ.get(DATA_DIR_ENV):
        found.append((str(Path(data_dir).expanduser().resolve()), f"${DATA_DIR_ENV}"))
    found.append((str(Path.home().resolve()), "~"))
    return sorted(found, key=lambda root: len(root[0]), reverse=True)


def portable_path(text: str, spellings: list[tuple[str, str]] | None = None) -> str:
    """`text` with every absolute path under one of `spellings` (`roots()` by default) spelled from the most specific
    root it lies under. The repository's spelling is empty: a path under it becomes relative (``runs/t.jsonl``), the
    repository itself ``.``."""
    spellings = sorted((root for root in (roots() if spellings is None else spellings) if root[0] != "/"),
                       key=lambda root: len(root[0]), reverse=True)  # the regex takes the first root that matches
    if not spellings or "/" not in text:
        return text
    by_root = dict(spellings)
    pattern = re.compile(rf"(?<!{_INSIDE_PATH})({'|'.join(re.escape(root) for root, _ in spellings)})"
                         rf"(/|(?!{_CONTINUES_NAME}))")

    def spelled(match: re.Match) -> str:
        spelling, below = by_root[match.group(1)], match.group(2) == "/"
        if spelling:
            return spelling + match.group(2)
        return "" if below else "."

    return pattern.sub(spelled, text)


def portable(value: Any, spellings: list[tuple[str, str]] | None = None) -> Any:
    """`value` (JSON-like: mappings, lists, tuples, strings, numbers) with every string spelled by `portable_path`."""
    spellings = roots() if spellings is None else spellings
    if isinstance(value, str):
        return portable_path(value, spellings)
    if isinstance(value, Mapping):
        return {key: portable(item, spellings) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(item, spellings) for item in value]
    return value
