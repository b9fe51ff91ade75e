"""Host-side helpers of the anomaly actions: which modules an event implicates, and safe file names.

Framework-free (no torch import): the module tree is passed in as ``name -> parent name``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from trainmon.base.records import ACTIVATION_KINDS, split_activation_row, split_module_call

_NO_MODULE: frozenset[str] = frozenset({"scalars", "comm"})
"""Families whose rows name no module (the loss and other scalars, collectives)."""


def module_parents(model: Any) -> dict[str, str | None]:
    """``module name -> parent module name`` of a torch module tree (the root ``""`` maps to None).

    Works on anything with ``named_modules()``/``named_children()``; imports no framework.
    """
    names = {name for name, _ in model.named_modules()}
    parents: dict[str, str | None] = {"": None}
    for name, module in model.named_modules():
        for child_name, _ in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if full in names:
                parents.setdefault(full, name)
    return parents


def implicated_module(name: str, module_names: Collection[str], family: str | None = None) -> str | None:
    """The module a statistics row or anomaly event belongs to.

    Activation rows (``actv``/``actv_grad``) are named ``{module}.input``, ``{module}.output.1``,
    ``{module}.input_grad``, ...; every other family uses the full parameter name
    (``{module}.{param}``). A module that itself ends in ``.output`` (HF BERT's
    ``layer.0.output``) is resolved by reading the suffix from the right.

    Args:
        name: the row/event name.
        module_names: every module name of the model (the root ``""`` is never returned).
        family: the row family when known; None tries activation suffixes first.

    Returns:
        The module name, or None when no module matches (a scalar such as the loss, a
        collective, a parameter of the root module).

    Example:
        >>> implicated_module("layers.2.mlp.output", {"layers.2.mlp", "layers.2.mlp.fc1"})
        'layers.2.mlp'
        >>> implicated_module("layers.2.mlp.fc1.weight", {"layers.2.mlp", "layers.2.mlp.fc1"}, "grad_reduced")
        'layers.2.mlp.fc1'
    """
    if family in _NO_MODULE:
        return None
    if family is None or family in ACTIVATION_KINDS:
        kinds = ACTIVATION_KINDS.get(family or "", ()) or sum(ACTIVATION_KINDS.values(), ())
        rest = name
        while (split := split_activation_row(rest)) is not None:  # each kind in the name, from the right
            rest, kind, _ = split
            module = split_module_call(rest)[0]  # the k-th call's rows: {module}.call{k}.output
            if kind in kinds and module in module_names:
                return module
        if family is not None:
            return None
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix and prefix in module_names:
            return prefix
    return None


def neighbourhood(name: str, parent_of: Mapping[str, str | None], depth: int) -> list[str]:
    """``name`` plus its ancestors and descendants up to ``depth`` levels (never the root ``""``).

    Example:
        >>> tree = {"a": "", "a.b": "a", "a.b.c": "a.b", "a.b.c.d": "a.b.c"}
        >>> neighbourhood("a.b", tree, 1)
        ['a', 'a.b', 'a.b.c']
    """
    chosen = {name}
    current: str | None = name
    for _ in range(depth):
        current = parent_of.get(current) if current is not None else None
        if not current:
            break
        chosen.add(current)
    children: dict[str, list[str]] = {}
    for child, parent in parent_of.items():
        if parent is not None:
            children.setdefault(parent, []).append(child)
    frontier = [name]
    for _ in range(depth):
        frontier = [child for node in frontier for child in children.get(node, [])]
        chosen.update(frontier)
    order = list(parent_of)
    return sorted(chosen, key=lambda n: order.index(n) if n in parent_of else -1)


def modules_for_events(events: Iterable[Any], parent_of: Mapping[str, str | None], depth: int) -> list[str]:
    """Modules to act on for one step's anomaly events, given first-origin first.

    The first event that maps to a module wins (events of the loss or of the root's own
    parameters map to none and are skipped); its neighbourhood of ``depth`` levels is returned.

    Args:
        events: objects with ``name`` and (optionally) ``family`` attributes, e.g. ``AnomalyEvent``.
        parent_of: ``module name -> parent module name`` (see ``module_parents`` in the dump).
        depth: levels of parents and children to add.

    Returns:
        Module names, empty when no event implicates a module.
    """
    names = {n for n in parent_of if n}
    for event in events:
        module = implicated_module(str(getattr(event, "name", "")), names, getattr(event, "family", None))
        if module is not None:
            return neighbourhood(module, parent_of, depth)
    return []


def names_activation(event: Any) -> bool:
    """Whether an event is an activation row (``actv``/``actv_grad``): the module it names made the value."""
    return getattr(event, "family", None) in ACTIVATION_KINDS


def is_nonfinite_event(event: Any) -> bool:
    """Whether an anomaly event reports a non-finite value (the ``nonfinite`` detector, or a NaN/Inf value)."""
    if getattr(event, "detector", None) == "nonfinite":
        return True
    try:
        value = float(getattr(event, "value", 0.0))
    except (TypeError, ValueError):
        return False
    return not math.isfinite(value)


def describe_event(event: Any) -> str:
    """``loss``, ``backward weight gradient of layers.0.weight``: where an event was observed, in words."""
    from trainmon.anomaly.ordering import describe

    return describe(str(getattr(event, "family", "")), str(getattr(event, "name", "")),
                    str(getattr(event, "phase", "")))
