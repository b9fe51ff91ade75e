"""Hugging Face ``transformers.Trainer``: ``Trainer(..., callbacks=[TrainmonCallback("monitor.yaml")])``.

What the callback does (see docs/hf.md):

- ``on_train_begin``: attaches a :class:`~trainmon.TrainerMonitor` to the Trainer's model and
  optimizer. accelerate's ``AcceleratedOptimizer`` is unwrapped (its ``GradScaler`` found), and
  ``grad_acc_steps`` is ``args.gradient_accumulation_steps``. Under DeepSpeed
  (``TrainingArguments(deepspeed=...)``) it attaches to the Trainer's ``DeepSpeedEngine`` instead
  (``trainer.model_wrapped``), through trainmon's DeepSpeed integration;
- the training loss of every step: HF callbacks never receive it, so a forward hook on the model
  reads ``outputs.loss`` of each training forward (a device tensor, no host sync) and scales it as
  ``Trainer.training_step`` does (:class:`TrainerLoss`); with several processes the step's value is
  their mean (one all-reduce of two floats per step). The ``loss`` scalar is then what the Trainer
  logs with ``logging_steps=1``;
- ``on_step_end``: ends the monitor step, with the identity of its data: the data loader's batches
  ``[epoch, first, end]`` (:class:`~trainmon.trainers.hf_data.TrainerBatches` wraps the Trainer's
  ``get_batch_samples`` to count them). Steps are numbered like the Trainer's ``global_step``
  after the update (the first optimizer step is step 1), so trainmon's rows line up with the
  Trainer's own logs;
- ``on_save``: writes ``trainmon_health.json`` into the checkpoint folder: whether the state is healthy, and the
  monitor's state (``monitor.state_dict(checkpoint=folder)``), which a resume from that folder loads;
- resuming (``trainer.train(resume_from_checkpoint=...)``) from the checkpoint a rollback names (found in the
  monitor's ``output_dir``, or given as ``rollback=``), the batches of its skip list are left out
  (docs/actions.md, "Rollback");
- evaluation and prediction run under ``torch.no_grad()`` in ``eval()`` mode: the step model does
  not count them and they record nothing;
- ``on_train_end``: closes the monitor (also its hooks and files).

``transformers`` is imported only when this module is.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from trainmon.actions.resume import Rollback, read_rollback
from trainmon.actions.rollback import RollbackExit
from trainmon.actions.skip_list import SkipList
from trainmon.base.safe_io import write_atomic
from trainmon.collect.step_hooks import unwrap_optimizer
from trainmon.config import MonitorConfig, load_config
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations import framework_of
from trainmon.integrations.losses import output_loss
from trainmon.monitor import TrainerMonitor
from trainmon.trainers.attaching import attach_or_train_on, ddp_options
from trainmon.trainers.hf_data import TrainerBatches

logger = logging.getLogger("trainmon")
HEALTH_FILE = "trainmon_health.json"
"""What ``on_save`` writes into a checkpoint folder (``trainmon_health.rank{R}.json`` on the other ranks)."""


class TrainmonCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs a trainmon monitor for the Trainer's training.

    Args:
        config: a trainmon config (path to YAML/JSON, dict, :class:`MonitorConfig`, or None).
        rollback: the rollback to resume from (a :class:`~trainmon.actions.rollback.Rollback`, or a path for
            :func:`~trainmon.actions.rollback.read_rollback`); default: the newest rollback in the monitor's
            ``output_dir`` that names the checkpoint the Trainer resumes from.
        **attach_options: extra keyword arguments for :meth:`TrainerMonitor.attach` (process
            groups, ``scaler``).

    Raises:
        UnsupportedSetupError: at ``on_train_begin``, for a set-up the callback cannot monitor correctly
            (``torch.nn.DataParallel`` over several GPUs in one process, tensor/context/sequence
            parallelism, DeepSpeed without a Trainer to take its engine from).

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=data,          # doctest: +SKIP
        ...                   callbacks=[TrainmonCallback("monitor.yaml")])
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None,
                 rollback: Rollback | str | Path | None = None, **attach_options: Any) -> None:
        self.config = config
        self.rollback = rollback
        self.attach_options = attach_options
        self.monitor: TrainerMonitor | None = None
        self._losses: TrainerLoss | None = None
        self._batches: TrainerBatches | None = None
        TrainerMonitor(config)  # validate the config now, when the Trainer is built, not at train begin

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        attach_or_train_on(lambda: self._attach(args, state, model, optimizer, train_dataloader), self._release,
                           "this Trainer")

    def _attach(self, args: Any, state: Any, model: Any, optimizer: Any, loader: Any) -> None:
        trainer = _calling_trainer()
        _check_setup(args, trainer)
        engine = _deepspeed_engine(trainer, optimizer)
        resumed = _resumed_checkpoint(trainer) if int(state.global_step) > 0 else None
        rollback = self._find_rollback(resumed)
        monitor = TrainerMonitor(self.config)
        start_step = int(state.global_step) + 1
        if engine is not None:
            # DeepSpeed owns the optimizer and the accumulation: the engine is the one thing to attach
            monitor.attach(engine, None, start_step=start_step, **self.attach_options)
        else:
            options = {"grad_acc_steps": max(1, int(args.gradient_accumulation_steps)), "start_step": start_step,
                       **self.attach_options}
            monitor.attach(model, optimizer, **ddp_options(getattr(trainer, "model_wrapped", None), options))
        self.monitor = monitor
        guard = monitor.guard
        self._losses = TrainerLoss(model, bool(getattr(args, "average_tokens_across_devices", False)),
                                   args.device, wrap=None if guard is None else functools.partial(guard.wrap, "loss"))
        if resumed is not None:
            _load_health(monitor, Path(resumed))
        if rollback is not None:
            monitor.resume(rollback)
        if trainer is not None and guard is not None and hasattr(trainer, "get_batch_samples"):
            epoch, position = _resume_position(args, state, loader)
            self._batches = TrainerBatches(trainer, rollback.skip if rollback is not None else SkipList(), epoch,
                                           position, wrap=functools.partial(guard.wrap, "batch"))
        elif rollback is not None and rollback.skip.batches():
            logger.warning("trainmon: this Trainer has no get_batch_samples (an older transformers): the batches of "
                           "the rollback %s are not left out", rollback.path)

    def _find_rollback(self, resumed: str | None) -> Rollback | None:
        """The rollback this run resumes from: the one given, else the newest naming the resumed checkpoint."""
        given = self.rollback
        if given is not None:
            return given if isinstance(given, Rollback) else read_rollback(given)
        if resumed is None:
            return None
        config = load_config(self.config)
        where = Path(config.output_dir) / config.run_name if config.run_name else Path(config.output_dir)
        return read_rollback(where, checkpoint=resumed) if where.exists() else None

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guarded(lambda batches: batches.epoch_begins())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor, losses = self.monitor, self._losses
        guard = monitor.guard if monitor is not None else None
        if monitor is not None and losses is not None and guard is not None:
            batches = self._batches
            # under the monitor's fail-safe guard: trainmon's own exception never reaches the Trainer
            try:
                guard.run("step", lambda: monitor.step(loss=losses.take(),
                                                       batch=batches.take_step() if batches is not None else None))
            except RollbackExit:  # the rollback action stops the run (at the end of the step, never in a hook)
                self._release()
                raise

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self.monitor
        guard = monitor.guard if monitor is not None else None
        if monitor is not None and guard is not None:
            guard.run("step", _save_health, monitor, Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release()

    def _guarded(self, fn: Callable[[TrainerBatches], Any]) -> None:
        guard = self.monitor.guard if self.monitor is not None else None
        if guard is not None and self._batches is not None:
            guard.run("step", fn, self._batches)

    def _release(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        if self._losses is not None:
            self._losses.remove()
            self._losses = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def _save_health(monitor: TrainerMonitor, folder: Path) -> None:
    """``trainmon_health.json`` in the checkpoint folder the Trainer just wrote (when it is there: the rank that
    saves): ``{"healthy", "step", "rank", "monitor": monitor.state_dict(checkpoint=folder)}``."""
    state = monitor.state_dict(checkpoint=folder)
    if not folder.is_dir():
        return
    rank = _rank()
    name = HEALTH_FILE if rank == 0 else f"trainmon_health.rank{rank}.json"
    health = {"healthy": state.get("healthy", True), "step": state["step"], "rank": rank, "monitor": state}
    write_atomic(folder / name, json.dumps(health, indent=1).encode("utf-8"), root=folder)


def _load_health(monitor: TrainerMonitor, folder: Path) -> None:
    """The monitor's state saved with a checkpoint (``trainmon_health.json``), loaded when it fits the detectors."""
    rank = _rank()
    path = folder / (HEALTH_FILE if rank == 0 else f"trainmon_health.rank{rank}.json")
    if not path.is_file():
        return
    try:
        monitor.load_state_dict(json.loads(path.read_text())["monitor"])
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("trainmon: %s not loaded (%s); the detectors warm up again", path, exc)


