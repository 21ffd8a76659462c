"""The data-flow rule (CONTRIBUTING.md): a package imports only from packages upstream of it.

core -> models -> tasks -> probes / geometry -> labeling -> validation -> evictor -> figures -> study. The planted-fact
and passcode probes are eviction experiments and the one sanctioned exception: they drive the evictor, so they sit
where the evictor does and may use everything upstream of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"core": 0, "models": 1, "tasks": 2, "probes": 3, "geometry": 3, "labeling": 4, "validation": 5, "evictor": 6,
        "figures": 7, "study": 8}
EVICTION_EXPERIMENTS = {"probes/planted_fact.py", "probes/passcode.py", "probes/_eviction_probe.py"}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(RANK)


def _modules():
    for package in RANK:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield pytest.param(path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("path", list(_modules()))
def test_imports_only_from_upstream(path):
    package = path.relative_to(ROOT).parts[0]
    relative = str(path.relative_to(ROOT))
    rank = RANK["evictor"] + 1 if relative in EVICTION_EXPERIMENTS else RANK[package]
    allowed = {name for name, r in RANK.items() if r < rank} | {package}
    wrong = _imported_packages(path) - allowed
    assert not wrong, f"{relative} imports downstream package(s) {sorted(wrong)}"
