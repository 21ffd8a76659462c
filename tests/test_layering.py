"""The data-flow rule (CONTRIBUTING.md): a package imports only from packages upstream of it, and no module imports
itself back through others.

core -> models -> tasks -> scoring -> signals / geometry -> labeling -> validation -> evictor -> probes -> figures ->
study. Both tests read one static import graph of every module of these packages and of bench/: every import
statement, at module level or inside a function, absolute or relative. An import of ``a.b.c`` reaches the module it
names and the packages above it (Python runs ``a`` and ``a.b`` first), so a package whose ``__init__`` imports
something that imports back one of its modules is a cycle too.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"core": 0, "models": 1, "tasks": 2, "scoring": 3, "signals": 4, "geometry": 4, "labeling": 5, "validation": 6,
        "evictor": 7, "probes": 8, "figures": 9, "study": 10}
SCRIPTS = ("bench",)  # directories of scripts, run as files: they also import their neighbours by bare name


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for top in (*RANK, *SCRIPTS) for path in sorted((ROOT / top).rglob("*.py"))}


def _known(name: str) -> str | None:
    """The module of this repository that importing the dotted `name` reaches: its longest known prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def _imported(module: str) -> set[str]:
    """The repository's modules `module` imports, with the packages above each."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]  # a module of `base`, or a name defined in it
        else:
            continue
        for name in names:
            target = _known(name)
            if target is None and path.parent.name in SCRIPTS:
                target = _known(f"{path.parent.name}.{name}")
            while target:
                if target in MODULES:
                    found.add(target)
                target = target.rpartition(".")[0]
    found.discard(module)  # a module that imports itself under its own name (for pickling) closes no cycle
    return found


@cache
def _graph() -> dict[str, set[str]]:
    return {module: _imported(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (``[a, b, ..., a]``) through each strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_shortest_cycle(graph, group, min(group)) for group in groups)


def _shortest_cycle(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    previous: dict[str, str] = {}
    queue = [start]
    for node in queue:  # breadth first, inside the group, until an edge leads back to the start
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in a strongly connected group but on no cycle")


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_module_imports_itself_through_others():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("module", [m for m in MODULES if m.split(".")[0] in RANK])
def test_imports_only_from_upstream(module):
    package = module.split(".")[0]
    allowed = {name for name, rank in RANK.items() if rank < RANK[package]} | {package}
    wrong = {target.split(".")[0] for target in _graph()[module]} - allowed
    assert not wrong, f"{MODULES[module].relative_to(ROOT)} imports downstream package(s) {sorted(wrong)}"
