"""Collectors for Megatron-Core: ``main_grad`` gradients, optimizer shards, recompute-aware activations.

Megatron keeps a parameter's gradient in ``param.main_grad`` (a view into the DDP grad buffer)
and steps a *torch* optimizer over fp32 main parameters that are the model parameter itself
(``FP32Optimizer``), an fp32 copy (``Float16OptimizerWithFloat16Params``) or a flat shard of
it (``DistributedOptimizer``). Every statistic here is measured where it lives, as partial
statistics, and combined across ranks at the end of the step with at most one ``all_gather``
per process group: over the data-parallel group for distributed-optimizer shards, then over
the tensor-parallel group for TP-partitioned parameters (a replicated parameter is each TP rank's own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base import process_groups
from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.base.records import RowKey, activation_row, module_call
from trainmon.collect.activations import ActivationCollector, is_root
from trainmon.collect.adam import AdamEntry, adam_update, coupled_groups, precursor_partials, update_ratio
from trainmon.collect.context import in_backward
from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.collect.stats import combine_partials_torch, empty_partial, partial_stats

if TYPE_CHECKING:
    from trainmon.base.types import MegatronParameter
    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig

_GRADS = "megatron_grads"
_OPTIMIZER = "megatron_optimizer"
_OPTIMIZER_FAMILIES = ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio")


@dataclass
class MainParam:
    """Where the optimizer keeps one model parameter: the torch optimizer and its parameter.

    Attributes:
        optimizer: the torch optimizer that steps ``main`` (``leaf.optimizer`` of a Megatron optimizer).
        main: the fp32 tensor the torch optimizer updates (the parameter, an fp32 copy or a flat shard).
        sharded: True when ``main`` is a distributed-optimizer shard (combined over ``dp_group``).
        dp_group: the distributed optimizer's data-parallel group (None when not sharded).
        piece: ``(start, numel)`` of ``main`` in the model parameter's flattening (distributed
            optimizer; None: ``main`` is the whole parameter).
    """

    optimizer: torch.optim.Optimizer
    main: torch.Tensor
    sharded: bool = False
    dp_group: Any = None
    piece: tuple[int, int] | None = None


@dataclass
class GroupLayout:
    """The process groups statistics are combined over (None: a group of one)."""

    tp_group: Any = None
    tp_size: int = 1
    tp_rank: int = 0


class _Slots:
    """Fixed ``[K, 8]`` table of one step's partials: identical layout on every rank of a group."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.partials: list[torch.Tensor | None] = [None] * size
        self.meta: list[tuple[int, int] | None] = [None] * size  # (micro_step, order)
        self.device = device

    def stacked(self) -> torch.Tensor:
        empty = empty_partial(self.device)
        return torch.stack([p if p is not None else empty for p in self.partials])


