"""Module activations and the gradients w.r.t. them, through public module hooks."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.context import in_backward
from trainmon.collect.hooks import (
    BackwardHook,
    ForwardHook,
    ForwardPreHook,
    HookedCollector,
    HookRegistry,
    QuietOutputOnlyBackward,
    TensorHook,
)
from trainmon.records import activation_row

logger = logging.getLogger("trainmon")

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import ActivationsConfig


def named_tensors(value: Any, prefix: str, tensor_type: type = torch.Tensor, *,
                  none_holds_position: bool = False) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor in ``value``.

    A tensor keeps ``prefix``, the i-th tensor of a tuple/list gets ``prefix.i`` (no suffix when
    it holds exactly one), a dict entry ``prefix.key``. Non-tensor entries are skipped.

    Args:
        value: a tensor, or a (nested) tuple, list or dict of them.
        prefix: the row name of the value.
        tensor_type: the framework's tensor class.
        none_holds_position: for gradient tuples (one entry per output/input tensor): a None
            entry (a gradient that was not computed) is not yielded but keeps its index, so the
            gradient of the second output of ``(a, b)`` is ``prefix.1`` even when ``a`` has none.

    Example:
        >>> list(named_tensors((None, torch.ones(1)), "fc.output_grad", none_holds_position=True))
        [('fc.output_grad.1', tensor([1.]))]
    """
    if isinstance(value, tensor_type):
        yield prefix, value
        return
    found: list[tuple[str, Any]] = []
    _flatten(value, found, tensor_type, none_holds_position)
    if len(found) == 1 and isinstance(value, (tuple, list)):
        if found[0][1] is not None:
            yield prefix, found[0][1]
        return
    for i, (key, tensor) in enumerate(found):
        if tensor is not None:
            yield f"{prefix}.{key or i}", tensor


def _flatten(value: Any, out: list[tuple[str, Any]], tensor_type: type, keep_none: bool, key: str = "") -> None:
    if isinstance(value, tensor_type) or (keep_none and value is None):
        out.append((key, value))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _flatten(item, out, tensor_type, keep_none, key)
    elif isinstance(value, dict):
        for name, item in value.items():
            _flatten(item, out, tensor_type, keep_none, f"{key}.{name}" if key else str(name))


