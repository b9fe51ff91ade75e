"""The MindSpore step buffer as the monitor's StepContext uses it.

A MindSpore attachment sets ``ctx.buffer_factory`` (this module's :func:`new_buffer`) and
``ctx.stats_fn`` (MindSpore statistics), so the shared collectors and ``ctx.record`` work
unchanged and the host side receives the same ``HostStep`` as from torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmon.integrations.mindspore.buffer import MindSporeStepBuffer

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
