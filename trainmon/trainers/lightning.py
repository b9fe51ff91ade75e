"""Lightning: ``L.Trainer(callbacks=[TrainmonCallback("monitor.yaml")])``.

What the callback does (see docs/lightning.md):

- ``on_train_start``: attaches a :class:`~trainmon.TrainerMonitor` to the LightningModule and its
  (first) optimizer, with ``grad_acc_steps = trainer.accumulate_grad_batches`` and the precision
  plugin's ``GradScaler`` (16-mixed) when there is one;
- Lightning calls ``training_step``, not the module's ``forward``, so the callback tells the step
  model where micro-steps begin (``on_train_batch_start``), when the gradients
  are final (``on_after_backward``: after the backward, before Lightning clips), and that
  validation records nothing (``on_validation_start``/``_end``, and the sanity check);
- automatic optimisation calls ``optimizer.step(closure)``: trainmon reads ``grad_reduced`` after
  the closure (which runs the backward and Lightning's clipping), so it is what the optimizer uses;
  ``grad_norm`` is the pre-clip norm; manual optimisation needs nothing else;
- the step ends when ``trainer.global_step`` moved (an optimizer step ran), with the step's loss:
  the sum of the normalised batch losses Lightning returns (automatic optimisation: their mean
  over the accumulated batches), or their mean (manual). Steps are numbered like
  ``trainer.global_step`` before the update, as ``self.log`` in ``training_step`` numbers them;
- each step's data: the training data loader's batches ``[epoch, position, position + 1]`` of its micro-steps
  (positions count every batch the loader yields, left out or not), and the sample indices ``batch_ids(batch)``
  returns when given (docs/actions.md, "Rollback");
- ``on_save_checkpoint`` adds ``checkpoint["trainmon"]``: whether the state is healthy, the checkpoint's path, the
  monitor's state (``monitor.state_dict(checkpoint=path)``) and the data the run leaves out; resuming
  (``trainer.fit(..., ckpt_path=...)``), the callback loads that state, and the rollback that names the checkpoint,
  if any, is :attr:`rollback`;
- resuming from a rollback's checkpoint (or from a checkpoint of a run that resumed from one), the batches of its
  skip list are left out of the training data loader, and a mid-epoch checkpoint resumes where its run was in the
  epoch (:class:`~trainmon.trainers.lightning_data.TrainData`: from ``setup`` to ``teardown`` it wraps the
  strategy's ``process_dataloader``); a set-up whose batches cannot be left out is refused when the fit starts;
- ``on_train_end`` and ``on_exception`` close the monitor;
- fail-safe: a refusal at attach (:class:`~trainmon.errors.ConfigError`,
  :class:`~trainmon.errors.UnsupportedSetupError`) is raised when training starts; any other exception of
  trainmon's in a callback is caught by the monitor's guard (part ``step``: the monitor stops, with one
  warning) and never reaches Lightning.

Lightning is imported only when this module is (``lightning``, else ``pytorch_lightning``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from trainmon.actions.resume import Rollback, read_rollback
from trainmon.actions.rollback import RollbackExit
from trainmon.actions.skip_list import SkipList
from trainmon.config import MonitorConfig, load_config
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations.losses import output_loss
from trainmon.monitor import TrainerMonitor
from trainmon.trainers.attaching import attach_or_train_on, ddp_options
from trainmon.trainers.lightning_data import TrainData

if TYPE_CHECKING:
    from trainmon.runtime.lifecycle import StepLifecycle


try:
    from lightning.pytorch import Callback, Trainer
except ImportError:  # the older package name
    from pytorch_lightning import Callback, Trainer  # type: ignore[assignment]

logger = logging.getLogger("trainmon")


class TrainmonCallback(Callback):
    """A Lightning ``Callback`` that runs a trainmon monitor for ``trainer.fit``.

    Args:
        config: a trainmon config (path to YAML/JSON, dict, :class:`MonitorConfig`, or None).
        batch_ids: ``batch -> sample indices`` (anything ``monitor.batch`` takes), for each training batch: the
            step's events, the skip list and a rollback then name its samples.
        rollback: the rollback to resume from (a :class:`~trainmon.actions.rollback.Rollback`, or a path for
            :func:`~trainmon.actions.rollback.read_rollback`); default: the newest rollback in the monitor's
            ``output_dir`` that names the checkpoint ``trainer.fit(..., ckpt_path=...)`` resumes from.
        **attach_options: extra keyword arguments for :meth:`TrainerMonitor.attach`.

    Attributes:
        rollback: the rollback this fit resumes from (its batches are left out of the training data loader), else
            None.

    Raises:
        UnsupportedSetupError: when the fit starts, resuming from a rollback with a training data loader whose
            batches cannot be left out (docs/lightning.md).

    Example:
        >>> trainer = L.Trainer(max_steps=100, callbacks=[TrainmonCallback("monitor.yaml")])  # doctest: +SKIP
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None,
                 batch_ids: Callable[[Any], object] | None = None, rollback: Rollback | str | Path | None = None,
                 **attach_options: Any) -> None:
        self.config = config
        self.batch_ids = batch_ids
        self.attach_options = attach_options
        self.monitor: TrainerMonitor | None = None
        self.rollback: Rollback | None = None
        self._given_rollback = rollback
        self._data: TrainData | None = None
        TrainerMonitor(config)  # validate the config now, not when training starts
        self._losses: list[torch.Tensor] = []
        self._global_step = 0
        self._automatic = True
        self._loaded: dict[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close_data()
            self._data = TrainData(trainer, self._skip_in_effect)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close_data()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        data = self._data
        if data is not None and data.plan is not None and not isinstance(trainer.train_dataloader, DataLoader):
            raise UnsupportedSetupError(
                "trainmon's TrainmonCallback resumes from a checkpoint whose run leaves data out (a rollback), but "
                f"this fit has several training data loaders ({type(trainer.train_dataloader).__name__}): the batch "
                "positions of a rollback name one loader's batches. Train from one DataLoader, or leave the data out "
                "yourself (callback.rollback).")
        attach_or_train_on(lambda: self._attach(trainer, pl_module), self._release, "this Lightning run")

    def _attach(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            logger.warning("trainmon: this LightningModule has %d optimizers (a GAN?); the monitor follows the first "
                           "one: its steps, its optimizer states and its parameters' gradients are the monitor's, the "
                           "others' are not (docs/lightning.md)", len(optimizers))
        options: dict[str, Any] = {"grad_acc_steps": max(1, int(trainer.accumulate_grad_batches)),
                                   "start_step": int(trainer.global_step)}
        scaler = getattr(getattr(trainer.strategy, "precision_plugin", None), "scaler", None)
        if scaler is not None:
            options["scaler"] = scaler
        options.update(self.attach_options)
        options = ddp_options(getattr(trainer.strategy, "model", None), options)
        self.monitor = TrainerMonitor(self.config)
        self.monitor.attach(pl_module, optimizers[0] if optimizers else None, **options)
        loaded, self._loaded = self._loaded, None
        if loaded is not None and isinstance(loaded.get("monitor"), dict):
            try:
                self.monitor.load_state_dict(loaded["monitor"])
            except ValueError as exc:
                logger.warning("trainmon: the checkpoint's monitor state is not loaded (%s); the detectors warm up "
                               "again", exc)
        if self._data is None:  # (setup not called: a fit driven by hand)
            self.rollback = self._find_rollback(getattr(trainer, "ckpt_path", None))
        if self.rollback is not None:
            self.monitor.resume(self.rollback)
        self._lifecycle().drive_by_callbacks()
        self._global_step = int(trainer.global_step)
        self._automatic = bool(pl_module.automatic_optimization)
        self._losses = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release()
        self._close_data()

    # ------------------------------------------------------------------ micro-steps and steps
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._guarded(lambda: self._lifecycle().micro_step_begins())
        self._guarded(self._batch_identity, trainer, batch, batch_idx, part="batch")  # failing: no identities

    def _batch_identity(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        assert self.monitor is not None
        epoch, data = int(trainer.current_epoch), self._data
        identity = data.identity(epoch) if data is not None else {"batches": [[epoch, batch_idx, batch_idx + 1]]}
        self.monitor.batch(identity)
        if self.batch_ids is not None:
            self.monitor.batch(self.batch_ids(batch))

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._guarded(self._save_health, trainer, checkpoint)

    def _save_health(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        assert self.monitor is not None
        path = _saved_path(trainer)
        state = self.monitor.state_dict(checkpoint=path)
        checkpoint["trainmon"] = {"healthy": state.get("healthy", True), "step": state["step"], "checkpoint": path,
                                  "monitor": state}
        skip = self._data.skip if self._data is not None else None
        if skip is not None and len(skip):
            checkpoint["trainmon"]["skip"] = skip.entries  # a resume from this checkpoint leaves that data out too

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("trainmon")
        self._loaded = saved if isinstance(saved, dict) else None  # loaded into the monitor when it attaches

    def _skip_in_effect(self) -> SkipList | None:
        """The data this fit leaves out: the rollback's (found for the checkpoint, or given) and what the
        checkpoint's run left out (``checkpoint["trainmon"]["skip"]``); also sets :attr:`rollback`."""
        trainer = self._data.trainer if self._data is not None else None
        self.rollback = self._find_rollback(getattr(trainer, "ckpt_path", None))
        saved = (self._loaded or {}).get("skip")
        skip = SkipList(entry for entry in saved if isinstance(entry, dict)) if isinstance(saved, list) else SkipList()
        if self.rollback is not None:
            skip = skip.union(self.rollback.skip)
        return skip

    def _find_rollback(self, checkpoint: str | None) -> Rollback | None:
        given = self._given_rollback
        if given is not None:
            return given if isinstance(given, Rollback) else read_rollback(given)
        if not checkpoint:
            return None
        config = load_config(self.config)
        where = Path(config.output_dir) / config.run_name if config.run_name else Path(config.output_dir)
        return read_rollback(where, checkpoint=checkpoint) if where.exists() else None

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._guarded(lambda: self._lifecycle().backward_ended())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._guarded(self._batch_end, trainer, outputs)

    def _batch_end(self, trainer: Any, outputs: Any) -> None:
        if self.monitor is None:
            return
        loss = outputs if isinstance(outputs, torch.Tensor) else output_loss(outputs)
        if loss is not None:
            self._losses.append(loss.detach().float().reshape(()))
        if int(trainer.global_step) != self._global_step:  # an optimizer step ran: the step ends
            self._global_step = int(trainer.global_step)
            losses, self._losses = self._losses, []
            total = torch.stack(losses).sum() if losses else None
            if total is not None and not self._automatic:
                total = total / len(losses)
            try:
                self.monitor.step(loss=total)
            except RollbackExit:  # the rollback action stops the run (at the end of the step, never in a hook)
                self._release()
                raise

    # ------------------------------------------------------------------ evaluation records nothing
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._guarded(lambda: self._lifecycle().suspend())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._guarded(lambda: self._lifecycle().resume())

    # ------------------------------------------------------------------ helpers
    def _guarded(self, fn: Callable[..., Any], *args: Any, part: str = "step") -> None:
        """Run a callback's body under the monitor's fail-safe guard (part ``step``); nothing when not attached."""
        guard = self.monitor.guard if self.monitor is not None else None
        if guard is not None:
            guard.run(part, fn, *args)

    def _lifecycle(self) -> StepLifecycle:
        lifecycle = self.monitor.lifecycle if self.monitor is not None else None
        assert lifecycle is not None  # _guarded runs its body only while attached
        return lifecycle

    def _release(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

    def _close_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None


def _saved_path(trainer: Any) -> str | None:
    """The file ``Trainer.save_checkpoint(filepath)`` is saving (``on_save_checkpoint`` runs inside it and is not
    told), found up the call stack; None when the checkpoint is saved otherwise."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "save_checkpoint" and frame.f_locals.get("self") is trainer \
                    and isinstance(trainer, Trainer):
                path = frame.f_locals.get("filepath")
                return str(path) if path is not None else None
            frame = frame.f_back
        return None
    finally:
        del frame