class MegatronParamCollector(HookedCollector):
    """``grad_unreduced``, ``grad_reduced``, ``param`` and Adam-state rows of Megatron parameters.

    - ``grad_unreduced``: the accumulated ``main_grad`` of the last micro-step, read in the
      parameter's post-accumulate-grad hook, which runs before Megatron's DDP hook adds the
      micro-step's ``grad`` into ``main_grad`` and (with ``overlap_grad_reduce``) launches the
      bucket's reduction: the value is ``main_grad + grad``, i.e. before any data-parallel
      reduction. The k-th call of a parameter's hook in a step is micro-step k (also under
      the 1F1B and interleaved schedules).
    - ``grad_reduced`` and ``param``: the main parameter and its ``.grad`` in the torch
      optimizer's step pre-hook, i.e. after reduction, unscaling and clipping: what it steps with.
    - ``exp_avg``, ``exp_avg_sq``, ``update``, ``ratio``, ``precursors``: in the torch optimizer's step post-hook
      (the precursors from the main parameter's ``.grad``, the unscaled and clipped gradient the step used).

    Args:
        ctx: the monitor's step context.
        params: ``(name, model parameter, vpp_stage)`` of the target parameters.
        mains: model parameter id -> :class:`MainParam` (empty without an optimizer).
        layout: tensor-parallel group for combining partitioned parameters.
        config: the monitor config.
        registry: where the hook handles live.
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, MegatronParameter, int]],
                 mains: dict[int, MainParam], layout: GroupLayout, config: MonitorConfig,
                 registry: HookRegistry) -> None:
        super().__init__(ctx, registry)
        self.params = list(params)
        self.mains = mains
        self.layout = layout
        self.config = config
        self.families = [f for f in ("grad_unreduced",) + _OPTIMIZER_FAMILIES if f in ctx.specs]
        if PRECURSORS in ctx.specs:  # two slots per parameter: a precursor row and its second half
            self.families += [PRECURSORS, PRECURSORS_TAIL]
        self._index = {family: i * len(self.params) for i, family in enumerate(self.families)}
        self._optimizers = list({id(m.optimizer): m.optimizer for m in mains.values()}.values())
        device = self.params[0][1].device if self.params else torch.device("cpu")
        self._slots = _Slots(len(self.families) * len(self.params), device)
        self._calls: list[int] = [0] * len(self.params)
        self._fired: set[str] = set()
        # A TP-partitioned parameter is combined over the TP group; a replicated one counts once.
        self._tp_partitioned = torch.tensor([bool(getattr(p, "tensor_model_parallel", False))
                                             for _, p, _ in self.params] * len(self.families), dtype=torch.bool,
                                            device=device)
        self._dp_groups = self._dp_shard_masks(device)

    # ----------------------------------------------------------------------------- lifecycle
    HOOK_GROUPS = (_GRADS, _OPTIMIZER)

    def install_hooks(self) -> None:
        self.reset()
        if "grad_unreduced" in self.ctx.specs:
            for i, (_, param, _) in enumerate(self.params):
                if param.requires_grad:
                    hook = self.guarded(self._grad_hook(i))
                    self.registry.add(_GRADS, param.register_post_accumulate_grad_hook(hook))
        wants_pre = any(f in self.ctx.specs for f in ("grad_reduced", "param"))
        wants_post = any(f in self.ctx.specs for f in ("exp_avg", "exp_avg_sq", "update", "ratio", PRECURSORS))
        for optimizer in self._optimizers:
            if wants_pre:
                self.registry.add(_OPTIMIZER, optimizer.register_step_pre_hook(self.guarded(self._pre_step)))
            if wants_post:
                self.registry.add(_OPTIMIZER, optimizer.register_step_post_hook(self.guarded(self._post_step)))

    def reset(self) -> None:
        self._slots = _Slots(len(self._slots.partials), self._slots.device)
        self._calls = [0] * len(self.params)
        self._fired = set()

    # ----------------------------------------------------------------------------- hooks
    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        name, param, vpp_stage = self.params[i]
        slot = self._index["grad_unreduced"] + i

        def hook(tensor: torch.Tensor) -> None:
            ctx = self.ctx
            micro_step = self._calls[i]
            self._calls[i] += 1
            if not ctx.collecting or (micro_step < ctx.grad_acc_steps - 1
                                      and not self.config.weight_grads.per_micro_step):
                return
            grad = unreduced_grad(param)
            if grad is None:
                return
            partial = partial_stats(grad, ctx.specs["grad_unreduced"])
            if self.config.weight_grads.per_micro_step and self.layout.tp_size == 1:
                ctx.add("grad_unreduced", name, partial, vpp_stage, micro_step)
                return
            # The last call wins: with grad_acc_steps left at 1 every micro-step is measured.
            self._slots.partials[slot] = partial
            self._slots.meta[slot] = (micro_step, ctx.buffer.next_order())
            self._fired.add("grad_unreduced")

        return hook

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.ctx.collecting:
            self._measure(optimizer, ("grad_reduced", "param"))

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.ctx.collecting:
            self._measure(optimizer, ("exp_avg", "exp_avg_sq", "update", "ratio", PRECURSORS))

    def _measure(self, optimizer: torch.optim.Optimizer, families: Sequence[str]) -> None:
        ctx = self.ctx
        families = [f for f in families if f in ctx.specs]
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        precursors: list[tuple[int, AdamEntry, torch.Tensor]] = []  # (slot, entry, gradient), measured together
        for i, (_, param, _) in enumerate(self.params):
            main = self.mains.get(id(param))
            if main is None or main.optimizer is not optimizer:
                continue
            state = optimizer.state.get(main.main) or {}
            update = None
            for family in families:
                slot = self._index[family] + i
                self._slots.meta[slot] = (ctx.micro_step, ctx.buffer.next_order())
                self._fired.add(family)
                if family == PRECURSORS:  # its second half: the same row, in the tail's slot
                    tail = self._index[PRECURSORS_TAIL] + i
                    self._slots.meta[tail] = self._slots.meta[slot]
                    self._fired.add(PRECURSORS_TAIL)
                if main.main.numel() == 0:
                    continue
                if family == PRECURSORS:
                    if state and main.main.grad is not None:
                        precursors.append((slot, (main.main, state, group_of[id(main.main)]), main.main.grad))
                    continue
                if family == "grad_reduced":
                    tensor = main.main.grad
                elif family == "param":
                    tensor = main.main
                elif family in ("exp_avg", "exp_avg_sq"):
                    tensor = state.get(family)
                else:
                    if update is None and state:
                        update = adam_update(state, group_of[id(main.main)])
                    tensor = update if family == "update" or update is None else update_ratio(update, main.main)
                if tensor is not None:
                    self._slots.partials[slot] = partial_stats(tensor, ctx.specs[family])
        if precursors:
            measured = precursor_partials([p[1] for p in precursors], [p[2] for p in precursors],
                                          coupled_groups([optimizer]))
            for (slot, _, _), partial in zip(precursors, measured):
                if partial is not None:
                    i = slot - self._index[PRECURSORS]
                    self._slots.partials[slot] = partial[:8]
                    self._slots.partials[self._index[PRECURSORS_TAIL] + i] = partial[8:]

    # ----------------------------------------------------------------------------- combination
    def _dp_shard_masks(self, device: torch.device) -> list[tuple[Any, torch.Tensor]]:
        """``(dp_group, [K] mask of rows sharded over it)`` for each distributed-optimizer group."""
        by_group: dict[int, tuple[Any, list[bool]]] = {}
        size = len(self.families) * len(self.params)
        for i, (_, param, _) in enumerate(self.params):
            main = self.mains.get(id(param))
            if main is None or not main.sharded or process_groups.group_size(main.dp_group, none_is_world=False) == 1:
                continue
            _, mask = by_group.setdefault(id(main.dp_group), (main.dp_group, [False] * size))
            for family in self.families:
                if family != "grad_unreduced":
                    mask[self._index[family] + i] = True
        return [(group, torch.tensor(mask, dtype=torch.bool, device=device)) for group, mask in by_group.values()]

    def before_transfer(self) -> None:
        """Combine the step's shards (one all_gather per group) and append the rows."""
        if not self.ctx.collecting or not self._fired:
            self.reset()
            return
        table = self._slots.stacked()
        for group, mask in self._dp_groups:
            # Distributed-optimizer shards: every element lives on exactly one DP rank.
            own, size = process_groups.layout(group)
            gathered = process_groups.all_gather_stacked(table, group, size)  # this group's one collective
            keep = mask.unsqueeze(0).expand(gathered.shape[0], -1).clone()
            keep[own] = True
            table = combine_partials_torch(torch.where(keep.unsqueeze(-1), gathered, 0.0))
        if self.layout.tp_size > 1:
            gathered = process_groups.all_gather_stacked(table, self.layout.tp_group, self.layout.tp_size)
            keep = self._tp_partitioned.unsqueeze(0).expand(gathered.shape[0], -1).clone()
            # a replicated parameter (layer norms, row-parallel biases) is this TP rank's own replica: replicas
            # that diverge (they should not) show as rows that differ between TP ranks
            keep[self.layout.tp_rank] = True
            table = combine_partials_torch(torch.where(keep.unsqueeze(-1), gathered, 0.0))
        ctx = self.ctx
        rows = []
        for family in self.families:
            if family not in self._fired:
                continue
            for i, (name, _, vpp_stage) in enumerate(self.params):
                slot = self._index[family] + i
                meta = self._slots.meta[slot]
                if meta is not None:
                    rows.append((meta[1], RowKey(family, name, meta[0], vpp_stage, meta[1]), slot))
        for _, key, slot in sorted(rows, key=lambda row: row[0]):
            ctx.buffer.add(key, table[slot])
        self.reset()


