"""Lightning: leaving a rollback's batches out of ``trainer.fit``'s training data, and which batch of the data loader
each training batch is.

**Positions.** A batch is named ``[epoch, position, position + 1]`` (:mod:`trainmon.actions.skip_list`): its position
counts every batch the training data loader yields in that epoch, left out or not, so it names the same data in
every run (:meth:`TrainData.position`).

**Leaving batches out.** Lightning builds the training data loader in its fit loop: it asks for it
(``train_dataloader()``, the data module's, or the one given to ``fit``), injects its ``DistributedSampler`` under
DDP, then hands it to the strategy's public ``process_dataloader(dataloader)``, once per fit and again for each
``reload_dataloaders_every_n_epochs``. :class:`TrainData` wraps that method on the one strategy instance (undone at
the end of the fit): resuming from a checkpoint whose run leaves data out (a rollback names it, or its run resumed
from one), the training loader is rebuilt as Lightning rebuilds it for its own samplers (``_update_dataloader``)
with its sampler wrapped in :class:`SkipBatches`, which leaves out the batches' indices (no data is loaded for
them), so on every rank the loader's own batches (after the distributed sampler's split) are counted.

**Resuming mid-epoch.** Lightning restarts a plain loader at the epoch's first batch. When batches are left out,
:class:`SkipBatches` also starts the resumed epoch where the checkpoint's run was: after the ``r`` batches Lightning
counted (``fit_loop.epoch_loop.batch_progress``), i.e. at the ``r``-th position not left out.

**A SkipSampler of your own** (``trainmon.SkipSampler`` anywhere in the loader's samplers) leaves out samples
itself: the steps whose samples it leaves out are not left out again; their batches are counted as gone from the
loader (exact when they are whole batches of the loader's order: a sequential sampler on one process).

**Lengths.** The loader's length is the epoch's batches less those left out, as for a run that never had them.
Lightning plans every epoch from the length at the start of the fit: set
``Trainer(reload_dataloaders_every_n_epochs=1)`` when later epochs are longer (a warning says so).

Refused at the start of the fit (:class:`~trainmon.errors.UnsupportedSetupError`), when data must be left out: a
loader that is not a torch ``DataLoader``, an ``IterableDataset`` (no indices), a batch sampler other than torch's
``BatchSampler``, several training loaders, and a resumable loader (``state_dict``) resumed mid-epoch.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from trainmon.actions.skip_list import SkipList, SkipSampler, batch_identity
from trainmon.errors import UnsupportedSetupError

logger = logging.getLogger("trainmon")
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


def _merged(ranges: Iterable[Range]) -> list[Range]:
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
        self.user = {e: _merged(r) for e, r in user.items() if r}
        self.dropped = {e: _without(_merged(r), self.user.get(e, [])) for e, r in dropped.items() if r}
        self.gone = {e: _merged(self.dropped.get(e, []) + self.user.get(e, []))
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


class SkipBatches(Sampler[Any]):
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
        super().__init__()
        self.sampler = sampler
        self.plan = plan
        self.per_batch = per_batch

    def _batches(self) -> tuple[int, int]:
        """``(indices, batches)`` of the inner sampler's epoch."""
        indices = len(self.sampler)  # type: ignore[arg-type]
        return indices, -(-indices // self.per_batch)

    def _positions(self, epoch: int) -> int:
        """The positions of ``epoch``'s batches, counting those a SkipSampler of the user's left out."""
        _, batches = self._batches()
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


# ----------------------------------------------------------------------------- the fit's training loader
def user_skip_samplers(loader: object) -> list[SkipSampler]:
    """The ``trainmon.SkipSampler`` objects among a loader's samplers (also inside Lightning's
    ``DistributedSamplerWrapper``, which keeps the sampler it wraps as its ``dataset``)."""
    found: list[SkipSampler] = []
    seen: set[int] = set()
    dataset = getattr(loader, "dataset", None)
    todo = [getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    while todo and len(seen) < 64:
        item = todo.pop()
        if item is None or item is dataset or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, SkipSampler):
            found.append(item)
        todo += [getattr(item, name, None) for name in ("sampler", "_sampler", "dataset")]
    return found


def plan_ranges(skip: SkipList, user: list[SkipSampler]) -> tuple[Ranges, Ranges, list[int]]:
    """``(dropped, user, unknown)``: the batches to leave out, the batches the user's SkipSamplers leave out (the
    steps all of whose samples they leave out), and the steps whose data has no batch position (left out only by
    a SkipSampler of the user's, if at all)."""
    user_samples = _merged(r for sampler in user for r in sampler.skip.samples())
    user_starts = [first for first, _ in user_samples]
    dropped: Ranges = {}
    covered: Ranges = {}
    unknown: list[int] = []
    for entry in skip:
        identity = entry.get("batch") or {}
        samples = identity.get("samples") or []
        mine = bool(samples) and all(_covers(user_samples, user_starts, first, end) for first, end in samples)
        batches = identity.get("batches") or []
        if not batches:
            if not mine:
                unknown.append(int(entry["step"]))
            continue
        for epoch, first, end in batches:
            (covered if mine else dropped).setdefault(int(epoch), []).append((int(first), int(end)))
    return dropped, covered, sorted(set(unknown))


def _covers(ranges: list[Range], starts: list[int], first: int, end: int) -> bool:
    at = bisect.bisect_right(starts, first) - 1
    return at >= 0 and end <= ranges[at][1]


def rebuild_loader(loader: object, plan: BatchPlan, mid_epoch: bool) -> DataLoader[Any]:
    """The training loader with its sampler wrapped in :class:`SkipBatches` (rebuilt as Lightning rebuilds a
    loader to inject its distributed sampler).

    Raises:
        UnsupportedSetupError: a loader whose batches cannot be left out by index (see the module docstring).
    """
    what = ("trainmon's TrainmonCallback resumes from a checkpoint whose run leaves data out (a rollback), but it "
            "cannot leave batches out of this training data loader: ")
    todo = (" Leave the data out yourself (callback.rollback, or trainmon.read_rollback: its skip.batches() are the "
            "loader's [epoch, first, end] batches), or use a map-style dataset in a torch DataLoader.")
    if not isinstance(loader, DataLoader):
        raise UnsupportedSetupError(f"{what}a {type(loader).__name__} is not a torch DataLoader.{todo}")
    if isinstance(loader.dataset, IterableDataset):
        raise UnsupportedSetupError(f"{what}its IterableDataset has no indices to leave out.{todo}")
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise UnsupportedSetupError(f"{what}its batch sampler {type(batch_sampler).__name__} is not torch's "
                                    f"BatchSampler (its batches are not known from the sampler's indices).{todo}")
    if mid_epoch and _resumable(loader):
        raise UnsupportedSetupError(f"{what}it is resumable (state_dict), and Lightning restores where it was: "
                                    "resume from an end-of-epoch checkpoint instead, or leave the data out "
                                    f"yourself.{todo}")
    per_batch = int(batch_sampler.batch_size) if batch_sampler is not None else 1
    sampler = SkipBatches(loader.sampler, plan, per_batch)
    try:
        from lightning.pytorch.trainer.states import RunningStage
        from lightning.pytorch.utilities.data import _update_dataloader
    except ImportError:  # the older package name
        from pytorch_lightning.trainer.states import RunningStage  # type: ignore[assignment]
        from pytorch_lightning.utilities.data import _update_dataloader  # type: ignore[assignment]
    try:
        rebuilt: DataLoader[Any] = _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    except Exception as exc:  # TypeError, or Lightning's MisconfigurationException: its init arguments are unknown
        raise UnsupportedSetupError(f"{what}it cannot be rebuilt with another sampler ({exc}).{todo}") from exc
    return rebuilt


def resume_point(trainer: Any) -> tuple[int, int] | None:
    """``(epoch, batches)``: where ``trainer.fit(..., ckpt_path=...)`` resumes: the epoch of the next batch and the
    batches of it the checkpoint's run took (Lightning's restored progress); None when not resuming."""
    if not trainer.ckpt_path:
        return None
    loop = trainer.fit_loop
    progress = loop.epoch_progress.current
    started = progress.started > progress.processed  # the checkpoint was saved during the epoch
    return int(progress.processed), int(loop.epoch_loop.batch_progress.current.ready) if started else 0


def _resumable(loader: object) -> bool:
    """Whether Lightning restores the loader's position itself (it has ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class TrainData:
    """The training data of one ``trainer.fit``: wraps the strategy's ``process_dataloader`` (undone by
    :meth:`close`) to leave out the data of the checkpoint's run, and names each training batch's position.

    Args:
        trainer: the Lightning ``Trainer``.
        skip: called once, when the training loader is first built (the checkpoint is loaded): the skip list in
            effect (a rollback's, and what the checkpoint's run left out), or None.
    """

    def __init__(self, trainer: Any, skip: Callable[[], SkipList | None]) -> None:
        self.trainer = trainer
        self._skip = skip
        self.skip: SkipList | None = None
        """The skip list in effect (after the training loader was first built)."""
        self.plan: BatchPlan | None = None
        self._decided = False
        self._first: dict[int, int] = {}  # where a pass the plan does not make begins (a resumable loader's)
        self._seen: tuple[int, int] = (-1, 0)  # (epoch, batches taken in its pass)
        strategy = trainer.strategy
        namespace = strategy.__dict__
        self._strategy = strategy
        self._had_own = "process_dataloader" in namespace
        self._previous = namespace.get("process_dataloader")
        self._original = strategy.process_dataloader
        namespace["process_dataloader"] = self._process_dataloader

    def close(self) -> None:
        """Put the strategy's method back."""
        namespace = self._strategy.__dict__
        if namespace.get("process_dataloader") == self._process_dataloader:
            if self._had_own:
                namespace["process_dataloader"] = self._previous
            else:
                del namespace["process_dataloader"]

    # ------------------------------------------------------------------ the wrapped method
    def _process_dataloader(self, dataloader: object) -> object:
        if self.trainer.training:
            dataloader = self._training_loader(dataloader)
        return self._original(dataloader)

    def _training_loader(self, loader: object) -> object:
        trainer = self.trainer
        epoch = int(trainer.fit_loop.epoch_progress.current.processed)
        resume = resume_point(trainer) if not self._decided else None
        if not self._decided:
            self._decided = True
            self.skip = self._skip()
            if self.skip is not None and len(self.skip):
                self.plan = self._plan(loader, self.skip, resume)
        plan = self.plan
        if plan is None or not plan.leaves_out(epoch):
            if resume is not None and resume[1] and _resumable(loader):
                self._first[resume[0]] = resume[1]  # Lightning restores its position: batches counted from there
            return loader
        mid_epoch = plan.resume is not None and plan.resume[1] > 0
        rebuilt = rebuild_loader(loader, plan, mid_epoch)
        self._warn_about_lengths(plan, epoch, rebuilt, resume[1] if resume is not None else 0)
        return rebuilt

    def _plan(self, loader: object, skip: SkipList, resume: tuple[int, int] | None) -> BatchPlan:
        dropped, user, unknown = plan_ranges(skip, user_skip_samplers(loader))
        if unknown:
            logger.warning("trainmon: the data of step(s) %s has no batch position (only sample indices): it is not "
                           "left out unless a trainmon.SkipSampler of your training data loader leaves it out",
                           unknown)
        gone = {e: _merged(dropped.get(e, []) + user.get(e, [])) for e in set(dropped) | set(user)}
        start = None if resume is None else (resume[0], nth_outside(resume[1], gone.get(resume[0], [])))
        loop = self.trainer.fit_loop
        return BatchPlan(dropped, user, start, epoch=lambda: int(loop.epoch_progress.current.processed))

    def _warn_about_lengths(self, plan: BatchPlan, epoch: int, loader: DataLoader[Any], taken: int) -> None:
        """Warn when a later epoch would be planned from this epoch's length, which differs from its own."""
        trainer = self.trainer
        here, later = epoch in plan.gone, any(e > epoch for e in plan.gone)
        if not (here or later) or int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0)) == 1:
            return
        max_epochs, max_steps = getattr(trainer, "max_epochs", None), int(getattr(trainer, "max_steps", -1))
        last_epoch = max_epochs is not None and 0 <= int(max_epochs) <= epoch + 1
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
        steps_left = max_steps - int(trainer.global_step) if max_steps >= 0 else None
        ends_here = steps_left is not None and steps_left * accumulate <= len(loader) - taken
        if not later and (last_epoch or ends_here):
            return
        logger.warning("trainmon: the training data loader leaves out batches of epoch %d%s; Lightning plans every "
                       "epoch from the length at the start of the fit, so an epoch of another length would end early "
                       "or lose its last batches: set Trainer(reload_dataloaders_every_n_epochs=1)", epoch,
                       " and later" if later else "")

    # ------------------------------------------------------------------ positions
    def position(self, epoch: int) -> int:
        """The position of the training batch that begins (called once per batch, in order)."""
        seen_epoch, taken = self._seen
        if epoch != seen_epoch:
            taken = 0
        self._seen = (epoch, taken + 1)
        if self.plan is not None and epoch in self.plan.starts:
            return self.plan.position(epoch, taken)
        return self._first.get(epoch, 0) + taken

    def identity(self, epoch: int) -> dict[str, Any] | None:
        """The identity of the training batch that begins: ``{"batches": [[epoch, position, position + 1]]}``."""
        position = self.position(epoch)
        return batch_identity({"batches": [[epoch, position, position + 1]]})
