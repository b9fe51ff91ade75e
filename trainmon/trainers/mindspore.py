"""``mindspore.train.Model.train``: ``model.train(epochs, dataset, callbacks=[TrainmonCallback("monitor.yaml")])``.

What the callback does (see docs/mindspore.md):

- ``on_train_begin``: attaches a :class:`~trainmon.TrainerMonitor` to the network and optimizer of
  ``run_context.original_args()`` (``network``, ``optimizer``; a ``TrainOneStepCell`` given as the network
  is unwrapped to its ``WithLossCell``'s backbone and its optimizer). Steps are numbered as the Model's
  ``cur_step_num`` (the first step is 1; after ``initial_epoch``/``initial_step``, where they resume);
- ``on_train_step_begin``: the step's data: the batch ``[epoch, position, position + 1]`` (the epoch counted from 0
  as ``cur_epoch_num - 1``, the batch's position in the epoch's data from 0), and the sample indices
  ``batch_ids(train_dataset_element)`` returns when given (docs/actions.md, "Which data a step trained on");
- ``on_train_step_end``: ends the monitor step with the loss the train network returned
  (``net_outputs``, its first element when it is a tuple: ``(loss, overflow, loss_scale)`` with a loss
  scale manager), a device tensor: no host synchronisation beyond the step's one transfer;
- checkpoints: each file a ``mindspore.train.ModelCheckpoint`` of the callback list saves (its
  ``latest_ckpt_file_name``) gets a sidecar ``{file without .ckpt}.trainmon_health.json``: ``{"healthy", "step",
  "rank", "checkpoint", "monitor"}`` (``monitor.state_dict(checkpoint=file)``, so a rollback names the last healthy
  file); looked for after the monitor's step ends (a ``ModelCheckpoint`` before this callback in the list) and
  before the next step begins (one after it), and at the end of training. With ``checkpoint=`` (the file a run
  resumes from), the sidecar's monitor state is loaded and the rollback that names the file is :attr:`rollback`;
- ``on_train_end`` (and the end of ``Model.train``'s callback context, also when the training raises):
  closes the monitor, its hooks and files.

Refused at ``on_train_begin``, before the first step, with ``attach``'s message: graph mode (cell hooks
do not run there) and a network or optimizer the integration cannot monitor; with ``anomaly.guard``, a dynamic loss
scale (:func:`trainmon.integrations.mindspore.guard.loss_scale_refusal`). ``mindspore`` is imported
only when this module is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindspore.train import Callback, ModelCheckpoint

from trainmon.actions.resume import Rollback, read_rollback
from trainmon.actions.rollback import RollbackExit
from trainmon.base.safe_io import write_atomic
from trainmon.config import MonitorConfig, load_config
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations.mindspore import dist_layout, unwrap_training_cell
from trainmon.monitor import TrainerMonitor
from trainmon.trainers.attaching import attach_or_train_on

logger = logging.getLogger("trainmon")
HEALTH_SUFFIX = ".trainmon_health.json"
"""The sidecar of a checkpoint file: ``net-1_4.ckpt`` -> ``net-1_4.trainmon_health.json``."""


def health_path(checkpoint: str | Path) -> Path:
    """The sidecar of ``checkpoint`` (its health and the monitor's state).

    Example:
        >>> str(health_path("ckpt/net-1_4.ckpt"))
        'ckpt/net-1_4.trainmon_health.json'
    """
    path = Path(checkpoint)
    return path.with_name(path.stem + HEALTH_SUFFIX if path.suffix else path.name + HEALTH_SUFFIX)


def read_health(checkpoint: str | Path) -> dict[str, Any] | None:
    """The sidecar of ``checkpoint`` read back (``{"healthy", "step", "rank", "checkpoint", "monitor"}``), or None when
    there is none.

    Raises:
        ValueError: the sidecar is not JSON (names the file).
    """
    path = health_path(checkpoint)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a trainmon checkpoint health file ({exc})") from None
    return data if isinstance(data, dict) else None


class TrainmonCallback(Callback):  # type: ignore[misc]  # mindspore is untyped
    """A ``mindspore.train.Callback`` that runs a trainmon monitor for ``Model.train``.

    Args:
        config: a trainmon config (path to YAML/JSON, dict, :class:`MonitorConfig`, or None); validated now.
        batch_ids: ``train_dataset_element -> sample indices`` (anything ``monitor.batch`` takes; the element is
            the tuple of the step's data columns): the step's events, the skip list and a rollback then name its
            samples too.
        checkpoint: the checkpoint file this run resumes from (loaded by you into the network and optimizer): its
            sidecar's monitor state is loaded (the detectors need no new warm-up) and the rollback that names it, if
            any, is :attr:`rollback`.
        **attach_options: extra keyword arguments for :meth:`TrainerMonitor.attach` (``grad_acc_steps``).

    Attributes:
        rollback: the rollback (in the monitor's ``output_dir``) that names ``checkpoint``, or None.

    Example:
        >>> model = mindspore.train.Model(network, loss_fn, optimizer)          # doctest: +SKIP
        >>> model.train(2, dataset, callbacks=[TrainmonCallback("monitor.yaml")])   # doctest: +SKIP
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None,
                 batch_ids: Callable[[Any], object] | None = None, checkpoint: str | Path | None = None,
                 **attach_options: Any) -> None:
        super().__init__()
        self.config = config
        self.batch_ids = batch_ids
        self.checkpoint = checkpoint
        self.attach_options = attach_options
        self.monitor: TrainerMonitor | None = None
        self.rollback: Rollback | None = None
        TrainerMonitor(config)  # validate the config now, when the callback is built, not at train begin
        self._savers: list[Any] = []
        self._tagged: dict[int, str] = {}  # id(ModelCheckpoint) -> the last file seen
        self._final: dict[str, Any] | None = None  # the state at the end of training, for files saved after it
        self._position = 0
        self._rank = 0

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
        config = load_config(self.config)
        if config.enabled and config.anomaly.guard.enabled:
            from trainmon.integrations.mindspore.guard import loss_scale_refusal

            reason = loss_scale_refusal(args.get("train_network"))
            if reason is not None:
                raise UnsupportedSetupError(f"anomaly.guard is not supported with this mindspore set-up: {reason}. Set "
                                            "anomaly.guard.enabled: false to monitor this run; see docs/mindspore.md, "
                                            "'Step guard'")
        monitor = TrainerMonitor(self.config)
        self.monitor = monitor  # released by the caller if attach raises
        monitor.attach(network, optimizer, **options)
        self._savers = [cb for cb in args.get("list_callback") or [] if isinstance(cb, ModelCheckpoint)]
        self._tagged = {id(saver): saver.latest_ckpt_file_name for saver in self._savers}
        self._final = None
        self._rank = dist_layout()[0]
        if self.checkpoint is not None:
            self._resume(monitor, config, self.checkpoint)

    def _resume(self, monitor: TrainerMonitor, config: MonitorConfig, checkpoint: str | Path) -> None:
        health = read_health(checkpoint)
        if health is not None and isinstance(health.get("monitor"), dict):
            try:
                monitor.load_state_dict(health["monitor"])
            except ValueError as exc:
                logger.warning("trainmon: the checkpoint's monitor state is not loaded (%s); the detectors warm up "
                               "again", exc)
        where = Path(config.output_dir) / config.run_name if config.run_name else Path(config.output_dir)
        self.rollback = read_rollback(where, checkpoint=checkpoint) if where.exists() else None
        if self.rollback is not None:
            monitor.resume(self.rollback)

    def on_train_epoch_begin(self, run_context: Any) -> None:
        self._position = 0

    def on_train_step_begin(self, run_context: Any) -> None:
        """Tag a checkpoint saved after the last step ended; say which data this step trains on."""
        self._guarded(self._tag_checkpoints, part="step")
        self._guarded(self._batch_identity, run_context, part="batch")  # failing: no identities
        self._position += 1

    def _batch_identity(self, run_context: Any) -> None:
        assert self.monitor is not None
        args = run_context.original_args()
        epoch = int(args.get("cur_epoch_num") or 1) - 1
        self.monitor.batch({"batches": [[epoch, self._position, self._position + 1]]})
        if self.batch_ids is not None:
            self.monitor.batch(self.batch_ids(args.get("train_dataset_element")))

    def on_train_step_end(self, run_context: Any) -> None:
        """End the monitor step with the train network's loss; tag a checkpoint saved in this step."""
        monitor = self.monitor
        guard = monitor.guard if monitor is not None else None
        if monitor is None or guard is None:
            return
        args = run_context.original_args()
        outputs = args.get("net_outputs")
        loss = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
        # under the monitor's fail-safe guard: trainmon's own exception never reaches Model.train
        try:
            guard.run("step", lambda: monitor.step(loss=loss))
        except RollbackExit:  # the rollback action stops the run (not trainmon's failure): the monitor is closed
            # a file saved in this step (a ModelCheckpoint before this callback) holds the state that rolled back
            try:
                self._tag_checkpoints({"healthy": False, "step": int(args.get("cur_step_num") or 0) + 1})
            except Exception as exc:  # the monitor is closed (no guard left); the rollback's exit goes on
                logger.warning("trainmon: could not tag the checkpoint of the stopping step (%s: %s)",
                               type(exc).__name__, exc)
            self._release()
            raise
        self._guarded(self._tag_checkpoints, part="step")

    def on_train_end(self, run_context: Any) -> None:
        """Tag the last checkpoints and close the monitor (hooks, files)."""
        self._guarded(self._tag_checkpoints, part="step")
        self._guarded(self._keep_final, part="step")
        self._release()

    def __exit__(self, *exc: object) -> None:
        """``Model.train`` leaves its callbacks' context, also when the training raised: tag the files saved after
        :meth:`on_train_end` (a ``ModelCheckpoint`` after this callback saves its last one there) and close the
        monitor."""
        if self._final is not None:
            try:
                self._tag_checkpoints(self._final)
            except Exception as exc:  # the monitor is closed (no guard left); never reach Model.train
                logger.warning("trainmon: could not tag the last checkpoint (%s: %s)", type(exc).__name__, exc)
            self._final = None
        self._release()

    # ------------------------------------------------------------------ checkpoints
    def _keep_final(self) -> None:
        assert self.monitor is not None
        self._final = self.monitor.state_dict()

    def _tag_checkpoints(self, final: dict[str, Any] | None = None) -> None:
        """A sidecar for each file a ``ModelCheckpoint`` saved since the last look (``final``: the state when the
        monitor is closed: at the end of training, or ``{"healthy": False, "step"}`` when a rollback stopped it)."""
        for saver in self._savers:
            path = saver.latest_ckpt_file_name
            if not path or self._tagged.get(id(saver)) == path:
                continue
            self._tagged[id(saver)] = path
            if final is None:
                assert self.monitor is not None
                state = self.monitor.state_dict(checkpoint=path)
            else:
                state = final
            _write_health(Path(path), {"healthy": state.get("healthy", True), "step": state["step"], "rank": self._rank,
                                       "checkpoint": str(path), "monitor": state if "anomaly" in state else None})

    # ------------------------------------------------------------------ helpers
    def _guarded(self, fn: Callable[..., Any], *args: Any, part: str) -> None:
        guard = self.monitor.guard if self.monitor is not None else None
        if guard is not None:
            guard.run(part, fn, *args)

    def _release(self) -> None:
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            monitor.close()


def _write_health(checkpoint: Path, health: dict[str, Any]) -> None:
    """The sidecar beside ``checkpoint``; never replaces a file (a name taken gets ``.1``, ``.2``, ...)."""
    data = json.dumps(health, indent=1).encode("utf-8")
    target = health_path(checkpoint)
    for n in range(100):
        path = target if n == 0 else target.with_name(f"{target.name[:-len('.json')]}.{n}.json")
        try:
            write_atomic(path, data, root=checkpoint.parent, exclusive=True)
            return
        except FileExistsError:
            continue
    logger.warning("trainmon: %s and 99 other names are taken; the checkpoint's health is not written", target)
