"""Leaving batches out of a data loader's sampler by their positions, and the positions of the batches it keeps.

A data loader's batch is named ``[epoch, position, position + 1]`` (:mod:`trainmon.actions.skip_list`): its position
counts every batch the loader yields in that epoch, left out or not, so it names the same data in every run as long
as the loader's order is the same (a sequential sampler, a ``DistributedSampler`` from its seed and the epoch).
:class:`SkipBatches` wraps the sampler (of whole batches, or of samples a torch ``BatchSampler`` groups) and leaves
out the indices of the batches a :class:`BatchPlan` names, and, resuming mid-epoch, those before the position the
checkpoint's run had reached: no data is loaded for them. :func:`place` says how each skip-list entry is left out:
by position, by its samples (``SkipSampler``), or already by a ``SkipSampler`` of the user's.

Framework-free: a sampler is any sized iterable of indices. Used by the Lightning callback
(:mod:`trainmon.trainers.lightning_data`).
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trainmon.actions.skip_list import SkipList, SkipSampler

Range = tuple[int, int]
Ranges = dict[int, list[Range]]


# ----------------------------------------------------------------------------- positions
def nth_outside(n: int, ranges: list[Range], start: int = 0) -> int:
    """The ``n``-th (from 0) position at or after ``start`` that is not in the sorted, merged ``ranges``.

    Example:
        >>> nth_outside(0, [(0, 2)]), nth_outside(3, [(1, 2), (3, 5)]), nth_outside(1, [(4, 6)], start=3)
        (2, 6, 6)
    """
    position = start + n
    for first, end in ranges:
        if end <= start:
            continue
        first = max(first, start)
        if first > position:
            break
        position += end - first
    return position


def merged(ranges: Iterable[Range]) -> list[Range]:
    """The ranges sorted, with overlapping and touching ones merged (empty ones dropped)."""
    merged: list[list[int]] = []
    for first, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([first, end])
    return [(first, end) for first, end in merged]


def _without(ranges: list[Range], holes: list[Range]) -> list[Range]:
    """``ranges`` less the positions of ``holes`` (both sorted and merged).

    Example:
        >>> _without([(0, 10)], [(2, 3), (5, 7)])
        [(0, 2), (3, 5), (7, 10)]
    """
    result = []
    for first, end in ranges:
        for hole_first, hole_end in holes:
            if hole_end <= first or hole_first >= end:
                continue
            if hole_first > first:
                result.append((first, hole_first))
            first = max(first, hole_end)
        if end > first:
            result.append((first, end))
    return result


def _count_below(ranges: list[Range], limit: int) -> int:
    return sum(max(0, min(end, limit) - first) for first, end in ranges if first < limit)


def _inside(position: int, starts: list[int], ranges: list[Range]) -> bool:
    at = bisect.bisect_right(starts, position) - 1
    return at >= 0 and position < ranges[at][1]


class BatchPlan:
    """The batches of each epoch that are gone from the training loader, and where the resumed epoch starts.

    Args:
        dropped: ``{epoch: [(first, end), ...]}``: the positions :class:`SkipBatches` leaves out.
        user: the positions a ``SkipSampler`` of the user's leaves out (already absent from the loader's stream).
        resume: ``(epoch, position)``: the loader's position where the checkpoint's run was, or None.
        epoch: the epoch Lightning's next pass over the loader is for (``fit_loop.epoch_progress.current.processed``).
    """

    def __init__(self, dropped: Ranges, user: Ranges, resume: tuple[int, int] | None,
                 epoch: Callable[[], int]) -> None:
        self.user = {e: merged(r) for e, r in user.items() if r}
        self.dropped = {e: _without(merged(r), self.user.get(e, [])) for e, r in dropped.items() if r}
        self.gone = {e: merged(self.dropped.get(e, []) + self.user.get(e, []))
                     for e in set(self.dropped) | set(self.user)}
        self.resume = resume
        self._epoch = epoch
        self.starts: dict[int, int] = {}
        """The first position of each epoch's pass over the loader (the resumed epoch's: where it resumed)."""

    def leaves_out(self, epoch: int) -> bool:
        """Whether the loader leaves out (or starts later in) ``epoch`` or a later epoch."""
        resumed = self.resume is not None and self.resume[1] > 0 and self.resume[0] >= epoch
        return resumed or any(e >= epoch for e in self.dropped) or any(e >= epoch for e in self.user)

    def epoch(self) -> int:
        """The epoch Lightning's next pass over the loader is for."""
        return int(self._epoch())

    def peek(self, total: Callable[[int], int]) -> tuple[int, int]:
        """``(epoch, first position)`` of the loader's next pass; ``total(epoch)``: the epoch's positions.

        A resumed epoch with nothing left (the checkpoint was saved after its last batch) is the next epoch.
        """
        epoch = self.epoch()
        if self.resume is not None and epoch <= self.resume[0]:
            epoch, position = self.resume
            if nth_outside(0, self.gone.get(epoch, []), start=position) >= total(epoch):
                return epoch + 1, 0
            return epoch, position
        return epoch, 0

    def begin(self, total: Callable[[int], int]) -> tuple[int, int]:
        """:meth:`peek`, for a pass that begins: the resumed position is used once."""
        epoch, start = self.peek(total)
        self.resume = None
        self.starts[epoch] = start
        return epoch, start

    def position(self, epoch: int, taken: int) -> int:
        """The position of the ``taken``-th (from 0) batch of ``epoch``'s pass."""
        return nth_outside(taken, self.gone.get(epoch, []), start=self.starts.get(epoch, 0))


