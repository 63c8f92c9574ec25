"""The package's shape: imports flow one way, modules stay small, no test hooks in production code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "blobdata"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    # "from . import _loop" imports the submodule _loop; "from ._x import y" imports _x.
    names = [f"{base}.{a.name}" for a in node.names]
    return [*names, base] if node.module else names


def _graph() -> dict[str, set[str]]:
    """Every import between blobdata's own modules, function-level (late) imports included."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(name, path.name == "__init__.py", node)
            for t in targets:
                if t in modules and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_graph_sees_imports() -> None:
    graph = _graph()
    assert "blobdata._errors" in graph["blobdata._fetch.engine"]
    assert "blobdata._fetch.engine" in graph["blobdata._fetch"]
    assert "blobdata._stores.base" in graph["blobdata._stores.s3"]
    assert "blobdata._process" in graph["blobdata._loop"]  # "from . import _process"


def test_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None




def test_no_import_cycle() -> None:
    graph = _graph()
    # The package root re-exports everything (and lazily FolderDataset): leave it out, as nothing
    # inside blobdata imports it.
    inner = {n: {d for d in deps if d != "blobdata"} for n, deps in graph.items() if n != "blobdata"}
    for name, deps in graph.items():
        assert "blobdata" not in deps or name == "blobdata", f"{name} imports the package root"
    cycle = _find_cycle(inner)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_small(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it by what it does"


def test_no_test_hooks_in_production_code() -> None:
    hooks = re.compile(r"(?<!\w)(_part_hook|_trace|_test_hook)\b|for tests only|test hook", re.IGNORECASE)
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {m.group(0)}"
        for path in PACKAGE.rglob("*.py")
        if "testing" not in path.relative_to(PACKAGE).parts
        for m in hooks.finditer(path.read_text())
    ]
    assert not found, found
