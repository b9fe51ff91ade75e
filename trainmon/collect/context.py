"""The state shared by the collectors of one attached monitor, and the collector protocol."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainmon.base.guard import Guard
from trainmon.base.records import RowKey
from trainmon.collect.buffer import Buffer, StepBuffer
from trainmon.collect.grouped import GroupedRows
from trainmon.collect.stats import partial_stats, partial_stats_many
from trainmon.collect.stats_base import StatsSpec

if TYPE_CHECKING:
    from trainmon.base.types import GradScaler

logger = logging.getLogger("trainmon")
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (one C call, no stack walk).

    A forward that runs then is a recompute re-run (activation checkpointing); a collective then
    belongs to the backward pass. False where torch lacks the function.
    """
    return _graph_task_id is not None and _graph_task_id() != -1


def backward_pass() -> int:
    """The id of the backward pass (autograd graph task) running on this thread, -1 outside one."""
    return _graph_task_id() if _graph_task_id is not None else -1


def unscale_partial(partial: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The partial statistics of ``x / scale`` from those of ``x`` (``scale`` > 0; on the device, no sync)."""
    inverse = scale.detach().to(device=partial.device, dtype=partial.dtype).reciprocal()
    return torch.cat([partial[:4] * inverse, partial[4:]])  # norm, sum, min, max scale; counts do not


class _ScaleMasks:
    """One cached ``[8]`` boolean per device: the slots that scale with the tensor (norm, sum, min, max)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        mask = self._by_device.get(device)
        if mask is None:  # made on the device: no host-to-device copy
            mask = self._by_device[device] = torch.arange(8, device=device) < 4
        return mask


_scale_mask = _ScaleMasks()


def unscale_block(block: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`unscale_partial` of a flat ``[8 N]`` block of partials: two kernels whatever ``N``."""
    factors = torch.where(_scale_mask(block.device), scale.detach().to(block.device, block.dtype).reciprocal(), 1.0)
    return (block.view(-1, 8) * factors).view(-1)


def _version(tensor: Any) -> int | None:
    """A torch tensor's version counter; None for other tensors, which are always measured: a MindSpore
    tensor has a ``_version`` too, but reading it waits for the op that makes the tensor to run (~0.5 ms,
    a host synchronisation in a hook)."""
    return tensor._version if isinstance(tensor, torch.Tensor) else None


def alias_key(tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(base, key)``: what makes two plain torch tensors views of the same elements. ``base`` is the tensor they
    are views of (their ``_base``, or the tensor itself; views share its version counter); ``key`` is its id and
    where and how they read its memory (address, shape, strides, dtype, negative and conjugate bits). An id is
    only meaningful while ``base`` lives: keep a weak reference to it. None for a tensor subclass or another
    framework's tensor (measured by identity only).

    Example:
        >>> x = torch.ones(2, 3)
        >>> alias_key(x.view(2, 3)) == alias_key(x[:]), alias_key(x.view(3, 2)) == alias_key(x)
        (True, False)
    """
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return None
    try:
        address = tensor.data_ptr()
    except RuntimeError:  # no memory of its own to compare (a functorch batched or functional tensor)
        return None
    base = tensor._base
    if base is None:
        base = tensor
    return base, (id(base), address, tensor.shape, tensor.stride(), tensor.dtype, tensor.is_neg(), tensor.is_conj())


class Collector(Protocol):
    """Something that measures tensors into the step buffer.

    The monitor calls :meth:`arm` before a collected step and :meth:`disarm` before an
    uncollected one (so uncollected steps cost nothing), :meth:`before_transfer` at the end
    of a collected step (the place for end-of-step reads and the one cross-rank collective),
    and :meth:`close` once. ``close`` must leave no hook behind and be idempotent. Every collector
    implements it through :class:`trainmon.collect.hooks.HookedCollector`.
    """

    def arm(self) -> None: ...

    def disarm(self) -> None: ...

    def before_transfer(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class StepContext:
    """Per-monitor state that hooks read and append to.

    Every field has one owner that writes it (in brackets below); the others only read it. The session
    (:class:`trainmon.runtime.session.Session`) builds the context and writes the step-level fields, the step
    model (:class:`trainmon.runtime.lifecycle.StepLifecycle`) the micro-step ones; an integration may set a field
    at ``attach`` only where its framework owns that fact (named below), never during a step, except for
    the temporary micro-step labels of a pipeline schedule, restored before the hook returns.

    Attributes:
        specs: ``family -> StatsSpec`` for every enabled family; a family missing here is off. [session: built,
            replaced on a dynamic reload]
        metrics: ``family -> metric names`` in config order (for the host side). [session]
        buffer: the current step's buffer. [:meth:`new_step`, which the session calls at each step end (it
            also resets ``micro_step``); MindSpore's ``attach`` starts its own]
        step: the current optimizer step. [session: ``start_step`` and ``+1`` at each step end; DeepSpeed's
            ``attach``: the engine's ``global_steps`` when resuming]
        micro_step: forward passes of the root module in this step, minus one (0 without accumulation).
            [lifecycle; DeepSpeed's pipeline schedule and Megatron's forward-backward hooks label their
            micro-batches while one runs]
        forwards: training root forwards begun so far. [lifecycle]
        collecting: whether the current step is collected. [session: armed/disarmed at each step boundary,
            off at close or when the guard stops; lifecycle: suspended in evaluation, restored after]
        grad_acc_steps: micro-steps per step, as given to ``attach``. [session; DeepSpeed's ``attach``: the
            engine's ``gradient_accumulation_steps()``]
        pp_stage: this rank's pipeline stage. [session, from the attachment]
        buffer_factory, stats_fn: [MindSpore's ``attach``: its own buffer and statistics; else the defaults]
        backward_end, backward_failed, micro_step_dropped, step_not_taken: subscribers. [collectors append at
            ``attach``;
            the lifecycle runs them]
        schedule_backward_end: [lifecycle]
        scaler: [lifecycle: the ``GradScaler`` given to ``attach`` or found by the step hooks]
        guard: [session: one per attached monitor]
        grouped: [this class; the activation collector sets its ``limit_bytes``]
    """

    specs: dict[str, StatsSpec]
    metrics: dict[str, list[str]]
    buffer: Buffer = field(default_factory=StepBuffer)
    step: int = 0
    micro_step: int = 0
    forwards: int = 0
    """Training root forwards begun so far (each one a pass: a forward that raises and is retried is a new one)."""
    collecting: bool = False
    state_init_step: bool = False
    """An optimizer step of ``torch.distributed.checkpoint``'s state initialisation is running
    (:func:`~trainmon.collect.step_hooks.state_dict_init_step`): not a training step; no hook of trainmon's acts on it.
    [lifecycle]"""
    training_forward_open: bool = True
    """Whether a training forward of the root may be in flight: False only while the step model, following the
    root's forwards, knows that none is; a forward under ``no_grad`` then is an evaluation's (``model.decode(z)``
    for samples), not activation checkpointing's first pass, and records no rows. [lifecycle]"""
    grad_acc_steps: int = 1
    pp_stage: int = 0
    buffer_factory: Callable[[], Buffer] = StepBuffer
    """Makes each step's buffer; an integration with its own tensors (MindSpore) sets its own."""
    stats_fn: Callable[[Any, StatsSpec], Any] = partial_stats
    """Partial statistics of one tensor; MindSpore sets its own."""
    backward_end: list[Callable[[], None]] = field(default_factory=list)
    """Run at the end of each backward pass of a collected step, when the gradients are final
    (after data-parallel reduction): see :class:`trainmon.runtime.lifecycle.StepLifecycle`."""
    scaler: GradScaler | None = None
    """The torch ``GradScaler`` of the run, when known: gradients read before ``unscale_`` are divided by its scale."""
    backward_failed: list[Callable[[], None]] = field(default_factory=list)
    """Run when a backward pass of a collected step raised (its rows are rolled back)."""
    micro_step_dropped: list[Callable[[int], None]] = field(default_factory=list)
    """Run with a micro-step's number when it was abandoned (its backward raised before it reached the model):
    later micro-steps move down by one."""
    step_not_taken: list[Callable[[], None]] = field(default_factory=list)
    """Run when the step guard skipped a step without calling the optimizer's ``step`` (its step hooks did not run):
    the rows those hooks write are measured from here."""
    schedule_backward_end: Callable[[], None] = lambda: None
    """Called from inside a backward pass: makes sure :attr:`backward_end` runs when the pass ends
    (set by :class:`trainmon.runtime.lifecycle.StepLifecycle`; idempotent within one pass)."""
    guard: Guard = field(default_factory=Guard)
    """Catches trainmon's own exceptions in every hook, per part (:mod:`trainmon.base.guard`); owned by the session."""
    grouped: GroupedRows = field(init=False)
    """Activation rows measured in groups at flush points (:mod:`trainmon.collect.grouped`; off until a
    collector sets its ``limit_bytes``)."""
    _measured: dict[int, tuple[weakref.ref[Any], int, StatsSpec, torch.Tensor, int | None]] = field(
        default_factory=dict)
    _aliases: dict[tuple[Any, ...], tuple[weakref.ref[Any], int, StatsSpec, torch.Tensor, int | None]] = field(
        default_factory=dict)
    """The same partials by :func:`alias_key`: another view of the same memory (see :meth:`cached`)."""
    _unmeasurable: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.grouped = GroupedRows(self)

    def wants(self, family: str) -> bool:
        return self.collecting and family in self.specs

    def record(self, family: str, name: str, tensor: torch.Tensor, vpp_stage: int = 0,
               micro_step: int | None = None, scale: torch.Tensor | None = None,
               order: int | None = None) -> torch.Tensor | None:
        """Measure ``tensor`` into the buffer as a row of ``family`` (no host sync).

        ``scale``: a device scalar the tensor is multiplied by (a loss scale): the row then holds
        the statistics of ``tensor / scale`` (norm, sum, min, max; counts are unchanged).
        ``order``: the row's execution order, when reserved beforehand (default: the next one).

        Returns the device partial vector (so a caller can reuse it), or None when the family is off
        or the tensor cannot be measured (a sparse tensor, say: warned once per row, then skipped).
        """
        partial = self.measure(family, name, tensor)
        if partial is None:
            return None
        if scale is not None:
            partial = unscale_partial(partial, scale)
        self.add(family, name, partial, vpp_stage, micro_step, order)
        return partial

    def measure(self, family: str, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The device partial vector of ``tensor`` for ``family`` (row ``name``), not added to the buffer.

        None when the family is off or the tensor cannot be measured (warned once per row).
        """
        spec = self.specs.get(family)
        if spec is None:
            return None
        # The same tensor object at the same version was already measured this step (an output
        # that is the next module's input, a gradient unchanged between accumulation and the
        # optimizer step): reuse its statistics instead of reading the tensor again.
        partial = self.cached(tensor, spec)
        return partial if partial is not None else self.measure_anew(family, name, tensor, spec)

    def measure_anew(self, family: str, name: str, tensor: Any, spec: StatsSpec) -> torch.Tensor | None:
        """:meth:`measure` of a tensor known not to be in the cache (``cached`` just said so), with ``family``'s
        spec: computed and remembered; None when it cannot be measured (warned once per row)."""
        try:
            partial: torch.Tensor = self.stats_fn(tensor, spec)
        except Exception as exc:  # a tensor we cannot measure must not break the user's step
            self._cannot_measure(family, name, exc)
            return None
        self.remember(tensor, spec, partial, None)
        return partial

    def record_many(self, family: str, names: Sequence[str], tensors: Sequence[torch.Tensor],
                    vpp_stages: int | Sequence[int] = 0, micro_step: int | None = None,
                    scale: torch.Tensor | None = None, orders: Sequence[int] | None = None) -> None:
        """:meth:`record` for many tensors at once: rows ``names[i]`` of ``tensors[i]``.

        Same rows, values, dedup cache and ``scale`` semantics as calling :meth:`record` for each
        tensor in turn, but the statistics are computed together (:func:`partial_stats_many`: a
        few kernels per device and dtype instead of a dozen per tensor) and added to the buffer
        as blocks. ``vpp_stages``: one for all rows or one per row; ``orders``: each row's
        execution order when reserved beforehand (default: consecutive, in the order given).
        A tensor that cannot be measured is warned about once per row and skipped.
        """
        spec = self.specs.get(family)
        if spec is None or not tensors:
            return
        stages = [vpp_stages] * len(tensors) if isinstance(vpp_stages, int) else list(vpp_stages)
        buffer = self.buffer
        if self.stats_fn is not partial_stats or not isinstance(buffer, StepBuffer):
            for i, (name, tensor) in enumerate(zip(names, tensors)):  # another framework's statistics
                self.record(family, name, tensor, stages[i], micro_step, scale,
                            None if orders is None else orders[i])
            return
        if orders is None:
            first = buffer.reserve_orders(len(tensors))
            orders = range(first, first + len(tensors))
        micro = self.micro_step if micro_step is None else micro_step
        fresh: list[int] = []
        for i, tensor in enumerate(tensors):
            cached = self.cached(tensor, spec)
            if cached is not None:  # measured already this step: reuse (see record)
                partial = cached if scale is None else unscale_partial(cached, scale)
                buffer.add(RowKey(family, names[i], micro, stages[i], orders[i]), partial)
            elif getattr(tensor, "layout", torch.strided) != torch.strided:
                self._cannot_measure(family, names[i], TypeError(f"{tensor.layout} tensors are not measured"))
            else:
                fresh.append(i)
        if not fresh:
            return
        try:
            groups = partial_stats_many([tensors[i] for i in fresh], spec)
        except Exception:  # measure one by one: each row that fails is warned about and skipped
            for i in fresh:
                self.record(family, names[i], tensors[i], stages[i], micro_step, scale, orders[i])
            return
        for indices, block in groups:
            rows = [fresh[j] for j in indices]
            for row, i in enumerate(rows):
                self.remember(tensors[i], spec, block, row)
            if scale is not None:
                block = unscale_block(block, scale)
            keys = [RowKey(family, names[i], micro, stages[i], orders[i]) for i in rows]
            buffer.add_block(keys, block)

    def cached(self, tensor: Any, spec: StatsSpec) -> torch.Tensor | None:
        """The partial of ``tensor`` measured earlier this step at its current version, if any."""
        seen = self._seen(tensor, spec)
        if seen is None:
            return None
        block, row = seen
        return block if row is None else block[row * 8:(row + 1) * 8]

    def cached_norms(self, tensors: Sequence[Any], spec: StatsSpec) -> list[torch.Tensor] | None:
        """The L2 norms of ``tensors``, in no particular order, from partials measured earlier this step at
        their current versions: the norm column of each block they fill (a view, no read of the tensors).
        None unless every tensor was measured with a spec that has the norm, in blocks holding only them (an
        index into part of a block would be a host-to-device copy)."""
        if not spec.norm:
            return None
        rows: dict[int, tuple[torch.Tensor, set[int]]] = {}
        for tensor in tensors:
            seen = self._seen(tensor, spec)
            if seen is None:
                return None
            block, row = seen
            rows.setdefault(id(block), (block, set()))[1].add(0 if row is None else row)
        if any(len(at) * 8 != block.numel() for block, at in rows.values()):
            return None
        return [block.view(-1, 8)[:, 0] for block, _ in rows.values()]

    def _seen(self, tensor: Any, spec: StatsSpec) -> tuple[torch.Tensor, int | None] | None:
        version = _version(tensor)
        if version is None:
            return None
        seen = self._measured.get(id(tensor))
        if seen is None or seen[0]() is not tensor or seen[1] != version or seen[2] != spec:
            # Another view of a measured tensor's memory (with module backward hooks, torch hands each hook its
            # own alias of an input or output): the same elements, the same version counter.
            alias = alias_key(tensor)
            seen = self._aliases.get(alias[1]) if alias is not None else None
            if seen is None or alias is None or seen[0]() is not alias[0] or seen[1] != version or seen[2] != spec:
                return None
        return seen[3], seen[4]

    def remember(self, tensor: Any, spec: StatsSpec, block: Any, row: int | None) -> None:
        version = _version(tensor)
        if version is not None:
            entry = (weakref.ref(tensor), version, spec, block, row)
            self._measured[id(tensor)] = entry
            alias = alias_key(tensor)
            if alias is not None:
                self._aliases[alias[1]] = (weakref.ref(alias[0]), version, spec, block, row)

    def forget_measured(self) -> None:
        """Forget which tensors were measured: the next read measures again.

        Called when the optimizer phase begins: ``GradScaler.unscale_`` rewrites gradients in
        place without bumping their version, so a cached partial could be the scaled gradient's.
        """
        self._measured.clear()
        self._aliases.clear()

    def _cannot_measure(self, family: str, name: str, exc: Exception) -> None:
        if (family, name) not in self._unmeasurable:
            self._unmeasurable.add((family, name))
            logger.warning("trainmon: cannot measure %s/%s (%s: %s); that row is skipped",
                           family, name, type(exc).__name__, exc)

    def new_step(self) -> None:
        """Reset the per-step state after the step's transfer."""
        self.buffer = self.buffer_factory()
        self._measured.clear()
        self._aliases.clear()
        self.micro_step = 0

    def add(self, family: str, name: str, partial: torch.Tensor, vpp_stage: int = 0,
            micro_step: int | None = None, order: int | None = None) -> None:
        """Append an already computed ``[8]`` partial vector (e.g. combined across shards)."""
        key = RowKey(family, name, self.micro_step if micro_step is None else micro_step,
                     vpp_stage, self.buffer.next_order() if order is None else order)
        self.buffer.add(key, partial)

    def add_many(self, family: str, names: Sequence[str], partials: torch.Tensor,
                 vpp_stages: Sequence[int] | None = None) -> None:
        """Append ``[N, 8]`` partials (one row each), e.g. after one all-gather for all parameters."""
        for i, name in enumerate(names):
            self.add(family, name, partials[i], vpp_stages[i] if vpp_stages else 0)
