"""The MindSpore step buffer: same interface as :class:`trainmon.collect.buffer.StepBuffer`.

Hooks append ``(RowKey, [8] MindSpore tensor)`` pairs, blocks of ``N`` rows (a flat ``[8 N]`` tensor)
and scalar tensors; :meth:`transfer` concatenates them on the device (one ``mint.cat``: ``ops.stack``
has no asynchronous kernel and costs about 1 ms a call) and copies them to the host once, returning the
framework-free :class:`~trainmon.collect.buffer.HostStep` that the shared host side finalises. Rows
measured together by size may come in another order than they ran: the host side puts them back in
execution order (their ``order``) after the copy, for free.

A MindSpore attachment sets ``ctx.buffer_factory`` (:func:`new_buffer`) and ``ctx.stats_fn``
(MindSpore statistics), so the shared collectors and ``ctx.record`` work unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.records import RowKey
from trainmon.collect.buffer import HostStep
from trainmon.integrations.mindspore.host import Deferred, HostEntry, HostRows

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext


@dataclass
class MindSporeStepBuffer:
    """Collects device statistics of one step; ``transfer()`` is the step's one host copy."""

    keys: list[RowKey] = field(default_factory=list)
    partials: list[Tensor] = field(default_factory=list)
    """Flat float32 tensors of ``8 k`` values, the partials of ``k`` consecutive ``keys``."""
    rows: list[int] = field(default_factory=list)
    """How many rows each of :attr:`partials` holds (host metadata: asking a tensor its size may wait)."""
    scalar_names: list[str] = field(default_factory=list)
    scalar_values: list[Tensor] = field(default_factory=list)
    host_scalars: dict[str, float] = field(default_factory=dict)
    host: list[tuple[int, HostEntry]] = field(default_factory=list)
    host_bytes: int = 0
    """Bytes of the copies kept for :attr:`host` rows (``MindSporeStats`` bounds them)."""
    """Rows measured on the host after the synchronisation (:mod:`.host`), with ``len(keys)`` when each was added."""
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def next_order(self) -> int:
        """Execution-order counter within the step (the ``order`` of rows and events)."""
        return next(self._order)

    def reserve_orders(self, count: int) -> int:
        """The first of ``count`` consecutive execution-order numbers, reserved for rows measured together."""
        first = next(self._order)
        if count > 1:
            self._order = itertools.count(first + count)
        return first

    def add(self, key: RowKey, partial: Tensor | Deferred) -> None:
        """One row: an ``[8]`` float32 tensor, or a tensor to measure on the host (:class:`~.host.Deferred`)."""
        if isinstance(partial, Deferred):
            self.add_host(HostRows([key], [partial.tensor], partial.spec))
            return
        self.keys.append(key)
        self.partials.append(partial)
        self.rows.append(1)

    def add_block(self, keys: list[RowKey], block: Tensor) -> None:
        """``len(keys)`` rows whose partials are the consecutive 8-value slices of the flat float32 ``block``."""
        self.keys.extend(keys)
        self.partials.append(block)
        self.rows.append(len(keys))

    def add_host(self, entry: HostEntry) -> None:
        """Rows measured on the host when the step is transferred (their tensors are only referenced now)."""
        self.host.append((len(self.keys), entry))

    def truncate(self, n_rows: int) -> None:
        """Keep the first ``n_rows`` rows only (the rows of a pass that raised go); a block is cut where needed."""
        self.host = [(mark, entry) for mark, entry in self.host if mark < n_rows]
        if n_rows >= len(self.keys):
            return
        del self.keys[n_rows:]
        kept, counts, total = [], [], 0
        for partial, count in zip(self.partials, self.rows):
            if total >= n_rows:
                break
            take = min(count, n_rows - total)
            kept.append(partial if take == count else partial[:take * PARTIAL_SLOTS])
            counts.append(take)
            total += take
        self.partials, self.rows = kept, counts

    def add_scalar(self, name: str, value: Any) -> None:
        """A MindSpore tensor stays on the device (its mean, in float32); a number is kept as is."""
        if isinstance(value, Tensor):
            self.scalar_names.append(name)
            self.scalar_values.append(mint.mean(value.astype(ms.float32)).reshape((1,)))
        else:
            self.host_scalars[name] = float(value)

    def __len__(self) -> int:
        return len(self.keys) + len(self.scalar_names) + sum(len(entry.keys) + 1 for _, entry in self.host)

    def transfer(self) -> HostStep:
        """Concatenate and copy to the host: THE host synchronisation of a collected step."""
        n_rows = len(self.keys)
        pieces = self.partials + self.scalar_values
        if pieces:
            flat = mint.cat(pieces) if len(pieces) > 1 else pieces[0]
            values = flat.asnumpy().astype(np.float64)  # sync: the one device-to-host transfer of the step
        else:
            values = np.empty(0)
        partials = values[: n_rows * PARTIAL_SLOTS].reshape(n_rows, PARTIAL_SLOTS)
        keys = list(self.keys)
        scalars = dict(self.host_scalars)
        if self.host:  # after the synchronisation above: these reads of host memory wait for nothing
            with torch_on_one_thread():
                measured = [entry.measure() for _, entry in self.host]
            keys += [key for _, entry in self.host for key in entry.keys]
            partials = np.concatenate([partials, *(rows for rows, _ in measured)])
            for _, values_of in measured:
                scalars.update(values_of)
            n_rows = len(keys)
        orders = np.fromiter((key.order for key in keys), np.int64, n_rows)
        if n_rows and (np.diff(orders) < 0).any():  # blocks measured by size: back to execution order
            permutation = np.argsort(orders, kind="stable")
            keys, partials = [keys[i] for i in permutation], partials[permutation]
        scalars.update(zip(self.scalar_names, map(float, values[len(self.keys) * PARTIAL_SLOTS:])))
        return HostStep(keys, partials, scalars)


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """torch's CPU kernels (trainmon's host statistics) on one thread, the thread count restored after (0.2 µs).

    MindSpore's thread pool keeps the cores busy after each op; torch's OpenMP workers then wait for a core:
    a sum of 65 K floats took 2.9 ms on 2 threads there, 80 µs on one. torch computes nothing else in a
    MindSpore run, so the user's training is not affected.
    """
    import torch

    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def new_buffer() -> MindSporeStepBuffer:
    """A fresh step buffer for a MindSpore attachment (``StepContext.buffer_factory``)."""
    return MindSporeStepBuffer()


def buffer_of(ctx: StepContext) -> MindSporeStepBuffer:
    """The current step's MindSpore buffer."""
    buffer = ctx.buffer
    assert isinstance(buffer, MindSporeStepBuffer), "attach() sets ctx.buffer_factory"
    return buffer
