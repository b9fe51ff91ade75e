"""Module activations and the gradients w.r.t. them, through public module hooks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.hooks import HookRegistry

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import ActivationsConfig

def named_tensors(value: Any, prefix: str, tensor_type: type = torch.Tensor) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor in ``value``: a tensor keeps ``prefix``,
    the i-th tensor of a tuple/list gets ``prefix.i``, a dict entry ``prefix.key``;
    None entries (gradients that were not computed) are skipped."""
    if isinstance(value, tensor_type):
        yield prefix, value
        return
    found: list[tuple[str, Any]] = []
    _flatten(value, found, tensor_type)
    if len(found) == 1 and isinstance(value, (tuple, list)):
        yield prefix, found[0][1]
        return
    for i, (key, tensor) in enumerate(found):
        yield f"{prefix}.{key or i}", tensor


def _flatten(value: Any, out: list[tuple[str, Any]], tensor_type: type, key: str = "") -> None:
    if isinstance(value, tensor_type):
        out.append((key, value))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _flatten(item, out, tensor_type, key)
    elif isinstance(value, dict):
        for name, item in value.items():
            _flatten(item, out, tensor_type, f"{key}.{name}" if key else str(name))


class ActivationCollector:
    """Forward inputs/outputs (family ``actv``) and their gradients (``actv_grad``).

    Hooks are registered by :meth:`arm` for collected steps only and removed by :meth:`disarm`,
    so an uncollected step runs the model without any hook of ours. A tensor that is both
    one module's output and the next module's input is measured once (see StepContext.record).

    Args:
        ctx: the monitor's step context.
        modules: ``(name, module, vpp_stage)`` of the target modules (or MindSpore cells).
        config: the ``activations`` section.
        registry: where the hook handles live.
        tensor_type: the framework's tensor class.
        backward_hook: the module method that registers a backward hook
            ``(module, grad_input, grad_output)`` and returns a removable handle.

    Subclasses (the Megatron collector) reuse :meth:`forward_hook` and the ``HOOK_GROUP`` of handles.
    """

    HOOK_GROUP = "activations"

    def __init__(self, ctx: StepContext, modules: Sequence[tuple[str, Any, int]], config: ActivationsConfig,
                 registry: HookRegistry, *, tensor_type: type = torch.Tensor,
                 backward_hook: str = "register_full_backward_hook") -> None:
        self.ctx = ctx
        self.modules = list(modules)
        self.config = config
        self.registry = registry
        self.tensor_type = tensor_type
        self.backward_hook = backward_hook

    def arm(self) -> None:
        if self.registry.count(self.HOOK_GROUP):
            return
        for name, module, vpp_stage in self.modules:
            if self.config.forward and "actv" in self.ctx.specs:
                handle = module.register_forward_hook(self.forward_hook(name, vpp_stage), with_kwargs=True)
                self.registry.add(self.HOOK_GROUP, handle)
            if self.config.backward and "actv_grad" in self.ctx.specs:
                handle = getattr(module, self.backward_hook)(self._backward_hook(name, vpp_stage))
                self.registry.add(self.HOOK_GROUP, handle)

    def disarm(self) -> None:
        self.registry.remove(self.HOOK_GROUP)

    def before_transfer(self) -> None:
        pass

    def close(self) -> None:
        self.disarm()

    def forward_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        """The hook ``(module, args, kwargs, output)`` that records the ``actv`` rows of module ``name``."""
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if not self.ctx.collecting:
                return
            if self.config.inputs:
                for row, tensor in named_tensors(args, f"{name}.input", self.tensor_type):
                    self.ctx.record("actv", row, tensor, vpp_stage)
                for row, tensor in named_tensors(kwargs, f"{name}.input", self.tensor_type):
                    self.ctx.record("actv", row, tensor, vpp_stage)
            for row, tensor in named_tensors(output, f"{name}.output", self.tensor_type):
                self.ctx.record("actv", row, tensor, vpp_stage)

        return hook

    def _backward_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        def hook(module: Any, grad_input: tuple, grad_output: tuple) -> None:
            if not self.ctx.collecting:
                return
            for row, tensor in named_tensors(grad_output, f"{name}.output_grad", self.tensor_type):
                self.ctx.record("actv_grad", row, tensor, vpp_stage)
            if self.config.inputs:
                for row, tensor in named_tensors(grad_input, f"{name}.input_grad", self.tensor_type):
                    self.ctx.record("actv_grad", row, tensor, vpp_stage)

        return hook
