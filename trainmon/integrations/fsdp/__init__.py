"""FSDP2: ``monitor.attach(model, optimizer)`` for a model sharded with ``torch.distributed.fsdp.fully_shard``.

What is measured where (see ``docs/fsdp.md``):

- ``actv`` / ``actv_grad``: module hooks, as for plain torch (FSDP2 keeps the user's module names).
- ``grad_unreduced``: this rank's own full gradient, before FSDP reduce-scatters it, from
  post-accumulate-grad hooks on the *unsharded* parameters (:mod:`trainmon.integrations.fsdp.unsharded`:
  found by a forward pre-hook of each FSDP module, or from FSDP2's records for FSDP modules that run
  compiled, which get no hook of trainmon's).
- ``grad_reduced``, ``param``, optimizer states (Adam ``exp_avg``/``exp_avg_sq``, ``update``,
  ``ratio``, ``precursors``; SGD ``momentum``): measured on this rank's local shard (``DTensor.to_local()``; no
  gather, no redistribution) in the optimizer's step hooks; scalar ``grad_norm`` from the local
  shards' norms at the end of the backward pass (pre-clip). The partial statistics of all of
  them go through ONE ``all_gather`` of an ``[N, 8]`` tensor per collected step over the shard
  mesh dimension, are combined on the device (:func:`combine_partials_torch`), and so equal the
  full tensors' statistics on every rank. They are written by the lowest rank of the shard group
  that ``ranks`` selects (by every rank with ``write_replicated_once: false``). HSDP (a 2-D replicate x shard
  mesh): combined over the shard dimension only, i.e. once per replica (replicas hold identical values after
  FSDP's all-reduce).

- ``grad_probe``: :mod:`trainmon.integrations.fsdp.probe` (the local shards' partials and sign bits,
  one gather per collected step).

Layouts other than ``Shard(d)`` on one mesh dimension (FSDP) or ``(Replicate(), Shard(d))``
(HSDP) — tensor parallelism, ``_StridedShard``, ``Partial``, parameters FSDP does not manage —
and FSDP1 (``FullyShardedDataParallel``) are refused at ``attach`` with :class:`FSDPLayoutError`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base import process_groups
from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.adam import adam_partials_cpu, adam_update, coupled_groups, precursor_partials, update_ratio
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.optimizer import TorchOptimizerCollector, global_grad_norm
from trainmon.collect.optimizer_parts import other_rule_groups, param_groups_of, state_holder, states_of
from trainmon.collect.optimizer_states import unless_skipped
from trainmon.collect.stats import combine_partials_torch, empty_partial
from trainmon.collect.step_hooks import scale_of, unwrap_optimizer
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
from trainmon.integrations.fsdp.layout import FSDPLayoutError, ShardGroup, local_shard, shard_group_of
from trainmon.integrations.fsdp.unsharded import GROUP as UNSHARDED
from trainmon.integrations.fsdp.unsharded import UnshardedGradHooks, fsdp_modules, unsharded_owners
from trainmon.integrations.torch import CompiledFeatures, OutsideCompiled, refuse_root_compiled_in_place, unwrap_model

if TYPE_CHECKING:
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig

logger = logging.getLogger("trainmon")

_STEP = "fsdp_optimizer_step"


class FSDPOptimizerCollector(TorchOptimizerCollector):
    """The torch optimizer collector on FSDP2's DTensor shards, combined with one collective per step.

    Rows of the optimizer phase and the local part of ``grad_norm`` are kept pending (device
    tensors, no sync) and combined in :meth:`before_transfer` by ONE ``all_gather`` over the shard
    group; every rank appends the same rows in the same order (which rows exist depends only on
    what every rank has: a gradient, an optimizer state), an empty shard giving an empty partial.

    Args:
        ctx: the monitor's step context.
        params: ``(name, sharded parameter, vpp_stage)`` of the target parameters.
        optimizer: the optimizer (stepping the sharded parameters), or None.
        config: the monitor config.
        registry: where the hook handles live.
        shards: the shard group (from :func:`shard_group_of`).
        unsharded_owners: ``(FSDP module, [(name, owner module, attribute, vpp_stage)])``: where
            each target parameter's unsharded version appears during that FSDP module's forward.
        writes_rows: whether this rank writes the combined rows (the lowest selected rank of the group; every
            rank with ``write_replicated_once: false``).
        model: the model given to ``attach`` (its forward ends outside compiled code: the root is
            never compiled in place), for :func:`traced_modules` and the after-forward hook.
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, torch.nn.Parameter, int]],
                 optimizer: torch.optim.Optimizer | None, config: MonitorConfig, registry: HookRegistry,
                 shards: ShardGroup, unsharded_owners: list[tuple[torch.nn.Module, list[tuple[str, Any, str, int]]]],
                 writes_rows: bool, model: torch.nn.Module) -> None:
        super().__init__(ctx, params, optimizer, config, registry)
        self.shards = shards
        self.unsharded_owners = unsharded_owners
        self.unsharded = UnshardedGradHooks(ctx, model, unsharded_owners, registry, self._grad_hook, self.guarded)
        self.writes_rows = writes_rows
        self.collective = shards.size > 1
        self._device = _collective_device(shards) if self.collective else None
        self._rows: list[tuple[str, str, int, torch.Tensor]] = []
        """This rank's shard rows ``(family, name, vpp, partial)``, combined in the step's one collective."""
        self._warned: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------------- hooks
    HOOK_GROUPS = (UNSHARDED, _STEP)
    reads_missing_grads = False  # the hooks see the unsharded parameters, not the sharded ones held here

    def install_hooks(self) -> None:
        if "grad_unreduced" in self.ctx.specs:
            self.unsharded.install()
        if self.optimizer is not None:
            self.registry.add(_STEP, self.optimizer.register_step_pre_hook(self.guarded(self._pre_step)))
            if self._states or self._precursors:
                self.registry.add(_STEP, self.optimizer.register_step_post_hook(self.guarded(self._post_step)))

    def reset(self) -> None:
        self.unsharded.reset()
        self._rows.clear()
        self._norm, self._norm_final = None, False

    def _backward_ended(self) -> None:
        """End of a backward pass (after FSDP's reduce-scatter): the norm of this rank's gradient shards."""
        ctx = self.ctx
        if self._norm_final or ctx.micro_step < ctx.grad_acc_steps - 1 or self.optimizer is None:
            return
        self._norm = self._local_norm()

    def _local_norm(self) -> torch.Tensor | None:
        assert self.optimizer is not None
        grads = [local_shard(p.grad) for group in param_groups_of(self.parts) for p in group["params"]
                 if p.grad is not None]
        if not grads:
            return None
        norm = global_grad_norm(grads)
        scale = scale_of(self.ctx.scaler)
        return norm if scale is None else norm / scale.to(norm.device, torch.float32)

    def _measure_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``grad_reduced`` and ``param`` shards of what the optimizer steps with; ``lr``."""
        ctx = self.ctx
        if not ctx.collecting:
            return
        for name, param, vpp_stage in self.params:
            if param.grad is not None:
                self._shard("grad_reduced", name, vpp_stage, param.grad)
            self._shard("param", name, vpp_stage, param)
        self._finish_step_measurement(optimizer)

    def _norm_as_it_stands(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        return self._local_norm()  # this rank's shards; combined with the rows in the step's one collective

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        ctx = self.ctx
        if not ctx.collecting or ctx.state_init_step:  # not a training step: nothing to measure
            return
        found = states_of(self.parts)
        adam = "update" in self._states or "ratio" in self._states
        other_rule = other_rule_groups(self.parts) if adam or self._precursors else frozenset()
        precursors: list[tuple[str, int, tuple[torch.Tensor, dict[str, Any], dict[str, Any]], torch.Tensor]] = []
        for name, param, vpp_stage in self.params:
            state, group = found.get(id(param), (None, {}))
            if not state:
                continue
            for family in ("exp_avg", "exp_avg_sq"):
                if family in self._states and family in state:
                    self._shard(family, name, vpp_stage, state[family])
            if "momentum" in self._states and state.get("momentum_buffer") is not None:
                self._shard("momentum", name, vpp_stage, state["momentum_buffer"])
            if id(group) in other_rule:  # NAdam, RAdam: Adam's arithmetic would not be their update
                continue
            if adam and "exp_avg" in state and "exp_avg_sq" in state:
                self._adam_rows(name, vpp_stage, state, group, local_shard(param))
            if self._precursors and param.grad is not None and all(
                    state.get(key) is not None for key in ("exp_avg", "exp_avg_sq", "step")):
                local = {key: local_shard(value) if isinstance(value, torch.Tensor) else value
                         for key, value in state.items()}
                precursors.append((name, vpp_stage, (local_shard(param), local, group), local_shard(param.grad)))
        if precursors:
            self._precursor_rows(precursors, getattr(optimizer, "found_inf", None))

    def _precursor_rows(self, rows: list[tuple[str, int, tuple[torch.Tensor, dict[str, Any], dict[str, Any]],
                                                torch.Tensor]], found_inf: Any = None) -> None:
        """The ``precursors`` rows of the local shards, all at once (the same elementwise sums as on whole tensors:
        the step's collective combines them); a shard that gives none still adds empty ones, so that every rank
        keeps the same rows; empty ones too where a fused optimizer skipped the step (``found_inf``)."""
        measured = precursor_partials([row[2] for row in rows], [row[3] for row in rows],
                                      coupled_groups([state_holder(part) for part in self.parts]))
        for (name, vpp_stage, (param, _, _), _), partial in zip(rows, measured):
            head, tail = (partial[:8], partial[8:]) if partial is not None else \
                (empty_partial(param.device), empty_partial(param.device))
            head, tail = unless_skipped(head, found_inf), unless_skipped(tail, found_inf)
            self._rows.append((PRECURSORS, name, vpp_stage, head))
            self._rows.append((PRECURSORS_TAIL, name, vpp_stage, tail))

    def _adam_rows(self, name: str, vpp_stage: int, state: dict[str, Any], group: dict[str, Any],
                   param: torch.Tensor) -> None:
        """``update`` and ``ratio`` of the local shard (the same elementwise arithmetic as on whole tensors)."""
        local = {key: local_shard(value) if isinstance(value, torch.Tensor) else value for key, value in state.items()}
        families: list[str] = [f for f in ("update", "ratio") if f in self._states]
        if param.numel() == 0:
            for family in families:
                self._rows.append((family, name, vpp_stage, empty_partial(param.device)))
            return
        fused = adam_partials_cpu(local, group, param, self.ctx.specs.get("update"), self.ctx.specs.get("ratio"))
        if fused is not None:
            for family, partial in zip(("update", "ratio"), fused):
                if family in families and partial is not None:  # a family's partial is None without its spec
                    self._rows.append((family, name, vpp_stage, partial))
            return
        update = adam_update(local, group)
        if update is None:  # the same on every rank (same state keys): rows stay aligned
            return
        if "update" in families:
            self._shard("update", name, vpp_stage, update)
        if "ratio" in families:
            self._shard("ratio", name, vpp_stage, update_ratio(update, param))

    def _shard(self, family: str, name: str, vpp_stage: int, tensor: torch.Tensor) -> None:
        """Partial statistics of this rank's shard of ``tensor``, kept for the step's collective.

        A shard that cannot be measured still adds an (empty) partial, so every rank keeps the
        same rows; it is warned about once.
        """
        spec = self.ctx.specs.get(family)
        if spec is None:
            return
        local = local_shard(tensor)
        try:
            partial = self.ctx.stats_fn(local, spec)
        except Exception as exc:  # a tensor we cannot measure must not break the user's step
            if (family, name) not in self._warned:
                self._warned.add((family, name))
                logger.warning("trainmon: cannot measure %s/%s (%s: %s); that row is empty",
                               family, name, type(exc).__name__, exc)
            partial = empty_partial(local.device)
        self._rows.append((family, name, vpp_stage, partial))

    # ------------------------------------------------------------------------- step end
    def before_transfer(self) -> None:
        pending, self._rows = self._rows, []
        norm, self._norm, self._norm_final = self._norm, None, False
        if not self.ctx.collecting or (not pending and norm is None):
            return
        rows = [partial for *_, partial in pending]
        device = self._device or (rows[0].device if rows or norm is None else norm.device)
        if norm is not None:  # the local norm as a row: combining takes sqrt(sum of squares) over shards
            norm_row = empty_partial(device)
            norm_row[0] = norm.to(device)
            norm_row[7] = 1.0
            rows.append(norm_row)
        partials = torch.stack([row.to(device) for row in rows])
        if self.collective:  # THE collective of the step: every shard's [N, 8] partials, combined on the device
            gathered = process_groups.all_gather_stacked(partials, self.shards.group, self.shards.size)
            partials = combine_partials_torch(gathered)
        if norm is not None:
            self.ctx.buffer.add_scalar("grad_norm", partials[-1, 0])  # the same on every rank: each writes it
        if self.writes_rows:  # the combined rows are the same on every rank of the group: written once
            for i, (family, name, vpp_stage, _) in enumerate(pending):
                self.ctx.add(family, name, partials[i], vpp_stage)


def _collective_device(shards: ShardGroup) -> torch.device | None:
    """Where the step's partials must be for the collective: NCCL takes CUDA tensors only, and the
    shards live on the CPU under FSDP's ``CPUOffloadPolicy``. None: the partials' own device."""
    import torch.distributed as dist

    if process_groups.initialized() and dist.get_backend(shards.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _reshard_if_unsharded(root: torch.nn.Module) -> None:
    """Put FSDP's sharded parameters back on the modules when a forward left them unsharded.

    FSDP2 does not reshard the root module after its forward (nor after an evaluation forward
    under ``no_grad``), so until the next backward the root's own parameters are the unsharded
    tensors, not the sharded ones the optimizer steps. ``FSDPModule.reshard()`` (public,
    idempotent) registers the sharded ones again; the next forward all-gathers them as usual.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule) and any(
                not hasattr(p, "to_local") for p in module.parameters()):
            module.reshard()


