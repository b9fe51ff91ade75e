"""Plain PyTorch: a ``torch.nn.Module`` and an optional ``torch.optim.Optimizer``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainmon.collect.activations import ActivationCollector
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.optimizer import TorchOptimizerCollector
from trainmon.integrations.base import AttachOptions, Attachment, dist_layout, select_modules, select_params

if TYPE_CHECKING:
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig


def attach(ctx: StepContext, config: MonitorConfig, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None, options: AttachOptions) -> Attachment:
    """Build the collectors for a plain torch model (also under ``DistributedDataParallel``).

    Raises:
        TargetError: a target pattern matches no module or parameter.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    registry = HookRegistry()
    named_modules = [(name, module, 0) for name, module in root.named_modules()]
    collectors: list[Collector] = []
    if config.activations.enabled:
        modules = select_modules(named_modules, config)
        collectors.append(ActivationCollector(ctx, modules, config.activations, registry))
    params = [(name, p, 0) for name, p in root.named_parameters()]
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        collectors.append(TorchOptimizerCollector(ctx, select_params(params, config), optimizer, config, registry))
    if config.grad_probe.enabled:
        from trainmon.probe.collector import GradProbe

        collectors.append(GradProbe(ctx, select_params(params, config), config, registry, optimizer))
    rank, world_size = dist_layout()
    return Attachment(collectors=collectors, roots=[(model, 0)], modules=named_modules, optimizer=optimizer,
                      registry=registry, rank=rank, world_size=world_size)
