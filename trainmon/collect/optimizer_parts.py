"""Where a torch optimizer keeps its parameters' states and settings: itself, the inner optimizers of a container
(torchtitan's ``OptimizersContainer``), or the local optimizer of a ``ZeroRedundancyOptimizer``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainmon.errors import UnsupportedSetupError


class OptimizerContainerError(UnsupportedSetupError):
    """An optimizer made of inner optimizers that do not hold all of its parameters (refused at ``attach``)."""


def optimizer_parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that hold the states and settings (``lr``, betas) of ``optimizer``'s parameters.

    ``optimizer`` itself, or the inner optimizers of a container: a ``torch.optim.Optimizer`` subclass
    that keeps one optimizer per model part in ``optimizers`` and steps each in its ``step()``
    (torchtitan's ``OptimizersContainer``, whose own ``param_groups`` has every parameter in one group
    without settings, and whose own ``state`` stays empty). Step hooks still go on the container:
    its pre-hook runs before any inner step, its post-hook after the last.

    Raises:
        OptimizerContainerError: a parameter of the container is in none of its inner optimizers.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> plain = torch.optim.SGD(layer.parameters(), lr=0.1)
        >>> optimizer_parts(plain) == [plain]
        True
    """
    inner = getattr(optimizer, "optimizers", None)
    if not (isinstance(inner, (list, tuple)) and inner
            and all(isinstance(part, torch.optim.Optimizer) and part is not optimizer for part in inner)):
        return [optimizer]
    held = {id(p) for part in inner for group in part.param_groups for p in group["params"]}
    missing = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in held]
    if missing:
        raise OptimizerContainerError(
            f"{type(optimizer).__name__} keeps {len(inner)} optimizers in .optimizers, but {len(missing)} of its "
            f"parameters (shape {tuple(missing[0].shape)}, ...) are in none of them: trainmon reads each parameter's "
            "state and learning rate from the inner optimizer that steps it. Pass attach() an optimizer whose "
            ".optimizers hold every parameter, or a plain torch optimizer")
    return list(inner)


def param_groups_of(parts: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Every parameter group of :func:`optimizer_parts`, in order (``lr/group{i}`` counts through them)."""
    return [group for part in parts for group in part.param_groups]


def states_of(parts: Sequence[torch.optim.Optimizer]) -> dict[int, tuple[dict[str, Any] | None, dict[str, Any]]]:
    """``id(param) -> (its optimizer state or None before the first step, its parameter group)``.

    A ``ZeroRedundancyOptimizer`` keeps the states of this rank's partition in its local optimizer (``.optim``):
    those parameters are found there; the others' states live on the rank that owns them, which writes their
    rows (so each rank writes the optimizer-state rows of the parameters it owns).
    """
    holders = [state_holder(part) for part in parts]
    return {id(p): (holder.state.get(p), group)
            for holder in holders for group in holder.param_groups for p in group["params"]}


def state_holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` holds ``optimizer``'s moments: itself, or the local optimizer of a
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` (its own ``state`` stays empty).

    Example:
        >>> plain = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        >>> state_holder(plain) is plain
        True
    """
    local = getattr(optimizer, "optim", None)
    if isinstance(local, torch.optim.Optimizer) and type(optimizer).__name__ == "ZeroRedundancyOptimizer" \
            and type(optimizer).__module__.startswith("torch.distributed.optim"):
        return local
    return optimizer


def other_update_rule(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps Adam's ``exp_avg`` and ``exp_avg_sq`` but does not step by Adam's
    ``m_hat / (sqrt(v_hat) + eps)``: torch's ``NAdam`` (Nesterov momentum with its own schedule) and ``RAdam``
    (rectified; SGD with momentum in the first steps). Their ``update``, ``ratio`` and ``precursors`` would be Adam's
    arithmetic on their moments, not the step they took (up to 36x it in a test), so none are written.

    Example:
        >>> params = [torch.nn.Parameter(torch.ones(1))]
        >>> other_update_rule(torch.optim.NAdam(params)), other_update_rule(torch.optim.AdamW(params))
        (True, False)
    """
    return isinstance(state_holder(optimizer), (torch.optim.NAdam, torch.optim.RAdam))


def other_rule_groups(parts: Sequence[torch.optim.Optimizer]) -> frozenset[int]:
    """``id`` of every parameter group (as :func:`states_of` gives them) of an optimizer of
    :func:`other_update_rule`."""
    return frozenset(id(group) for part in parts if other_update_rule(part)
                     for group in state_holder(part).param_groups)


def kept_states(parts: Sequence[torch.optim.Optimizer]) -> str:
    """The optimizers' class names and the state keys they keep, for a warning (host-side, no tensor read).

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> adagrad = torch.optim.Adagrad(layer.parameters())
        >>> kept_states([adagrad])
        'Adagrad (its state: step, sum)'
    """
    described = []
    for part in parts:
        holder = state_holder(part)
        keys = sorted({key for state in holder.state.values() for key in state})
        described.append(f"{type(part).__name__} ({'its state: ' + ', '.join(keys) if keys else 'no state'})")
    return ", ".join(dict.fromkeys(described))


__all__ = ["OptimizerContainerError", "kept_states", "optimizer_parts", "other_rule_groups", "other_update_rule",
           "param_groups_of", "state_holder", "states_of"]
