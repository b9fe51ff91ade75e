"""Installing and removing the wrappers that :class:`~trainmon.collect.comm.CommCollector` puts on the functions of
``torch.distributed`` (and the same names in ``torch.distributed.distributed_c10d``, which its own helpers call).

:func:`install` puts one wrapper per function object on every module that holds it; :func:`restore` puts the
originals back, or, where another trainmon collector wrapped ours (a config reload attaches the new collectors
before closing the old ones), splices ours out of the chain. Where foreign code wrapped ours, its wrapper is left in
place (not clobbered) and ours underneath only calls through. The wrappers themselves (what a call measures) are
the collector's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MODULES: tuple[ModuleType, ...] = (dist, c10d)
"""The modules whose functions are wrapped."""


@dataclass
class Wrap:
    """One installed wrapper. The wrapper calls ``original`` through this object, so a later
    trainmon wrapper's ``original`` can be re-pointed when an earlier one is removed."""

    name: str
    original: Callable[..., Any]
    modules: list[ModuleType]
    wrapper: Callable[..., Any] = lambda *a, **k: None


def install(names: list[str], wrap_of: Callable[[str, Callable[..., Any]], Wrap], into: list[Wrap]) -> None:
    """Replace the functions ``names`` of :data:`MODULES` by their wrappers (``wrap_of(name, original)``, one per
    function object), each :class:`Wrap` appended to ``into`` as it is installed."""
    for name in names:
        by_function: dict[int, Wrap] = {}  # torch.distributed and c10d share the function objects
        for module in MODULES:
            current = getattr(module, name, None)
            if current is None:
                continue
            wrap = by_function.get(id(current))
            if wrap is None:
                wrap = by_function[id(current)] = wrap_of(name, current)
                into.append(wrap)
            wrap.modules.append(module)
            setattr(module, name, wrap.wrapper)


def restore(wraps: list[Wrap]) -> list[tuple[ModuleType, str]]:
    """Put back the originals of ``wraps`` (see the module); returns ``(module, name)`` of each function left
    wrapped by foreign code, whose wrapper stays over ours."""
    left: list[tuple[ModuleType, str]] = []
    for wrap in wraps:
        for module in wrap.modules:
            if getattr(module, wrap.name, None) is wrap.wrapper:
                setattr(module, wrap.name, wrap.original)
            elif not splice(getattr(module, wrap.name, None), wrap):
                left.append((module, wrap.name))
    return left


def splice(top: Any, wrap: Wrap) -> bool:
    """Remove ``wrap`` from a chain of trainmon wrappers starting at ``top``; False when a foreign
    wrapper is in the way (or ``wrap`` is not in the chain)."""
    node = getattr(top, "_trainmon_wrap", None)
    while node is not None and node is not wrap:  # `is wrap`: a foreign functools.wraps copy of ours
        if node.original is wrap.wrapper:
            node.original = node.wrapper.__wrapped__ = wrap.original
            return True
        if node.original is wrap.original:
            return True  # already spliced through the other module that shares the wrapper
        node = getattr(node.original, "_trainmon_wrap", None)
    return False


__all__ = ["MODULES", "Wrap", "install", "restore", "splice"]
