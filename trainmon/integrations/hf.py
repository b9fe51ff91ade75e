"""Hugging Face ``transformers.Trainer``: ``Trainer(..., callbacks=[TrainmonCallback("monitor.yaml")])``.

What the callback does (see docs/hf.md):

- ``on_train_begin``: attaches a :class:`~trainmon.TrainerMonitor` to the Trainer's model and
  optimizer. accelerate's ``AcceleratedOptimizer`` is unwrapped (its ``GradScaler`` found), and
  ``grad_acc_steps`` is ``args.gradient_accumulation_steps``.
- the training loss of every step: HF callbacks never receive it, so a forward hook on the model
  reads ``outputs.loss`` of each training forward (a device tensor, no host sync) and the step's
  ``loss`` is the mean over its micro-batches;
- ``on_step_end``: ends the monitor step. Steps are numbered like the Trainer's ``global_step``
  after the update (the first optimizer step is step 1), so trainmon's rows line up with the
  Trainer's own logs;
- evaluation and prediction run under ``torch.no_grad()`` in ``eval()`` mode: the step model does
  not count them and they record nothing;
- ``on_train_end``: closes the monitor (also its hooks and files).

``transformers`` is imported only when this module is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainmon.config import MonitorConfig
from trainmon.integrations.losses import LossTracker
from trainmon.monitor import TrainerMonitor


class TrainmonCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs a trainmon monitor for the Trainer's training.

    Args:
        config: a trainmon config (path to YAML/JSON, dict, :class:`MonitorConfig`, or None).
        **attach_options: extra keyword arguments for :meth:`TrainerMonitor.attach` (process
            groups, ``scaler``).

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=data,          # doctest: +SKIP
        ...                   callbacks=[TrainmonCallback("monitor.yaml")])
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None,
                 **attach_options: Any) -> None:
        self.config = config
        self.attach_options = attach_options
        self.monitor: TrainerMonitor | None = None
        self._losses: LossTracker | None = None
        TrainerMonitor(config)  # validate the config now, when the Trainer is built, not at train begin

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._release()
        self.monitor = TrainerMonitor(self.config)
        options = {"grad_acc_steps": max(1, int(args.gradient_accumulation_steps)),
                   "start_step": int(state.global_step) + 1, **self.attach_options}
        self.monitor.attach(model, optimizer, **options)
        self._losses = LossTracker(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self._losses is not None:
            self.monitor.step(loss=self._losses.take())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release()

    def _release(self) -> None:
        if self._losses is not None:
            self._losses.remove()
            self._losses = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
