"""DeepSpeed: ``monitor.attach(engine)`` for a ``DeepSpeedEngine`` under ZeRO 0/1/2/3.

What is measured where (see ``docs/deepspeed.md``):

- ``actv`` / ``actv_grad``: module hooks on ``engine.module`` (the generic activation collector).
- ``grad_unreduced``: ``param.grad`` in its post-accumulate-grad hook, on every rank, before
  DeepSpeed reduces it (the generic torch collector, without an optimizer).
- ``grad_reduced`` and ``param``: the rank-local shards of the averaged gradient and of the fp32
  master parameter at the start of ``engine.step()`` on an accumulation boundary (where
  DeepSpeed documents its gradient accessors as valid); optimizer states, ``update`` and
  ``ratio`` after it; ``precursors`` in a step post-hook of the torch optimizer DeepSpeed steps (inside
  ``engine.step()``, where the unscaled, clipped gradient it stepped with is still on the flat partition).
  Partial statistics of the shards are combined across the data-parallel group with ONE all-gather per step
  for all parameters, and written by the lowest rank of the data-parallel group that ``ranks`` selects
  (data-parallel rank 0 when ``ranks`` is null).
- scalars: ``grad_norm`` (``engine.get_global_grad_norm()``), ``loss_scale`` (fp16),
  ``skipped_steps``, ``step_applied``, ``global_steps``, ``lr/group{i}``.

There is no public hook at the end of ``engine.step()``, so the one engine instance is wrapped
(:class:`trainmon.collect.step_hooks.StepWrapper`: an instance attribute ``step``, removed on close); the class
is never patched.

This module attaches; the parts live in :mod:`.collect` (:class:`DeepSpeedShardCollector`), :mod:`.shards` (where
a parameter's shards live), :mod:`.groups`, :mod:`.probe` (the grad probe), :mod:`.guard` (the step guard) and
:mod:`.pipe` (the ``PipelineEngine``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainmon.base import process_groups
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.optimizer import TorchOptimizerCollector
from trainmon.collect.step_hooks import StepWrapper
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations.base import (
    Attachment,
    AttachOptions,
    named_modules,
    named_parameters,
    select_modules,
    select_params,
)
from trainmon.integrations.deepspeed.collect import DeepSpeedShardCollector
from trainmon.integrations.deepspeed.guard import guard_factory, guard_refusal
from trainmon.integrations.deepspeed.probe import grad_probe

if TYPE_CHECKING:
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig

__all__ = ["DeepSpeedShardCollector", "attach", "guard_refusal"]

logger = logging.getLogger("trainmon")


def attach(ctx: StepContext, config: MonitorConfig, engine: Any, optimizer: Any,
           options: AttachOptions) -> Attachment:
    """Build the collectors for a ``DeepSpeedEngine``.

    Args:
        ctx: the monitor's step context (its step follows ``engine.global_steps`` and its
            accumulation steps ``engine.gradient_accumulation_steps()``).
        config: the monitor config.
        engine: the engine returned by ``deepspeed.initialize``.
        optimizer: ignored (the engine owns its optimizer); must be None or the engine's.
        options: ``dp_group`` overrides the engine's data-parallel group.

    Raises:
        TypeError: ``engine`` is not a DeepSpeedEngine, or has no optimizer.
        TargetError: a target pattern matches no module or parameter.
    """
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"the deepspeed integration needs a DeepSpeedEngine, got {type(engine).__name__}")
    if optimizer is not None and optimizer is not engine.optimizer:
        raise TypeError("pass only the engine to attach(): DeepSpeed owns the optimizer")
    if isinstance(engine, PipelineEngine):  # train_batch() instead of forward/backward/step
        return _attach_pipeline(ctx, config, engine, options)
    if config.features.weights.enabled and engine.zero_optimization_stage() == 3:
        raise UnsupportedSetupError(
            "features.weights under DeepSpeed ZeRO-3: each rank holds a flat partition of every weight, not rows or "
            "columns of it, so the power iteration cannot combine the shards; turn features.weights off or use "
            "ZeRO-1/2 (docs/features.md)")
    module = engine.module
    ctx.grad_acc_steps = engine.gradient_accumulation_steps()
    if options.start_step == 0:
        ctx.step = engine.global_steps
    registry = HookRegistry()
    modules_named, module_aliases = named_modules(module)
    params, param_aliases = named_parameters(module)
    collectors: list[Collector] = []
    if config.activations.enabled:
        collectors.append(ActivationCollector(ctx, select_modules(modules_named, config, module_aliases),
                                              config.activations, registry))
    hooks = StepWrapper(engine, boundary=engine.is_gradient_accumulation_boundary).install()
    shard_collector = None
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        chosen = select_params(params, config, param_aliases)
        if "grad_unreduced" in ctx.specs:
            collectors.append(TorchOptimizerCollector(ctx, chosen, None, config, registry))
        dp_group = options.dp_group if options.dp_group is not None else getattr(engine, "data_parallel_group", None)
        shard_collector = DeepSpeedShardCollector(ctx, engine, chosen, config, hooks, dp_group)
        collectors.append(shard_collector)
    probe = None
    if config.grad_probe.enabled:
        try:
            probe = grad_probe(ctx, config, engine, select_params(params, config, param_aliases), registry, hooks,
                              options)
        except BaseException:
            hooks.uninstall()  # a failed attach leaves the engine as it was
            raise
        collectors.append(probe)
    if config.features.enabled:
        from trainmon.integrations.features import feature_collectors

        collectors += feature_collectors(ctx, config, modules_named, module_aliases, params, param_aliases, registry)
    rank, world_size = process_groups.layout()
    # a collective at the step's end: every rank collects the steps the writers collect
    collective = (shard_collector is not None and shard_collector.collective) or getattr(probe, "world", 1) > 1
    return Attachment(collectors=collectors, roots=[(module, 0)], modules=modules_named, optimizer=hooks,
                      registry=registry, rank=rank, world_size=world_size, collective=collective,
                      micro_steps_by_user=True, on_close=[hooks.uninstall],
                      replicated=shard_collector.replicated() if shard_collector is not None else None,
                      step_guard=guard_factory(engine, params, options, shard_collector))


def _attach_pipeline(ctx: StepContext, config: MonitorConfig, engine: Any, options: AttachOptions) -> Attachment:
    """Build the collectors for a ``PipelineEngine`` (see :mod:`trainmon.integrations.deepspeed.pipe`).

    Raises:
        PipelineSetupError: a set-up trainmon cannot monitor exactly (see :func:`.pipe.refusal`).
        TargetError: a target pattern matches no module or parameter of this stage.
    """
    from trainmon.integrations.deepspeed import pipe as deepspeed_pipe

    reason = deepspeed_pipe.refusal(engine, config)
    if reason is not None:
        raise deepspeed_pipe.PipelineSetupError(reason)
    if config.features.enabled:
        logger.warning("trainmon: features are not computed under DeepSpeed's PipelineEngine (docs/features.md)")
    module = engine.module
    ctx.grad_acc_steps = engine.gradient_accumulation_steps()  # the micro-batches of the schedule
    if options.start_step == 0:
        ctx.step = engine.global_steps
    registry = HookRegistry()
    named_modules = [(name, m, 0) for name, m in module.named_modules()]
    params = [(name, p, 0) for name, p in module.named_parameters()]
    collectors: list[Collector] = [deepspeed_pipe.BackwardMarks(ctx, module, registry)]
    if config.activations.enabled:
        collectors.append(ActivationCollector(ctx, select_modules(named_modules, config), config.activations, registry))
    # engine.step() raises here: the optimizer step is _take_model_step (inside train_batch, after ReduceGrads)
    optimizer_step = StepWrapper(engine, method="_take_model_step").install()
    batch = StepWrapper(engine, method="train_batch").install()
    batch.register_step_post_hook(deepspeed_pipe.loss_reader(ctx, batch))
    undo = [batch.uninstall, optimizer_step.uninstall]
    shard_collector = None
    try:
        if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
            chosen = select_params(params, config)
            if "grad_unreduced" in ctx.specs:
                collectors.append(TorchOptimizerCollector(ctx, chosen, None, config, registry))
            dp_group = options.dp_group if options.dp_group is not None else engine.data_parallel_group
            norm_group = options.pp_group if options.pp_group is not None else engine.grid.get_model_parallel_group()
            shard_collector = DeepSpeedShardCollector(ctx, engine, chosen, config, optimizer_step, dp_group, norm_group)
            collectors.append(shard_collector)
    except BaseException:
        for step in undo:
            step()  # a failed attach leaves the engine as it was
        raise
    rank, world_size = process_groups.layout()
    # collectives (shards over the data-parallel group, the ZeRO-0 norm over the stages): every rank collects
    # the steps the writers collect
    collective = shard_collector is not None and (
        shard_collector.collective or (shard_collector.layout.replicated and shard_collector.norm_world > 1))
    # The monitor step ends after the optimizer step (then at the next forward, monitor.step() or close()).
    return Attachment(collectors=collectors, roots=[(module, 0)], modules=named_modules, optimizer=optimizer_step,
                      registry=registry, rank=rank, world_size=world_size, pp_stage=int(engine.stage_id),
                      collective=collective, on_close=undo,
                      replicated=shard_collector.replicated() if shard_collector is not None else None)
