"""msprobe's names in trainmon's terms (framework-free): its squashed module and parameter names
(:func:`squash_name`), the trainmon ``targets`` patterns of its ``targets`` keys
(:func:`module_pattern`, :func:`param_pattern`) and the trainmon row of its target specs
(:func:`trainmon_row_name`). :mod:`trainmon.config.msprobe` translates a whole config with them.
"""

from __future__ import annotations

import re

from trainmon.base.records import activation_row
from trainmon.base.targets import OPTIONAL, labelled

TARGET_SPEC = re.compile(r"tensor|tuple\[(\d+)\](?::(\d+))?")
"""msprobe's spec of a target's tensor: ``"tensor"`` or ``"tuple[n]:i"`` (element ``i`` of an ``n``-tuple)."""

_SQUASH_HEADS = (r"layers?\.", r"embeddings?\.")
_SQUASH_TAILS = ("final", "output", "norm")


def squash_name(name: str) -> str:
    """msprobe's squashed name of a module or parameter (``squash_param_name`` in
    ``module_metric.py``, used while ``squash_name`` is true): the text after the first
    ``layer.``/``layers.``, else after the first ``embedding.``/``embeddings.``, else from the first
    ``final``, ``output`` or ``norm`` on, else the name itself.

    Example:
        >>> squash_name("model.layers.3.mlp.fc1.weight"), squash_name("decoder.final_norm.weight")
        ('3.mlp.fc1.weight', 'final_norm.weight')
    """
    for head in _SQUASH_HEADS:
        match = re.search(head + "(.*)", name, re.DOTALL)
        if match:
            return match.group(1)
    for tail in _SQUASH_TAILS:
        index = name.find(tail)
        if index >= 0:
            return name[index:]
    return name


def _squashed_regexes(key: str, whole: bool) -> list[str]:
    """Regexes (to be anchored with ``^``) of the names whose :func:`squash_name` equals ``key``
    (``whole``) or starts with it; the plain name itself is matched separately."""
    end = "$" if whole else ""
    escaped = re.escape(key)
    found: list[str] = []
    excluded = ""
    for head in _SQUASH_HEADS:
        found.append(f"{excluded}(?:(?!{head}).)*{head}{escaped}{end}")
        excluded += f"(?!.*{head})"
    for tail in _SQUASH_TAILS:
        if key.startswith(tail):
            found.append(f"{excluded}(?:(?!{tail}).)*{escaped}{end}")
        elif not whole and tail.startswith(key):
            found.append(f"{excluded}(?:(?!{tail}).)*{tail}")
        excluded += f"(?!.*{tail})"
    return found


def module_pattern(key: str, squash: bool = True, written: str | None = None) -> str:
    """The trainmon ``targets.modules`` pattern of a msprobe ``targets`` key (chunk prefix removed):
    the module named ``key``, or whose squashed name is ``key``. May match nothing. Messages show it as
    ``written`` (the key as in the file; default ``key``)."""
    alternatives = [re.escape(key) + "$"] + (_squashed_regexes(key, whole=True) if squash else [])
    return OPTIONAL + labelled(f"(?s)^(?:{'|'.join(alternatives)})", key if written is None else written)


def param_pattern(key: str, squash: bool, written: str | None = None) -> str:
    """The trainmon ``targets.params`` pattern of a msprobe ``targets`` key (chunk prefix removed):
    parameters whose name (or, with ``squash``, squashed name) starts with ``key``; shown as ``written``."""
    alternatives = [re.escape(key)] + (_squashed_regexes(key, whole=False) if squash else [])
    return OPTIONAL + labelled(f"(?s)^(?:{'|'.join(alternatives)})", key if written is None else written)


def trainmon_row_name(module: str, kind: str, spec: str | None = None) -> str:
    """The trainmon row of msprobe's ``kind`` (``input``, ``output``, ``input_grad``,
    ``output_grad``) of ``module`` under the target spec ``spec`` (``"tensor"``, ``"tuple[n]:i"``).

    msprobe 1.2.1 measures one tensor: the spec's element ``i`` of a tuple (element 0 by
    default). trainmon measures every tensor: ``{module}.{kind}`` for a lone tensor,
    ``{module}.{kind}.{i}`` for the i-th tensor of a tuple holding several.

    Example:
        >>> trainmon_row_name("layers.0", "input", "tuple[2]:1"), trainmon_row_name("layers.0", "output", "tensor")
        ('layers.0.input.1', 'layers.0.output')
    """
    match = TARGET_SPEC.fullmatch(spec or "tensor")
    if match is None or match.group(1) is None or int(match.group(1)) <= 1:
        return activation_row(module, kind)
    return activation_row(module, kind, int(match.group(2) or 0))
