"""Weight gradients, parameters and optimizer states of a MindSpore optimizer (PyNative mode).

- ``grad_unreduced``: ``Parameter.register_hook``, i.e. the gradient autograd hands out for the
  parameter in this micro-step (before ``DistributedGradReducer``; MindSpore has no ``.grad`` that
  accumulates); written for the last micro-step, or every one with ``per_micro_step``.
- ``grad_reduced``, ``param``, ``grad_norm`` and ``lr/group{i}``: a forward pre-hook on the
  optimizer cell, which receives the gradients the step uses (reduced ones when the user passes
  the output of ``DistributedGradReducer``).
- ``exp_avg``/``exp_avg_sq`` (``nn.Adam`` ``moment1``/``moment2``, ``nn.AdamWeightDecay``
  ``moments1``/``moments2``), ``momentum`` (``nn.Momentum``), ``update`` and ``ratio``: a forward
  hook on the optimizer cell, after the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mindspore as ms
from mindspore import Parameter, Tensor, mint, ops

from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.integrations.mindspore.buffer import buffer_of
from trainmon.integrations.mindspore.stats import sum_of_squares

if TYPE_CHECKING:
    from mindspore import nn

    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig

_GRADS = "weight_grads"
_OPTIMIZER = "optimizer_step"
_STATE_ATTRS: dict[str, tuple[str, ...]] = {
    "exp_avg": ("moment1", "moments1"),
    "exp_avg_sq": ("moment2", "moments2"),
    "momentum": ("moments",),
}
"""Where MindSpore optimizers keep each state, as ParameterTuples aligned with ``optimizer.parameters``."""


def _state_tuple(optimizer: nn.Optimizer, family: str) -> Sequence[Parameter] | None:
    for attr in _STATE_ATTRS[family]:
        value: Sequence[Parameter] | None = getattr(optimizer, attr, None)
        if value is not None and len(value) == len(optimizer.parameters):
            return value
    return None


def adam_update(optimizer: nn.Optimizer, index: int) -> Tensor | None:
    """The Adam update direction of parameter ``index``, on the device, after the step.

    ``nn.Adam`` (bias-corrected, as torch's Adam): ``m_hat / (sqrt(v_hat) + eps)`` with the bias
    corrections ``1 - beta_power`` read from the optimizer's ``beta1_power``/``beta2_power``
    parameters (``vhat`` replaces ``v`` with ``use_amsgrad``). ``nn.AdamWeightDecay`` applies no
    bias correction, so its update is ``m / (sqrt(v) + eps)``. None for other optimizers.
    """
    m_tuple, v_tuple = _state_tuple(optimizer, "exp_avg"), _state_tuple(optimizer, "exp_avg_sq")
    eps = getattr(optimizer, "eps", None)
    if m_tuple is None or v_tuple is None or eps is None:
        return None
    m, v = m_tuple[index].astype(ms.float32), v_tuple[index].astype(ms.float32)
    if getattr(optimizer, "use_amsgrad", False) and getattr(optimizer, "vhat", None) is not None:
        v = mint.maximum(v, optimizer.vhat[index].astype(ms.float32))
    beta1_power, beta2_power = getattr(optimizer, "beta1_power", None), getattr(optimizer, "beta2_power", None)
    if beta1_power is not None and beta2_power is not None:
        m = m / (1 - beta1_power)
        v = v / (1 - beta2_power)
    return (m / (mint.sqrt(v) + eps.reshape(()))).reshape(m.shape)


def update_ratio(update: Tensor, param: Tensor) -> Tensor:
    """Elementwise ``update / param``; 0 where the parameter is exactly 0 (as for torch)."""
    param = param.astype(ms.float32)
    nonzero = param != 0
    safe = ops.select(nonzero, param, ops.ones_like(param))
    return ops.select(nonzero, update / safe, ops.zeros_like(update))


class MindSporeOptimizerCollector(HookedCollector):
    """``grad_unreduced``, ``grad_reduced``, ``param`` and optimizer-state rows for a MindSpore optimizer.

    Args:
        ctx: the monitor's step context.
        params: ``(name, parameter, vpp_stage)`` of the target parameters.
        optimizer: the ``nn.Optimizer`` cell, or None (then only ``grad_unreduced``).
        config: the monitor config.
        registry: where the hook handles live.
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, Parameter, int]],
                 optimizer: nn.Optimizer | None, config: MonitorConfig, registry: HookRegistry) -> None:
        super().__init__(ctx, registry)
        self.params = list(params)
        self.optimizer = optimizer
        self.config = config
        self._states = [s for s in config.optimizer_states.states if s in ctx.specs]
        index = {id(p): i for i, p in enumerate(optimizer.parameters)} if optimizer is not None else {}
        # (name, parameter, vpp_stage, index in optimizer.parameters) of the targets the optimizer steps
        self._stepped = [(n, p, v, index[id(p)]) for n, p, v in self.params if id(p) in index]

    HOOK_GROUPS = (_GRADS, _OPTIMIZER)

    def install_hooks(self) -> None:
        if "grad_unreduced" in self.ctx.specs:
            for name, param, vpp_stage in self.params:
                if param.requires_grad:
                    self.registry.add(_GRADS, param.register_hook(self.guarded(self._grad_hook(name, vpp_stage))))
        if self.optimizer is not None:
            pre_step, post_step = self.guarded(self._pre_step_hook()), self.guarded(self._post_step_hook())
            self.registry.add(_OPTIMIZER, self.optimizer.register_forward_pre_hook(pre_step))
            if self._states:
                self.registry.add(_OPTIMIZER, self.optimizer.register_forward_hook(post_step))

    def _grad_hook(self, name: str, vpp_stage: int) -> Callable[[Tensor], None]:
        per_micro_step = self.config.weight_grads.per_micro_step

        def hook(grad: Tensor) -> None:
            ctx = self.ctx
            if ctx.collecting and (per_micro_step or ctx.micro_step >= ctx.grad_acc_steps - 1):
                ctx.record("grad_unreduced", name, grad, vpp_stage)

        return hook

    def _pre_step_hook(self) -> Callable[[nn.Optimizer, tuple[Any, ...]], None]:
        def hook(optimizer: nn.Optimizer, args: tuple[Any, ...]) -> None:
            ctx = self.ctx
            if not ctx.collecting:
                return
            grads = args[0] if args and isinstance(args[0], (tuple, list)) else None
            for name, param, vpp_stage, i in self._stepped:
                if grads is not None and grads[i] is not None:
                    ctx.record("grad_reduced", name, grads[i], vpp_stage)
                ctx.record("param", name, param, vpp_stage)
            buffer = buffer_of(ctx)
            if grads:
                buffer.add_scalar("grad_norm", mint.sqrt(sum_of_squares([g for g in grads if g is not None])))
            for i, lr in enumerate(_learning_rates(optimizer)):
                buffer.add_scalar(f"lr/group{i}", lr)

        return hook

    def _post_step_hook(self) -> Callable[[nn.Optimizer, tuple[Any, ...], Any], None]:
        def hook(optimizer: nn.Optimizer, args: tuple[Any, ...], output: Any) -> None:
            ctx = self.ctx
            if not ctx.collecting:
                return
            tuples = {family: _state_tuple(optimizer, family) for family in ("exp_avg", "exp_avg_sq", "momentum")}
            for name, param, vpp_stage, i in self._stepped:
                for family, states in tuples.items():
                    if family in self._states and states is not None:
                        ctx.record(family, name, states[i], vpp_stage)
                if "update" in self._states or "ratio" in self._states:
                    update = adam_update(optimizer, i)
                    if update is None:
                        continue
                    ctx.record("update", name, update, vpp_stage)
                    if "ratio" in self._states:
                        ctx.record("ratio", name, update_ratio(update, param), vpp_stage)

        return hook


def _learning_rates(optimizer: nn.Optimizer) -> list[Tensor]:
    """Fixed learning rates (one per group) as device tensors; none for a dynamic schedule."""
    if getattr(optimizer, "dynamic_lr", False):
        return []
    lr = getattr(optimizer, "learning_rate", None)
    if isinstance(lr, Tensor):
        return [lr]
    if getattr(optimizer, "is_group_lr", False) and lr is not None:
        return [value for value in lr if isinstance(value, Tensor)]
    return []
