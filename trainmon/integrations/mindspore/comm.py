"""Statistics of the tensors that pass through MindSpore collectives (family ``comm``).

The MindSpore counterpart of :mod:`trainmon.collect.comm`. While a :class:`MindSporeCommCollector`
is attached:

- the functions of ``mindspore.mint.distributed`` (torch-like, in-place: ``all_reduce``,
  ``broadcast``, ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``reduce``,
  ``gather``, ``scatter``, ``send``, ``recv``, ...), of ``mindspore.ops`` (``ops.all_reduce``, ...: the
  same signatures, in place or returning the result) and of ``mindspore.communication.comm_func``
  (functional: they return the result) are replaced by thin wrappers in the modules that hold them;
- the collective primitives ``AllReduce``, ``AllGather``, ``ReduceScatter`` and ``Broadcast`` are
  replaced, in the MindSpore modules that export them (``mindspore.ops``, ``mindspore.ops.operations``,
  ``mindspore.nn.wrap.grad_reducer``, ...), by subclasses of the same name whose call is measured:
  primitives created while attached (e.g. a ``DistributedGradReducer`` built after ``attach``) are
  measured; their classes are never modified.

:meth:`MindSporeCommCollector.close` puts every original back. On a step that is not collected a
wrapper calls straight through. Rows and scalars are those of torch: ``{op}.{group}.call{n}.{pre|post}.{i}``
(op names in torch's vocabulary, e.g. ``AllReduce`` is ``all_reduce``, ``AllGather``
``all_gather_into_tensor``), ``comm/{op}.{group}/calls`` and ``/bytes``. Statistics are computed with
MindSpore ops on the device and reach the host with the step's one transfer.

What each API sends and receives (its call plan) is in :mod:`trainmon.integrations.mindspore.comm_plans`;
this module installs the wrappers and measures, rows and flushes what they see.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import mindspore as ms
from mindspore import Tensor, mint, ops

from trainmon.base.process_groups import mindspore_layout
from trainmon.base.records import RowKey
from trainmon.collect.comm_ops import ArgumentBinder, group_label
from trainmon.collect.hooks import HookedCollector
from trainmon.config import COMM_OPS
from trainmon.integrations.mindspore.comm_plans import (
    COMM_FUNC_PLANS,
    MINT_PLANS,
    OPS_NAMES,
    PRIMITIVES,
    MeasuredHandle,
    Plan,
    either,
    one_tensor,
    tensors_of,
)
from trainmon.integrations.mindspore.stats import partial_stats

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import CommunicationConfig

log = logging.getLogger(__name__)
FAMILY = "comm"
_WORLD_NAMES = frozenset({"hccl_world_group", "nccl_world_group", "mccl_world_group"})


@dataclass
class _Row:
    order: int
    micro_step: int
    phase: str
    partials: list[Tensor] = field(default_factory=list)


@dataclass
class _Swap:
    """One replaced attribute: ``module.name`` was ``original`` and is ``replacement`` while attached."""

    module: ModuleType
    name: str
    original: Any
    replacement: Any


class MindSporeCommCollector(HookedCollector):
    """Wraps MindSpore's collectives while attached and measures their tensors.

    Args:
        ctx: the monitor's step context (MindSpore buffer and statistics).
        config: the ``communication`` section (``ops`` filters by the torch-vocabulary names).
        root: the attached network; collectives inside its forward have phase ``forward``.
        optimizer: the optimizer cell; collectives inside its call have phase ``optimizer``.
    """

    PART = "communication"

    def __init__(self, ctx: StepContext, config: CommunicationConfig, root: Any = None, optimizer: Any = None) -> None:
        super().__init__(ctx)
        self.config = config
        self._rank, self._world = mindspore_layout()
        self._ops = set(config.ops or COMM_OPS)
        self._local = threading.local()
        self._rows: dict[tuple[str, int], _Row] = {}
        self._traffic: dict[str, list[int]] = {}
        self._calls: dict[tuple[str, int], int] = {}
        self._groups: dict[Any, str] = {}
        self._binders: dict[int, ArgumentBinder] = {}
        self._step_buffer: Any = None
        self._flushed: Any = None
        self._depth = {"forward": 0, "optimizer": 0}
        self._swaps: list[_Swap] = []
        self._active = True
        if config.call_sites or config.call_site_filter is not None:
            log.warning("trainmon: communication.call_sites and call_site_filter apply to torch.distributed only; "
                        "MindSpore rows are named by call index")
        self._hook_phase(root, "forward")
        self._hook_phase(optimizer, "optimizer")
        self._install()

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self._reset(None)

    def before_transfer(self) -> None:
        buffer = self.ctx.buffer
        if self._step_buffer is buffer:
            self._flush(buffer)
        self._flushed = buffer  # later collectives of this step (none of ours) are not measured
        self._reset(None)

    def release(self) -> None:
        """Put every original function and primitive class back (once, by ``close``, which also removes the
        phase hooks)."""
        self._active = False
        for swap in reversed(self._swaps):
            if getattr(swap.module, swap.name, None) is swap.replacement:
                setattr(swap.module, swap.name, swap.original)
            else:
                log.info("%s.%s was replaced again after trainmon; trainmon's wrapper stays under it and only "
                         "calls through", swap.module.__name__, swap.name)
        self._swaps.clear()

    # ------------------------------------------------------------------ phases
    def _hook_phase(self, cell: Any, phase: str) -> None:
        if cell is None:
            return

        def enter(*args: Any) -> None:
            self._depth[phase] += 1

        def leave(*args: Any) -> None:
            self._depth[phase] = max(self._depth[phase] - 1, 0)

        self.keep(cell.register_forward_pre_hook(self.guarded(enter)))
        self.keep(cell.register_forward_hook(self.guarded(leave), always_call=True))

    def _phase(self) -> str:
        if self._depth["forward"]:
            return "forward"
        return "optimizer" if self._depth["optimizer"] else "communication"

    # ------------------------------------------------------------------ installing
    def _install(self) -> None:
        import mindspore.communication.comm_func as comm_func
        import mindspore.mint.distributed as mint_distributed
        from mindspore.ops.function import comm_func as ops_comm_func

        ops_planners = {name: either(MINT_PLANS[name]) for name in OPS_NAMES if name in MINT_PLANS}
        packages = ((MINT_PLANS, mint_distributed), (COMM_FUNC_PLANS, comm_func), (ops_planners, ops_comm_func))
        for planners, package in packages:
            for name, planner in planners.items():
                original = getattr(package, name, None)
                if original is None or name not in self._ops:
                    continue
                wrapper = self._wrap_function(name, original, planner)
                self._swap_everywhere(name, original, wrapper)
        from mindspore.ops.operations import comm_ops

        for class_name, op in PRIMITIVES.items():
            original = getattr(comm_ops, class_name, None)
            if original is None or op not in self._ops:
                continue
            self._swap_everywhere(class_name, original, self._measured_primitive(original, op))

    def _swap_everywhere(self, name: str, original: Any, replacement: Any) -> None:
        """Replace ``name`` in every loaded ``mindspore`` module that holds ``original``."""
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "mindspore" or module_name.startswith("mindspore.")):
                continue
            try:
                holds = module.__dict__.get(name) is original
            except AttributeError:
                continue
            if holds:
                setattr(module, name, replacement)
                self._swaps.append(_Swap(module, name, original, replacement))

    def _wrap_function(self, name: str, original: Callable[..., Any], planner: Callable[..., Plan]) -> Any:
        binder = ArgumentBinder(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._measuring():
                return original(*args, **kwargs)
            try:
                plan = planner(binder(args, kwargs), self._rank, None)
            except (TypeError, KeyError, ValueError):
                return original(*args, **kwargs)  # a malformed call: MindSpore raises its own error
            return self._call(name, plan, lambda: original(*args, **kwargs))

        return wrapper

    def _measured_primitive(self, original: type, op: str) -> type:
        collector = self

        def __call__(prim: Any, *args: Any) -> Any:  # the primitive's call
            # the primitive class's own __call__; mypy only knows `measured` as some type (made by type() below)
            call = super(measured, prim).__call__  # type: ignore[misc]
            if not (collector._active and collector._measuring()):
                return call(*args)
            group = getattr(prim, "group", None)
            inputs = args[0] if op == "broadcast" and args and isinstance(args[0], (tuple, list)) else args
            sends = op != "broadcast" or getattr(prim, "root_rank", 0) == collector._rank
            plan = Plan(group, tensors_of(inputs) if sends else [], [], False, result_is_post=True)
            return collector._call(op, plan, lambda: call(*args))

        measured: type[Any] = type(original.__name__, (original,), {
            "__call__": __call__, "__module__": original.__module__, "__doc__": original.__doc__})
        return measured

    # ------------------------------------------------------------------ measuring
    def _measuring(self) -> bool:
        ctx = self.ctx
        return (self._active and ctx.collecting and FAMILY in ctx.specs and ctx.buffer is not self._flushed
                and not getattr(self._local, "depth", 0))

    def _call(self, name: str, plan: Plan, run: Callable[[], Any]) -> Any:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            prefix = f"{name}.{self._group(plan.group)}"
            buffer = self.ctx.buffer
            if self._step_buffer is not buffer:
                self._reset(buffer)
            counter = (prefix, self.ctx.micro_step)
            index = self._calls.get(counter, 0)
            self._calls[counter] = index + 1
            row = f"{prefix}.call{index}"
            self._measure(row, "pre", plan.pre)
            result = run()
            post, handle = plan.post, result
            paired = plan.async_op and isinstance(result, tuple) and len(result) >= 2  # (output, handle)
            value = result[0] if paired else result
            if plan.result_is_post or (plan.result_may_be_post and isinstance(value, (Tensor, tuple, list))):
                post = tensors_of(value) if isinstance(value, (tuple, list)) else one_tensor(value)
                handle = result[1] if paired else None
            traffic = self._traffic.setdefault(prefix, [0, 0])
            traffic[0] += 1
            traffic[1] += max(sum(int(t.nbytes) for _, t in plan.pre), sum(int(t.nbytes) for _, t in post))
            if not plan.async_op or handle is None or not hasattr(handle, "wait"):
                self._measure(row, "post", post)
                return result
            measured = MeasuredHandle(handle, lambda: self._measure_if_current(buffer, row, post))
            return (result[0], measured) + tuple(result[2:]) if paired else measured
        finally:
            self._local.depth -= 1

    def _measure_if_current(self, buffer: Any, row: str, post: list[tuple[int, Tensor]]) -> None:
        if self._active and self.ctx.collecting and self._step_buffer is buffer:
            self._measure(row, "post", post)

    def _group(self, group: Any) -> str:
        label = self._groups.get(group)
        if label is None:
            label = self._groups[group] = group_label(self._ranks(group))
        return label

    def _ranks(self, group: Any) -> list[int]:
        if group is None or group in _WORLD_NAMES:
            return list(range(self._world))
        from mindspore.communication import get_process_group_ranks

        try:
            return list(get_process_group_ranks(group))
        except Exception:  # a group MindSpore cannot describe: name it as given
            return list(range(self._world)) if "world" in str(group) else [self._rank]

    def _measure(self, prefix: str, when: str, tensors: Sequence[tuple[int, Tensor]]) -> None:
        spec = self.ctx.specs[FAMILY]
        micro_step = self.ctx.micro_step
        phase = self._phase() if tensors else ""
        for i, tensor in tensors:
            key = (f"{prefix}.{when}.{i}", micro_step)
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row(self.ctx.buffer.next_order(), micro_step, phase)
            row.partials.append(partial_stats(tensor, spec))

    def _reset(self, buffer: Any) -> None:
        self._rows.clear()
        self._traffic.clear()
        self._calls.clear()
        self._step_buffer = buffer

    def _flush(self, buffer: Any) -> None:
        for (name, micro_step), row in self._rows.items():
            partial = row.partials[0] if len(row.partials) == 1 else combine_partials(row.partials)
            run_phase = "" if row.phase == "communication" else row.phase
            buffer.add(RowKey(FAMILY, name, micro_step, 0, row.order, run_phase), partial)
        for prefix, (calls, nbytes) in self._traffic.items():
            buffer.add_scalar(f"comm/{prefix}/calls", calls)
            buffer.add_scalar(f"comm/{prefix}/bytes", nbytes)


def combine_partials(partials: list[Tensor]) -> Tensor:
    """One ``[8]`` partial from several (calls combined into one row), exactly, on the device:
    norm = sqrt(sum of norm^2), sums and counts added, min of mins and max of maxes (NaN wins)."""
    stacked = ops.stack(partials)  # [n, 8]
    nan = Tensor(float("nan"), ms.float32)

    def any_nan(column: Tensor) -> Tensor:
        return mint.isnan(column).any()

    lo = ops.select(any_nan(stacked[:, 2]), nan, mint.min(stacked[:, 2]))
    hi = ops.select(any_nan(stacked[:, 3]), nan, mint.max(stacked[:, 3]))
    norm = mint.sqrt(mint.sum(stacked[:, 0] * stacked[:, 0]))
    sums = mint.sum(stacked, dim=0)
    return ops.stack([norm, sums[1], lo, hi, sums[4], sums[5], sums[6], sums[7]])
