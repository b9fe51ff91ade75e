"""Plain PyTorch: a ``torch.nn.Module`` and an optional ``torch.optim.Optimizer``."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, cast

import torch

from trainmon.base import process_groups
from trainmon.base.targets import plain_name
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.optimizer import TorchOptimizerCollector
from trainmon.collect.optimizer_parts import optimizer_parts, state_holder
from trainmon.collect.step_hooks import unwrap_optimizer
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations.base import (
    REPLICATED_FAMILIES,
    Attachment,
    AttachOptions,
    Replicated,
    named_modules,
    named_parameters,
    select_modules,
    select_params,
)

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


def ddp_of(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` among the wrappers of ``model`` (``torch.compile`` around it or inside it)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        if not _is_compiled(model):
            return None
        model = cast(torch.nn.Module, model._orig_mod)


def replicated_families(model: torch.nn.Module, parts: list[torch.optim.Optimizer],
                        options: AttachOptions) -> Replicated | None:
    """What is the same on every data-parallel replica of a plain torch model, or None where trainmon cannot be sure.

    Under ``DistributedDataParallel`` (over its own process group) every rank steps with the same averaged
    gradients from the same parameters: ``grad_reduced``, ``param`` and the optimizer states are equal on every
    rank of the group. A ``dp_group`` given to ``attach`` for a model without DDP says the same of that group (the
    user averages the gradients over it). Not so for the optimizer states of a ``ZeroRedundancyOptimizer`` (each
    rank keeps those of its own parameters), nor for anything when DDP leaves parameters out of its reduction
    (``parameters_to_ignore``). Without DDP or a ``dp_group`` nothing is assumed (ranks may hold other parameters:
    tensor or pipeline parallelism done by hand).
    """
    ddp = ddp_of(model)
    if ddp is not None:
        if getattr(ddp, "parameters_to_ignore", None):
            logger.info("trainmon: DDP leaves parameters out of its gradient reduction (parameters_to_ignore): "
                        "every rank writes its own grad_reduced, param and optimizer-state rows")
            return None
        group = getattr(ddp, "process_group", None)
    elif options.dp_group is not None:
        group = options.dp_group
    else:
        return None
    sharded_states = any(state_holder(part) is not part for part in parts)  # ZeroRedundancyOptimizer
    families = ("grad_reduced", "param") if sharded_states else REPLICATED_FAMILIES
    return Replicated(families, group)


def _is_compiled(module: Any) -> bool:
    """A ``torch.compile(module)`` wrapper: ``OptimizedModule``, or a subclass of it such as the
    ``FSDPOptimizedModule`` that ``fully_shard`` makes of a wrapper. Imports nothing: when dynamo was
    never imported, no wrapper exists."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def compiled_in_place(module: Any) -> bool:
    """Whether ``module.compile()`` was called: its ``__call__`` runs its hooks and forward as compiled code."""
    return getattr(module, "_compiled_call_impl", None) is not None


def traced_modules(model: torch.nn.Module) -> dict[int, str]:
    """``id(module) -> compiled region`` for every module whose hooks run inside compiled code.

    A module compiled in place (``module.compile()``) runs its own hooks and everything below it
    compiled; a ``torch.compile(module)`` wrapper runs its own hooks eagerly and its ``_orig_mod``
    (with everything below) compiled. Dynamo traces hooks present at tracing time into the graph and
    recompiles when they change, so trainmon puts none there. The region is named like the rows
    (no ``_orig_mod``; ``""`` is the whole model). Walks the model: called at attach and when hooks
    are installed for a collected step (users may compile after attaching).
    """
    traced: dict[int, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module, str | None]] = [("", model, None)]
    while stack:
        name, module, region = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if region is None and compiled_in_place(module):
            region = plain_name(name)
        if region is not None:
            traced[id(module)] = region
        wrapped = module._orig_mod if region is None and _is_compiled(module) else None
        ddp = isinstance(module, torch.nn.parallel.DistributedDataParallel)
        for child_name, child in module.named_children():
            inner = plain_name(name) if child is wrapped else region
            child_path = name if ddp else f"{name}.{child_name}" if name else child_name  # rows have no "module."
            stack.append((child_path, child, inner))
    return traced


def compiled_regions(model: torch.nn.Module) -> list[str]:
    """Names (in the unwrapped model) of the compiled regions of :func:`traced_modules`."""
    return sorted(set(traced_modules(model).values()))


class CompiledRootError(UnsupportedSetupError):
    """The model given to ``attach`` was compiled in place: trainmon's step hooks would run inside compiled code."""


def refuse_root_compiled_in_place(model: torch.nn.Module) -> None:
    """Raise :class:`CompiledRootError` when ``model.compile()`` was called on the root given to ``attach``.

    trainmon's forward hooks on the root tell micro-steps, evaluation forwards and the end of the
    backward pass apart (the pre-clip ``grad_norm`` is read there); a root compiled in place runs them
    as traced code, where they cannot act. A wrapper runs its hooks eagerly.
    """
    if compiled_in_place(model):
        raise CompiledRootError(
            f"{type(model).__name__}.compile() was called on the model given to attach(): its forward hooks, "
            "which trainmon needs to count micro-steps and read the pre-clip grad_norm at the end of the "
            "backward pass, would run inside compiled code. Pass a torch.compile(model) wrapper to attach() "
            "instead (its hooks run outside the compiled code), or compile submodules in place "
            "(block.compile(), as torchtitan does); see docs/training_loops.md")


