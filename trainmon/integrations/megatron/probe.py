"""The grad probe under Megatron-Core: on the main parameters' gradients in the step pre-hooks of the torch optimizers
inside a Megatron optimizer, tensor-parallel partitions and distributed-optimizer ranges combined."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.hooks import HookRegistry
from trainmon.integrations.megatron.collect import GroupLayout, MainParam
from trainmon.integrations.megatron.groups import probe_group
from trainmon.probe.sharded import ShardedGradProbe

if TYPE_CHECKING:
    from trainmon.base.types import MegatronParameter
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig

__all__ = ["grad_probe"]

logger = logging.getLogger("trainmon")


class _InnerStepHooks:
    """``register_step_pre_hook`` on every torch optimizer inside a Megatron optimizer, as one handle.

    Their pre-hooks run after Megatron has copied, unscaled and clipped the gradients into the main
    parameters (for a ``ChainedOptimizer``: all of them, before the first inner step)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def register_step_pre_hook(self, hook: Callable[..., None]) -> _Handles:
        return _Handles([optimizer.register_step_pre_hook(hook) for optimizer in self.optimizers])


class _Handles:
    """Several removable handles as one."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def grad_probe(ctx: StepContext, config: MonitorConfig, params: list[tuple[str, MegatronParameter, int]],
               mains: dict[int, MainParam], layout: GroupLayout, registry: HookRegistry) -> Collector | None:
    """The grad probe on what Megatron's torch optimizers step with: ``main.grad`` of each main parameter,
    in their step pre-hooks (after Megatron's unscaling and clipping), with Adam's ``exp_avg`` of it.

    A TP-partitioned parameter (``tensor_model_parallel``) is a block along ``partition_dim`` of the
    whole parameter; a distributed-optimizer main parameter is a range of that block; a parameter
    replicated over TP ranks is counted on TP rank 0 only. Pieces spread over ranks are combined by
    :class:`~trainmon.probe.sharded.ShardedGradProbe`; without TP or a sharded optimizer, every rank
    measures its own whole parameters with :class:`~trainmon.probe.collector.GradProbe`.
    Without an optimizer the probe is off (one warning).
    """
    from trainmon.probe.collector import GradProbe
    from trainmon.probe.shards import ShardSpec

    optimizers = list({id(m.optimizer): m.optimizer for m in mains.values()}.values())
    if not optimizers:
        logger.warning("trainmon: grad_probe on Megatron needs the optimizer (attach(chunks, optimizer)); it is off")
        return None
    hooks = _InnerStepHooks(optimizers)

    def grad_of(param: MegatronParameter) -> torch.Tensor | None:
        main = mains.get(id(param))
        return None if main is None or main.main.numel() == 0 else main.main.grad

    def exp_avg_of(param: MegatronParameter) -> torch.Tensor | None:
        main = mains.get(id(param))
        if main is None or main.main.numel() == 0:
            return None
        return (main.optimizer.state.get(main.main) or {}).get("exp_avg")

    sharded, group = probe_group(mains, layout)
    if not sharded:
        return GradProbe(ctx, params, config, registry, hooks, grad_of=grad_of, exp_avg_of=exp_avg_of)

    def spec_of(param: MegatronParameter) -> ShardSpec:
        main = mains.get(id(param))
        start, numel = main.piece if main is not None and main.piece is not None else (0, param.numel())
        shape = list(param.shape)
        if layout.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            length, shape[dim] = shape[dim], shape[dim] * layout.tp_size
            return ShardSpec.block(shape, dim, layout.tp_rank * length, length, start, numel)
        if layout.tp_rank > 0:
            return ShardSpec.flat(shape, 0, 0)  # replicated over TP: TP rank 0's copy counts
        return ShardSpec.flat(shape, start, numel)

    return ShardedGradProbe(ctx, params, config, registry, hooks, grad_of=grad_of, spec_of=spec_of,
                            exp_avg_of=exp_avg_of, group=group)
