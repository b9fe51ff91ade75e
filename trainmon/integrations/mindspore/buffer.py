"""The MindSpore step buffer: same interface as :class:`trainmon.collect.buffer.StepBuffer`.

Hooks append ``(RowKey, [8] MindSpore tensor)`` pairs and 0-d scalar tensors; :meth:`transfer`
stacks them on the device and copies them to the host once, returning the framework-free
:class:`~trainmon.collect.buffer.HostStep` that the shared host side finalises.

A MindSpore attachment sets ``ctx.buffer_factory`` (:func:`new_buffer`) and ``ctx.stats_fn``
(MindSpore statistics), so the shared collectors and ``ctx.record`` work unchanged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from trainmon.collect.buffer import HostStep
from trainmon.records import PARTIAL_SLOTS, RowKey

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext


@dataclass
class MindSporeStepBuffer:
    """Collects device statistics of one step; ``transfer()`` is the step's one host copy."""

    keys: list[RowKey] = field(default_factory=list)
    partials: list[Tensor] = field(default_factory=list)
    scalar_names: list[str] = field(default_factory=list)
    scalar_values: list[Tensor] = field(default_factory=list)
    host_scalars: dict[str, float] = field(default_factory=dict)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def next_order(self) -> int:
        """Execution-order counter within the step (the ``order`` of rows and events)."""
        return next(self._order)

    def add(self, key: RowKey, partial: Tensor) -> None:
        self.keys.append(key)
        self.partials.append(partial)

    def truncate(self, n_rows: int) -> None:
        """Keep the first ``n_rows`` rows only (one partial per row here)."""
        del self.keys[n_rows:]
        del self.partials[n_rows:]

    def add_scalar(self, name: str, value: Any) -> None:
        """A MindSpore tensor stays on the device (its mean, in float32); a number is kept as is."""
        if isinstance(value, Tensor):
            self.scalar_names.append(name)
            self.scalar_values.append(value.astype(ms.float32).mean().reshape((1,)))
        else:
            self.host_scalars[name] = float(value)

    def __len__(self) -> int:
        return len(self.keys) + len(self.scalar_names)

    def transfer(self) -> HostStep:
        """Stack and copy to the host: THE host synchronisation of a collected step."""
        n_rows = len(self.partials)
        pieces = [ops.stack(self.partials).reshape(-1)] if n_rows else []
        pieces += self.scalar_values
        if pieces:
            flat = ops.cat(pieces) if len(pieces) > 1 else pieces[0]
            values = flat.asnumpy().astype(np.float64)  # sync: the one device-to-host transfer of the step
        else:
            values = np.empty(0)
        partials = values[: n_rows * PARTIAL_SLOTS].reshape(n_rows, PARTIAL_SLOTS)
        scalars = dict(self.host_scalars)
        scalars.update(zip(self.scalar_names, map(float, values[n_rows * PARTIAL_SLOTS:])))
        return HostStep(list(self.keys), partials, scalars)


def new_buffer() -> MindSporeStepBuffer:
    """A fresh step buffer for a MindSpore attachment (``StepContext.buffer_factory``)."""
    return MindSporeStepBuffer()


def buffer_of(ctx: StepContext) -> MindSporeStepBuffer:
    """The current step's MindSpore buffer."""
    buffer = ctx.buffer
    assert isinstance(buffer, MindSporeStepBuffer), "attach() sets ctx.buffer_factory"
    return buffer
