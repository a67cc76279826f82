"""The product's import graph has no cycles (docs/DESIGN.md "Layers").

Every ``import`` statement of talos_sdk, talos and mcp_proxy counts, also the
ones inside functions: a deferred import hides a circle from the interpreter,
not from the reader. Imports under ``if TYPE_CHECKING:`` are left out: they
name a type for the checker and load nothing. Edges run module to module
(``from pkg import mod`` is an edge to ``pkg.mod`` when that is a module).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("talos_sdk", "talos", "mcp_proxy")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, here: str, is_package: bool, modules: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in modules:
                yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = here.split(".")
            if not is_package:
                anchor = anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                yield sub
            elif base in modules:
                yield base


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> product modules it imports (any import statement but type-only ones)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        skip = _type_only(tree)
        edges = {
            t
            for node in ast.walk(tree)
            if id(node) not in skip
            for t in _targets(node, name, is_package, modules)
        }
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_the_cycle_finder_sees_a_circle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_product() -> None:
    graph = import_graph()
    assert graph.get("talos.node")  # the walk found real edges
    assert find_cycles(graph) == []


def test_layers_import_downward_only() -> None:
    """talos_sdk imports neither talos nor mcp_proxy; talos does not import mcp_proxy."""
    for module, edges in import_graph().items():
        if module.startswith("talos_sdk"):
            assert not {e for e in edges if not e.startswith("talos_sdk")}, module
        elif module.startswith("talos"):
            assert not {e for e in edges if e.startswith("mcp_proxy")}, module


def test_type_only_imports_are_left_out() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import talos.node\n")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import)]
    assert {id(n) for n in imports} <= _type_only(tree)
