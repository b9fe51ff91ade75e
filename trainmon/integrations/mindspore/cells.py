"""Cell activations and the gradients w.r.t. them, through MindSpore's public cell hooks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainmon.collect.hooks import HookRegistry
from trainmon.integrations.mindspore.context import named_tensors, record

if TYPE_CHECKING:
    from mindspore import nn

    from trainmon.collect.context import StepContext
    from trainmon.config import ActivationsConfig

_GROUP = "activations"


class CellActivationCollector:
    """Forward inputs/outputs (``actv``) and their gradients (``actv_grad``) of target cells.

    The MindSpore twin of :class:`trainmon.collect.activations.ActivationCollector`, with the same
    row names: ``{cell}.input``/``.output`` from ``Cell.register_forward_hook`` (with kwargs) and
    ``{cell}.input_grad``/``.output_grad`` from ``Cell.register_backward_hook`` (PyNative mode).
    Hooks exist only during collected steps (:meth:`arm`/:meth:`disarm`).

    Args:
        ctx: the monitor's step context.
        cells: ``(name, cell, vpp_stage)`` of the target cells (names from ``cells_and_names()``).
        config: the ``activations`` section.
        registry: where the hook handles live.
    """

    def __init__(self, ctx: StepContext, cells: Sequence[tuple[str, nn.Cell, int]], config: ActivationsConfig,
                 registry: HookRegistry) -> None:
        self.ctx = ctx
        self.cells = list(cells)
        self.config = config
        self.registry = registry

    def arm(self) -> None:
        if self.registry.count(_GROUP):
            return
        for name, cell, vpp_stage in self.cells:
            if self.config.forward and "actv" in self.ctx.specs:
                handle = cell.register_forward_hook(self._forward_hook(name, vpp_stage), with_kwargs=True)
                self.registry.add(_GROUP, handle)
            if self.config.backward and "actv_grad" in self.ctx.specs:
                self.registry.add(_GROUP, cell.register_backward_hook(self._backward_hook(name, vpp_stage)))

    def disarm(self) -> None:
        self.registry.remove(_GROUP)

    def before_transfer(self) -> None:
        pass

    def close(self) -> None:
        self.disarm()

    def _forward_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        def hook(cell: nn.Cell, args: tuple, kwargs: dict, output: Any) -> None:
            ctx = self.ctx
            if not ctx.collecting:
                return
            if self.config.inputs:
                for row, tensor in named_tensors(args, f"{name}.input"):
                    record(ctx, "actv", row, tensor, vpp_stage)
                for row, tensor in named_tensors(kwargs, f"{name}.input"):
                    record(ctx, "actv", row, tensor, vpp_stage)
            for row, tensor in named_tensors(output, f"{name}.output"):
                record(ctx, "actv", row, tensor, vpp_stage)

        return hook

    def _backward_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        def hook(cell: nn.Cell, grad_input: Any, grad_output: Any) -> None:
            ctx = self.ctx
            if not ctx.collecting:
                return
            for row, tensor in named_tensors(grad_output, f"{name}.output_grad"):
                record(ctx, "actv_grad", row, tensor, vpp_stage)
            if self.config.inputs:
                for row, tensor in named_tensors(grad_input, f"{name}.input_grad"):
                    record(ctx, "actv_grad", row, tensor, vpp_stage)

        return hook