class ActivationCollector(HookedCollector):
    """Forward inputs/outputs (family ``actv``) and their gradients (``actv_grad``).

    Hooks are registered by :meth:`arm` for collected steps only and removed by :meth:`disarm`,
    so an uncollected step runs the model without any hook of ours. A tensor that is both
    one module's output and the next module's input is measured once (see StepContext.record).

    Gradients come from full module backward hooks (``grad_hooks: module``) or from hooks on
    the module's tensors (``grad_hooks: tensor``): a forward pre-hook hooks the input tensors
    (before the module may modify them in place), the forward hook the output tensors. Those
    tensor hooks go on non-leaf tensors only, so they die with the autograd graph; their
    handles are also removed at the end of the step and on :meth:`disarm`.

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
    TENSOR_HOOK_GROUP = "activation_tensors"
    HOOK_GROUPS = (HOOK_GROUP, TENSOR_HOOK_GROUP)
    PART = "activations"

    def __init__(self, ctx: StepContext, modules: Sequence[tuple[str, Any, int]], config: ActivationsConfig,
                 registry: HookRegistry, *, tensor_type: type = torch.Tensor,
                 backward_hook: str = "register_full_backward_hook") -> None:
        super().__init__(ctx, registry)
        self.modules = list(modules)
        self.config = config
        self.tensor_type = tensor_type
        self.backward_hook = backward_hook
        self.grad_hooks = config.grad_hooks if tensor_type is torch.Tensor else "module"
        self._quiet = QuietOutputOnlyBackward()
        ctx.grouped.limit_bytes = int(config.group_mb * 2**20)

    def install_hooks(self) -> None:
        forward = self.config.forward and "actv" in self.ctx.specs
        backward = self.config.backward and "actv_grad" in self.ctx.specs
        if backward and self.grad_hooks == "module" and self.tensor_type is torch.Tensor:
            self._avoid_in_place_targets()
        for name, module, vpp_stage in self.modules:
            if forward:
                handle = module.register_forward_hook(self.guarded(self.forward_hook(name, vpp_stage)),
                                                      with_kwargs=True)
                self.registry.add(self.HOOK_GROUP, handle)
            if backward and self.grad_hooks == "tensor":
                if self.config.inputs:
                    handle = module.register_forward_pre_hook(self.guarded(self._input_grad_hooks(name, vpp_stage)),
                                                              with_kwargs=True)
                    self.registry.add(self.HOOK_GROUP, handle)
                handle = module.register_forward_hook(self.guarded(self._output_grad_hooks(name, vpp_stage)),
                                                      with_kwargs=True)
                self.registry.add(self.HOOK_GROUP, handle)
            elif backward:
                handle = getattr(module, self.backward_hook)(self.guarded(self._backward_hook(name, vpp_stage)))
                self.registry.add(self.HOOK_GROUP, handle)
                if self.tensor_type is torch.Tensor:  # torch's "no inputs require gradients" warning
                    for quiet in self._quiet.hooks(module, handle, self.guarded):
                        self.registry.add(self.HOOK_GROUP, quiet)

    def _avoid_in_place_targets(self) -> None:
        """Switches to tensor hooks (with a warning) when a target module works in place.

        A full backward hook wraps the module's input in a view that torch forbids modifying in
        place, so ``nn.ReLU(inplace=True)`` as a target would raise in the user's forward. Only
        modules with an ``inplace`` attribute are detected here, not ``out += x`` in a forward.
        """
        in_place = [name for name, module, _ in self.modules if getattr(module, "inplace", False) is True]
        if in_place:
            logger.warning("trainmon: activations.grad_hooks: module cannot hook the in-place module(s) %s; "
                           "using grad_hooks: tensor (input_grad is then the gradient summed over all consumers)",
                           ", ".join(in_place[:3]) + (", ..." if len(in_place) > 3 else ""))
            self.grad_hooks = "tensor"

    def reset(self) -> None:
        self._quiet.reset()

    def before_transfer(self) -> None:
        # The step's backward passes are over: drop the handles of its tensor hooks.
        self.registry.remove(self.TENSOR_HOOK_GROUP)
        self._quiet.reset()

    def forward_hook(self, name: str, vpp_stage: int) -> ForwardHook:
        """The hook ``(module, args, kwargs, output)`` that records the ``actv`` rows of module ``name``."""
        input_row, output_row = activation_row(name, "input"), activation_row(name, "output")

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.ctx.collecting or in_backward():  # in a backward: activation checkpointing's re-run
                return
            if self.config.inputs:
                for row, tensor in named_tensors(args, input_row, self.tensor_type):
                    self.ctx.grouped.record("actv", row, tensor, vpp_stage)
                for row, tensor in named_tensors(kwargs, input_row, self.tensor_type):
                    self.ctx.grouped.record("actv", row, tensor, vpp_stage)
            for row, tensor in named_tensors(output, output_row, self.tensor_type):
                self.ctx.grouped.record("actv", row, tensor, vpp_stage)

        return hook

    def _backward_hook(self, name: str, vpp_stage: int) -> BackwardHook:
        input_row, output_row = activation_row(name, "input_grad"), activation_row(name, "output_grad")

        def hook(module: Any, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
            self._quiet.lift()  # torch has just warned (or not): our filter, if any, comes out at once
            if not self.ctx.collecting:
                return
            # One entry per output/input tensor, None where no gradient flowed: keep the positions
            # so that rows are named like the forward rows of the same tensors.
            for row, tensor in named_tensors(grad_output, output_row, self.tensor_type,
                                             none_holds_position=True):
                self.ctx.grouped.record("actv_grad", row, tensor, vpp_stage)
            if self.config.inputs:
                for row, tensor in named_tensors(grad_input, input_row, self.tensor_type,
                                                 none_holds_position=True):
                    self.ctx.grouped.record("actv_grad", row, tensor, vpp_stage)

        return hook

    def _input_grad_hooks(self, name: str, vpp_stage: int) -> ForwardPreHook:
        """Forward pre-hook ``(module, args, kwargs)``: before the module may modify its inputs in place."""
        row = activation_row(name, "input_grad")

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.ctx.collecting and torch.is_grad_enabled():
                self._hook_tensors(args, row, vpp_stage)
                self._hook_tensors(kwargs, row, vpp_stage)

        return hook

    def _output_grad_hooks(self, name: str, vpp_stage: int) -> ForwardHook:
        row = activation_row(name, "output_grad")

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self.ctx.collecting and torch.is_grad_enabled():
                self._hook_tensors(output, row, vpp_stage)

        return hook

    def _hook_tensors(self, value: Any, prefix: str, vpp_stage: int) -> None:
        """Puts a gradient hook on every tensor of ``value`` that is part of the autograd graph.

        Rows are named like the forward rows of the same tensors (a tensor without gradient
        keeps its index). Leaves (parameters, user inputs) are skipped: a hook on them would
        outlive the step's graph.
        """
        for row, tensor in named_tensors(value, prefix, self.tensor_type):
            if tensor.requires_grad and tensor.grad_fn is not None:
                handle = tensor.register_hook(self.guarded(self._tensor_grad_hook(row, vpp_stage)))
                self.registry.add(self.TENSOR_HOOK_GROUP, handle)

    def _tensor_grad_hook(self, row: str, vpp_stage: int) -> TensorHook:
        # The gradient of a tensor belongs to the micro-step of the forward that made it, also when a
        # pipeline schedule runs the backward of micro-batch k after forwards of later ones.
        micro_step = self.ctx.micro_step

        def hook(grad: torch.Tensor) -> None:
            if self.ctx.collecting:
                self.ctx.grouped.record("actv_grad", row, grad, vpp_stage, micro_step)

        return hook
