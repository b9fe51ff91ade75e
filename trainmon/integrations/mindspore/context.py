"""Measuring MindSpore tensors into the monitor's step context.

The monitor's :class:`~trainmon.collect.context.StepContext` is framework-neutral except for
``record`` (torch statistics) and the buffer it creates; the MindSpore collectors measure with
:func:`record` below, which computes MindSpore statistics and appends them through ``ctx.add``
to a :class:`MindSporeStepBuffer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mindspore import Tensor

from trainmon.integrations.mindspore.buffer import MindSporeStepBuffer
from trainmon.integrations.mindspore.stats import partial_stats

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext


def new_buffer() -> MindSporeStepBuffer:
    """A fresh step buffer for a MindSpore attachment (``StepContext.buffer_factory``)."""
    return MindSporeStepBuffer()


def buffer_of(ctx: StepContext) -> MindSporeStepBuffer:
    """The current step's MindSpore buffer."""
    buffer = ctx.buffer
    assert isinstance(buffer, MindSporeStepBuffer), "attach() sets ctx.buffer_factory"
    return buffer


def record(ctx: StepContext, family: str, name: str, tensor: Tensor, vpp_stage: int = 0,
           micro_step: int | None = None) -> Tensor | None:
    """Measure a MindSpore ``tensor`` as a row of ``family`` (no host sync).

    Returns:
        The ``[8]`` device partial vector, or None when ``family`` is off.
    """
    spec = ctx.specs.get(family)
    if spec is None:
        return None
    buffer_of(ctx)
    partial = partial_stats(tensor, spec)
    ctx.add(family, name, partial, vpp_stage, micro_step)
    return partial


def named_tensors(value: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every MindSpore tensor in ``value``, named exactly as the torch
    collector names them (:func:`trainmon.collect.activations.named_tensors`): a tensor keeps
    ``prefix``, the i-th tensor of a tuple/list gets ``prefix.i``, a dict entry ``prefix.key``;
    ``None`` entries (gradients that were not computed) are skipped."""
    if isinstance(value, Tensor):
        yield prefix, value
        return
    found: list[tuple[str, Tensor]] = []
    _flatten(value, found)
    if len(found) == 1 and isinstance(value, (tuple, list)):
        yield prefix, found[0][1]
        return
    for i, (key, tensor) in enumerate(found):
        yield f"{prefix}.{key or i}", tensor


def _flatten(value: Any, out: list[tuple[str, Tensor]], key: str = "") -> None:
    if isinstance(value, Tensor):
        out.append((key, value))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _flatten(item, out, key)
    elif isinstance(value, dict):
        for name, item in value.items():
            _flatten(item, out, f"{key}.{name}" if key else str(name))
