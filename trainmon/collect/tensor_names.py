"""The one naming rule of activation rows (framework-neutral): a value's tensors by their path in it.

:func:`named_tensors` names every tensor of a (nested) tuple, list or dict after its path (``prefix.1.0``,
``prefix.position_embeddings.1``), :func:`tensor_paths` gives the paths alone, :func:`flatten_into` walks a value,
and :func:`is_activation` says which tensors are activations (the others get no row and do not count when naming).
Used by the activation collector (:mod:`trainmon.collect.activations`), ``module_struct.json``, the non-finite
localiser, the step model and DeepSpeed's pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def is_activation(tensor: Any) -> bool:
    """Whether a tensor is measured as an activation: floating point (or complex), and not a scalar that no
    gradient flows through.

    Token ids, positions, masks (integer and bool tensors) and counts or scales passed along as 0-d tensors
    (HF's ``num_items_in_batch``, a float 0-d tensor handed to every block) are inputs, not activations:
    they get no row and do not count when naming the other tensors of a value. A 0-d output that requires
    grad (a loss) is an activation.
    """
    return bool((tensor.is_floating_point() or tensor.is_complex()) and (tensor.dim() > 0 or tensor.requires_grad))


def named_tensors(value: Any, prefix: str, tensor_type: type = torch.Tensor, *,
                  none_holds_position: bool = False, keep: Callable[[Any], bool] | None = None
                  ) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor in ``value``: the one naming rule of activation rows.

    A row's name is ``prefix`` followed by the path of the tensor in ``value``: the position in a
    tuple or list, the key in a dict (an HF ``ModelOutput`` too), one ``.`` per level
    (``prefix.1.0``, ``prefix.position_embeddings.1``). A tuple or list that holds exactly one tensor
    (at any depth; None and other entries do not count) is named ``prefix`` alone, so ``(out, None)``
    and ``(x,)`` are ``prefix``. Gradient rows are named by applying this rule to the *forward* value,
    so a tensor and its gradient always have the same name (``.output`` / ``.output_grad``).

    Args:
        value: a tensor, or a (nested) tuple, list or dict of them.
        prefix: the row name of the value.
        tensor_type: the framework's tensor class.
        none_holds_position: for gradient tuples of a module backward hook (one entry per top-level
            tensor): a None entry (no gradient) is not yielded but counts as an entry.
        keep: tensors for which it is False are treated like non-tensor entries (e.g. :func:`is_activation`).

    Example:
        >>> x = torch.ones(1)
        >>> [n for n, _ in named_tensors((x, None), "fc.output")], [n for n, _ in named_tensors((x, [x, x]), "f.input")]
        (['fc.output'], ['f.input.0', 'f.input.1.0', 'f.input.1.1'])
        >>> [n for n, _ in named_tensors({"pos": (x, x)}, "attn.input")]
        ['attn.input.pos.0', 'attn.input.pos.1']
    """
    for path, tensor in tensor_paths(value, tensor_type, keep, none_holds_position):
        if tensor is not None:
            yield (f"{prefix}.{path}" if path else prefix), tensor


def tensor_paths(value: Any, tensor_type: type = torch.Tensor, keep: Callable[[Any], bool] | None = None,
                 keep_none: bool = False) -> list[tuple[str, Any]]:
    """``(path, tensor)`` of every tensor in ``value`` as :func:`named_tensors` names them (``""``: the prefix
    alone); with ``keep_none``, None entries too."""
    if isinstance(value, tensor_type):
        return [("", value)] if keep is None or keep(value) else []
    found: list[tuple[str, Any]] = []
    flatten_into(value, found, tensor_type, keep, keep_none, "")
    if len(found) == 1 and isinstance(value, (tuple, list)):
        return [("", found[0][1])]
    return found


def flatten_into(value: Any, out: list[tuple[str, Any]], tensor_type: type, keep: Callable[[Any], bool] | None,
                 keep_none: bool, path: str) -> None:
    """Append ``(path, tensor)`` of every tensor in ``value`` to ``out``, its path under ``path`` (one ``.`` per
    level; None entries too with ``keep_none``), without :func:`tensor_paths`' naming of a lone tensor."""
    if isinstance(value, tensor_type):
        if keep is None or keep(value):
            out.append((path, value))
    elif value is None:
        if keep_none:
            out.append((path, None))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            flatten_into(item, out, tensor_type, keep, keep_none, f"{path}.{i}" if path else str(i))
    elif isinstance(value, dict):
        for name, item in value.items():
            flatten_into(item, out, tensor_type, keep, keep_none, f"{path}.{name}" if path else str(name))


__all__ = ["flatten_into", "is_activation", "named_tensors", "tensor_paths"]