def attach(ctx: StepContext, config: MonitorConfig, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None, options: AttachOptions) -> Attachment:
    """Build the collectors for a model sharded with FSDP2 ``fully_shard`` (also HSDP).

    Raises:
        FSDPLayoutError: FSDP1, or a parameter layout trainmon cannot combine exactly (see
            :func:`shard_group_of`); raised before any hook is installed.
        CompiledRootError: ``model.compile()`` was called on ``model`` itself.
        TargetError: a target pattern matches no module or parameter.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    refuse_root_compiled_in_place(model)
    root = unwrap_model(model)
    if any(isinstance(module, FullyShardedDataParallel) for module in root.modules()):
        raise FSDPLayoutError("FSDP1 (FullyShardedDataParallel) is not supported: its parameters are flattened "
                              "per-rank shards that trainmon cannot name or combine exactly. Use FSDP2 "
                              "(torch.distributed.fsdp.fully_shard); see docs/fsdp.md")
    optimizer, scaler = unwrap_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    weights = config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled
    probe = config.grad_probe.enabled
    spectral = config.features.weights.enabled
    guarded = config.enabled and config.anomaly.guard.enabled  # the step guard sums norms over the shard group
    if weights or probe or spectral:
        _reshard_if_unsharded(root)
    registry = HookRegistry()
    modules_named, module_aliases = named_modules(root)
    params, param_aliases = named_parameters(root)
    collectors: list[Collector] = []
    shard_collector: FSDPOptimizerCollector | None = None
    shards: ShardGroup | None = None
    if weights or probe or guarded or spectral:
        names = {id(p): name for name, p, _ in params}
        extra = [] if optimizer is None else [(f"optimizer parameter {i}", p) for i, p in enumerate(
            p for group in optimizer.param_groups for p in group["params"]) if id(p) not in names]
        shards = shard_group_of([(name, p) for name, p, _ in params] + extra)
    if weights or probe:
        chosen = select_params(params, config, param_aliases)
    probe_collector = None
    if probe and shards is not None:  # its layout check may raise: before any other collector exists
        from trainmon.integrations.fsdp.probe import fsdp_grad_probe

        probe_collector = fsdp_grad_probe(ctx, config, chosen, optimizer, registry, shards)
    if weights and shards is not None:
        shard_collector = FSDPOptimizerCollector(
            ctx, chosen, optimizer, config, registry, shards,
            unsharded_owners(root, chosen, fsdp_modules(root)),
            writes_rows=not config.write_replicated_once or process_groups.is_lowest_selected(shards.group,
                                                                                                config.ranks),
            model=model)
    if shard_collector is not None and "grad_unreduced" in ctx.specs:
        unreadable = shard_collector.unsharded.unreadable()
        if unreadable:
            raise FSDPLayoutError(
                f"grad_unreduced of FSDP modules compiled in place ({', '.join(unreadable[:3])}) needs FSDP2's "
                "record of their unsharded parameters (a hook of trainmon's inside compiled code would break "
                "the compiled forward), and this torch's FSDP2 keeps none that trainmon can read. Set "
                "weight_grads.unreduced: false, or compile torch.compile(block) wrappers before fully_shard; "
                "see docs/fsdp.md")
    if config.activations.enabled:
        outside = OutsideCompiled(model)
        modules = outside(select_modules(modules_named, config, module_aliases))  # warns at attach already
        collectors.append(ActivationCollector(ctx, modules, config.activations, registry, select=outside,
                                                recheck_on=model))
    collectors += [c for c in (shard_collector, probe_collector) if c is not None]
    if config.features.enabled:
        collectors += _feature_collectors(ctx, config, model, modules_named, module_aliases, params, param_aliases,
                                          registry, shards)
    rank, world_size = process_groups.layout()
    # the combined rows are the same on every rank of the shard group (HSDP: of each replica's shard group)
    replicated = Replicated(REPLICATED_FAMILIES, shard_collector.shards.group, combined=True) \
        if shard_collector is not None and shard_collector.collective else None
    return Attachment(collectors=collectors, roots=[(model, 0)], modules=modules_named, optimizer=optimizer,
                      registry=registry, rank=rank, world_size=world_size, scaler=scaler,
                      collective=shards is not None and shards.size > 1 and (weights or probe or spectral),
                      shard_group=shards.group if shards is not None and shards.size > 1 else None,
                      replicated=replicated)



def _feature_collectors(ctx: StepContext, config: MonitorConfig, model: torch.nn.Module,
                        modules: list[tuple[str, torch.nn.Module, int]], aliases: dict[str, list[str]],
                        params: list[tuple[str, torch.nn.Parameter, int]], param_aliases: dict[str, list[str]],
                        registry: HookRegistry, shards: ShardGroup | None) -> list[Collector]:
    """The model features (docs/features.md) of an FSDP2 model: the weight matrices' shards combined over the shard
    group (``Shard(d)``: ``d`` is the split dimension), attention and routers as in plain torch (their hooks run
    while FSDP has the parameters unsharded)."""
    from trainmon.integrations.features import FeatureLayout, feature_collectors

    def split(param: torch.nn.Parameter) -> tuple[int, Any] | None:
        placements = getattr(param, "placements", None)
        if shards is None or shards.size == 1 or not placements:
            return None
        return int(placements[-1].dim), shards.group

    return feature_collectors(ctx, config, modules, aliases, params, param_aliases, registry,
                              FeatureLayout(select=CompiledFeatures(model), split=split))
