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
with its sampler wrapped in :class:`~trainmon.actions.skip_batches.SkipBatches`, which leaves out the batches'
indices (no data is loaded for them), so on every rank the loader's own batches (after the distributed sampler's
split) are counted.

**Resuming mid-epoch.** Lightning restarts a plain loader at the epoch's first batch. When batches are left out,
``SkipBatches`` also starts the resumed epoch where the checkpoint's run was: after the ``r`` batches Lightning
counted (``fit_loop.epoch_loop.batch_progress``), i.e. at the ``r``-th position not left out.

**A SkipSampler of your own** (``trainmon.SkipSampler`` anywhere in the loader's samplers) leaves out samples
itself: the steps whose samples it leaves out are not left out again; their batches are counted as gone from the
loader (exact when they are whole batches of the loader's order: a sequential sampler on one process).

**A random order** (torch's ``RandomSampler``, drawn anew in the resumed run, unlike ``DistributedSampler``'s from
its seed and the epoch): positions name other data, so the entries' samples (``TrainmonCallback(batch_ids=...)``)
are left out instead, by a ``SkipSampler`` inside (in every epoch); entries without samples are refused. So are
entries without a position (a loop's sample indices only) left out by sample.

**Lengths.** The loader's length is the epoch's batches less those left out, as for a run that never had them.
Lightning plans every epoch from the length at the start of the fit: set
``Trainer(reload_dataloaders_every_n_epochs=1)`` when later epochs are longer (a warning says so).

Refused at the start of the fit (:class:`~trainmon.errors.UnsupportedSetupError`), when data must be left out: a
loader that is not a torch ``DataLoader``, an ``IterableDataset`` (no indices), a batch sampler other than torch's
``BatchSampler``, several training loaders, a resumable loader (``state_dict``) resumed mid-epoch, and a random order
without the samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from trainmon.actions.skip_batches import BatchPlan, SkipBatches, merged, nth_outside, place
from trainmon.actions.skip_list import SkipList, SkipSampler, batch_identity
from trainmon.errors import UnsupportedSetupError

logger = logging.getLogger("trainmon")


# ----------------------------------------------------------------------------- the fit's training loader
def _samplers(loader: object) -> list[object]:
    """The samplers of a loader, outermost first (also inside Lightning's ``DistributedSamplerWrapper``, which keeps
    the sampler it wraps as its ``dataset``)."""
    found: list[object] = []
    seen: set[int] = set()
    dataset = getattr(loader, "dataset", None)
    todo = [getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)]
    while todo and len(seen) < 64:
        item = todo.pop()
        if item is None or item is dataset or id(item) in seen:
            continue
        seen.add(id(item))
        found.append(item)
        todo += [getattr(item, name, None) for name in ("dataset", "_sampler", "sampler")]
    return found


def user_skip_samplers(loader: object) -> list[SkipSampler]:
    """The ``trainmon.SkipSampler`` objects among a loader's samplers."""
    return [sampler for sampler in _samplers(loader) if isinstance(sampler, SkipSampler)]


def random_order(loader: object) -> bool:
    """Whether the loader's order comes from a torch ``RandomSampler``: drawn anew in a resumed run (unlike
    ``DistributedSampler``'s, from its seed and the epoch), so batch positions do not name the same data."""
    return any(isinstance(sampler, RandomSampler) for sampler in _samplers(loader))


def rebuild_loader(loader: object, plan: BatchPlan, mid_epoch: bool, by_samples: SkipList) -> DataLoader[Any]:
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
    inner = SkipSampler(loader.sampler, by_samples) if len(by_samples) else loader.sampler
    sampler = SkipBatches(inner, plan, per_batch)
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
        self._by_samples = SkipList()
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
        if plan is None or not (plan.leaves_out(epoch) or len(self._by_samples)):
            if resume is not None and resume[1] and _resumable(loader):
                self._first[resume[0]] = resume[1]  # Lightning restores its position: batches counted from there
            return loader
        mid_epoch = plan.resume is not None and plan.resume[1] > 0
        rebuilt = rebuild_loader(loader, plan, mid_epoch, self._by_samples)
        self._warn_about_lengths(plan, epoch, rebuilt, resume[1] if resume is not None else 0)
        return rebuilt

    def _plan(self, loader: object, skip: SkipList, resume: tuple[int, int] | None) -> BatchPlan:
        shuffled = random_order(loader)
        placement = place(skip, user_skip_samplers(loader), shuffled)
        if placement.unplaced and shuffled:
            raise UnsupportedSetupError(
                "trainmon's TrainmonCallback resumes from a checkpoint whose run leaves data out (a rollback), but the "
                "training data loader shuffles with torch's RandomSampler, whose order is drawn anew in this run: the "
                f"batch positions of step(s) {placement.unplaced} name other data here, and no sample indices are "
                "known. Give the callback batch_ids= (the batch's sample indices) so that a rollback names samples, "
                "or an order that is the same in every run (DistributedSampler(..., seed=...) with set_epoch), and "
                "run again from the start or a checkpoint before that data.")
        if placement.unplaced:
            logger.warning("trainmon: the data of step(s) %s is not known (the loop gave no batch identity): it is "
                           "not left out", placement.unplaced)
        self._by_samples = placement.by_samples
        dropped, user = placement.dropped, placement.absent
        gone = {e: merged(dropped.get(e, []) + user.get(e, [])) for e in set(dropped) | set(user)}
        start = None if resume is None else (resume[0], nth_outside(resume[1], gone.get(resume[0], [])))
        loop = self.trainer.fit_loop
        return BatchPlan(dropped, user, start, epoch=lambda: int(loop.epoch_progress.current.processed))

    def _warn_about_lengths(self, plan: BatchPlan, epoch: int, loader: DataLoader[Any], taken: int) -> None:
        """Warn when a later epoch would be planned from this epoch's length, which differs from its own (batches
        left out by position: samples left out by a SkipSampler shorten every epoch alike)."""
        trainer = self.trainer
        here, later = epoch in plan.dropped, any(e > epoch for e in plan.dropped)
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
