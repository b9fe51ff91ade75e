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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.buffer import StepBuffer
from trainmon.collect.stats import numpy_viewable, partial_stats, partial_stats_many
from trainmon.records import PARTIAL_SLOTS, RowKey

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext

logger = logging.getLogger("trainmon")

_GROUPED, _IN_HOOK = True, False


@dataclass
class _Kept:
    """The tensors of one family kept since the last flush, and the rows that read them."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # id(tensor) -> position (the tensor is held: ids are stable)
    rows: list[tuple[RowKey, int]] = field(default_factory=list)


class GroupedRows:
    """Rows of the activation families measured in groups (see the module docstring).

    Args:
        ctx: the monitor's step context (its buffer, specs, dedup cache and micro-step).
        limit_bytes: the most bytes of tensors kept before a flush; 0 measures every tensor in its hook.
    """

    def __init__(self, ctx: StepContext, limit_bytes: int = 0) -> None:
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
        spec = ctx.specs.get(family)
        if spec is None:
            return
        mode = self._mode.get((family, name))
        if (mode is _IN_HOOK or not self.limit_bytes or not isinstance(tensor, torch.Tensor)
                or ctx.stats_fn is not partial_stats or not isinstance(ctx.buffer, StepBuffer)
                or tensor.layout != torch.strided or numpy_viewable(tensor) or tensor.numel() == 0
                or tensor.is_inference()):  # an inference tensor has no version counter
            ctx.record(family, name, tensor, vpp_stage, micro_step)
            return
        if mode is None:  # first seen: measured now, its tensor kept and watched until the next flush point
            ctx.record(family, name, tensor, vpp_stage, micro_step)
            self._watched.append((family, name, tensor, tensor._version))
            self._add_bytes(tensor)
            return
        key = RowKey(family, name, ctx.micro_step if micro_step is None else micro_step, vpp_stage,
                     ctx.buffer.next_order())
        cached = ctx._cached(tensor, spec)
        if cached is not None:  # measured already this step at this version
            ctx.buffer.add(key, cached)
            return
        kept = self._kept.setdefault(family, _Kept())
        position = kept.index.get(id(tensor))
        if position is None or kept.versions[position] != tensor._version:
            position = kept.index[id(tensor)] = len(kept.tensors)
            kept.tensors.append(tensor)
            kept.versions.append(tensor._version)
            kept.rows.append((key, position))
            self._add_bytes(tensor)
        else:
            kept.rows.append((key, position))

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
        self._bytes = 0

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
        where: dict[int, tuple[torch.Tensor, int]] = {}
        for indices, block in partial_stats_many([kept.tensors[i] for i in intact], spec) if intact else []:
            for row, j in enumerate(indices):
                where[intact[j]] = (block, row)
                ctx._remember(kept.tensors[intact[j]], spec, block, row)
        firsts: dict[int, list[RowKey]] = {}  # id(block) -> keys of its rows, in block order
        blocks: dict[int, torch.Tensor] = {}
        taken: set[int] = set()
        for key, position in kept.rows:
            found = where.get(position)
            if found is None:  # modified in place after its hook: its value then is gone
                self._mode[(family, key.name)] = _IN_HOOK
                self._warn_once((family, key.name), "trainmon: %s/%s was modified in place after its hook; that row "
                                "is skipped this step and measured in its hook from now on", family, key.name)
                continue
            block, row = found
            if position in taken:  # a second row of the same tensor (an output that is the next input)
                buffer.add(key, block[row * PARTIAL_SLOTS:(row + 1) * PARTIAL_SLOTS])
                continue
            taken.add(position)
            firsts.setdefault(id(block), []).append(key)
            blocks[id(block)] = block
        for block_id, keys in firsts.items():
            block = blocks[block_id]
            if len(keys) * PARTIAL_SLOTS == block.numel():
                buffer.add_block(keys, block)
            else:  # pragma: no cover - every tensor of a block has a first row
                raise AssertionError("grouped rows and their block disagree")

    def _warn_once(self, key: tuple[str, str], message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)
