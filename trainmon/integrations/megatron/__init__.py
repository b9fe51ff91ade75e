"""Megatron-Core: a list of model chunks (virtual pipeline) and a Megatron optimizer.

``monitor.attach(model_chunks, optimizer)`` where ``model_chunks`` is what Megatron's
``get_model`` returns (each chunk usually ``DistributedDataParallel(Float16Module(GPTModel))``)
and ``optimizer`` what ``get_megatron_optimizer`` returns (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer`` or a ``ChainedOptimizer`` of them).
Process groups come from ``megatron.core.parallel_state`` when it is initialised; explicit
``tp_group``/``pp_group`` override them. Shards of the distributed optimizer are always combined
over the optimizer's own ``data_parallel_group`` (an explicit ``dp_group`` with other ranks gets
one warning). See docs/megatron.md.

This module attaches; the parts live in :mod:`.chunks` (unwrapping and naming the chunks), :mod:`.optimizer`
(the leaves of a Megatron optimizer, where its main parameters live), :mod:`.groups` (process groups),
:mod:`.collect` (the collectors), :mod:`.features`, :mod:`.probe` (the grad probe), :mod:`.guard` (the step guard)
and :mod:`.actions`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base import process_groups
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.step_hooks import StepWrapper
from trainmon.integrations.base import (
    Attachment,
    AttachOptions,
    named_modules,
    named_parameters,
    select_modules,
    select_params,
)
from trainmon.integrations.megatron.chunks import chunks_named, unwrap
from trainmon.integrations.megatron.collect import (
    GroupLayout,
    MegatronActivationCollector,
    MegatronParamCollector,
)
from trainmon.integrations.megatron.features import megatron_features
from trainmon.integrations.megatron.groups import check_dp_group, model_parallel_groups, replicated_families
from trainmon.integrations.megatron.guard import guard_factory, guard_refusal
from trainmon.integrations.megatron.optimizer import leaf_optimizers, main_params
from trainmon.integrations.megatron.probe import grad_probe

if TYPE_CHECKING:
    from trainmon.base.types import MegatronParameter
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig

__all__ = ["attach", "check_dp_group", "grad_probe", "guard_refusal", "leaf_optimizers", "main_params",
           "model_parallel_groups", "replicated_families", "unwrap"]

logger = logging.getLogger("trainmon")

def _computes_grad_norm(optimizer: Any) -> bool:
    """Whether ``optimizer.step()``'s grad norm is one: a ``ChainedOptimizer`` (what ``get_megatron_optimizer``
    returns) always computes it; a bare Megatron optimizer only with ``clip_grad > 0`` (else it returns 0.0)."""
    if getattr(optimizer, "chained_optimizers", None) is not None:
        return True
    return float(getattr(getattr(optimizer, "config", None), "clip_grad", 1.0)) > 0.0


def _record_step_result(ctx: StepContext, wrapper: StepWrapper) -> Callable[..., None]:
    """A step post-hook that records what Megatron's ``optimizer.step()`` returned and knows.

    ``(update_successful, grad_norm, num_zeros)``: ``step_skipped`` (and Megatron's own name
    ``skipped_iter``) is 1 when the step was skipped for non-finite gradients; ``grad_norm`` is
    Megatron's pre-clip norm; ``loss_scale`` and ``lr/group{i}``.
    """
    def hook(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        result = wrapper.last_result
        if not ctx.collecting or not (isinstance(result, tuple) and len(result) == 3):
            return
        ok, grad_norm, num_zeros = result
        buffer = ctx.buffer
        buffer.add_scalar("skipped_iter", 0.0 if ok else 1.0)
        buffer.add_scalar("step_skipped", 0.0 if ok else 1.0)
        if grad_norm is not None and _computes_grad_norm(optimizer):
            buffer.add_scalar("grad_norm", grad_norm)
        if num_zeros is not None:
            buffer.add_scalar("num_zeros", num_zeros)
        scale = optimizer.get_loss_scale()
        if scale is not None:
            buffer.add_scalar("loss_scale", scale)
        for i, group in enumerate(optimizer.param_groups):
            buffer.add_scalar(f"lr/group{i}", group["lr"])

    return hook


def attach(ctx: StepContext, config: MonitorConfig, model: Any, optimizer: Any,
           options: AttachOptions) -> Attachment:
    """Build the collectors for Megatron-Core model chunks and their optimizer.

    Args:
        ctx: the monitor's step context.
        config: the monitor config.
        model: a model chunk or the list of chunks (one per virtual pipeline stage).
        optimizer: the Megatron optimizer, or None.
        options: ``grad_acc_steps`` (set it to the number of micro-batches) and process groups
            (``dp_group`` is only checked against the distributed optimizer's, see :func:`check_dp_group`).

    Raises:
        TargetError: a target pattern matches no module or parameter.
        TypeError: the optimizer is not a supported Megatron optimizer.
    """
    chunks: Sequence[torch.nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]
    roots = [unwrap(chunk) for chunk in chunks]
    tp_group, pp_group = model_parallel_groups(options)
    tp_rank, tp_size = process_groups.layout(tp_group, none_is_world=False)
    pp_stage = process_groups.group_rank(pp_group, none_is_world=False)
    registry = HookRegistry()
    modules_named, module_aliases = chunks_named(roots, named_modules)
    collectors: list[Collector] = []
    if config.activations.enabled:
        collectors.append(MegatronActivationCollector(ctx, select_modules(modules_named, config, module_aliases),
                                                      config.activations, registry))
    params, param_aliases = chunks_named(roots, named_parameters)
    chosen = functools.partial(select_params, params, config, param_aliases)  # raises only when called
    layout = GroupLayout(tp_group, tp_size, tp_rank)
    if config.features.enabled:
        collectors += megatron_features(ctx, config, modules_named, module_aliases, params, param_aliases, registry,
                                        layout)
    if isinstance(optimizer, torch.optim.Optimizer):
        # A plain torch optimizer (NVIDIA's examples/run_simple_mcore_train_loop.py): its own
        # step hooks and the torch collectors, which read ``param.grad`` as it stands.
        return _attach_torch_optimizer(ctx, config, roots, modules_named, chosen, optimizer, collectors,
                                       registry, pp_stage, tp_size)
    step_hooks = None
    if optimizer is not None:
        step_hooks = StepWrapper(optimizer).install()
        step_hooks.register_step_post_hook(ctx.guard.wrap("step", _record_step_result(ctx, step_hooks)))
    mains = main_params(optimizer) if optimizer is not None else {}
    replicated = None
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        check_dp_group(options.dp_group, mains)
        collectors.append(MegatronParamCollector(ctx, chosen(), mains, layout, config, registry))
        replicated = replicated_families(mains, options)
    if config.grad_probe.enabled:
        try:
            probe = grad_probe(ctx, config, chosen(), mains, layout, registry)
        except BaseException:
            if step_hooks is not None:
                step_hooks.uninstall()  # a failed attach leaves the optimizer as it was
            raise
        if probe is not None:
            collectors.append(probe)
    rank, world_size = process_groups.layout()
    attachment = Attachment(collectors=collectors, roots=[(root, vpp) for vpp, root in enumerate(roots)],
                            modules=modules_named, optimizer=step_hooks, registry=registry, rank=rank,
                            world_size=world_size, pp_stage=pp_stage, collective=world_size > 1,
                            replicated=replicated,
                            step_guard=None if optimizer is None else guard_factory(optimizer, params, mains, layout))
    if step_hooks is not None:
        attachment.on_close.append(step_hooks.uninstall)
    return attachment


def _attach_torch_optimizer(ctx: StepContext, config: MonitorConfig, roots: list[torch.nn.Module],
                            named_modules: list[tuple[str, torch.nn.Module, int]],
                            chosen: Callable[[], list[tuple[str, MegatronParameter, int]]],
                            optimizer: torch.optim.Optimizer,
                            collectors: list[Collector], registry: HookRegistry, pp_stage: int,
                            tp_size: int = 1) -> Attachment:
    """Megatron-Core model chunks trained with a ``torch.optim`` optimizer.

    Under Megatron's DDP the gradients live in ``param.main_grad`` and ``param.grad`` stays None:
    the torch collectors then see no gradient, so that combination warns once.
    """
    from trainmon.collect.optimizer import TorchOptimizerCollector

    if any(hasattr(p, "main_grad") for root in roots for p in root.parameters()):
        logger.warning("trainmon: a torch optimizer over Megatron DDP chunks: gradients live in param.main_grad, "
                       "which a torch optimizer does not use; grad rows and grad_norm may be missing")
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        collectors.append(TorchOptimizerCollector(ctx, chosen(), optimizer, config, registry))
    if config.grad_probe.enabled and tp_size > 1:
        logger.warning("trainmon: grad_probe over tensor-parallel chunks needs the Megatron optimizer (it knows "
                       "the partitions); with a torch optimizer it is off")
    elif config.grad_probe.enabled:
        from trainmon.probe.collector import GradProbe

        collectors.append(GradProbe(ctx, chosen(), config, registry, optimizer))
    rank, world_size = process_groups.layout()
    # the tensor-parallel power iterations all-reduce over the TP group: every rank collects the same steps
    split = any(getattr(c, "collective", False) for c in collectors)
    return Attachment(collectors=collectors, roots=[(root, vpp) for vpp, root in enumerate(roots)],
                      modules=named_modules, optimizer=optimizer, registry=registry, rank=rank,
                      world_size=world_size, pp_stage=pp_stage, collective=split)
