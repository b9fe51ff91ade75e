"""The configuration reference (docs/config.md), generated from the config dataclasses' docstrings.

Regenerate with ``python -m trainmon.config > docs/config.md``; a test keeps the file current.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import typing

from trainmon import config as config_module
from trainmon.config import MonitorConfig, type_name


def config_reference() -> str:
    """Markdown reference of every section and field, generated from the docstrings."""
    lines = ["# Configuration reference", "", "Generated from `trainmon/config.py` "
             "(`python -m trainmon.config > docs/config.md`). Every key is optional.", ""]
    source = inspect.getsource(config_module)
    tree = ast.parse(source)
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, item in enumerate(body):
                if isinstance(item, ast.AnnAssign) and i + 1 < len(body):
                    nxt = body[i + 1]
                    if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                        docs[(node.name, item.target.id)] = str(nxt.value.value)  # type: ignore[union-attr]

    def section(cls: type, prefix: str) -> None:
        lines.append(f"## `{prefix or 'top level'}`")
        lines.append("")
        lines.append((cls.__doc__ or "").strip())
        lines.append("")
        lines.append("| key | type | default | meaning |")
        lines.append("|---|---|---|---|")
        nested = []
        hints = typing.get_type_hints(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                nested.append((hints[f.name], f"{prefix}.{f.name}" if prefix else f.name))
                continue
            value = json.dumps(getattr(default, f.name))
            cells = [f"`{f.name}`", f"`{type_name(hints[f.name])}`", f"`{value}`", docs.get((cls.__name__, f.name), "")]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")  # GFM table cells
        lines.append("")
        for sub, path in nested:
            section(sub, path)

    section(MonitorConfig, "")
    return "\n".join(lines)