class SkipBatches:
    """A sampler that leaves out the indices of a :class:`BatchPlan`'s batches (and, resuming, those before the
    resumed position), in the inner sampler's order otherwise.

    Args:
        sampler: the loader's sampler (after Lightning's distributed sampler): of whole batches (``batch_size=None``)
            or of samples grouped by a torch ``BatchSampler``.
        plan: the batches to leave out.
        per_batch: the indices per batch (the ``BatchSampler``'s ``batch_size``; 1 without one).

    Example:
        >>> plan = BatchPlan({0: [(1, 2)]}, {}, None, epoch=lambda: 0)   # epoch 0: its batch 1 left out
        >>> list(SkipBatches(range(7), plan, per_batch=2)), len(SkipBatches(range(7), plan, per_batch=2))
        ([0, 1, 4, 5, 6], 5)
    """

    def __init__(self, sampler: Iterable[Any], plan: BatchPlan, per_batch: int) -> None:
        self.sampler = sampler
        self.plan = plan
        self.per_batch = per_batch

    def _batches(self) -> tuple[int, int]:
        """``(indices, batches)`` of the inner sampler's epoch."""
        indices = len(self.sampler)  # type: ignore[arg-type]
        return indices, -(-indices // self.per_batch)

    def _positions(self, epoch: int) -> int:
        """The positions of ``epoch``'s batches, counting those a SkipSampler of the user's left out."""
        try:
            _, batches = self._batches()
        except TypeError:  # a sampler without a length: its epoch's end is not known ahead
            return sys.maxsize
        return nth_outside(batches - 1, self.plan.user.get(epoch, [])) + 1 if batches else 0

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.plan.begin(self._positions)
        dropped, user = self.plan.dropped.get(epoch, []), self.plan.user.get(epoch, [])
        if not dropped and not user and not start:
            yield from self.sampler
            return
        starts = [first for first, _ in dropped]
        per_batch = self.per_batch
        position, filled = nth_outside(0, user), 0
        for index in self.sampler:
            if filled == per_batch:  # the next batch: the next position the user's sampler did not leave out
                position, filled = nth_outside(0, user, start=position + 1), 0
            filled += 1
            if position >= start and not _inside(position, starts, dropped):
                yield index

    def __len__(self) -> int:
        """The epoch's indices less those of its batches left out (not less those before a resumed position:
        Lightning counts the batches the checkpoint's run took)."""
        indices, batches = self._batches()
        epoch, _ = self.plan.peek(self._positions)
        dropped = self.plan.dropped.get(epoch, [])
        if not batches or not dropped:
            return indices
        total = self._positions(epoch)
        removed = _count_below(dropped, total) * self.per_batch
        if _inside(total - 1, [first for first, _ in dropped], dropped):  # the last batch, maybe short, left out
            removed -= batches * self.per_batch - indices
        return indices - removed

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the inner sampler (``DistributedSampler``)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class Placement:
    """How the skip list's entries are left out of a loader (:func:`place`).

    Attributes:
        dropped: ``{epoch: [(first, end), ...]}``: the batches :class:`SkipBatches` leaves out.
        absent: the batches already absent from the loader's stream (their samples left out by a SkipSampler).
        by_samples: the entries whose samples a SkipSampler of trainmon's leaves out (in every epoch): those
            without a batch position, and all of them in a random order.
        unplaced: the steps whose data cannot be left out (no identity; a random order without samples).
    """

    def __init__(self) -> None:
        self.dropped: Ranges = {}
        self.absent: Ranges = {}
        self.by_samples = SkipList()
        self.unplaced: list[int] = []


def place(skip: SkipList, user: list[SkipSampler], shuffled: bool) -> Placement:
    """Where each entry of ``skip`` is left out: by the user's SkipSamplers (the steps all of whose samples they
    leave out), by batch position, or by sample (``shuffled``: the loader's order is drawn anew, see
    :func:`random_order`)."""
    user_samples = merged(r for sampler in user for r in sampler.skip.samples())
    user_starts = [first for first, _ in user_samples]
    placement = Placement()
    by_samples = []
    for entry in skip:
        identity = entry.get("batch") or {}
        samples = identity.get("samples") or []
        batches = [(int(e), int(first), int(end)) for e, first, end in identity.get("batches") or []]
        if samples and all(_covers(user_samples, user_starts, first, end) for first, end in samples):
            target = placement.absent  # the user's SkipSampler leaves them out
        elif samples and (shuffled or not batches):
            by_samples.append(entry)
            target = placement.absent
        elif batches and not shuffled:
            target = placement.dropped
        else:
            placement.unplaced.append(int(entry["step"]))
            continue
        for epoch, first, end in batches:
            target.setdefault(epoch, []).append((first, end))
    placement.by_samples = SkipList(by_samples)
    placement.unplaced = sorted(set(placement.unplaced))
    return placement


def _covers(ranges: list[Range], starts: list[int], first: int, end: int) -> bool:
    at = bisect.bisect_right(starts, first) - 1
    return at >= 0 and end <= ranges[at][1]
