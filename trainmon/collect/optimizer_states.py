"""The rows a torch optimizer's step post-hook writes: the optimizer states (``exp_avg``, ``exp_avg_sq``,
``momentum``) and the Adam-derived ``update``, ``ratio`` and ``precursors`` (computed by :mod:`trainmon.collect.adam`'s
kernels from one read of ``m``, ``v`` and the parameter), each family recorded at once with its execution orders
interleaved parameter by parameter (:class:`OptimizerStateRows`, a base of
:class:`~trainmon.collect.optimizer.TorchOptimizerCollector`, whose step pre-hook records its rows the same way); and
:func:`unless_skipped`, the precursor rows of a step a fused optimizer skipped."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.base.records import RowKey
from trainmon.collect.adam import AdamEntry, adam_partials_many, coupled_groups
from trainmon.collect.optimizer_parts import kept_states, other_rule_groups, other_update_rule, state_holder, states_of

logger = logging.getLogger("trainmon")

if TYPE_CHECKING:
    from trainmon.collect.buffer import StepBuffer
    from trainmon.collect.context import StepContext


class OptimizerStateRows:
    """The optimizer-state rows of :class:`~trainmon.collect.optimizer.TorchOptimizerCollector` (its
    ``_post_step``, the optimizer's step post-hook), and the recording of a step's rows family by family.

    What it reads of the collector is declared below (set by the collector's ``__init__``).
    """

    ctx: StepContext
    params: list[tuple[str, torch.nn.Parameter, int]]
    """The target parameters the optimizer holds: ``(name, parameter, vpp_stage)``."""
    parts: list[torch.optim.Optimizer]
    """The optimizers holding the states and settings."""
    _states: list[str]
    """The optimizer-state families measured (``optimizer_states.states`` that have a spec)."""
    _precursors: bool
    """Whether the ``precursors`` rows are measured."""
    _states_checked: bool
    """Whether the optimizer's states were checked for the families asked for (one warning if it keeps none of
    them: :meth:`_post_step`)."""

    def _warn_other_rule(self) -> None:
        """One warning at attach when the update-derived rows are asked of an optimizer that does not step by Adam's
        rule (:func:`other_update_rule`): they are not written (:meth:`_post_step`), rather than written wrong."""
        derived: list[str] = [family for family in ("update", "ratio") if family in self._states]
        derived += [PRECURSORS] if self._precursors else []
        others = sorted({type(part).__name__ for part in self.parts if other_update_rule(part)})
        if derived and others:
            logger.warning("trainmon: %s does not step by Adam's m_hat / (sqrt(v_hat) + eps): its %s rows are not "
                           "written (they would be Adam's arithmetic on its moments, not its update); exp_avg and "
                           "exp_avg_sq are", ", ".join(others), ", ".join(derived))

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer states, ``update``, ``ratio`` and ``precursors`` after the step, each family measured at once."""
        ctx = self.ctx
        if not ctx.collecting or ctx.state_init_step:  # not a training step: nothing to measure
            return
        found = states_of(self.parts)
        rows: dict[str, list[tuple[str, torch.Tensor, int]]] = {
            family: [] for family in ("exp_avg", "exp_avg_sq", "momentum", "update", "ratio", PRECURSORS)}
        adam_entries: list[AdamEntry] = []
        adam_rows: list[tuple[str, int]] = []
        grads: list[torch.Tensor | None] = []
        derived = "update" in self._states or "ratio" in self._states
        other_rule = other_rule_groups(self.parts) if derived or self._precursors else frozenset()
        for name, param, vpp_stage in self.params:
            state, group = found.get(id(param), (None, {}))
            if not state or (param.grad is None and not param.requires_grad):  # frozen: its state is not stepped
                continue
            for family in ("exp_avg", "exp_avg_sq"):
                if family in self._states and family in state:
                    rows[family].append((name, state[family], vpp_stage))
            if "momentum" in self._states and state.get("momentum_buffer") is not None:
                rows["momentum"].append((name, state["momentum_buffer"], vpp_stage))
            if (derived or self._precursors) and id(group) not in other_rule and all(
                    state.get(key) is not None for key in ("exp_avg", "exp_avg_sq", "step")):
                # placeholders keep the rows' execution order; the values come from adam_partials_many
                for family in ("update", "ratio"):
                    if family in self._states:
                        rows[family].append((name, param, vpp_stage))
                grad = param.grad if self._precursors else None
                if grad is not None:
                    rows[PRECURSORS].append((name, param, vpp_stage))
                adam_entries.append((param, state, group))
                adam_rows.append((name, vpp_stage))
                grads.append(grad)
        # exp_avg and exp_avg_sq from the update's read of m and v, where a fused kernel makes it (one spec: the
        # kernel takes one set of flags for both)
        fused_states: list[str] = []
        if adam_entries and derived:
            wanted: list[str] = [family for family in ("exp_avg", "exp_avg_sq") if family in self._states]
            if len({ctx.specs[family] for family in wanted}) == 1:
                fused_states = wanted
        if not self._states_checked and any(found.get(id(param), (None,))[0] for _, param, _ in self.params):
            # decided at the first step with any state (an optimizer that has not stepped yet holds none)
            self._states_checked = True
            if not any(rows[family] for family in self._states):
                logger.warning("trainmon: optimizer_states asked for %s, but %s keeps none of them: no optimizer-state "
                               "rows are written (the gradients and lr are)", ", ".join(self._states),
                               kept_states(self.parts))
        orders = self._record_interleaved(rows, skip=("update", "ratio", PRECURSORS, *fused_states))
        if adam_entries:
            self._record_adam(adam_entries, adam_rows, orders, rows, fused_states, grads,
                              getattr(optimizer, "found_inf", None))

    def _record_interleaved(self, rows: dict[str, list[tuple[str, torch.Tensor, int]]],
                            skip: Sequence[str] = ()) -> dict[str, list[int]]:
        """``record_many`` per family, with execution orders interleaved parameter by parameter
        (as if each parameter's rows were recorded in turn). Returns the orders of every family."""
        ctx = self.ctx
        families = [family for family, entries in rows.items() if entries and family in ctx.specs]
        if not families:
            return {}
        reserve = getattr(ctx.buffer, "reserve_orders", None)
        orders: dict[str, list[int]] = {family: [] for family in families}
        if reserve is not None:
            # one order per row, a parameter's rows consecutive (the rows lists follow self.params)
            names = {family: {entry[0] for entry in rows[family]} for family in families}
            position: dict[tuple[str, str], int] = {}
            next_order = reserve(sum(len(rows[family]) for family in families))
            for name, _, _ in self.params:
                for family in families:
                    if name in names[family]:
                        position[(family, name)] = next_order
                        next_order += 1
            for family in families:
                orders[family] = [position[(family, entry[0])] for entry in rows[family]]
        for family in families:
            if family in skip:
                continue
            entries = rows[family]
            ctx.record_many(family, [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries],
                            orders=orders[family] or None)
        return orders

    def _record_adam(self, entries: list[AdamEntry], names: list[tuple[str, int]], orders: dict[str, list[int]],
                     rows: dict[str, list[tuple[str, torch.Tensor, int]]], states: Sequence[str],
                     grads: list[torch.Tensor | None], found_inf: Any = None) -> None:
        """``update``, ``ratio`` and ``precursors`` rows of the Adam-like parameters, without full-size temporaries;
        and the rows of ``states`` (``exp_avg``/``exp_avg_sq``, not recorded yet) from the same read of ``m`` and
        ``v`` where a fused kernel made it, else as any state. ``rows``/``orders``: every family's rows and orders;
        ``grads``: per entry, the gradient of its precursor row (None: no row); ``found_inf``: the device flag a fused
        optimizer was stepped with (a ``GradScaler``'s or the step guard's), whose skipped step leaves its precursor
        rows empty (:func:`unless_skipped`)."""
        ctx = self.ctx
        update_spec = ctx.specs.get("update") if "update" in self._states else None
        ratio_spec = ctx.specs.get("ratio") if "ratio" in self._states else None
        precursors = self._precursors and any(grad is not None for grad in grads)
        coupled = coupled_groups([state_holder(part) for part in self.parts]) if precursors else frozenset()
        blocks = adam_partials_many(entries, update_spec, ratio_spec, ctx.specs[states[0]] if states else None,
                                    grads if precursors else None, coupled)[1] \
            if update_spec is not None or ratio_spec is not None or precursors else []
        positions = {family: {entry[0]: k for k, entry in enumerate(rows[family])}
                     for family in ("update", "ratio", PRECURSORS, *states)}
        done: dict[str, set[str]] = {family: set() for family in states}
        buffer = cast("StepBuffer", ctx.buffer)  # torch statistics: a StepBuffer
        for indices, update_block, ratio_block, state_blocks, precursor_blocks in blocks:
            parts = [("update", update_spec is not None, update_block), ("ratio", ratio_spec is not None, ratio_block)]
            parts += [(family, family in states, block)
                      for family, block in zip(("exp_avg", "exp_avg_sq"), state_blocks or ())]
            parts += [(family, True, unless_skipped(block, found_inf))
                      for family, block in zip((PRECURSORS, PRECURSORS_TAIL), precursor_blocks or ())]
            for family, wanted, block in parts:
                if not wanted:
                    continue
                row_family = PRECURSORS if family == PRECURSORS_TAIL else family  # a tail shares its row's order
                family_orders = orders.get(row_family) or None
                keys = [RowKey(family, names[i][0], ctx.micro_step, names[i][1],
                               family_orders[positions[row_family][names[i][0]]] if family_orders
                               else ctx.buffer.next_order()) for i in indices]
                buffer.add_block(keys, block)
                if family in done:
                    done[family].update(names[i][0] for i in indices)
        for family in states:  # the rest (the plain torch ops, AMSGrad's v): measured as any state
            rest = [k for k, entry in enumerate(rows[family]) if entry[0] not in done[family]]
            family_orders = orders.get(family)
            if rest:
                ctx.record_many(family, [rows[family][k][0] for k in rest], [rows[family][k][1] for k in rest],
                                [rows[family][k][2] for k in rest],
                                orders=[family_orders[k] for k in rest] if family_orders else None)


def unless_skipped(partials: torch.Tensor, found_inf: Any) -> torch.Tensor:
    """``partials``, or zeros (rows of no element: NaN values, no alarm) where ``found_inf``, the device flag a fused
    optimizer steps with, says the step was skipped: its gradient was not folded into the moments. On the device, no
    synchronisation.

    Example:
        >>> unless_skipped(torch.ones(2), torch.tensor(1.0)).tolist(), unless_skipped(torch.ones(2), None).tolist()
        ([0.0, 0.0], [1.0, 1.0])
    """
    if not isinstance(found_inf, torch.Tensor):
        return partials
    skipped = found_inf.detach().to(partials.device).reshape(()) > 0
    return torch.where(skipped, torch.zeros((), dtype=partials.dtype, device=partials.device), partials)


__all__ = ["OptimizerStateRows", "unless_skipped"]
