"""The package's shape: packages named after the stages of the data path, imports flowing one way
between them (the table below is ARCHITECTURE.md's rules), each package entered by its ``__init__``,
modules small, no test hooks in production code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "blobdata"
MAX_LINES = 500
MAX_TOP_MODULES = 10  # directly in blobdata/, besides __init__ and __main__
MAX_PACKAGE_MODULES = 16

#: The plumbing every stage shares: modules directly in blobdata/. They import only each other.
PLUMBING = {"_config", "_errors", "_loop", "_process", "_retry", "_url"}

#: Which unit may import which (besides itself and the plumbing). A unit is a package of blobdata or a
#: public top-level module. Lower stages never import higher ones: the table has no cycle (checked).
ALLOWED: dict[str, set[str]] = {
    "_node": set(),
    "_metrics": set(),
    "_stores": {"_node"},
    "_cache": set(),
    "_decode": {"_node"},
    "_fetch": {"_node", "_metrics", "_stores"},
    "_tables": {"_fetch", "_stores"},
    "_listing": {"_fetch", "_metrics", "_node", "_stores", "_tables"},
    "_sampling": {"_listing"},
    "_peers": {"_cache", "_fetch", "_listing", "_metrics", "_node", "_stores"},
    "transforms": {"_decode", "_sampling"},
    "gpu": {"_metrics", "_decode", "_sampling", "transforms"},
    "testing": {"gpu", "transforms", "_decode"},
    "_dataset": {
        "_cache", "_decode", "_fetch", "_listing", "_metrics", "_node", "_peers", "_sampling", "_stores",
        "gpu", "transforms",
    },
    "_cli": {
        "_cache", "_dataset", "_decode", "_fetch", "_listing", "_metrics", "_node", "_sampling", "_stores",
        "gpu", "testing", "transforms",
    },
}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


_TREES: dict[Path, ast.Module] = {}


def _parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once. Parsing at collection, before any test starts a thread,
    avoids CPython 3.11's ast recursion check that another thread's compile can upset
    ("AST constructor recursion depth mismatch", python/cpython#106905)."""
    if path not in _TREES:
        _TREES[path] = ast.parse(path.read_text(), str(path))
    return _TREES[path]


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
        tree = _parse(path)
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
                return [*stack[stack.index(d) :], d]
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
    assert "blobdata._stores.base" in graph["blobdata._stores.s3.reader"]
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


def _unit(module: str) -> str:
    """The package (or top-level module) of blobdata that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "blobdata"


def _import_statements() -> list[tuple[str, str, int, str]]:
    """(importing module, imported module as written, line, its unit) for every import of blobdata's own
    modules inside the package, function-level ones included."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node)[-1]
                targets = (
                    [target] if node.module else [t for t in _resolve(name, path.name == "__init__.py", node)]
                )
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            out += [(name, t, node.lineno, _unit(t)) for t in targets if t.split(".")[0] == "blobdata"]
    return out


def test_the_edge_table_is_one_way() -> None:
    graph = {unit: deps for unit, deps in ALLOWED.items()}
    assert _find_cycle(graph) is None, _find_cycle(graph)


def test_every_package_is_in_the_table_and_in_architecture() -> None:
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    tops = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert set(packages) <= set(ALLOWED), set(packages) - set(ALLOWED)
    assert set(tops) - PLUMBING <= set(ALLOWED), set(tops) - PLUMBING - set(ALLOWED)
    architecture = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    for unit in [*packages, *tops]:
        assert f"`{unit}/`" in architecture or f"`{unit}.py`" in architecture, f"ARCHITECTURE.md: {unit}?"


def test_the_top_level_is_small_and_packages_are_not_crowded() -> None:
    tops = [p.name for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(tops) <= MAX_TOP_MODULES, sorted(tops)
    for pkg in PACKAGE.iterdir():
        if (pkg / "__init__.py").is_file():
            count = len([p for p in pkg.rglob("*.py") if p.name != "__init__.py"])
            assert count <= MAX_PACKAGE_MODULES, f"{pkg.name} has {count} modules"


def test_imports_follow_the_table() -> None:
    bad = []
    for importer, target, line, unit in _import_statements():
        here = _unit(importer)
        if unit == here or unit in PLUMBING or here in ("blobdata", "__main__"):
            continue
        if target == "blobdata.__version__":  # the root's version, read late by the command line
            continue
        if here in PLUMBING:
            bad.append(f"{importer}:{line} plumbing imports {target}")
        elif here != "blobdata" and unit not in ALLOWED.get(here, set()):
            bad.append(f"{importer}:{line} ({here}) imports {target} ({unit}): not in ALLOWED")
    assert not bad, "\n".join(bad)


def test_other_packages_enter_a_package_by_its_init() -> None:
    """``from .._fetch import FetchEngine``, never ``from .._fetch.engine import FetchEngine``: moving a
    module inside its package then touches nothing outside it. ``from .._metrics import stats`` names a
    module through the package: allowed. ``gpu`` and ``testing`` are public: their ``__init__`` is the
    user's API, so the data path reaches their private modules directly."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        tree = _parse(path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or (not node.module and node.level == 0):
                continue
            base = _resolve(name, path.name == "__init__.py", node)[-1] if node.module else None
            if base is None:
                continue
            parts = base.split(".")
            inside = parts[0] == "blobdata" and parts[1] not in PLUMBING | {"gpu", "testing"}
            if len(parts) > 2 and inside and _unit(base) != _unit(name):
                bad.append(f"{name}:{node.lineno} imports from {base}")
    assert not bad, "\n".join(bad)


def test_tests_enter_moved_packages_by_their_init() -> None:
    """Tests import blobdata's packages by their interface too, except a package's own white-box tests
    (tests/<package>/), the store and cache internals (their own folders) and gpu's private modules."""
    tests = PACKAGE.parent / "tests"
    interface_only = {"_fetch", "_listing", "_sampling", "_metrics", "_dataset", "_decode", "_cli", "_node"}
    bad = []
    for path in sorted(tests.rglob("*.py")):
        own = path.relative_to(tests).parts[0].replace("-", "_")
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("blobdata."):
                parts = node.module.split(".")
                if len(parts) > 2 and parts[1] in interface_only and f"_{own}" != parts[1]:
                    bad.append(f"{path.relative_to(tests)}:{node.lineno} imports from {node.module}")
    assert not bad, "\n".join(bad)


for _path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tests").rglob("*.py")]:  # at collection
    _parse(_path)


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
