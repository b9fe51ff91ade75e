"""The training loss where a trainer does not hand it to callbacks: read from the model's outputs."""

from __future__ import annotations

from typing import Any

import torch


def output_loss(output: Any) -> torch.Tensor | None:
    """The ``loss`` of a model output (a ``ModelOutput``, a dict, or an object with ``.loss``), if any."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class LossTracker:
    """Sums the ``loss`` of each training forward of ``model`` on the device; :meth:`take` gives their mean.

    A forward hook with a removable handle; only host-free device arithmetic.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = output_loss(output)
        if loss is not None:
            value = loss.detach().float().reshape(())
            self._sum = value if self._sum is None else self._sum + value
            self._count += 1

    def take(self) -> torch.Tensor | None:
        """The mean loss of the forwards since the last call (None if none had a loss); resets."""
        total, count = self._sum, self._count
        self._sum, self._count = None, 0
        return None if total is None else total / count

    def remove(self) -> None:
        self._handle.remove()
