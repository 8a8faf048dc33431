"""The package's shape: no import cycle among rigup's modules, product code never imports the tests,
and the scripts uploaded to rigs use the standard library only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rigup"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: Path, known: set[str]) -> set[str]:
    """Every module `path` imports, at any depth of the file (function-level imports count too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # `from rigup.rig import servingctl` imports the submodule too
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return out


def rigup_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: {m for m in imported(path, known) if m in known and m != name} for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_rigup_modules() -> None:
    graph = rigup_graph()
    assert len(graph) > 40  # the walk sees the whole package
    # A package's __init__ importing its own submodules is how Python packages work, not a cycle of
    # design; none of rigup's __init__ files does it, so the check is strict.
    assert cycles(graph) == []


def test_product_code_never_imports_the_tests_or_benchmarks() -> None:
    known = set(modules())
    for name, path in modules().items():
        bad = {m for m in imported(path, known) if m.split(".")[0] in {"tests", "bench"}}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_rig_scripts_use_the_standard_library_only() -> None:
    known = set(modules())
    for path in (PACKAGE / "rig").glob("*.py"):
        if path.name == "__init__.py":
            continue
        outside = {m for m in imported(path, known) if m.split(".")[0] not in sys.stdlib_module_names}
        assert not outside, f"{path.name} imports {sorted(outside)}: rigs run it with a bare python3"


def test_layers_point_one_way() -> None:
    """Lower layers never import higher ones: parsers < facts/checks/desired < operations < cli."""
    rank = {"parsers": 0, "client": 1, "desired": 1, "checks": 2, "facts": 2, "runstate": 3, "operations": 3, "cli": 4}
    for name, deps in rigup_graph().items():
        layer = name.split(".")[1] if name.count(".") else None
        if layer not in rank:
            continue
        for dep in deps:
            dep_layer = dep.split(".")[1] if dep.count(".") else None
            if dep_layer in rank and dep_layer != layer:
                assert rank[dep_layer] <= rank[layer], f"{name} ({layer}) imports {dep} ({dep_layer})"