def unreduced_grad(param: MegatronParameter) -> torch.Tensor | None:
    """The parameter's accumulated gradient including the micro-step being accumulated now."""
    main_grad: torch.Tensor | None = getattr(param, "main_grad", None)
    grad: torch.Tensor | None = param.grad
    if main_grad is None:
        return grad
    if grad is None or getattr(param, "grad_added_to_main_grad", False):
        return main_grad  # gradient-accumulation fusion wrote into main_grad already
    return main_grad + grad


class MegatronActivationCollector(ActivationCollector):
    """The generic activation collector, adapted to Megatron modules.

    - Forward rows come from the generic forward hook (tuple outputs, kwargs inputs). The
      recompute re-run of a checkpointed region is skipped without a stack walk: Megatron runs
      the first forward of such a region under ``no_grad`` and the re-run, during backward,
      with grad enabled, both inside ``tensor_parallel.random.is_checkpointing()``; the re-runs of
      ``recompute_modules`` set no such flag and are told by autograd running a backward pass
      (:func:`trainmon.collect.context.in_backward`).
    - Gradient rows come from tensor hooks that the forward hook puts on the module's output
      (and input) tensors (the base class's ``grad_hooks: tensor`` machinery), not from full
      module backward hooks: those wrap a module's inputs in
      a view that Megatron's in-place ops (``masked_fill_`` of the attention scores) reject.
      ``{module}.output_grad`` is the gradient w.r.t. the output; ``{module}.input_grad`` is
      the gradient of the input tensor (summed over all of its consumers, e.g. including the
      residual branch). In a checkpointed region the hooks are put on the re-run's tensors.
    - Gradient rows carry the micro-step of the backward pass (the k-th gradient of a row in a
      step is micro-step k), which differs from the forward count under the 1F1B schedule.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from megatron.core.tensor_parallel.random import is_checkpointing

        self._is_checkpointing = is_checkpointing
        self._grad_calls: dict[tuple[int, str], int] = {}

    def install_hooks(self) -> None:
        forward = self.config.forward and "actv" in self.ctx.specs
        backward = self.config.backward and "actv_grad" in self.ctx.specs
        if not (forward or backward):
            return
        for name, module, vpp_stage in self.modules:
            hook = self.guarded(self._megatron_hook(name, vpp_stage, forward, backward))
            self.registry.add(self.HOOK_GROUP, module.register_forward_hook(hook, with_kwargs=True,
                                                                            prepend=is_root(name)))

    def reset(self) -> None:
        super().reset()
        self._grad_calls.clear()

    def before_transfer(self) -> None:
        super().before_transfer()
        self._grad_calls.clear()

    def _megatron_hook(self, name: str, vpp_stage: int, forward: bool,
                       backward: bool) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        is_checkpointing = self._is_checkpointing

        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.ctx.collecting:
                return
            call = self.next_call(name, vpp_stage)
            grad_enabled = torch.is_grad_enabled()
            if forward and not (grad_enabled and is_checkpointing()) and not in_backward():
                self.record_forward(name, vpp_stage, call, args, kwargs, output)
            if backward and grad_enabled:
                module_name = module_call(name, call)
                self.hook_tensors(output, activation_row(module_name, "output_grad"), vpp_stage)
                if self.config.inputs:
                    self.hook_tensors(args, activation_row(module_name, "input_grad"), vpp_stage)
                    self.hook_tensors(kwargs, activation_row(module_name, "input_grad"), vpp_stage)

        return hook

    def _tensor_grad_hook(self, row: str, vpp_stage: int) -> Callable[[torch.Tensor], None]:
        """As the base class's, with the micro-step counted per row (the 1F1B order of backwards)."""
        key = (vpp_stage, row)  # chunks of a virtual pipeline have the same module names
        def hook(grad: torch.Tensor) -> None:
            ctx = self.ctx
            if not ctx.collecting or not grad.numel():  # no element: no row (see ActivationCollector)
                return
            micro_step = self._grad_calls.get(key, 0)
            self._grad_calls[key] = micro_step + 1
            # Backward runs while the training thread waits in backward(): swapping is safe.
            forward_micro_step, ctx.micro_step = ctx.micro_step, micro_step
            try:
                ctx.record("actv_grad", row, grad, vpp_stage)
            finally:
                ctx.micro_step = forward_micro_step

        return hook
