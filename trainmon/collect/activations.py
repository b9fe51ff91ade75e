"""Module activations and the gradients w.r.t. them, through public module hooks (their rows named by
:mod:`trainmon.collect.tensor_names`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base.records import activation_row, module_call
from trainmon.collect.context import backward_pass, in_backward
from trainmon.collect.hooks import (
    BackwardHook,
    ForwardHook,
    ForwardPreHook,
    HookedCollector,
    HookRegistry,
    QuietOutputOnlyBackward,
    TensorHook,
)
from trainmon.collect.tensor_names import flatten_into, is_activation
from trainmon.collect.tensor_names import named_tensors as named_tensors  # also its address before the split

logger = logging.getLogger("trainmon")

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import ActivationsConfig


def is_root(name: str) -> bool:
    """Whether a target is the root module (``activations.root``). Its forward hook is put before the step
    lifecycle's hooks on it (``prepend``), which end the micro-step's forward: an evaluation forward's rows are
    then still suppressed, and its tensors are measured with the forward's others."""
    return not name


class ActivationCollector(HookedCollector):
    """Forward inputs/outputs (family ``actv``) and their gradients (``actv_grad``).

    Hooks are registered by :meth:`arm` for collected steps only and removed by :meth:`disarm`,
    so an uncollected step runs the model without any hook of ours. A tensor that is both
    one module's output and the next module's input is measured once (see StepContext.record).

    Rows are named by :func:`named_tensors` (gradients after their forward tensors) and by the call:
    the k-th call (k >= 1) of a module in one micro-step writes under ``{module}.call{k}``
    (:func:`trainmon.base.records.module_call`). Integer and bool tensors are not activations and tensors
    with no element get no row. A forward run again inside a backward pass (activation checkpointing)
    writes no forward rows; its calls are numbered per backward pass.

    Gradients (torch): ``output_grad`` from hooks on the output tensors that the forward hook puts
    on them, whatever the output's structure (a dict, an HF ``ModelOutput``). ``input_grad`` with
    ``grad_hooks: module``: a full backward hook makes torch route the gradient of the positional
    input tensors through one node per call, and a hook on that node, put on it by the forward hook,
    reads the gradient through this module only; with ``grad_hooks: tensor``: hooks on the input
    tensors (their total gradient), put on them by a forward pre-hook (before the module may modify
    them in place). Either way the call that made a tensor names its gradient row. Tensor and node
    hooks die with the autograd graph; their handles are also removed at the end of the step and on
    :meth:`disarm`. Other frameworks (MindSpore cells) use the module backward hook's tuples.

    Args:
        ctx: the monitor's step context.
        modules: ``(name, module, vpp_stage)`` of the target modules (or MindSpore cells).
        config: the ``activations`` section.
        registry: where the hook handles live.
        tensor_type: the framework's tensor class.
        backward_hook: the module method that registers a backward hook
            ``(module, grad_input, grad_output)`` and returns a removable handle.
        select: given ``modules``, those that may be hooked now (the torch integration leaves out
            modules inside ``torch.compile``'d code, with a warning); asked when hooks are installed
            and, with ``recheck_on``, before the first forward of each collected step. None: every module.
        recheck_on: the model given to ``attach``: its forward pre-hook asks ``select`` again and
            unhooks the modules it leaves out (compiled since), before their compiled code first runs:
            a module backward hook present when dynamo traces a ``fullgraph`` region is an error.

    Subclasses (the Megatron collector) reuse :meth:`next_call`, :meth:`record_forward`,
    :meth:`hook_tensors` and the ``HOOK_GROUP`` of handles.
    """

    HOOK_GROUP = "activations"
    TENSOR_HOOK_GROUP = "activation_tensors"
    HOOK_GROUPS = (HOOK_GROUP, TENSOR_HOOK_GROUP)
    PART = "activations"

    def __init__(self, ctx: StepContext, modules: Sequence[tuple[str, Any, int]], config: ActivationsConfig,
                 registry: HookRegistry, *, tensor_type: type = torch.Tensor,
                 backward_hook: str = "register_full_backward_hook",
                 select: Callable[[list[tuple[str, Any, int]]], list[tuple[str, Any, int]]] | None = None,
                 recheck_on: Any = None) -> None:
        super().__init__(ctx, registry)
        self.modules = list(modules)
        self.select = select
        self.recheck_on = recheck_on
        self._handles: dict[int, list[Any]] = {}
        """``id(module) -> its hook handles`` of the last :meth:`install_hooks` (also in the registry)."""
        self._checked: int | None = None
        """The step whose first forward :meth:`_recheck` saw."""
        self.config = config
        self.tensor_type = tensor_type
        self.backward_hook = backward_hook
        self.grad_hooks = config.grad_hooks if tensor_type is torch.Tensor else "module"
        self._quiet = QuietOutputOnlyBackward()
        self._calls: dict[tuple[str, int], int] = {}  # (module, vpp_stage) -> calls so far
        self._calls_at: tuple[int, int, int] = (-1, -1, -1)  # (step, micro_step, backward pass) they count in
        self._open: dict[tuple[str, int], list[int]] = {}  # calls between their pre-hook and their hook
        ctx.grouped.limit_bytes = int(config.group_mb * 2**20)

    def install_hooks(self) -> None:
        forward = self.config.forward and "actv" in self.ctx.specs
        backward = self.config.backward and "actv_grad" in self.ctx.specs
        if not (forward or backward):
            return
        if self.tensor_type is not torch.Tensor:
            self._install_cell_hooks(forward, backward)
            return
        input_grads = backward and self.config.inputs
        if input_grads and self.grad_hooks == "module":
            self._avoid_in_place_targets()
        modules = self.modules if self.select is None else self.select(self.modules)
        self._handles = {}
        for name, module, vpp_stage in modules:
            handles = self._handles.setdefault(id(module), [])
            tensor_inputs = input_grads and self.grad_hooks == "tensor"
            if tensor_inputs:
                handles.append(module.register_forward_pre_hook(self.guarded(self._pre_hook(name, vpp_stage)),
                                                                with_kwargs=True))
            hook = self.guarded(self._hook(name, vpp_stage, forward, backward, tensor_inputs))
            handles.append(module.register_forward_hook(hook, with_kwargs=True, prepend=is_root(name)))
            if input_grads and self.grad_hooks == "module":
                # Only so that torch routes the inputs' gradient through one node per call (see the class docstring).
                handle = module.register_full_backward_hook(self.guarded(self._lift))
                handles.append(handle)
                handles.extend(self._quiet.hooks(module, handle, self.guarded))
            for handle in handles:
                self.registry.add(self.HOOK_GROUP, handle)
        if self.select is not None and self.recheck_on is not None:
            recheck = self.recheck_on.register_forward_pre_hook(self.guarded(self._recheck))
            self.registry.add(self.HOOK_GROUP, recheck)

    def _recheck(self, module: Any, args: Any) -> None:
        """Forward pre-hook of the model: unhook the targets ``select`` leaves out now (compiled since).
        Once per step (``select`` walks the model: ~2 ms for 1,000 modules), at its first forward."""
        if not self.ctx.collecting or self.select is None or self._checked == self.ctx.step:
            return
        self._checked = self.ctx.step
        allowed = {id(target) for _, target, _ in self.select(self.modules)}
        for key in [key for key in self._handles if key not in allowed]:
            for handle in self._handles.pop(key):
                handle.remove()  # removing again (the registry, on disarm) is a no-op

    def _install_cell_hooks(self, forward: bool, backward: bool) -> None:
        """Another framework's cells (MindSpore): forward hooks, and the cell backward hook's gradient tuples."""
        for name, module, vpp_stage in self.modules:
            if forward:
                handle = module.register_forward_hook(self.guarded(self.forward_hook(name, vpp_stage)),
                                                      with_kwargs=True)
                self.registry.add(self.HOOK_GROUP, handle)
            if backward:
                handle = getattr(module, self.backward_hook)(self.guarded(self._backward_hook(name, vpp_stage)))
                self.registry.add(self.HOOK_GROUP, handle)

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
        self._forget_calls()

    def before_transfer(self) -> None:
        # The step's backward passes are over: drop the handles of its tensor hooks.
        self.registry.remove(self.TENSOR_HOOK_GROUP)
        self._quiet.reset()
        self._forget_calls()

    def _forget_calls(self) -> None:
        self._open.clear()
        self._calls.clear()
        self._calls_at = (-1, -1, -1)

    def _lift(self, module: Any, grad_input: Any, grad_output: Any) -> None:
        self._quiet.lift()  # torch has just warned (or not): our filter, if any, comes out at once

    # ------------------------------------------------------------------ calls and rows
    def next_call(self, name: str, vpp_stage: int) -> int:
        """The index of this call of module ``name`` in the micro-step (from 0); calls inside a backward
        pass (activation checkpointing's re-run) are numbered per pass, in the order they run. A forward
        that raised and is retried (its rows rolled back) numbers its calls afresh."""
        ctx, task = self.ctx, backward_pass()
        at = (ctx.step, ctx.micro_step, ctx.forwards) if task == -1 else (ctx.step, -1, task)
        if at != self._calls_at:
            self._calls.clear()
            self._calls_at = at
        call = self._calls.get((name, vpp_stage), 0)
        self._calls[(name, vpp_stage)] = call + 1
        return call

    def record_forward(self, name: str, vpp_stage: int, call: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                       output: Any) -> None:
        """The ``actv`` rows of one call of module ``name``."""
        module = module_call(name, call)
        if self.config.inputs:
            self._record_all("actv", args, activation_row(module, "input"), vpp_stage)
            self._record_all("actv", kwargs, activation_row(module, "input"), vpp_stage)
        self._record_all("actv", output, activation_row(module, "output"), vpp_stage)

    def _record_all(self, family: str, value: Any, prefix: str, vpp_stage: int) -> None:
        for row, tensor in named_tensors(value, prefix, self.tensor_type, keep=is_activation):
            self._record(family, row, tensor, vpp_stage)

    def _record(self, family: str, row: str, tensor: Any, vpp_stage: int, micro_step: int | None = None) -> None:
        if tensor.numel():  # no element, no statistics: an empty row would read as NaN
            self.ctx.grouped.record(family, row, tensor, vpp_stage, micro_step)

    def evaluating(self) -> bool:
        """A forward under ``no_grad`` outside the root's training forwards: an evaluation calling submodules
        itself (``model.decode(z)``), recorded nowhere, as an evaluation forward of the root."""
        return not torch.is_grad_enabled() and not self.ctx.training_forward_open

    def forward_hook(self, name: str, vpp_stage: int) -> ForwardHook:
        """The hook ``(module, args, kwargs, output)`` that records the ``actv`` rows of module ``name``."""

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.ctx.collecting or self.evaluating():
                return
            call = self.next_call(name, vpp_stage)
            if not in_backward():  # in a backward: activation checkpointing's re-run
                self.record_forward(name, vpp_stage, call, args, kwargs, output)

        return hook

    def _pre_hook(self, name: str, vpp_stage: int) -> ForwardPreHook:
        """Forward pre-hook ``(module, args, kwargs)``: numbers the call, hooks the input tensors before the
        module may modify them in place (``grad_hooks: tensor``)."""
        key = (name, vpp_stage)

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.ctx.collecting or self.evaluating():
                return
            call = self.next_call(name, vpp_stage)
            self._open.setdefault(key, []).append(call)
            if torch.is_grad_enabled():
                row = activation_row(module_call(name, call), "input_grad")
                self.hook_tensors(args, row, vpp_stage)
                self.hook_tensors(kwargs, row, vpp_stage)

        return hook

    def _hook(self, name: str, vpp_stage: int, forward: bool, backward: bool, numbered_before: bool) -> ForwardHook:
        """Forward hook ``(module, args, kwargs, output)``: the call's ``actv`` rows and its gradient hooks."""
        key = (name, vpp_stage)
        module_inputs = backward and self.config.inputs and self.grad_hooks == "module"

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.ctx.collecting or self.evaluating():
                return
            calls = self._open.get(key)
            call = calls.pop() if numbered_before and calls else self.next_call(name, vpp_stage)
            if forward and not in_backward():  # in a backward: activation checkpointing's re-run
                self.record_forward(name, vpp_stage, call, args, kwargs, output)
            if backward and torch.is_grad_enabled():
                module_name = module_call(name, call)
                self.hook_tensors(output, activation_row(module_name, "output_grad"), vpp_stage)
                if module_inputs:
                    self._hook_input_node(args, activation_row(module_name, "input_grad"), vpp_stage)

        return hook

    def hook_tensors(self, value: Any, prefix: str, vpp_stage: int) -> None:
        """Puts a gradient hook on every activation tensor of ``value`` that is part of the autograd graph.

        Rows are named like the forward rows of the same tensors. Leaves (parameters, user inputs) are
        skipped: a hook on them would outlive the step's graph.
        """
        for row, tensor in named_tensors(value, prefix, self.tensor_type, keep=is_activation):
            if tensor.requires_grad and tensor.grad_fn is not None:
                handle = tensor.register_hook(self.guarded(self._tensor_grad_hook(row, vpp_stage)))
                self.registry.add(self.TENSOR_HOOK_GROUP, handle)

    def _tensor_grad_hook(self, row: str, vpp_stage: int) -> TensorHook:
        # The gradient of a tensor belongs to the micro-step of the forward that made it, also when a
        # pipeline schedule runs the backward of micro-batch k after forwards of later ones.
        micro_step = self.ctx.micro_step

        def hook(grad: torch.Tensor | None) -> None:
            if self.ctx.collecting and grad is not None:  # None: no gradient flowed to the tensor
                self._record("actv_grad", row, grad, vpp_stage, micro_step)

        return hook

    def _hook_input_node(self, args: tuple[Any, ...], prefix: str, vpp_stage: int) -> None:
        """``grad_hooks: module``: a hook on the node through which torch's full backward hook machinery
        routes this call's positional input tensors (the forward hook sees them as that node's outputs);
        it receives their gradients through this module only, in the order of the tensors in ``args``."""
        positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        nodes = {id(args[i].grad_fn): args[i].grad_fn for i in positions if args[i].grad_fn is not None}
        if len(nodes) != 1:
            return  # no input requires grad (no gradient to read), or not one node of ours
        node = next(iter(nodes.values()))
        if node.name() != "BackwardHookFunctionBackward":
            return
        found: list[tuple[str, Any]] = []
        flatten_into(args, found, torch.Tensor, is_activation, False, "")  # named as record_forward names them
        paths = {path for path, _ in found}
        names = [(prefix if len(found) == 1 else f"{prefix}.{i}") if str(i) in paths else None for i in positions]

        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if self.ctx.collecting:
                for row, grad in zip(names, grad_inputs):
                    if row is not None and grad is not None:
                        self._record("actv_grad", row, grad, vpp_stage)

        self.registry.add(self.TENSOR_HOOK_GROUP, node.register_hook(self.guarded(hook)))

    def _backward_hook(self, name: str, vpp_stage: int) -> BackwardHook:
        input_row, output_row = activation_row(name, "input_grad"), activation_row(name, "output_grad")

        def hook(module: Any, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
            if not self.ctx.collecting:
                return
            # One entry per output/input tensor, None where no gradient flowed: keep the positions
            # so that rows are named like the forward rows of the same tensors.
            for row, tensor in named_tensors(grad_output, output_row, self.tensor_type, none_holds_position=True,
                                             keep=is_activation):
                self._record("actv_grad", row, tensor, vpp_stage)
            if self.config.inputs:
                for row, tensor in named_tensors(grad_input, input_row, self.tensor_type,
                                                 none_holds_position=True, keep=is_activation):
                    self._record("actv_grad", row, tensor, vpp_stage)

        return hook