def _rank() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank() if distributed else 0


def _resume_position(args: Any, state: Any, loader: Any) -> tuple[int, int]:
    """``(epoch, loader position)`` where the Trainer resumes: as ``Trainer._init_training_state`` computes it."""
    steps = int(state.global_step)
    if steps == 0:
        return 0, 0
    acc = max(1, int(args.gradient_accumulation_steps))
    try:
        batches = len(loader)
    except (TypeError, AttributeError, NotImplementedError):  # no length (an IterableDataset): max_steps per epoch
        batches = None
    per_epoch = max(batches // acc + int(batches % acc > 0), 1) if batches else max(1, int(state.max_steps))
    position = 0 if getattr(args, "ignore_data_skip", False) else steps % per_epoch * acc
    return steps // per_epoch, position


def _resumed_checkpoint(trainer: Trainer | None) -> str | None:
    """The checkpoint folder the Trainer resumes from: ``resume_from_checkpoint`` of its ``train`` (a path, after
    ``True`` was resolved to the last checkpoint), found up the call stack as :func:`_calling_trainer` finds the
    Trainer."""
    if trainer is None:
        return None
    frame = inspect.currentframe()
    try:
        while frame is not None:
            value = frame.f_locals.get("resume_from_checkpoint")
            if frame.f_locals.get("self") is trainer and isinstance(value, (str, Path)):
                return str(value)
            frame = frame.f_back
        return None
    finally:
        del frame


class TrainerLoss:
    """The loss the Trainer logs for each step (``logging_steps=1``), from the model's ``outputs.loss``.

    ``Trainer.training_step`` adds, per micro-batch, ``outputs.loss`` as it went into the backward:

    - when the Trainer passed ``num_items_in_batch`` to the model (a model whose ``forward`` takes
      ``**kwargs``; transformers 5), the model already divided its summed loss by the items of the
      whole accumulated batch (of every process with ``average_tokens_across_devices``, in which case
      ``compute_loss`` multiplies it by the number of processes);
    - otherwise ``outputs.loss`` is the micro-batch's mean and is divided by the number of
      micro-batches of the step.

    It then logs the mean of those sums over the processes. This class keeps the sum on the device
    (a forward hook with a removable handle, no host sync) and :meth:`take` makes the step's value.
    A ``compute_loss`` of a Trainer subclass, label smoothing or ``compute_loss_func`` compute the
    loss outside the model: their loss is not seen (the model returns none, or one the Trainer does
    not use as is).

    Args:
        model: the Trainer's model (``trainer.model``, inside any DDP or DeepSpeed wrapper).
        average_tokens_across_devices: ``TrainingArguments.average_tokens_across_devices``.
        device: ``TrainingArguments.device`` (where the cross-process mean is taken).
    """

    def __init__(self, model: torch.nn.Module, average_tokens_across_devices: bool, device: torch.device,
                 wrap: Callable[[Callable[..., None]], Callable[..., None]] | None = None) -> None:
        self.device = device
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.world_size = torch.distributed.get_world_size() if distributed else 1
        self._items_factor = float(self.world_size) if average_tokens_across_devices else 1.0
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._normalised = False
        hook = self._hook if wrap is None else wrap(self._hook)  # the monitor's fail-safe guard, part ``loss``
        self._handle = model.register_forward_hook(hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = output_loss(output)
        if loss is None:
            return
        value = loss.detach().float().reshape(())
        if kwargs.get("num_items_in_batch") is not None:  # normalised over the whole accumulated batch
            self._normalised = True
            value = value * self._items_factor
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def take(self) -> torch.Tensor | None:
        """The step's loss as the Trainer logs it (None when no forward had a loss); resets.

        With several processes every one of them joins one all-reduce here, every step, loss or not
        (on a GPU it is queued on the stream: no host sync).
        """
        total, count, normalised = self._sum, self._count, self._normalised
        self._sum, self._count, self._normalised = None, 0, False
        local = None if total is None else (total if normalised else total / count)
        if self.world_size == 1:
            return local
        # [sum of the processes' losses, how many processes had one]: the same collective on every rank
        pair = torch.zeros(2, device=self.device) if local is None else torch.stack(
            [local.to(self.device), torch.ones((), device=self.device)])
        torch.distributed.all_reduce(pair)
        # the Trainer's own compute_loss raises where the model returns no loss, so either every process has
        # one or none has; the count keeps the collective the same on every rank whatever happens
        return None if local is None else pair[0] / pair[1]

    def remove(self) -> None:
        self._handle.remove()


def _calling_trainer() -> Trainer | None:
    """The ``transformers.Trainer`` whose callback event is running, found up the call stack.

    Callbacks are given the model and the optimizer, not the Trainer; under DeepSpeed the engine that
    owns both exists only as ``trainer.model_wrapped``. Events are raised by the Trainer's own methods
    (``self.callback_handler.on_train_begin(...)``), so its frame is a few levels up.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # no reference cycle through the frames


def _check_setup(args: Any, trainer: Trainer | None) -> None:
    """Refuse, with the alternative, the set-ups whose loss and statistics the callback would get wrong."""
    if int(getattr(args, "n_gpu", 1)) > 1:
        raise UnsupportedSetupError(
            f"trainmon's TrainmonCallback does not support torch.nn.DataParallel (the Trainer runs one process on "
            f"{args.n_gpu} GPUs): its hooks would run once per replica. Launch one process per GPU instead "
            "(torchrun or accelerate launch), or make one GPU visible.")
    if trainer is None:
        return
    # (getattr: older transformers have only some of these methods, and then none of those parallelisms)
    sizes = {kind: getattr(trainer, f"get_{short}_size", lambda: 1)()
             for kind, short in (("tensor", "tp"), ("context", "cp"), ("sequence", "sp"))}
    parallel = [f"{kind} parallel size {size}" for kind, size in sizes.items() if int(size) > 1]
    if parallel:
        raise UnsupportedSetupError(
            f"trainmon's TrainmonCallback does not support a Trainer with {', '.join(parallel)}: its loss and "
            "gradient statistics would be those of one shard. Monitor a data-parallel (DDP, FSDP or DeepSpeed) "
            "run, or attach TrainerMonitor to the model in your own loop.")


def _deepspeed_engine(trainer: Trainer | None, optimizer: Any) -> Any:
    """The Trainer's ``DeepSpeedEngine`` when it trains under DeepSpeed, else None.

    Raises:
        UnsupportedSetupError: DeepSpeed is in use but its engine cannot be found.
    """
    inner, _ = unwrap_optimizer(optimizer) if optimizer is not None else (None, None)
    deepspeed = (inner is not None and type(inner).__module__.split(".")[0] == "deepspeed") or bool(
        trainer is not None and getattr(trainer, "is_deepspeed_enabled", False))
    if not deepspeed:
        return None
    engine = getattr(trainer, "model_wrapped", None)
    if engine is None or framework_of(engine) != "deepspeed":
        raise UnsupportedSetupError("trainmon's TrainmonCallback found a DeepSpeed optimizer but not the Trainer's "
                         f"DeepSpeedEngine (trainer.model_wrapped is {type(engine).__name__}): attach "
                         "TrainerMonitor to the engine yourself (monitor.attach(trainer.model_wrapped)).")
    return engine
