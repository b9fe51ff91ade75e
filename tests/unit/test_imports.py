"""No import circle in ``trainmon/``: the graph of the modules' own imports (read with ``ast``) is acyclic.

Every ``import``/``from ... import`` counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (annotations only: they never run). An import names its module, not the packages
above it: ``from trainmon.anomaly.events import AnomalyEvent`` is an edge to ``trainmon.anomaly.events``
only, though Python runs ``trainmon/anomaly/__init__.py`` first (counting those edges would put every
module in a circle with ``trainmon/__init__.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trainmon"

def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ``trainmon`` modules that the file at ``path`` imports."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", modules)


def imports_in(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules among ``modules`` that the source of the module ``name`` imports."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (``a -> b -> ... -> a``) per strongly connected component with more than one module;
    the component's other modules (in further circles through them) follow after ``|``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    circles = []
    for component in components:
        circle = _circle(graph, component)
        circles.append(circle + (["|", *sorted(component - set(circle))] if component - set(circle) else []))
    return circles


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the first module of ``component`` (breadth-first inside it)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node] & component):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                queue.append(target)
    raise AssertionError(f"no circle in {component}")  # pragma: no cover


def test_the_graph_reader_sees_function_level_imports_and_skips_type_checking():
    source = """
from typing import TYPE_CHECKING
from p import b
from .c import thing
if TYPE_CHECKING:
    from p import d
else:
    import p.e
def f():
    from p.f import g
"""
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e", "p.f"}
    assert imports_in(source, "p.a", False, modules) == {"p.b", "p.c", "p.e", "p.f"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a", "|", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import circles in trainmon/:\n" + "\n".join(" -> ".join(c) for c in found)
