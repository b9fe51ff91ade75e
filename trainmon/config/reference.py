"""A configuration reference in Markdown, generated from a config dataclass and its fields' docstrings.

``docs/config.md`` is ``trainmon.config.config_reference()`` (``python -m trainmon.config > docs/config.md``);
a test keeps the file current. Generic over the sections: it reads nothing but the dataclasses and their source.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from pathlib import Path

from trainmon.base.schema import type_name


def field_docs(cls: type) -> dict[str, str]:
    """``field -> docstring``: the string literal right after each annotated field in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for item, after in zip(body, body[1:]):
        if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[item.target.id] = after.value.value
    return docs


def reference(root: type, command: str) -> str:
    """Markdown reference of every section (nested dataclass) and field of ``root``.

    Args:
        root: the top-level config dataclass; every field must have a default.
        command: the command that regenerates the file (named in its header).
    """
    source = Path(inspect.getfile(root)).resolve().relative_to(Path(__file__).resolve().parents[2])
    lines = ["# Configuration reference", "", f"Generated from `{source.as_posix()}` (`{command}`). "
             "Every key is optional.", ""]
    sections: list[tuple[type, str]] = [(root, "")]
    while sections:
        cls, prefix = sections.pop(0)
        lines += _section(cls, prefix, sections)
    return "\n".join(lines)


def _section(cls: type, prefix: str, nested: list[tuple[type, str]]) -> list[str]:
    """The lines of one section's table; its nested sections are appended to ``nested``, in field order."""
    lines = [f"## `{prefix or 'top level'}`", "", (cls.__doc__ or "").strip(), "",
             "| key | type | default | meaning |", "|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    inner = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            inner.append((hints[f.name], f"{prefix}.{f.name}" if prefix else f.name))
            continue
        cells = [f"`{f.name}`", f"`{type_name(hints[f.name])}`", f"`{json.dumps(getattr(default, f.name))}`",
                 " ".join(docs.get(f.name, "").split())]  # a docstring's lines, one table row
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # GFM table cells
    nested[:0] = inner  # depth first, as the sections nest
    return [*lines, ""]
