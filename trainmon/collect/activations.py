"""Module activations and the gradients w.r.t. them, through public module hooks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.hooks import HookRegistry

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import ActivationsConfig

_GROUP = "activations"


def named_tensors(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in ``value``: a tensor keeps ``prefix``,
    the i-th tensor of a tuple/list gets ``prefix.i``, a dict entry ``prefix.key``."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
        return
    found: list[tuple[str, torch.Tensor]] = []
    _flatten(value, found)
    if len(found) == 1 and isinstance(value, (tuple, list)):
        yield prefix, found[0][1]
        return
    for i, (key, tensor) in enumerate(found):
        yield f"{prefix}.{key or i}", tensor


def _flatten(value: Any, out: list[tuple[str, torch.Tensor]], key: str = "") -> None:
    if isinstance(value, torch.Tensor):
        out.append((key, value))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _flatten(item, out, key)
    elif isinstance(value, dict):
        for name, item in value.items():
            _flatten(item, out, f"{key}.{name}" if key else str(name))


class ActivationCollector:
    """Forward inputs/outputs (family ``actv``) and their gradients (``actv_grad``).

    Hooks are registered by :meth:`arm` for collected steps only and removed by :meth:`disarm`,
    so an uncollected step runs the model without any hook of ours. A tensor that is both
    one module's output and the next module's input is measured once (see StepContext.record).

    Args:
        ctx: the monitor's step context.
        modules: ``(name, module, vpp_stage)`` of the target modules.
        config: the ``activations`` section.
        registry: where the hook handles live.
    """

    def __init__(self, ctx: StepContext, modules: Sequence[tuple[str, torch.nn.Module, int]],
                 config: ActivationsConfig, registry: HookRegistry) -> None:
        self.ctx = ctx
        self.modules = list(modules)
        self.config = config
        self.registry = registry

    def arm(self) -> None:
        if self.registry.count(_GROUP):
            return
        for name, module, vpp_stage in self.modules:
            if self.config.forward and "actv" in self.ctx.specs:
                handle = module.register_forward_hook(self._forward_hook(name, vpp_stage), with_kwargs=True)
                self.registry.add(_GROUP, handle)
            if self.config.backward and "actv_grad" in self.ctx.specs:
                handle = module.register_full_backward_hook(self._backward_hook(name, vpp_stage))
                self.registry.add(_GROUP, handle)

    def disarm(self) -> None:
        self.registry.remove(_GROUP)

    def before_transfer(self) -> None:
        pass

    def close(self) -> None:
        self.disarm()

    def _forward_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self.ctx.collecting:
                return
            if self.config.inputs:
                for row, tensor in named_tensors(args, f"{name}.input"):
                    self.ctx.record("actv", row, tensor, vpp_stage)
                for row, tensor in named_tensors(kwargs, f"{name}.input"):
                    self.ctx.record("actv", row, tensor, vpp_stage)
            for row, tensor in named_tensors(output, f"{name}.output"):
                self.ctx.record("actv", row, tensor, vpp_stage)

        return hook

    def _backward_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        def hook(module: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            if not self.ctx.collecting:
                return
            for row, tensor in named_tensors(grad_output, f"{name}.output_grad"):
                self.ctx.record("actv_grad", row, tensor, vpp_stage)
            if self.config.inputs:
                for row, tensor in named_tensors(grad_input, f"{name}.input_grad"):
                    self.ctx.record("actv_grad", row, tensor, vpp_stage)

        return hook
