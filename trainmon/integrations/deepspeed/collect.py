"""The rows DeepSpeed's ZeRO shards make (``grad_reduced``, ``param``, optimizer states, ``update``, ``ratio``,
``precursors``) and the engine's scalars, measured on each rank's shards and combined over the data-parallel group
with one all-gather per step (see :mod:`trainmon.integrations.deepspeed`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainmon.base import process_groups
from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.collect.adam import AdamEntry, adam_update, coupled_groups, precursor_partials, update_ratio
from trainmon.collect.hooks import HookedCollector
from trainmon.collect.stats import combine_partials_torch, empty_partial
from trainmon.integrations.base import REPLICATED_FAMILIES, Replicated
from trainmon.integrations.deepspeed.shards import ShardLayout, layout_for

if TYPE_CHECKING:
    from trainmon.base.types import DeepSpeedParameter
    from trainmon.collect.context import StepContext
    from trainmon.collect.step_hooks import StepWrapper
    from trainmon.config import MonitorConfig

__all__ = ["DeepSpeedShardCollector"]

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
