"""Weight gradients, parameters and optimizer states of a plain torch optimizer: the collector, its gradient hooks,
the parameter groups it follows and its step pre-hook (the optimizer-state rows of its step post-hook in
:mod:`trainmon.collect.optimizer_states`); :func:`global_grad_norm`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base.precursors import PRECURSORS
from trainmon.collect.hooks import HookedCollector, HookRegistry, post_accumulate_grad_hook
from trainmon.collect.optimizer_parts import optimizer_parts, param_groups_of
from trainmon.collect.optimizer_states import OptimizerStateRows
from trainmon.collect.optimizer_states import unless_skipped as unless_skipped  # its address before the split
from trainmon.collect.stats_base import foreach_norms, norm_of_norms
from trainmon.collect.step_hooks import scale_of

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig

logger = logging.getLogger("trainmon")
_GRADS = "weight_grads"
_OPTIMIZER = "optimizer_step"


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm over all of ``grads``, as a float32 0-d tensor on the first gradient's device.

    Per-tensor norms accumulate in float32 (``get_total_norm`` would keep a bf16 gradient's
    norm in bf16, 3 significant digits), one fused ``_foreach_norm`` per device and dtype;
    float32/float64 gradients in their own dtype (on the CPU, a float32 norm that overflowed is computed
    again in float64: ``foreach_norms``); the per-tensor norms combine scaled by the largest. Never
    synchronises with the host.

    Example:
        >>> float(global_grad_norm([torch.full((4,), 1.5, dtype=torch.bfloat16), torch.ones(1)]))
        3.1622776985168457
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    device = grads[0].device
    norms: list[torch.Tensor] = []
    for group in groups.values():
        per_tensor = foreach_norms(group)
        # a device-to-device copy where gradients span devices (as get_total_norm does): no host sync
        norms.extend(norm.to(device=device, dtype=torch.float32) for norm in per_tensor)
    return norm_of_norms(torch.stack(norms))  # scaled: per-tensor norms up to float32's max


class TorchOptimizerCollector(OptimizerStateRows, HookedCollector):
    """``grad_unreduced``, ``grad_reduced``, ``param`` and optimizer-state rows for a torch optimizer.

    - ``grad_unreduced``: ``param.grad`` in its post-accumulate-grad hook, i.e. as accumulated
      on the parameter after each micro-step's backward (before any data-parallel reduction
      outside autograd); written for the last micro-step, or every one with ``per_micro_step``.
      A parameter that got no gradient in that micro-step (an MoE expert without tokens) but holds
      one from an earlier micro-step is read when the backward ends (with several processes, after
      a data-parallel reduction that reduced it there): every gradient the optimizer steps with has
      its row.
    - With an optimizer, only the target parameters it holds (at ``attach``) are measured, and of those only
      the ones that require a gradient or have one (checked each step: a frozen parameter, or one outside
      the optimizer, has no rows; one unfrozen later has them again).
    - ``grad_reduced`` and ``param``: in the optimizer's step pre-hook (what the step uses: after
      ``GradScaler.unscale_`` and clipping); with a closure (``optimizer.step(closure)``: LBFGS,
      Lightning), right after the closure's first call, when its backward has run.
    - optimizer states, ``update``, ``ratio`` and ``precursors``: in the step post-hook (after the step; the
      precursors of the parameters that have a gradient then, from the same read of ``m``, ``v`` and the
      parameter as the update; :class:`OptimizerStateRows`).
    - scalar ``grad_norm``: the global L2 norm over every optimizer parameter's gradient *before
      clipping*, read at the end of the backward pass (after data-parallel reduction) of the last
      micro-step, divided by the loss scale under a ``GradScaler``.

    Under a ``GradScaler`` (``ctx.scaler``) ``grad_unreduced`` is divided by the loss scale, so
    every gradient row is in the units the optimizer steps with.

    An optimizer made of one optimizer per model part (:func:`optimizer_parts`) is hooked as one; the
    states and learning rates come from its inner optimizers.

    Args:
        ctx: the monitor's step context.
        params: ``(name, parameter, vpp_stage)`` of the target parameters.
        optimizer: the optimizer, or None (then only ``grad_unreduced``).
        config: the monitor config.
        registry: where the hook handles live.
        all_params: parameters counted in ``grad_norm`` (default: every optimizer parameter).
        batch_unreduced: the run has no data-parallel reduction inside the backward (one process):
            ``grad_unreduced`` is then measured for all parameters at once when the backward pass
            ends (one group of kernels) instead of tensor by tensor in each hook. The hooks only
            note the gradient and its version; a gradient changed in place before the pass ends
            (an optimizer step inside the backward) is measured tensor by tensor from then on.

    Raises:
        OptimizerContainerError: see :func:`optimizer_parts`.
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, torch.nn.Parameter, int]],
                 optimizer: torch.optim.Optimizer | None, config: MonitorConfig, registry: HookRegistry,
                 batch_unreduced: bool = False) -> None:
        self.parts = optimizer_parts(optimizer) if optimizer is not None else []
        """The optimizers holding the states and settings (``[optimizer]`` unless it is a container)."""
        super().__init__(ctx, registry)
        self.optimizer = optimizer
        self._targets = list(params)
        """Every target parameter; the ones the optimizer holds are measured (:meth:`_follow_param_groups`)."""
        self._held_size = self._group_size()
        self.params = self._held_targets()  # what the optimizer does not hold is not measured (frozen LoRA bases)
        self.config = config
        self._states = [s for s in config.optimizer_states.states if s in ctx.specs]
        self._precursors = PRECURSORS in ctx.specs
        self._states_checked = not self._states
        self._warn_other_rule()
        self._norm: torch.Tensor | None = None
        self._norm_final = False
        self.batch_unreduced = batch_unreduced
        self._pending: list[tuple[str, torch.Tensor, int, int, int, int]] = []
        """Gradients noted by the hooks, measured together: ``(name, grad, version, vpp, micro, order)``."""
        self._rows_this_pass: set[int] = set()
        """Parameters whose hook wrote (or noted) a row in the backward pass in flight."""
        ctx.backward_end.insert(0, self._backward_end_rows)  # before the norm: both read the same gradients
        ctx.backward_failed.append(self._drop_pending)
        ctx.micro_step_dropped.append(self._micro_step_dropped)
        if optimizer is not None:
            ctx.backward_end.append(self._backward_ended)
            ctx.step_not_taken.append(self._step_not_taken)

    HOOK_GROUPS = (_GRADS, _OPTIMIZER)
    reads_missing_grads = True
    """Whether ``self.params``' own ``.grad`` is what the hooks read (so a parameter without a hook call in a
    pass is read at its end); False where the hooks fire on other tensors (FSDP2's unsharded parameters)."""

    def install_hooks(self) -> None:
        self._follow_param_groups()
        self._hook_grads(self.params)
        if self.optimizer is not None:
            self.registry.add(_OPTIMIZER, self.optimizer.register_step_pre_hook(self.guarded(self._pre_step)))
            if self._states or self._precursors:
                self.registry.add(_OPTIMIZER, self.optimizer.register_step_post_hook(self.guarded(self._post_step)))

    def _hook_grads(self, params: Sequence[tuple[str, torch.nn.Parameter, int]]) -> None:
        if "grad_unreduced" in self.ctx.specs:
            for name, param, vpp_stage in params:
                if param.requires_grad:
                    hook = self.guarded(self._grad_hook(name, vpp_stage))
                    self.registry.add(_GRADS, post_accumulate_grad_hook(param, hook))

    def _group_size(self) -> int:
        return sum(len(group["params"]) for group in param_groups_of(self.parts))

    def _held_targets(self) -> list[tuple[str, torch.nn.Parameter, int]]:
        if self.optimizer is None:
            return list(self._targets)
        held = {id(p) for group in param_groups_of(self.parts) for p in group["params"]}
        return [item for item in self._targets if id(item[1]) in held]

    def _follow_param_groups(self) -> None:
        """The optimizer's parameters changed since (``add_param_group``: a backbone unfrozen and handed to the
        optimizer mid-run): measure the targets it holds now, from this backward pass on (a few additions per
        group, once per pass while nothing changes). The new parameters' gradient hooks are added now; in the pass
        that ends now their gradients are read at its end (:meth:`_measure_missing`)."""
        if self.optimizer is None or (size := self._group_size()) == self._held_size:
            return
        self._held_size = size
        known = {id(item[1]) for item in self.params}
        self.params = self._held_targets()
        if self.armed and self.reads_missing_grads:  # (FSDP2's hooks are on the unsharded parameters: not here)
            self._hook_grads([item for item in self.params if id(item[1]) not in known])

    def before_transfer(self) -> None:
        self._backward_end_rows()
        if self._norm is not None and self.ctx.collecting:
            self.ctx.buffer.add_scalar("grad_norm", self._norm)
        self._norm, self._norm_final = None, False

    def release(self) -> None:
        self._drop_pending()
        for subscriber in (self._backward_end_rows, self._backward_ended):
            if subscriber in self.ctx.backward_end:
                self.ctx.backward_end.remove(subscriber)
        if self._drop_pending in self.ctx.backward_failed:
            self.ctx.backward_failed.remove(self._drop_pending)
        if self._micro_step_dropped in self.ctx.micro_step_dropped:
            self.ctx.micro_step_dropped.remove(self._micro_step_dropped)
        if self._step_not_taken in self.ctx.step_not_taken:
            self.ctx.step_not_taken.remove(self._step_not_taken)

    def _grad_hook(self, name: str, vpp_stage: int) -> Callable[[torch.Tensor], None]:
        per_micro_step = self.config.weight_grads.per_micro_step

        def hook(param: torch.Tensor) -> None:
            ctx = self.ctx
            if ctx.collecting and param.grad is not None and (
                    per_micro_step or ctx.micro_step >= ctx.grad_acc_steps - 1):
                self._rows_this_pass.add(id(param))
                if self.batch_unreduced:
                    grad = param.grad
                    self._pending.append((name, grad, grad._version, vpp_stage, ctx.micro_step,
                                          ctx.buffer.next_order()))
                    ctx.schedule_backward_end()
                else:
                    ctx.record("grad_unreduced", name, param.grad, vpp_stage, scale=scale_of(ctx.scaler))

        return hook

    def _drop_pending(self) -> None:
        """The noted gradients' backward raised: its rows are rolled back, these are never measured."""
        self._pending.clear()
        self._rows_this_pass.clear()

    def _backward_end_rows(self) -> None:
        """End of a backward pass: the noted gradients, then those that got no gradient in this pass."""
        if self.ctx.collecting:
            self._follow_param_groups()
        self._measure_pending()
        self._measure_missing()

    def _measure_missing(self) -> None:
        """``grad_unreduced`` rows of the parameters whose hook did not fire in a pass that writes rows but
        that hold a gradient (accumulated in an earlier micro-step): the optimizer steps with it too."""
        hooked, self._rows_this_pass = self._rows_this_pass, set()
        ctx = self.ctx
        if not (hooked and self.reads_missing_grads and ctx.collecting and "grad_unreduced" in ctx.specs) or not (
                self.config.weight_grads.per_micro_step or ctx.micro_step >= ctx.grad_acc_steps - 1):
            return
        missing = [(name, param.grad, vpp) for name, param, vpp in self.params
                   if id(param) not in hooked and param.grad is not None]
        if missing:
            ctx.record_many("grad_unreduced", [m[0] for m in missing], [m[1] for m in missing],
                            [m[2] for m in missing], scale=scale_of(ctx.scaler))

    def _micro_step_dropped(self, micro: int) -> None:
        """An earlier micro-step was abandoned: the noted gradients of later ones move down by one, and those
        no longer of the last micro-step are not written (unless every micro-step is)."""
        ctx = self.ctx
        moved = [(name, grad, version, vpp, m - 1 if m > micro else m, order)
                 for name, grad, version, vpp, m, order in self._pending]
        self._pending = [item for item in moved if self.config.weight_grads.per_micro_step
                         or item[4] >= ctx.grad_acc_steps - 1]

    def _measure_pending(self) -> None:
        """``grad_unreduced`` of the gradients the hooks noted, all at once (see ``batch_unreduced``)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        ctx = self.ctx
        if not ctx.collecting:
            return
        changed = [name for name, grad, version, *_ in pending if grad._version != version]
        kept = [item for item in pending if item[1]._version == item[2]]
        if changed:  # changed in place before the pass ended: those values are gone; per tensor from now on
            self.batch_unreduced = False
            logger.warning("trainmon: %d gradient(s) changed inside the backward pass before trainmon read them "
                           "(e.g. %s; an optimizer step in a gradient hook?): their grad_unreduced rows are skipped "
                           "this step, and gradients are read in their hooks from now on", len(changed), changed[0])
        by_micro: dict[int, list[tuple[str, torch.Tensor, int, int, int, int]]] = {}
        for item in kept:
            by_micro.setdefault(item[4], []).append(item)
        scale = scale_of(ctx.scaler)
        for micro, items in by_micro.items():
            ctx.record_many("grad_unreduced", [i[0] for i in items], [i[1] for i in items], [i[3] for i in items],
                            micro_step=micro, scale=scale, orders=[i[5] for i in items])

    def _backward_ended(self) -> None:
        """End of a backward pass: the pre-clip global norm of the gradients as they stand now."""
        ctx = self.ctx
        if self._norm_final or ctx.micro_step < ctx.grad_acc_steps - 1 or self.optimizer is None:
            return
        grads = [p.grad for group in param_groups_of(self.parts) for p in group["params"] if p.grad is not None]
        if grads:
            # every gradient measured just now as grad_unreduced, as a group (one process: nothing reduced them
            # since; every parameter a target): the norm from those partials, without reading them again. With
            # several processes the hooks measured them before the reduction, which need not bump versions.
            spec = ctx.specs.get("grad_unreduced")
            norms = ctx.cached_norms(grads, spec) if spec is not None and self.batch_unreduced else None
            device = grads[0].device
            norm = global_grad_norm(grads) if norms is None else \
                norm_of_norms(torch.cat([n.to(device) for n in norms]) if len(norms) > 1 else norms[0])
            scale = scale_of(ctx.scaler)
            self._norm = norm if scale is None else norm / scale.to(norm.device, torch.float32)

    def _step_not_taken(self) -> None:
        """The step guard skipped the step without calling the optimizer: its rows as the step hooks write them
        (the gradients it would have applied, the states it left as they were)."""
        if self.armed and self.optimizer is not None:
            self._pre_step(self.optimizer, (self.optimizer,), {})
            if self._states:  # no precursor rows: their gradient was not folded into the moments
                precursors, self._precursors = self._precursors, False
                try:
                    self._post_step(self.optimizer, (self.optimizer,), {})
                finally:
                    self._precursors = precursors

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if not self.ctx.collecting or self.ctx.state_init_step:  # not a training step: nothing to measure
            return None
        self._backward_end_rows()  # a backward whose end was not seen: before unscale_ or the step change them
        self.ctx.forget_measured()  # unscale_ rewrote the gradients without bumping their versions
        # torch passes the step's own arguments, the optimizer first: step(self, closure=None)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._measure_step(optimizer)
            return None
        measured = False

        def closure_then_measure(*closure_args: Any, **closure_kwargs: Any) -> Any:
            nonlocal measured
            loss = closure(*closure_args, **closure_kwargs)
            if not measured:  # LBFGS re-evaluates: the step's direction comes from the first call
                measured = True  # called by the optimizer, outside the pre-hook's guard: guarded here
                self.ctx.guard.run(self.PART, self._measure_step, optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_measure}
        return (args[0], closure_then_measure, *args[2:]), kwargs

    def _measure_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``grad_reduced``, ``param`` and ``lr`` of the gradients the optimizer steps with.

        Every target parameter is visible here at once: each family is measured with one
        :meth:`StepContext.record_many` (a few kernels per device and dtype), rows in the order
        of the parameters, gradient then parameter.
        """
        ctx = self.ctx
        if not ctx.collecting:
            return
        rows: dict[str, list[tuple[str, torch.Tensor, int]]] = {"grad_reduced": [], "param": []}
        for name, param, vpp_stage in self.params:
            if param.grad is not None:
                rows["grad_reduced"].append((name, param.grad, vpp_stage))
            elif not param.requires_grad:
                continue  # frozen now: the optimizer does not step it
            rows["param"].append((name, param, vpp_stage))
        self._record_interleaved(rows)
        self._finish_step_measurement(optimizer)

    def _finish_step_measurement(self, optimizer: torch.optim.Optimizer) -> None:
        """After the step's gradients were read: settle ``grad_norm`` and record the learning rates."""
        if self._norm is None:  # no backward pass was seen (gradients set by hand): the norm as it stands
            self._norm = self._norm_as_it_stands(optimizer)
        self._norm_final = True
        for i, group in enumerate(param_groups_of(self.parts)):
            if "lr" in group:  # every torch optimizer has one; a custom one may not
                self.ctx.buffer.add_scalar(f"lr/group{i}", group["lr"])

    def _norm_as_it_stands(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The global norm of the optimizer's gradients now (subclasses with sharded gradients override it)."""
        grads = [p.grad for group in param_groups_of(self.parts) for p in group["params"] if p.grad is not None]
        return global_grad_norm(grads) if grads else None


__all__ = ["TorchOptimizerCollector", "global_grad_norm"]
