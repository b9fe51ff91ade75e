"""The floor plan of ``trainmon/``: no import circle, and every import goes down the layers.

The graph of the modules' own imports is read with ``ast``. Every ``import``/``from ... import`` counts, at
module level, inside a function, and under ``if TYPE_CHECKING:`` (mypy follows those: a circle through them is
a circle in the type checker's reading, and an annotation naming an upper room ties the lower one to it).
An import names its module, not the packages above it: ``from trainmon.anomaly.events import AnomalyEvent`` is
an edge to ``trainmon.anomaly.events`` only, though Python runs ``trainmon/anomaly/__init__.py`` first (counting
those edges would put every module in a circle with ``trainmon/__init__.py``).
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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


def _import_nodes(node: ast.AST, type_checking: bool = True) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``; the bodies of ``if TYPE_CHECKING:`` only if ``type_checking``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]), type_checking)
        else:
            yield from _import_nodes(child, type_checking)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ``trainmon`` modules that the file at ``path`` imports."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", modules)


def imports_in(source: str, name: str, is_package: bool, modules: set[str],
               type_checking: bool = True) -> set[str]:
    """The modules among ``modules`` that the source of the module ``name`` imports (with or without the
    ``TYPE_CHECKING`` ones)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(source), type_checking):
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


def test_the_graph_reader_sees_function_level_and_type_checking_imports():
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
    assert imports_in(source, "p.a", False, modules, type_checking=False) == {"p.b", "p.c", "p.e", "p.f"}
    assert imports_in(source, "p.a", False, modules) == {"p.b", "p.c", "p.d", "p.e", "p.f"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a", "|", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import circles in trainmon/:\n" + "\n".join(" -> ".join(c) for c in found)


# The rooms, bottom to top: a module imports only modules of its own room or of a room on a lower floor
# (two rooms on one floor do not import each other). A room is a folder, or a top-level module (the face).
FLOORS: list[tuple[str, ...]] = [
    ("errors", "version"),
    ("base",),
    ("anomaly", "sinks"),
    ("config",),  # may import the detectors' specs
    ("collect",),
    ("probe", "actions"),
    ("integrations",),
    ("runtime",),
    ("monitor",),
    ("trainers", "tools"),
    ("", "__main__"),  # the package face: trainmon/__init__.py and python -m trainmon
]

# Deprecated aliases kept for one release: modules at an old import path that re-export the new one.
CALLBACK_ALIASES = {
    "trainmon.integrations.hf": "trainmon.trainers.hf",
    "trainmon.integrations.lightning": "trainmon.trainers.lightning",
    "trainmon.integrations.mindspore.callback": "trainmon.trainers.mindspore",
}
ALIASES = {**CALLBACK_ALIASES, "trainmon.anomaly.analyse": "trainmon.anomaly.merge",
           "trainmon.cli": "trainmon.tools.cli"}  # the `trainmon` command of an install made before the move

FLOOR_OF = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    """``trainmon.anomaly.events`` -> ``anomaly``; ``trainmon`` -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def against_the_order(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a room on the same or a higher floor (other than the module's own room)."""
    found = []
    for source, targets in sorted(graph.items()):
        if source in ALIASES:
            continue
        for target in sorted(targets):
            here, there = room_of(source), room_of(target)
            if here != there and FLOOR_OF[there] >= FLOOR_OF[here]:
                found.append(f"{source} ({here or 'face'}) -> {target} ({there or 'face'})")
    return found


def test_every_module_is_in_a_room():
    unknown = {module for module in import_graph() if room_of(module) not in FLOOR_OF and module not in ALIASES}
    assert not unknown, f"modules outside the floor plan: {sorted(unknown)} (add their room to FLOORS)"


def test_no_import_against_the_layer_order():
    found = against_the_order(import_graph())
    assert not found, "imports against the layer order (see docs/design.md, map of the package):\n" + "\n".join(found)


def test_the_order_check_sees_upward_and_sideways_imports():
    graph = {"trainmon.base.records": {"trainmon.config"}, "trainmon.probe.storage": {"trainmon.actions.naming"},
             "trainmon.collect.hooks": {"trainmon.base.guard", "trainmon.collect.context"}}
    assert against_the_order(graph) == ["trainmon.base.records (base) -> trainmon.config (config)",
                                        "trainmon.probe.storage (probe) -> trainmon.actions.naming (actions)"]


def test_aliases_are_deprecated_re_exports():
    """An alias module only warns and re-exports its new home (kept one release, then removed)."""
    for alias, target in ALIASES.items():
        source = (PACKAGE.parent / Path(*alias.split("."))).with_suffix(".py").read_text()
        assert "DeprecationWarning" in source and target in source, alias


@pytest.mark.parametrize("old", sorted(CALLBACK_ALIASES))
def test_old_callback_paths_warn_and_give_the_same_callback(old):
    """The HF, Lightning and MindSpore callbacks' old import paths still work for one release, with a warning."""
    try:
        new = importlib.import_module(ALIASES[old])
    except ImportError as exc:  # transformers, lightning or mindspore not installed
        pytest.skip(f"{ALIASES[old]} needs its trainer's package ({exc})")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=ALIASES[old]):
        alias = importlib.import_module(old)
    assert alias.TrainmonCallback is new.TrainmonCallback


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(defined, imported)``: the names a module defines and those it imports from ``trainmon``."""
    defined: set[str] = set()
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined.update(name.id for name in ast.walk(target) if isinstance(name, ast.Name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainmon"):
            imported.update(alias.asname or alias.name for alias in node.names)
    return defined, imported


def test_no_module_imports_another_modules_private_name():
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainmon"):
                found += [f"{module_name(path)}: {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")
                          and f"{node.module}.{alias.name}" not in modules]
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def test_only_the_package_faces_re_export():
    """A module's ``__all__`` names what it defines; only a package's ``__init__`` (and an alias) lists
    names it imports, so each function has one address."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" or module_name(path) in ALIASES:
            continue
        tree = ast.parse(path.read_text())
        defined, imported = _top_level_names(tree)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                names = [element.value for element in ast.walk(node.value) if isinstance(element, ast.Constant)]
                found += [f"{module_name(path)}: {name}" for name in names if name in imported and name not in defined]
    assert not found, "names re-exported outside the package faces:\n" + "\n".join(found)


def test_the_documented_analyse_run_path_warns_and_gives_the_same_function():
    """``trainmon.anomaly.analyse.analyse_run`` (documented before the re-rooming) still works for one release."""
    from trainmon.anomaly.merge import analyse_run

    sys.modules.pop("trainmon.anomaly.analyse", None)
    with pytest.warns(DeprecationWarning, match="trainmon.anomaly.merge"):
        alias = importlib.import_module("trainmon.anomaly.analyse")
    assert alias.analyse_run is analyse_run
