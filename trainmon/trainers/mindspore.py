"""``mindspore.train.Model.train``: ``model.train(epochs, dataset, callbacks=[TrainmonCallback("monitor.yaml")])``.

What the callback does (see docs/mindspore.md):

- ``on_train_begin``: attaches a :class:`~trainmon.TrainerMonitor` to the network and optimizer of
  ``run_context.original_args()`` (``network``, ``optimizer``; a ``TrainOneStepCell`` given as the network
  is unwrapped to its ``WithLossCell``'s backbone and its optimizer). Steps are numbered as the Model's
  ``cur_step_num`` (the first step is 1; after ``initial_epoch``/``initial_step``, where they resume);
- ``on_train_step_end``: ends the monitor step with the loss the train network returned
  (``net_outputs``, its first element when it is a tuple: ``(loss, overflow, loss_scale)`` with a loss
  scale manager), a device tensor: no host synchronisation beyond the step's one transfer;
- ``on_train_end`` (and the end of ``Model.train``'s callback context, also when the training raises):
  closes the monitor, its hooks and files.

Refused at ``on_train_begin``, before the first step, with ``attach``'s message: graph mode (cell hooks
do not run there) and a network or optimizer the integration cannot monitor. ``mindspore`` is imported
only when this module is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindspore.train import Callback

from trainmon.config import MonitorConfig
from trainmon.integrations.mindspore import unwrap_training_cell
from trainmon.monitor import TrainerMonitor
from trainmon.trainers.attaching import attach_or_train_on


class TrainmonCallback(Callback):  # type: ignore[misc]  # mindspore is untyped
    """A ``mindspore.train.Callback`` that runs a trainmon monitor for ``Model.train``.

    Args:
        config: a trainmon config (path to YAML/JSON, dict, :class:`MonitorConfig`, or None); validated now.
        **attach_options: extra keyword arguments for :meth:`TrainerMonitor.attach` (``grad_acc_steps``).

    Example:
        >>> model = mindspore.train.Model(network, loss_fn, optimizer)          # doctest: +SKIP
        >>> model.train(2, dataset, callbacks=[TrainmonCallback("monitor.yaml")])   # doctest: +SKIP
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None,
                 **attach_options: Any) -> None:
        super().__init__()
        self.config = config
        self.attach_options = attach_options
        self.monitor: TrainerMonitor | None = None
        TrainerMonitor(config)  # validate the config now, when the callback is built, not at train begin

    def on_train_begin(self, run_context: Any) -> None:
        """Attach to the Model's network and optimizer.

        Raises:
            ConfigError, UnsupportedSetupError: a refusal (graph mode, say), before the first step; any other
                failure to attach is warned about and the training goes on without the monitor.
        """
        attach_or_train_on(lambda: self._attach(run_context), self._release, "this Model")

    def _attach(self, run_context: Any) -> None:
        args = run_context.original_args()
        network = args.get("network") or args.get("train_network")
        optimizer = args.get("optimizer")
        options = {"start_step": int(args.get("cur_step_num") or 0) + 1, **self.attach_options}
        network, optimizer = unwrap_training_cell(network, optimizer)  # Model(TrainOneStepCell(...)) given
        monitor = TrainerMonitor(self.config)
        self.monitor = monitor  # released by the caller if attach raises
        monitor.attach(network, optimizer, **options)

    def on_train_step_end(self, run_context: Any) -> None:
        """End the monitor step with the train network's loss."""
        monitor = self.monitor
        guard = monitor.guard if monitor is not None else None
        if monitor is None or guard is None:
            return
        outputs = run_context.original_args().get("net_outputs")
        loss = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
        # under the monitor's fail-safe guard: trainmon's own exception never reaches Model.train
        guard.run("step", lambda: monitor.step(loss=loss))

    def on_train_end(self, run_context: Any) -> None:
        """Close the monitor (hooks, files)."""
        self._release()

    def __exit__(self, *exc: object) -> None:
        """``Model.train`` leaves its callbacks' context, also when the training raised: close the monitor."""
        self._release()

    def _release(self) -> None:
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            monitor.close()
