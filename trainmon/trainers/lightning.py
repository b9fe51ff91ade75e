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
- ``on_train_end`` and ``on_exception`` close the monitor;
- fail-safe: a refusal at attach (:class:`~trainmon.errors.ConfigError`,
  :class:`~trainmon.errors.UnsupportedSetupError`) is raised when training starts; any other exception of
  trainmon's in a callback is caught by the monitor's guard (part ``step``: the monitor stops, with one
  warning) and never reaches Lightning.

Lightning is imported only when this module is (``lightning``, else ``pytorch_lightning``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainmon.config import MonitorConfig
from trainmon.integrations.losses import output_loss
from trainmon.monitor import TrainerMonitor
from trainmon.trainers.attaching import attach_or_train_on, ddp_options

if TYPE_CHECKING:
    from trainmon.runtime.lifecycle import StepLifecycle


try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback  # type: ignore[assignment]


class TrainmonCallback(Callback):
    """A Lightning ``Callback`` that runs a trainmon monitor for ``trainer.fit``.

    Args:
        config: a trainmon config (path to YAML/JSON, dict, :class:`MonitorConfig`, or None).
        **attach_options: extra keyword arguments for :meth:`TrainerMonitor.attach`.

    Example:
        >>> trainer = L.Trainer(max_steps=100, callbacks=[TrainmonCallback("monitor.yaml")])  # doctest: +SKIP
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None,
                 **attach_options: Any) -> None:
        self.config = config
        self.attach_options = attach_options
        self.monitor: TrainerMonitor | None = None
        TrainerMonitor(config)  # validate the config now, not when training starts
        self._losses: list[torch.Tensor] = []
        self._global_step = 0
        self._automatic = True

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        attach_or_train_on(lambda: self._attach(trainer, pl_module), self._release, "this Lightning run")

    def _attach(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        options: dict[str, Any] = {"grad_acc_steps": max(1, int(trainer.accumulate_grad_batches)),
                                   "start_step": int(trainer.global_step)}
        scaler = getattr(getattr(trainer.strategy, "precision_plugin", None), "scaler", None)
        if scaler is not None:
            options["scaler"] = scaler
        options.update(self.attach_options)
        options = ddp_options(getattr(trainer.strategy, "model", None), options)
        self.monitor = TrainerMonitor(self.config)
        self.monitor.attach(pl_module, optimizers[0] if optimizers else None, **options)
        self._lifecycle().drive_by_callbacks()
        self._global_step = int(trainer.global_step)
        self._automatic = bool(pl_module.automatic_optimization)
        self._losses = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release()

    # ------------------------------------------------------------------ micro-steps and steps
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._guarded(lambda: self._lifecycle().micro_step_begins())

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
            self.monitor.step(loss=total)

    # ------------------------------------------------------------------ evaluation records nothing
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._guarded(lambda: self._lifecycle().suspend())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._guarded(lambda: self._lifecycle().resume())

    # ------------------------------------------------------------------ helpers
    def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a callback's body under the monitor's fail-safe guard (part ``step``); nothing when not attached."""
        guard = self.monitor.guard if self.monitor is not None else None
        if guard is not None:
            guard.run("step", fn, *args)

    def _lifecycle(self) -> StepLifecycle:
        lifecycle = self.monitor.lifecycle if self.monitor is not None else None
        assert lifecycle is not None  # _guarded runs its body only while attached
        return lifecycle

    def _release(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
