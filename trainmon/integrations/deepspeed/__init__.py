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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base import process_groups
from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.adam import AdamEntry, adam_update, coupled_groups, precursor_partials, update_ratio
from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.collect.optimizer import TorchOptimizerCollector
from trainmon.collect.stats import combine_partials_torch, empty_partial
from trainmon.collect.step_hooks import StepWrapper
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
from trainmon.integrations.deepspeed.shards import ShardLayout, layout_for

if TYPE_CHECKING:
    from collections.abc import Callable

    from trainmon.base.guard import Guard
    from trainmon.base.types import DeepSpeedParameter
    from trainmon.collect.context import Collector, StepContext
    from trainmon.collect.step_guard import GuardedSteps, GuardFactory
    from trainmon.config import GuardConfig, MonitorConfig

logger = logging.getLogger("trainmon")

_STATES = ("exp_avg", "exp_avg_sq")


class DeepSpeedShardCollector(HookedCollector):
    """``grad_reduced``, ``param``, optimizer states, ``update``, ``ratio`` and the engine's scalars.

    Hooks compute partial statistics of the local shards (no host sync) and keep them pending;
    :meth:`before_transfer` stacks them into ``[N, 8]`` and runs THE collective of the step
    (one ``all_gather`` over the data-parallel group), then combines on the device. Every rank
    produces the same rows in the same order (an empty partial where it holds no element).

    Args:
        ctx: the monitor's step context.
        engine: the ``DeepSpeedEngine``.
        params: ``(name, parameter, vpp_stage)`` of the target parameters.
        config: the monitor config.
        hooks: the engine's boundary hooks.
        dp_group: the data-parallel process group (None: the default group).
        norm_group: the pipeline stages of this replica, whose ZeRO-0 norms make ``grad_norm`` (None: one stage).

    The combined rows are identical on every rank of the group, so they are written once, by
    the lowest *selected* (``config.ranks``) global rank of the group (by every rank with
    ``write_replicated_once: false``); every rank still joins the collective.
    """

    def __init__(self, ctx: StepContext, engine: Any, params: list[tuple[str, DeepSpeedParameter, int]],
                 config: MonitorConfig, hooks: StepWrapper, dp_group: Any = None, norm_group: Any = None) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.params = params
        self.layout: ShardLayout = layout_for(engine, [p for _, p, _ in params] or engine.module.parameters())
        self.states = [s for s in config.optimizer_states.states if s in ctx.specs and s != "momentum"]
        self.dp_group = dp_group
        rank, world = process_groups.layout(dp_group)
        self.dp_rank, self.dp_world = rank, world
        self.writes_rows = not config.write_replicated_once or process_groups.is_lowest_selected(dp_group,
                                                                                                 config.ranks)
        self.collective = not self.layout.replicated and world > 1
        self.norm_group = norm_group
        self.norm_world = process_groups.group_size(norm_group, none_is_world=False)
        self._pending: list[tuple[str, str, int, torch.Tensor]] = []
        self.precursors = PRECURSORS in ctx.specs and self.layout.optimizer is not None
        self._precursors: dict[str, torch.Tensor] = {}
        """This step's ``[16]`` precursor partial per parameter name, from the inner optimizer's step hooks."""
        self.guard_norm: torch.Tensor | float | None = None
        """The global norm the step guard judged, on a step DeepSpeed skipped (it reports its own as Inf then)."""
        self.keep(hooks.register_step_pre_hook(self.guarded(self._pre_step)))
        self.keep(hooks.register_step_post_hook(self.guarded(self._post_step)))

    HOOK_GROUPS = ("deepspeed_inner_step",)

    def install_hooks(self) -> None:
        """The precursors' hook on the torch optimizer DeepSpeed steps: inside ``engine.step()``, where the gradient
        it steps with (unscaled, clipped) is still on its flat fp32 partition, which DeepSpeed frees right after."""
        inner = self.layout.optimizer
        if self.precursors and inner is not None:
            self.registry.add(self.HOOK_GROUPS[0], inner.register_step_post_hook(self.guarded(self._inner_step)))

    def reset(self) -> None:
        self._pending.clear()
        self._precursors.clear()

    def record_guard_norm(self, norm: torch.Tensor | float) -> None:
        """The step guard's global norm of a step DeepSpeed skipped: recorded as ``grad_norm`` instead of the Inf
        DeepSpeed reports for every skipped step (a skipped spike is not a non-finite norm)."""
        self.guard_norm = norm

    def replicated(self) -> Replicated | None:
        """The rows written once per data-parallel group (under ZeRO-0 too: the averaged gradients and what the
        optimizer makes of them are the same on every rank), or None with a group of one."""
        if self.dp_world == 1:
            return None
        return Replicated(tuple(f for f in REPLICATED_FAMILIES if f != "momentum"), self.dp_group, combined=True)

    # ------------------------------------------------------------------------- hooks
    def _measure(self, family: str, name: str, vpp_stage: int, tensor: torch.Tensor | None) -> None:
        spec = self.ctx.specs[family]
        from trainmon.collect.stats import partial_stats

        device = self.engine.device if tensor is None else tensor.device
        partial = empty_partial(torch.device(device)) if tensor is None else partial_stats(tensor, spec)
        self._pending.append((family, name, vpp_stage, partial))

    def _pre_step(self, engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ctx, layout = self.ctx, self.layout
        self.guard_norm = None  # an uncollected step's
        if not ctx.collecting:
            return
        for name, param, vpp_stage in self.params:
            if "grad_reduced" in ctx.specs:
                self._measure("grad_reduced", name, vpp_stage, layout.grad(param))
            if "param" in ctx.specs:
                self._measure("param", name, vpp_stage, layout.master(param))
        if layout.replicated and getattr(engine.optimizer, "_global_grad_norm", None) is None:
            self.replicated_grad_norm(engine)

    def replicated_grad_norm(self, engine: Any) -> None:
        """``grad_norm`` under ZeRO-0 with a plain torch optimizer, where DeepSpeed computes none.

        Every rank has all gradients of its model (averaged over the data-parallel group). A pipeline
        stage has only its layers': the squared norms are summed over ``norm_group`` (the stages of
        this replica), a weight tied across stages counted once, on its owner (DeepSpeed marks the
        other copies ``ds_pipe_replicated`` and counts them so too). This runs at the start of the
        optimizer step, the one point every stage is sure to reach together (the schedule ends with
        the tied-weight all-reduce, the gradient reduction and the optimizer step on every stage);
        the end of the monitor step is not: a collective there would deadlock the pipeline.
        """
        grads = [p.grad for p in engine.module.parameters()
                 if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
        if self.norm_world == 1:
            if grads:
                self.ctx.buffer.add_scalar("grad_norm", torch.nn.utils.get_total_norm(grads, 2.0, foreach=True))
            return
        norm = (torch.nn.utils.get_total_norm(grads, 2.0, foreach=True) if grads
                else torch.zeros((), device=torch.device(engine.device)))  # a stage without gradients joins too
        squared = norm.to(torch.float32).square()
        import torch.distributed as dist

        dist.all_reduce(squared, group=self.norm_group)  # THE collective of the step (ZeRO-0: no shard combined)
        self.ctx.buffer.add_scalar("grad_norm", squared.sqrt())

    def _post_step(self, engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ctx, layout = self.ctx, self.layout
        if not ctx.collecting:
            return
        buffer = ctx.buffer
        applied = bool(engine.was_step_applied())
        norm = engine.get_global_grad_norm()
        if not applied and self.guard_norm is not None:
            norm = self.guard_norm  # the step guard's skip: the norm it judged, not DeepSpeed's Inf
        self.guard_norm = None
        if norm is not None:
            buffer.add_scalar("grad_norm", norm)  # a device tensor stays on the device until the transfer
        if engine.fp16_enabled():
            scale = getattr(engine.optimizer, "cur_scale", None)
            scale = getattr(engine.optimizer, "loss_scale", None) if scale is None else scale
            if scale is not None:
                buffer.add_scalar("loss_scale", scale)
        buffer.add_scalar("skipped_steps", engine.skipped_steps)
        buffer.add_scalar("step_applied", int(applied))
        buffer.add_scalar("step_skipped", int(not applied))
        buffer.add_scalar("global_steps", engine.global_steps)
        for i, lr in enumerate(engine.get_lr()):
            buffer.add_scalar(f"lr/group{i}", lr)
        if self.precursors and applied:  # every rank the same rows (an empty partial where it measured none)
            empty = empty_partial(torch.device(engine.device))
            for name, _, vpp_stage in self.params:
                partial = self._precursors.get(name)
                self._pending.append((PRECURSORS, name, vpp_stage, empty if partial is None else partial[:8]))
                self._pending.append((PRECURSORS_TAIL, name, vpp_stage, empty if partial is None else partial[8:]))
        self._precursors.clear()
        if not self.states:
            return
        context = layout.adam_context() if ("update" in self.states or "ratio" in self.states) else {}
        for name, param, vpp_stage in self.params:
            shards = {key: layout.state(param, key) for key in _STATES}
            for key in _STATES:
                if key in self.states:
                    self._measure(key, name, vpp_stage, shards[key])
            if "update" not in self.states and "ratio" not in self.states:
                continue
            update = None
            if shards["exp_avg"] is not None and shards["exp_avg_sq"] is not None:
                found = context.get(shards["exp_avg"].untyped_storage().data_ptr())
                if found is not None:
                    state, group = found
                    update = adam_update({"exp_avg": shards["exp_avg"], "exp_avg_sq": shards["exp_avg_sq"],
                                          "step": state.get("step")}, group)
            if "update" in self.states:
                self._measure("update", name, vpp_stage, update)
            if "ratio" in self.states:
                ratio = None
                if update is not None:
                    master = layout.master(param)
                    ratio = None if master is None else update_ratio(update, master)
                self._measure("ratio", name, vpp_stage, ratio)

    def _inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After the inner optimizer stepped some of its flat partitions (ZeRO 1/2: one parameter group per call,
        ZeRO-3: one sub-group): the precursors of the target parameters whose local shard lies in them, read as
        views of the flat partition, its ``.grad`` and its states at the shard's offset (no copy)."""
        if not self.ctx.collecting:
            return
        stepped = {flat.untyped_storage().data_ptr(): (flat, group)
                   for group in optimizer.param_groups for flat in group["params"]}
        entries: list[AdamEntry] = []
        grads: list[torch.Tensor | None] = []
        names: list[str] = []
        for name, param, _ in self.params:
            master = self.layout.master(param) if name not in self._precursors else None
            if master is None or master.numel() == 0:
                continue
            found = stepped.get(master.untyped_storage().data_ptr())
            if found is None:
                continue
            flat, group = found
            state = optimizer.state.get(flat)
            if flat.grad is None or not state or not isinstance(state.get("exp_avg"), torch.Tensor):
                continue
            offset, count = master.storage_offset() - flat.storage_offset(), master.numel()

            def piece(tensor: torch.Tensor, offset: int = offset, count: int = count) -> torch.Tensor:
                return tensor.reshape(-1).narrow(0, offset, count)

            local = {key: piece(value) if isinstance(value, torch.Tensor) and value.numel() == flat.numel() else value
                     for key, value in state.items()}
            local.setdefault("step", group.get("step"))
            entries.append((piece(flat), local, group))
            grads.append(piece(flat.grad))
            names.append(name)
        if entries:
            measured = precursor_partials(entries, grads, coupled_groups([optimizer]))
            self._precursors.update((name, partial) for name, partial in zip(names, measured) if partial is not None)

    # ------------------------------------------------------------------------- step end
    def before_transfer(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        partials = torch.stack([p for *_, p in pending])
        if self.collective:  # THE collective of the step: every rank's [N, 8] partials, combined on the device
            partials = combine_partials_torch(process_groups.all_gather_stacked(partials, self.dp_group, self.dp_world))
        if not self.writes_rows:
            return  # replicated statistics are written once, by the group's lowest selected rank
        for i, (family, name, vpp_stage, _) in enumerate(pending):
            self.ctx.add(family, name, partials[i], vpp_stage)


def _grad_probe(ctx: StepContext, config: MonitorConfig, engine: Any, params: list[tuple[str, DeepSpeedParameter, int]],
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
                            exp_avg_of=exp_avg_of, group=_dp_group(engine, params, options))


def _dp_group(engine: Any, params: list[tuple[str, DeepSpeedParameter, int]], options: AttachOptions) -> Any:
    """The group the ZeRO partitions are spread over: ZeRO-3's ``ds_process_group``, else the data-parallel group."""
    if options.dp_group is not None:
        return options.dp_group
    groups = {id(p.ds_process_group): p.ds_process_group for _, p, _ in params if hasattr(p, "ds_process_group")}
    if len(groups) == 1:
        return next(iter(groups.values()))
    return getattr(engine, "data_parallel_group", None)


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
            probe = _grad_probe(ctx, config, engine, select_params(params, config, param_aliases), registry, hooks,
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
                      step_guard=_guard_factory(engine, params, options, shard_collector))


def guard_refusal(engine: Any) -> str | None:
    """Why the step guard cannot hold back this engine's steps exactly, or None when it can.

    Supported: ``DeepSpeedEngine`` (not the pipeline engine) in fp32 or bf16 under ZeRO 0-3 without offload, with
    DeepSpeed's ZeRO 1/2, ZeRO-3, BF16 or unfused ZeRO-0 bf16 optimizer, or a torch optimizer under ZeRO-0 fp32.
    """
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, DeepSpeedEngine):
        return None  # attach() says what it needs
    if isinstance(engine, PipelineEngine):
        return "DeepSpeed's PipelineEngine (train_batch) is not supported by the step guard yet"
    if engine.fp16_enabled():
        return ("fp16 is not supported: DeepSpeed's overflow skip also lowers its dynamic loss scale, so a step the "
                "guard skips would change the run's later loss scales (use bf16)")
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return "torch autocast with DeepSpeed's GradScaler is not supported (a GradScaler skips its own steps)"
    optimizer = engine.optimizer
    if optimizer is None:
        return "the engine has no optimizer"
    from trainmon.integrations.deepspeed.guard import optimizer_kind

    kind = optimizer_kind(optimizer)
    if kind is None:
        return (f"DeepSpeed's optimizer wrapper {type(optimizer).__name__} is not supported (supported: ZeRO 1/2 and "
                "3, the BF16 optimizer, ZeRO-0 bf16's unfused wrapper, a torch optimizer under ZeRO-0 fp32)")
    if kind == "zero" and optimizer.cpu_offload or kind == "zero3" and (
            optimizer.offload_optimizer or getattr(optimizer, "offload_param", False)):
        return "ZeRO-Offload is not supported (DeepSpeed checks offloaded gradients for overflow during backward)"
    if kind == "zero" and not optimizer.compute_grad_norm:
        return "zero_optimization.compute_grad_norm: false is not supported (DeepSpeed then checks no norm)"
    if kind == "zero" and optimizer.dtype == torch.bfloat16 and not optimizer.check_grad_overflow:
        return ("bf16.check_grad_overflow: false is not supported: DeepSpeed then applies a step whatever its norm, "
                "so it has no skip to take")
    return None


def _guard_factory(engine: Any, params: list[tuple[str, DeepSpeedParameter, int]], options: AttachOptions,
                   collector: DeepSpeedShardCollector | None) -> GuardFactory:
    """Builds the step guard on ``engine`` (``anomaly.guard``): every trainable parameter, judged from this rank's
    shards of the reduced gradients (summed over the group they are spread over)."""

    def build(settings: GuardConfig, guard: Guard, on_decided: Callable[[torch.Tensor | float], None]
              ) -> GuardedSteps:
        from trainmon.integrations.deepspeed.guard import DeepSpeedStepGuard

        trainable = [item for item in params if item[1].requires_grad]
        layout = layout_for(engine, [param for _, param, _ in trainable])
        group = None if layout.replicated else _dp_group(engine, trainable, options)
        return DeepSpeedStepGuard(settings, engine, layout, [(name, param) for name, param, _ in trainable], guard,
                                  on_decided, group, None if collector is None else collector.record_guard_norm)

    return build


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
