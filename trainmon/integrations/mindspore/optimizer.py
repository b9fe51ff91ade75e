"""Weight gradients, parameters and optimizer states of a MindSpore optimizer (PyNative mode).

- ``grad_unreduced``: ``Parameter.register_hook``, i.e. the gradient autograd hands out for the
  parameter in this micro-step (before ``DistributedGradReducer``; MindSpore has no ``.grad`` that
  accumulates); written for the last micro-step, or every one with ``per_micro_step``.
- ``grad_reduced``, ``param``, ``grad_norm`` and ``lr/group{i}``: a forward pre-hook on the
  optimizer cell, which receives the gradients the step uses (reduced ones when the user passes
  the output of ``DistributedGradReducer``).
- ``exp_avg``/``exp_avg_sq`` (``nn.Adam`` ``moment1``/``moment2``, ``nn.AdamWeightDecay``
  ``moments1``/``moments2``), ``momentum`` (``nn.Momentum``), ``update`` and ``ratio``: a forward
  hook on the optimizer cell, after the step.

Where the optimizer keeps its states and the Adam arithmetic on them live in
:mod:`trainmon.integrations.mindspore.optimizer_states`; this module holds the collector and its hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mindspore as ms
from mindspore import Parameter, Tensor, mint

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.base.records import RowKey
from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.integrations.mindspore.buffer import buffer_of
from trainmon.integrations.mindspore.host import (
    HOST_DTYPES,
    HostAdam,
    HostNorm,
    HostPrecursors,
    HostRows,
    host_measurable,
)
from trainmon.integrations.mindspore.optimizer_states import (
    AdamMoments,
    Precursors,
    learning_rates,
    state_tuple,
    update_ratio,
)
from trainmon.integrations.mindspore.stats import (
    Group,
    constants,
    group_matrix,
    group_partials,
    matrix_partials,
    plan_groups,
    precursor_partials,
    sum_of_squares,
    tensor_meta,
    working_dtype,
)

if TYPE_CHECKING:
    from mindspore import nn

    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig

_F32 = ms.float32
_GRADS = "weight_grads"
_OPTIMIZER = "optimizer_step"


class MindSporeOptimizerCollector(HookedCollector):
    """``grad_unreduced``, ``grad_reduced``, ``param`` and optimizer-state rows for a MindSpore optimizer.

    The optimizer hooks see every parameter at once. On the CPU (``host``) the gradients and states
    are only referenced in the hooks and measured on the host after the step's synchronisation
    (:mod:`trainmon.integrations.mindspore.host`); elsewhere each family is measured in groups of one
    size and dtype (:mod:`trainmon.integrations.mindspore.stats`), a few kernels per group, with the
    Adam update and ratio computed on the same matrices as the moments' statistics.

    Args:
        ctx: the monitor's step context.
        params: ``(name, parameter, vpp_stage)`` of the target parameters.
        optimizer: the ``nn.Optimizer`` cell, or None (then only ``grad_unreduced``).
        config: the monitor config.
        registry: where the hook handles live.
        host: measure on the host what cannot change before the step ends (MindSpore on the CPU).
        world_size: processes training together; with more than one, ``grad_unreduced`` is measured in
            its hook (a data-parallel all-reduce may change the gradient in place afterwards).
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, Parameter, int]],
                 optimizer: nn.Optimizer | None, config: MonitorConfig, registry: HookRegistry,
                 host: bool = False, world_size: int = 1) -> None:
        super().__init__(ctx, registry)
        self.params = list(params)
        self.optimizer = optimizer
        self.config = config
        self.host = host
        self._host_unreduced = host and world_size == 1
        self._states = [s for s in config.optimizer_states.states if s in ctx.specs]
        self._precursors = PRECURSORS in ctx.specs
        index = {id(p): i for i, p in enumerate(optimizer.parameters)} if optimizer is not None else {}
        # (name, parameter, vpp_stage, index in optimizer.parameters) of the targets the optimizer steps
        self._stepped = [(n, p, v, index[id(p)]) for n, p, v in self.params if id(p) in index]
        self._names = [n for n, _, _, _ in self._stepped]
        self._stages = [v for _, _, v, _ in self._stepped]
        self._positions = [i for _, _, _, i in self._stepped]
        # Parameters' shapes and dtypes do not change: read once here, never in a hook.
        self._param_metas = [tensor_meta(p) for _, p, _, _ in self._stepped]
        self._every_grad = len(set(self._positions)) == len(index)
        self._not_taken = False
        """The step guard skipped this step's ``construct``: the post-step hook writes no precursor rows (the
        gradient was not folded into the moments)."""
        if optimizer is not None:
            ctx.step_not_taken.append(self._step_not_taken)

    HOOK_GROUPS = (_GRADS, _OPTIMIZER)

    def release(self) -> None:
        if self._step_not_taken in self.ctx.step_not_taken:
            self.ctx.step_not_taken.remove(self._step_not_taken)

    def _step_not_taken(self) -> None:
        """The step guard decided not to apply the step (inside the optimizer cell's call, before its forward hook)."""
        self._not_taken = True

    def install_hooks(self) -> None:
        if "grad_unreduced" in self.ctx.specs:
            for name, param, vpp_stage in self.params:
                if param.requires_grad:
                    hook = self.guarded(self._grad_hook(name, param, vpp_stage))
                    self.registry.add(_GRADS, param.register_hook(hook))
        if self.optimizer is not None:
            pre_step, post_step = self.guarded(self._pre_step_hook()), self.guarded(self._post_step_hook())
            self.registry.add(_OPTIMIZER, self.optimizer.register_forward_pre_hook(pre_step))
            if self._states or self._precursors:
                self.registry.add(_OPTIMIZER, self.optimizer.register_forward_hook(post_step))

    def _grad_hook(self, name: str, param: Parameter, vpp_stage: int) -> Callable[[Tensor], None]:
        per_micro_step = self.config.weight_grads.per_micro_step
        on_host = self._host_unreduced and param.dtype in HOST_DTYPES  # a gradient has its parameter's dtype

        def hook(grad: Tensor) -> None:
            ctx = self.ctx
            if ctx.collecting and (per_micro_step or ctx.micro_step >= ctx.grad_acc_steps - 1):
                if on_host and isinstance(grad, Tensor):
                    buffer = buffer_of(ctx)
                    key = RowKey("grad_unreduced", name, ctx.micro_step, vpp_stage, buffer.next_order())
                    buffer.add_host(HostRows([key], [grad], ctx.specs["grad_unreduced"]))
                else:
                    ctx.record("grad_unreduced", name, grad, vpp_stage)

        return hook

    def _pre_step_hook(self) -> Callable[[nn.Optimizer, tuple[Any, ...]], None]:
        def hook(optimizer: nn.Optimizer, args: tuple[Any, ...]) -> None:
            ctx = self.ctx
            self._not_taken = False  # the guard decides after this hook, inside the call
            if not ctx.collecting:
                return
            grads = args[0] if args and isinstance(args[0], (tuple, list)) else None
            buffer = buffer_of(ctx)
            if grads is not None:
                rows = [k for k, i in enumerate(self._positions) if isinstance(grads[i], Tensor)]
                tensors = [grads[self._positions[k]] for k in rows]
                given = [g for g in grads if isinstance(g, Tensor)]
                metas = [tensor_meta(g) for g in given]  # tensors handed to the hook: no wait
                if self.host and host_measurable(metas):
                    self._record_host("grad_reduced", rows, tensors)
                    buffer.add_host(HostNorm("grad_norm", given))
                else:
                    self._grad_reduced_on_device(rows, tensors, given, metas)
            if "param" in ctx.specs:  # the parameters change in the step: measured now, on the device
                self._record_many("param", list(range(len(self._stepped))), [p for _, p, _, _ in self._stepped],
                                  self._param_metas)
            for i, lr in enumerate(learning_rates(optimizer)):
                buffer.add_scalar(f"lr/group{i}", lr)

        return hook

    def _grad_reduced_on_device(self, rows: list[int], tensors: list[Tensor], given: list[Tensor],
                                metas: list[tuple[Any, int]]) -> None:
        squares = self._record_many("grad_reduced", rows, tensors)
        buffer = buffer_of(self.ctx)
        if squares is not None and self._every_grad and len(rows) == len(given):
            total = squares[0] if len(squares) == 1 else mint.cat(squares)
            buffer.add_scalar("grad_norm", mint.sqrt(mint.sum(total)))  # the rows' sums of squares
        elif given:
            buffer.add_scalar("grad_norm", mint.sqrt(sum_of_squares(given, metas)))

    def _reserve(self, family: str) -> int:
        """The first of the family's orders, one per stepped target in parameter order: rows measured in
        another order are put back in this one on the host (:meth:`MindSporeStepBuffer.transfer`)."""
        return buffer_of(self.ctx).reserve_orders(len(self._stepped))

    def _keys(self, family: str, rows: list[int], first: int) -> list[RowKey]:
        micro_step = self.ctx.micro_step
        return [RowKey(family, self._names[k], micro_step, self._stages[k], first + k) for k in rows]

    def _record_host(self, family: str, rows: list[int], tensors: list[Tensor]) -> None:
        spec = self.ctx.specs.get(family)
        if spec is not None:
            buffer_of(self.ctx).add_host(HostRows(self._keys(family, rows, self._reserve(family)), tensors, spec))

    def _record_many(self, family: str, rows: list[int], tensors: list[Tensor],
                     metas: list[tuple[Any, int]] | None = None) -> list[Tensor] | None:
        """Rows ``self._names[rows[j]]`` of ``tensors[j]``, measured on the device in groups; returns the groups'
        sums of squares (``[m, 1]`` float32 each), None when the family is off."""
        spec = self.ctx.specs.get(family)
        if spec is None:
            return None
        plan = plan_groups([tensor_meta(t) for t in tensors] if metas is None else metas)
        first = self._reserve(family)
        squares: list[Tensor] = []
        for group in plan:
            if group.numel == 0:
                block = group_partials(tensors, group, spec)
            else:
                block, sums = matrix_partials(group_matrix(tensors, group), spec, len(group.indices), group.numel,
                                              group.working_dtype)
                squares.append(sums if group.working_dtype == _F32 else sums.astype(_F32))
            self._add_block(family, [rows[j] for j in group.indices], block, first)
        return squares

    def _add_block(self, family: str, rows: list[int], block: Tensor, first: int) -> None:
        buffer_of(self.ctx).add_block(self._keys(family, rows, first), block)

    def _post_step_hook(self) -> Callable[[nn.Optimizer, tuple[Any, ...], Any], None]:
        def hook(optimizer: nn.Optimizer, args: tuple[Any, ...], output: Any) -> None:
            if not self.ctx.collecting:
                return
            every = list(range(len(self._stepped)))
            adam = AdamMoments.of(optimizer)
            families = ("momentum",) if adam is not None else ("exp_avg", "exp_avg_sq", "momentum")
            for family in families:
                states = state_tuple(optimizer, family) if family in self._states else None
                if states is not None:
                    tensors = [states[i] for i in self._positions]
                    if self.host and host_measurable([tensor_meta(t) for t in tensors]):  # Parameters: no wait
                        self._record_host(family, every, tensors)
                    else:
                        self._record_many(family, every, tensors)
            not_taken, self._not_taken = self._not_taken, False
            if adam is not None:
                grads = args[0] if args and isinstance(args[0], (tuple, list)) else None
                wanted = self._precursors and not not_taken and grads is not None and all(
                    isinstance(grads[i], Tensor) for i in self._positions)
                self._adam_rows(adam, Precursors(optimizer, grads, self._positions) if wanted and grads else None)

        return hook

    def _adam_rows(self, adam: AdamMoments, precursors: Precursors | None = None) -> None:
        """``exp_avg``, ``exp_avg_sq``, ``update``, ``ratio`` and ``precursors`` of Adam-like optimizers: on the host
        (CPU), else group by group on the device, where the moments' matrices give their statistics and the
        update."""
        ctx = self.ctx
        positions = self._positions
        m = [adam.m[i] for i in positions]
        v = [adam.v[i] for i in positions]
        vhat = [adam.vhat[i] for i in positions] if adam.vhat is not None else None
        params = [p for _, p, _, _ in self._stepped]
        wants = {family: ctx.specs[family] for family in self._states if family in ("exp_avg", "exp_avg_sq",
                                                                                    "update", "ratio")}
        if not wants and precursors is None:
            return
        every = list(range(len(positions)))
        grads = precursors.grads if precursors is not None else []
        if self.host and vhat is None and host_measurable([tensor_meta(t) for t in (*m, *v, *params, *grads)]):
            keys = {family: self._keys(family, every, self._reserve(family)) for family in wants}
            extra = None
            if precursors is not None:
                first = self._reserve(PRECURSORS)
                keys[PRECURSORS] = self._keys(PRECURSORS, every, first)
                keys[PRECURSORS_TAIL] = self._keys(PRECURSORS_TAIL, every, first)
                extra = HostPrecursors(grads, precursors.lr, precursors.decay, precursors.decayed)
            buffer_of(ctx).add_host(HostAdam(keys, wants, m, v, params, adam.eps, adam.beta_powers, extra))
            return
        derived = "update" in wants or "ratio" in wants or precursors is not None
        corrections = adam.corrections() if derived else None
        firsts = {family: self._reserve(family) for family in (*wants, *((PRECURSORS,) if precursors else ()))}
        kinds = [((m[k].dtype, v[k].dtype, None if vhat is None else vhat[k].dtype, dtype,
                   tensor_meta(grads[k])[0] if grads else None), numel)
                 for k, (dtype, numel) in enumerate(self._param_metas)]  # states are Parameters: no wait
        for group in plan_groups(kinds):
            m_dtype, v_dtype, vhat_dtype, p_dtype, g_dtype = group.dtype
            rows = list(group.indices)
            count = len(rows)
            if group.numel == 0:
                for family in wants:
                    self._add_block(family, rows, group_partials(m, Group(group.indices, 0, m_dtype), wants[family]),
                                    firsts[family])
                if precursors is not None:  # no element: empty rows
                    empty = mint.zeros((count * PARTIAL_SLOTS,), dtype=_F32)
                    self._add_block(PRECURSORS, rows, empty, firsts[PRECURSORS])
                    self._add_block(PRECURSORS_TAIL, rows, empty, firsts[PRECURSORS])
                continue
            matrices = {}
            for family, tensors, dtype in (("exp_avg", m, m_dtype), ("exp_avg_sq", v, v_dtype)):
                if family in wants or derived:
                    matrices[family] = group_matrix(tensors, Group(group.indices, group.numel, dtype))
                if family in wants:
                    self._add_block(family, rows, matrix_partials(matrices[family], wants[family], count, group.numel,
                                                                  working_dtype(dtype))[0], firsts[family])
            if not derived:
                continue
            m32, v32 = (_float32(matrices[f], working_dtype(d)) for f, d in (("exp_avg", m_dtype),
                                                                              ("exp_avg_sq", v_dtype)))
            vhat32 = None if vhat is None else group_matrix(vhat, Group(group.indices, group.numel, vhat_dtype), _F32)
            update = adam.update(m32, v32, vhat32, corrections)
            if "update" in wants:
                self._add_block("update", rows, matrix_partials(update, wants["update"], count, group.numel, _F32)[0],
                                firsts["update"])
            param = group_matrix(params, Group(group.indices, group.numel, p_dtype), _F32) \
                if "ratio" in wants or precursors is not None else None
            if "ratio" in wants and param is not None:
                self._add_block("ratio", rows, matrix_partials(update_ratio(update, param), wants["ratio"], count,
                                                               group.numel, _F32)[0], firsts["ratio"])
            if precursors is not None and param is not None:
                grad = group_matrix(grads, Group(group.indices, group.numel, g_dtype), _F32)
                lr = precursors.lr_tensor()
                if precursors.decay is not None and any(precursors.decayed[k] for k in rows):
                    # nn.Adam's coupled decay: the moments took g + wd * p_before, p_before = p + its own step
                    column = mint.cat([constants.column(1, 1.0 if precursors.decayed[k] else 0.0, _F32) for k in rows])
                    before = mint.add(param, adam.applied_step(m32, v32, vhat32, corrections, lr))
                    grad = mint.add(grad, mint.mul(mint.mul(column, precursors.decay), before))
                head, tail = precursor_partials(update, m32, adam.v_hat(v32, vhat32, corrections), param, grad,
                                                adam.eps_tensor(), lr, count, group.numel)
                self._add_block(PRECURSORS, rows, head, firsts[PRECURSORS])
                self._add_block(PRECURSORS_TAIL, rows, tail, firsts[PRECURSORS])


def _float32(matrix: Tensor, dtype: Any) -> Tensor:
    return matrix if dtype == _F32 else matrix.astype(_F32)
