"""Activations measured in groups: a hook keeps the tensor, one group kernel measures many at once.

Measured in its hook, every activation costs one statistics call: a kernel launch and about 200 µs
of host time on a GPU, some 600 calls per step for a 1 B-parameter GPT. :class:`GroupedRows` keeps
the tensor (and its version) instead and measures what it kept with :func:`partial_stats_many` at
the next flush point: the end of the root module's forward, the end of a backward pass, the end of
the step, or as soon as the kept tensors hold ``limit_bytes`` (the bound on the memory they may keep
alive; most are kept by autograd for the backward anyway).

The value a row reports is the tensor's value at its hook. A tensor modified in place after its
hook (``out += x`` in the parent's forward) would be measured wrong later, so each row is first
measured in its hook while its tensor is kept and its version watched until the next flush point
(its first collected step; watched tensors count towards ``limit_bytes``). A row whose tensor was
modified is measured in its hook from then on, the others are grouped. A grouped tensor found
modified at its flush (the model changed its behaviour) is not measured: that row is skipped once
with a warning and measured in its hook from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.records import RowKey
from trainmon.collect.buffer import StepBuffer, device_module
from trainmon.collect.stats import numpy_viewable, partial_stats, partial_stats_many

if TYPE_CHECKING:
    from trainmon.collect.stats_base import StatsSpec

logger = logging.getLogger("trainmon")


class RowContext(Protocol):
    """What :class:`GroupedRows` uses of :class:`trainmon.collect.context.StepContext`, which owns it (named here
    so that this module does not import the context that imports it)."""

    @property
    def specs(self) -> dict[str, StatsSpec]: ...
    @property
    def buffer(self) -> Any: ...
    @property
    def micro_step(self) -> int: ...
    @property
    def stats_fn(self) -> Callable[[Any, StatsSpec], Any]: ...

    def record(self, family: str, name: str, tensor: torch.Tensor, vpp_stage: int = 0,
               micro_step: int | None = None, scale: torch.Tensor | None = None,
               order: int | None = None) -> torch.Tensor | None: ...

    def measure(self, family: str, name: str, tensor: torch.Tensor) -> torch.Tensor | None: ...

    def measure_anew(self, family: str, name: str, tensor: Any, spec: StatsSpec) -> torch.Tensor | None: ...

    def cached(self, tensor: Any, spec: StatsSpec) -> torch.Tensor | None: ...

    def remember(self, tensor: Any, spec: StatsSpec, block: Any, row: int | None) -> None: ...

_GROUPED, _IN_HOOK = True, False


@dataclass
class _Kept:
    """The rows of one family since the last flush, in execution order, and the tensors kept for them.

    A row is ``(key, position)``, the position of its kept tensor, or ``(key, partial)``: statistics
    computed in its hook (a row measured in its hook, a tensor measured earlier this step, a CPU tensor),
    held back so that the rows reach the buffer, and the CSV, in execution order.
    """

    tensors: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    streams: list[Any] = field(default_factory=list)  # the stream current at each tensor's hook (None on CPU)
    index: dict[int, int] = field(default_factory=dict)  # id(tensor) -> position (the tensor is held: ids are stable)
    rows: list[tuple[RowKey, int | torch.Tensor]] = field(default_factory=list)


class GroupedRows:
    """Rows of the activation families measured in groups (see the module docstring).

    Args:
        ctx: the monitor's step context (its buffer, specs, dedup cache and micro-step).
        limit_bytes: the most bytes of tensors kept before a flush; 0 measures every tensor in its hook.
    """

    def __init__(self, ctx: RowContext, limit_bytes: int = 0) -> None:
        self.ctx = ctx
        self.limit_bytes = limit_bytes
        self._kept: dict[str, _Kept] = {}
        self._bytes = 0
        self._mode: dict[tuple[str, str], bool] = {}  # (family, row) -> _GROUPED or _IN_HOOK; absent: learning
        self._watched: list[tuple[str, str, torch.Tensor, int]] = []
        self._warned: set[tuple[str, str]] = set()

    def record(self, family: str, name: str, tensor: Any, vpp_stage: int = 0, micro_step: int | None = None) -> None:
        """:meth:`StepContext.record` of a tensor, now or at the next flush point."""
        ctx = self.ctx
        if (not self.limit_bytes or ctx.stats_fn is not partial_stats or not isinstance(ctx.buffer, StepBuffer)
                or family not in ctx.specs):
            ctx.record(family, name, tensor, vpp_stage, micro_step)
            return
        key = RowKey(family, name, ctx.micro_step if micro_step is None else micro_step, vpp_stage,
                     ctx.buffer.next_order())
        kept = self._kept.setdefault(family, _Kept())
        mode = self._mode.get((family, name))
        spec = ctx.specs[family]
        cached = ctx.cached(tensor, spec)
        groupable = _groupable(tensor)
        if mode is not _GROUPED or cached is not None or not groupable:
            partial = cached if cached is not None else ctx.measure_anew(family, name, tensor, spec)
            if partial is not None:
                kept.rows.append((key, partial))
            if mode is None and partial is not None and groupable:  # learning: watched to the flush
                self._watched.append((family, name, tensor, tensor._version))
                self._add_bytes(tensor)
            return
        position = kept.index.get(id(tensor))
        if position is not None and kept.versions[position] == tensor._version:
            kept.rows.append((key, position))  # a second row of a kept tensor (an output that is the next input)
            return
        position = kept.index[id(tensor)] = len(kept.tensors)
        kept.tensors.append(tensor)
        kept.versions.append(tensor._version)
        kept.streams.append(_current_stream(tensor.device))
        kept.rows.append((key, position))
        self._add_bytes(tensor)  # may flush: after the row is in

    def _add_bytes(self, tensor: torch.Tensor) -> None:
        self._bytes += tensor.numel() * tensor.element_size()
        if self._bytes >= self.limit_bytes:
            self.flush()

    def flush(self) -> None:
        """Measure every kept tensor (a few kernels per family, device and dtype) into the step's buffer."""
        watched, self._watched = self._watched, []
        kept_by_family, self._kept, self._bytes = self._kept, {}, 0
        try:
            self._settle(watched)
            for family, kept in kept_by_family.items():
                self._measure(family, kept)
        except Exception as exc:  # a monitor failure never reaches the user's step
            self._warn_once(("", ""), "trainmon: measuring activations together failed (%s: %s); those rows are "
                            "skipped", type(exc).__name__, exc)

    def discard(self) -> None:
        """Forget the kept tensors and watches (the pass that recorded them raised: its rows go)."""
        self._kept, self._bytes = {}, 0
        self._watched.clear()

    def _settle(self, watched: list[tuple[str, str, torch.Tensor, int]]) -> None:
        """Rows measured in their hook while learning: grouped from now on unless their tensor changed since."""
        for family, name, tensor, version in watched:
            changed = tensor._version != version
            if changed or (family, name) not in self._mode:
                self._mode[(family, name)] = _IN_HOOK if changed else _GROUPED

    def _measure(self, family: str, kept: _Kept) -> None:
        ctx, spec, buffer = self.ctx, self.ctx.specs.get(family), self.ctx.buffer
        if spec is None or not kept.rows or not isinstance(buffer, StepBuffer):
            return
        intact = [i for i, tensor in enumerate(kept.tensors) if tensor._version == kept.versions[i]]
        _follow_streams([kept.tensors[i] for i in intact], [kept.streams[i] for i in intact])
        where: dict[int, tuple[torch.Tensor, int]] = {}
        for indices, block in partial_stats_many([kept.tensors[i] for i in intact], spec) if intact else []:
            for row, j in enumerate(indices):
                where[intact[j]] = (block, row)
                ctx.remember(kept.tensors[intact[j]], spec, block, row)
        # Into the buffer in execution order: runs of consecutive rows of one block go in as one block.
        run: list[RowKey] = []
        run_block, first = None, 0
        for key, source in kept.rows:
            if isinstance(source, torch.Tensor):
                _add_run(buffer, run, run_block, first)
                run, run_block = [], None
                buffer.add(key, source)
                continue
            found = where.get(source)
            if found is None:  # modified in place after its hook: its value then is gone
                self._mode[(family, key.name)] = _IN_HOOK
                self._warn_once((family, key.name), "trainmon: %s/%s was modified in place after its hook; that row "
                                "is skipped this step and measured in its hook from now on", family, key.name)
                continue
            block, row = found
            if block is not run_block or row != first + len(run):
                _add_run(buffer, run, run_block, first)
                run, run_block, first = [], block, row
            run.append(key)
        _add_run(buffer, run, run_block, first)

    def _warn_once(self, key: tuple[str, str], message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def _groupable(tensor: Any) -> bool:
    """Whether a tensor can be kept and measured later: a non-empty strided device-path tensor with a version."""
    return (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and tensor.numel() > 0
            and not numpy_viewable(tensor) and not tensor.is_inference())  # an inference tensor has no version


def _add_run(buffer: StepBuffer, keys: list[RowKey], block: torch.Tensor | None, first: int) -> None:
    """Rows ``first .. first + len(keys)`` of ``block``: the block itself when they are all of it, else a view."""
    if not keys or block is None:
        return
    if first == 0 and len(keys) * PARTIAL_SLOTS == block.numel():
        buffer.add_block(keys, block)
    else:
        buffer.add_block(keys, block[first * PARTIAL_SLOTS:(first + len(keys)) * PARTIAL_SLOTS])


def _current_stream(device: torch.device) -> Any:
    """The stream work is queued on for ``device`` now (a CUDA or NPU stream), or None (CPU, or no stream API)."""
    if device.type == "cpu":
        return None
    current = getattr(device_module(device.type), "current_stream", None)
    return current(device) if current is not None else None



def _follow_streams(tensors: list[torch.Tensor], streams: list[Any]) -> None:
    """Make the stream that measures now wait for the streams the tensors were made on, where they differ.

    Measured in its hook, a tensor is read on the stream that made it. Kept, it is read at the flush, on the
    stream current then: that stream first waits for the tensor's stream (on the device, no host sync), and
    the tensor is marked as used by it, so that its memory is not reused before the read.
    """
    waited: set[Any] = set()
    current: dict[torch.device, Any] = {}
    for tensor, stream in zip(tensors, streams):
        if stream is None:
            continue
        device = tensor.device
        now = current[device] if device in current else current.setdefault(device, _current_stream(device))
        if now is None or stream == now:
            continue
        if stream not in waited:
            now.wait_stream(stream)
            waited.add(stream)
        tensor.record_stream(now)