class OutsideCompiled:
    """Activation targets whose hooks run eagerly, given again each time hooks are installed.

    Modules inside compiled code (:func:`traced_modules`) are dropped with one warning naming them
    (and again for modules that become compiled later). Weight-gradient, optimizer-state and
    parameter rows do not use module hooks and are not affected.

    Args:
        model: the model given to ``attach`` (wrappers included).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._warned: set[str] = set()

    def __call__(self, modules: list[tuple[str, Any, int]]) -> list[tuple[str, Any, int]]:
        traced = traced_modules(self.model)
        if not traced:
            return modules
        kept = [item for item in modules if id(item[1]) not in traced]
        dropped = [item for item in modules if id(item[1]) in traced and item[0] not in self._warned]
        if dropped:
            self._warned.update(name for name, _, _ in dropped)
            regions = sorted({traced[id(module)] for _, module, _ in dropped})
            shown = ", ".join(repr(r) if r else "the whole model" for r in regions[:3])
            names = ", ".join(name for name, _, _ in dropped[:5]) + (", ..." if len(dropped) > 5 else "")
            logger.warning(
                "trainmon: activations of %d target module(s) (%s) are not recorded: they run inside "
                "torch.compile'd code (%s), which does not run hooks added after it was traced and would "
                "recompile each time trainmon adds or removes them. Only activation rows are affected: weight "
                "gradients, optimizer states and parameters are recorded as usual. To record these activations, "
                "leave those modules uncompiled (compile other submodules, or set targets.modules to modules "
                "outside the compiled code), or monitor activations in an uncompiled run.",
                len(dropped), names, shown)
        return kept


class CompiledFeatures:
    """The attention modules whose hooks run eagerly (:func:`traced_modules`), given again each time hooks are
    installed; those inside compiled code are left out, with one warning naming them.

    Args:
        model: the model given to ``attach`` (wrappers included).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._warned: set[str] = set()

    def __call__(self, sources: list[Any]) -> list[Any]:
        traced = traced_modules(self.model)
        kept = [source for source in sources if id(source.module) not in traced]
        dropped = [source.name for source in sources if id(source.module) in traced and source.name not in self._warned]
        if dropped:
            self._warned.update(dropped)
            logger.warning("trainmon: features.attention: %d attention module(s) (%s) run inside torch.compile'd code, "
                           "which does not run hooks added after it was traced: they get no attn rows",
                           len(dropped), ", ".join(dropped[:5]) + (", ..." if len(dropped) > 5 else ""))
        return kept


def attach(ctx: StepContext, config: MonitorConfig, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None, options: AttachOptions) -> Attachment:
    """Build the collectors for a plain torch model (also under ``DistributedDataParallel``).

    Raises:
        TargetError: a target pattern matches no module or parameter.
        CompiledRootError: ``model.compile()`` was called on ``model`` (see :func:`refuse_root_compiled_in_place`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    optimizer, scaler = unwrap_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    refuse_root_compiled_in_place(model)
    root = unwrap_model(model)
    registry = HookRegistry()
    modules_named, module_aliases = named_modules(root)
    collectors: list[Collector] = []
    if config.activations.enabled:
        outside = OutsideCompiled(model)
        modules = outside(select_modules(modules_named, config, module_aliases))  # warns at attach already
        collectors.append(ActivationCollector(ctx, modules, config.activations, registry, select=outside,
                                                recheck_on=model))
    params, param_aliases = named_parameters(root)
    rank, world_size = process_groups.layout()
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        # one process: no data-parallel reduction can change a gradient inside the backward
        chosen = select_params(params, config, param_aliases)
        collectors.append(TorchOptimizerCollector(ctx, chosen, optimizer, config, registry,
                                                  batch_unreduced=world_size == 1))
    if config.grad_probe.enabled:
        from trainmon.probe.collector import GradProbe

        parts = optimizer_parts(optimizer) if optimizer is not None else []

        def exp_avg_of(param: torch.Tensor) -> torch.Tensor | None:  # from the inner optimizer of a container
            state = next((holder.state[param] for holder in map(state_holder, parts) if param in holder.state), None)
            exp_avg = state.get("exp_avg") if state else None
            return exp_avg if isinstance(exp_avg, torch.Tensor) else None

        collectors.append(GradProbe(ctx, select_params(params, config, param_aliases), config, registry, optimizer,
                                    exp_avg_of=exp_avg_of if [state_holder(p) for p in parts] != [optimizer] else None))
    if config.features.enabled:
        from trainmon.integrations.features import FeatureLayout, feature_collectors

        collectors += feature_collectors(ctx, config, modules_named, module_aliases, params, param_aliases, registry,
                                         FeatureLayout(select=CompiledFeatures(model)))
    # the optimizers holding the states (those of a container, a ZeroRedundancyOptimizer's local one)
    state_parts = next((c.parts for c in collectors if isinstance(c, TorchOptimizerCollector)), [])
    return Attachment(collectors=collectors, roots=[(model, 0)], modules=modules_named, optimizer=optimizer,
                      registry=registry, rank=rank, world_size=world_size, scaler=scaler,
                      replicated=replicated_families(model, state_parts, options) if world_size > 1 else None)
