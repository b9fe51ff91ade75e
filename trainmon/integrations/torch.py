"""Plain PyTorch: a ``torch.nn.Module`` and an optional ``torch.optim.Optimizer``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch

from trainmon import process_groups
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.optimizer import TorchOptimizerCollector
from trainmon.integrations.base import (
    Attachment,
    AttachOptions,
    named_modules,
    named_parameters,
    select_modules,
    select_params,
)
from trainmon.step_hooks import unwrap_optimizer
from trainmon.targets import plain_name

if TYPE_CHECKING:
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig

logger = logging.getLogger("trainmon")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside ``DistributedDataParallel`` and ``torch.compile`` wrappers (any nesting).

    Rows are named after this module's names, so they never carry ``module.`` or ``_orig_mod.``.
    """
    while True:
        # (nn.Module.__getattr__ types these attributes as Tensor | Module: they hold modules)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = cast(torch.nn.Module, model.module)
        elif _is_compiled(model):
            model = cast(torch.nn.Module, model._orig_mod)
        else:
            return model


def _is_compiled(module: Any) -> bool:
    """A ``torch.compile(module)`` wrapper (``OptimizedModule``), detected without importing dynamo."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                     torch.nn.Module)


def compiled_regions(model: torch.nn.Module) -> list[str]:
    """Names (in the unwrapped model) of the modules whose forward runs compiled: a compiled
    wrapper anywhere in the chain or among the submodules, or a module compiled in place
    (``module.compile()``). Hooks of modules inside them are traced once and then skipped."""
    regions: list[str] = []
    chain = model
    while isinstance(chain, torch.nn.parallel.DistributedDataParallel) or _is_compiled(chain):
        if _is_compiled(chain):
            regions.append("")
        chain = cast(torch.nn.Module, chain.module if isinstance(chain, torch.nn.parallel.DistributedDataParallel)
                     else chain._orig_mod)
    for name, module in chain.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None or (name and _is_compiled(module)):
            regions.append(name)
    return regions


def _inside(name: str, regions: list[str]) -> bool:
    return any(region == "" or name == region or name.startswith(region + ".") for region in regions)


def attach(ctx: StepContext, config: MonitorConfig, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None, options: AttachOptions) -> Attachment:
    """Build the collectors for a plain torch model (also under ``DistributedDataParallel``).

    Raises:
        TargetError: a target pattern matches no module or parameter.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    optimizer, scaler = unwrap_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = unwrap_model(model)
    registry = HookRegistry()
    modules_named, module_aliases = named_modules(root)
    collectors: list[Collector] = []
    if config.activations.enabled:
        regions = [plain_name(region) for region in compiled_regions(model)]
        modules = _outside_compiled(select_modules(modules_named, config, module_aliases), regions)
        collectors.append(ActivationCollector(ctx, modules, config.activations, registry))
    params, param_aliases = named_parameters(root)
    rank, world_size = process_groups.layout()
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        # one process: no data-parallel reduction can change a gradient inside the backward
        chosen = select_params(params, config, param_aliases)
        collectors.append(TorchOptimizerCollector(ctx, chosen, optimizer, config, registry,
                                                  batch_unreduced=world_size == 1))
    if config.grad_probe.enabled:
        from trainmon.probe.collector import GradProbe

        collectors.append(GradProbe(ctx, select_params(params, config, param_aliases), config, registry, optimizer))
    return Attachment(collectors=collectors, roots=[(model, 0)], modules=modules_named, optimizer=optimizer,
                      registry=registry, rank=rank, world_size=world_size, scaler=scaler)


def _outside_compiled(modules: list[tuple[str, torch.nn.Module, int]], regions: list[str]
                      ) -> list[tuple[str, torch.nn.Module, int]]:
    """Drop activation targets inside a compiled region, with one warning naming what is not seen.

    torch.compile traces a module's forward once and reuses that code: hooks added or removed
    later (trainmon arms them on collected steps only) are not run again, so their rows would
    appear on the first collected step and silently vanish afterwards.
    """
    if not regions:
        return modules
    kept = [item for item in modules if not _inside(item[0], regions)]
    if len(kept) < len(modules):
        shown = ", ".join(repr(r) if r else "the whole model" for r in regions[:3])
        logger.warning("trainmon: activations of %d target module(s) inside torch.compile'd code (%s) are not "
                       "recorded: compiled code does not run hooks added after it was traced. Weight gradients, "
                       "optimizer states and parameters are unaffected. Compile submodules instead of the model "
                       "root, or monitor activations in an uncompiled run.", len(modules) - len(kept), shown)
    return kept
