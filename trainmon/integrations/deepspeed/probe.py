"""The grad probe under DeepSpeed: on the gradient DeepSpeed steps with, each rank's ZeRO partition of it placed in
the whole parameter and the pieces combined over the group the partitions are spread over."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainmon.integrations.deepspeed.groups import partition_group
from trainmon.integrations.deepspeed.shards import layout_for

if TYPE_CHECKING:
    from trainmon.base.types import DeepSpeedParameter
    from trainmon.collect.context import Collector, StepContext
    from trainmon.collect.hooks import HookRegistry
    from trainmon.collect.step_hooks import StepWrapper
    from trainmon.config import MonitorConfig
    from trainmon.integrations.base import AttachOptions

__all__ = ["grad_probe"]


def grad_probe(ctx: StepContext, config: MonitorConfig, engine: Any, params: list[tuple[str, DeepSpeedParameter, int]],
               registry: HookRegistry, hooks: StepWrapper, options: AttachOptions) -> Collector:
    """The grad probe on the gradient DeepSpeed steps with (read at the start of ``engine.step()`` on a boundary).

    ZeRO-0 (replicated): ``param.grad``, the whole averaged gradient on every rank (no gather).
    ZeRO 1/2/3: each rank's partition of the gradient (``layout.grad``) and of ``exp_avg``, placed in
    the whole parameter by :meth:`ShardLayout.spec`; the pieces are combined by
    :class:`~trainmon.probe.sharded.ShardedGradProbe` (one gather to the group's writer per
    collected step; with one rank, the piece is the whole parameter).
    """
    from trainmon.probe.collector import GradProbe

    layout = layout_for(engine, [p for _, p, _ in params] or engine.module.parameters())

    def exp_avg_of(param: DeepSpeedParameter) -> torch.Tensor | None:
        return layout.state(param, "exp_avg")

    # The step wrapper's pre-hooks run on accumulation boundaries only, before DeepSpeed steps
    # (and, under ZeRO 1/2/3, before it frees the gradient partitions).
    if layout.replicated:
        return GradProbe(ctx, params, config, registry, hooks, exp_avg_of=exp_avg_of, grad_of=layout.grad)
    from trainmon.probe.sharded import ShardedGradProbe

    return ShardedGradProbe(ctx, params, config, registry, hooks, grad_of=layout.grad, spec_of=layout.spec,
                            exp_avg_of=exp_avg_of, group=partition_group(engine, params, options))
