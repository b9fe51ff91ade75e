"""The grad probe for MindSpore (PyNative): the gradients handed to the optimizer cell.

A forward pre-hook on the ``nn.Optimizer`` cell receives the gradients the step uses (the reduced
ones when the user passes ``DistributedGradReducer``'s output) and, before the step, the optimizer's
``exp_avg`` (``nn.Adam`` ``moment1``, ``nn.AdamWeightDecay`` ``moments1``). The probe itself is
:class:`trainmon.probe.collector.GradProbe`: each gradient is handed to it as a CPU torch tensor
sharing the memory of ``Tensor.asnumpy()`` (float32 for bfloat16), so the statistics, sign bits,
hash and files are exactly those of a torch run. On CPU that is a view of host memory; on a device
``asnumpy()`` copies each target gradient to the host (one copy per parameter per collected step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mindspore as ms
import torch
from mindspore import Parameter, Tensor

from trainmon.integrations.mindspore.optimizer_states import state_tuple

if TYPE_CHECKING:
    from mindspore import nn

    from trainmon.collect.context import StepContext
    from trainmon.collect.hooks import HookRegistry
    from trainmon.config import MonitorConfig
    from trainmon.probe.collector import GradProbe


def _to_torch(value: Tensor | None) -> torch.Tensor | None:
    """A CPU torch tensor over ``value.asnumpy()`` (float32 for dtypes numpy lacks)."""
    if value is None:
        return None
    if value.dtype == ms.bfloat16:
        value = value.astype(ms.float32)
    return torch.from_numpy(value.asnumpy())


class OptimizerPreHook:
    """Gives the probe a ``register_step_pre_hook`` on a MindSpore optimizer cell and remembers the
    gradients of the call being made (``grads_of``), by position in ``optimizer.parameters``."""

    def __init__(self, optimizer: nn.Optimizer) -> None:
        self.optimizer = optimizer
        self.grads: Sequence[Tensor | None] | None = None
        self.index = {id(p): i for i, p in enumerate(optimizer.parameters)}

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        def pre_hook(cell: Any, args: tuple[Any, ...]) -> None:
            self.grads = args[0] if args and isinstance(args[0], (tuple, list)) else None
            try:
                hook(cell, args, {})
            finally:
                self.grads = None

        return self.optimizer.register_forward_pre_hook(pre_hook)

    def grad_of(self, param: Parameter) -> torch.Tensor | None:
        i = self.index.get(id(param))
        if self.grads is None or i is None or i >= len(self.grads):
            return None
        return _to_torch(self.grads[i])

    def exp_avg_of(self, param: Parameter) -> torch.Tensor | None:
        i = self.index.get(id(param))
        moments = state_tuple(self.optimizer, "exp_avg")
        return None if moments is None or i is None else _to_torch(moments[i])


def grad_probe(ctx: StepContext, params: Sequence[tuple[str, Parameter, int]], config: MonitorConfig,
               registry: HookRegistry, optimizer: nn.Optimizer | None) -> GradProbe:
    """The probe of a MindSpore attachment.

    Raises:
        ValueError: no optimizer (the probe reads the gradients handed to it).
    """
    from trainmon.probe.collector import GradProbe

    if optimizer is None:
        raise ValueError("grad_probe with MindSpore needs the optimizer: attach(network, optimizer); "
                         "it reads the gradients handed to the optimizer cell")
    hooks = OptimizerPreHook(optimizer)
    return GradProbe(ctx, params, config, registry, hooks, grad_of=hooks.grad_of, exp_avg_of=hooks.exp_avg_of)
