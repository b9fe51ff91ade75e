"""Which batches each step of a ``transformers.Trainer`` trains on, and leaving out the batches of a skip list.

The Trainer takes each optimizer step's batches with its public ``get_batch_samples(epoch_iterator, num_batches,
device)``. :class:`TrainerBatches` wraps that method on the one Trainer instance (undone at the end of training):
it counts the batches it takes from each epoch's iterator, so every step's data is known as the data loader's
batches ``[epoch, first, end]`` (:mod:`trainmon.actions.skip_list`), and it leaves out, taking the next ones
instead, the batches a rollback names. Positions count every batch the loader yields, left out or not, so they
name the same data in every run.

Resuming mid-epoch, the Trainer skips the batches its checkpoint has seen (``(global_step % steps per epoch) *
gradient_accumulation_steps`` of the loader). When the run that saved the checkpoint itself left batches out, the
loader's position is that many batches behind the data: the wrapper takes them too, so the resumed run continues
where the checkpoint's run was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from trainmon.actions.skip_list import SkipList


class TrainerBatches:
    """Wraps ``trainer.get_batch_samples`` to know and to filter each step's batches.

    Args:
        trainer: the ``transformers.Trainer``.
        skip: the batches to leave out (a rollback's ``skip``); empty: only count.
        first_epoch: the epoch training starts in (resumed: ``global_step // steps per epoch``).
        first_position: the loader's position in that epoch where the Trainer resumes (``(global_step % steps per
            epoch) * gradient_accumulation_steps``; 0 when starting an epoch).
        wrap: the monitor's fail-safe guard for trainmon's part (the bookkeeping); the data loading is the user's.
    """

    def __init__(self, trainer: Any, skip: SkipList, first_epoch: int, first_position: int,
                 wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None) -> None:
        self.trainer = trainer
        self.skipped = skip.batches()
        self.epoch = first_epoch - 1
        self._resume = (first_epoch, first_position)
        self._iterator: Iterator[Any] | None = None
        self._position = 0
        self._catch_up = 0  # batches to take and drop at the resumed epoch's start
        self.pending: list[list[int]] = []
        """The ``[epoch, first, end]`` batches of the step being taken (for ``on_step_end``)."""
        self.dropped = 0
        namespace = trainer.__dict__
        self._had_own = "get_batch_samples" in namespace
        self._previous = namespace.get("get_batch_samples")
        self._original = trainer.get_batch_samples
        self._note = wrap(self._note_batch) if wrap is not None else self._note_batch
        namespace["get_batch_samples"] = self._get_batch_samples

    def close(self) -> None:
        """Put the Trainer's method back."""
        namespace = self.trainer.__dict__
        if namespace.get("get_batch_samples") == self._get_batch_samples:
            if self._had_own:
                namespace["get_batch_samples"] = self._previous
            else:
                del namespace["get_batch_samples"]

    def epoch_begins(self) -> None:
        """The Trainer begins an epoch (``on_epoch_begin``)."""
        self.epoch += 1

    def take_step(self) -> dict[str, Any] | None:
        """The identity of the step's data (``{"batches": [[epoch, first, end], ...]}``), forgotten once asked."""
        batches, self.pending = self.pending, []
        return {"batches": batches} if batches else None

    # ------------------------------------------------------------------ the wrapped method
    def _get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int, *args: Any, **kwargs: Any) -> Any:
        kept: list[Any] = []
        while len(kept) < num_batches:
            try:
                batch = next(epoch_iterator)  # the user's data: its exceptions are the user's
            except StopIteration:
                break
            if self._note(epoch_iterator) is not False:
                kept.append(batch)
        return self._original(iter(kept), num_batches, *args, **kwargs)  # (older Trainers: no device)

    def _note_batch(self, iterator: Iterator[Any]) -> bool:
        """Count one batch of ``iterator``; False when it is left out."""
        if iterator is not self._iterator:  # a new epoch's iterator
            self._iterator = iterator
            self._position = 0
            self._catch_up = 0
            if self.epoch == self._resume[0] and self._resume[1]:
                self._position = self._resume[1]
                self._catch_up = _true_position(self._resume[1], self.skipped.get(self.epoch, [])) - self._position
            self._resume = (-1, 0)
        position = self._position
        self._position += 1
        if self._catch_up > 0:  # seen by the checkpoint's run (the loader lags behind its left-out batches)
            self._catch_up -= 1
            return False
        if any(first <= position < end for first, end in self.skipped.get(self.epoch, ())):
            self.dropped += 1
            return False
        self.pending.append([self.epoch, position, position + 1])
        return True


def _true_position(kept: int, skipped: list[tuple[int, int]]) -> int:
    """The loader's position after ``kept`` batches taken with the ``skipped`` ranges left out.

    Example:
        >>> _true_position(4, [(2, 3)]), _true_position(2, [(2, 3)]), _true_position(4, [(1, 2), (4, 6)])
        (5, 2, 7)
    """
    position = kept
    for first, end in sorted(skipped):
        if first >= position:  # not reached yet: left out when it comes
            break
        position += end - first
    return position
