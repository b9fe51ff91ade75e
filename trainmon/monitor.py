"""TrainerMonitor: the lifecycle (construct, attach, step, close)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.base.records import StepRecord
from trainmon.config import MonitorConfig, load_config
from trainmon.errors import ConfigError

if TYPE_CHECKING:
    from trainmon.actions import HandOffAction
    from trainmon.actions.resume import Rollback
    from trainmon.anomaly.engine import AnomalyCallback
    from trainmon.base.guard import Guard
    from trainmon.base.types import GradScaler, Model, Optimizer, ProcessGroup, Scalar
    from trainmon.config.msprobe_checks import MsprobeKeys
    from trainmon.runtime.lifecycle import StepLifecycle
    from trainmon.runtime.session import Session

logger = logging.getLogger("trainmon")

class TrainerMonitor:
    """A drop-in training monitor.

    Args:
        config: a path to a YAML/JSON file, a dict, a :class:`MonitorConfig`, or None for defaults.

    Raises:
        ConfigError: the config is invalid (the message names the dotted key).

    Example:
        >>> monitor = TrainerMonitor({"output_dir": "/tmp/out"})          # doctest: +SKIP
        >>> monitor.attach(model, optimizer)                               # doctest: +SKIP
        >>> for batch in loader:                                           # doctest: +SKIP
        ...     loss = model(batch).mean(); loss.backward()
        ...     optimizer.step(); optimizer.zero_grad()
        ...     monitor.step(loss=loss)
        >>> monitor.close()                                                # doctest: +SKIP
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | str | Path | None = None) -> None:
        self.config_path = Path(config) if isinstance(config, (str, Path)) else None
        self._config = load_config(config)
        self._callbacks: list[AnomalyCallback] = []
        self._session: Session | None = None
        self._closed = False
        self._dirs: tuple[Path | None, Path | None] = (None, None)
        self._msprobe: MsprobeKeys | None = None
        """Built by :meth:`from_msprobe`: the msprobe keys that errors at ``attach`` name."""
        self._resumed: Rollback | None = None
        self._fired: dict[str, Any] | None = None

    @classmethod
    def from_msprobe(cls, path: str | Path) -> TrainerMonitor:
        """Build a monitor from a msprobe monitor JSON config, warning once per key it cannot honour.

        Output goes where msprobe's would: ``$MONITOR_OUTPUT_DIR`` (the one environment variable
        trainmon reads, and only here), else ``./monitor_output``. See docs/msprobe.md.

        Raises:
            ConfigError: the config is invalid; here and at ``attach`` the message names the file and msprobe's key
                (``monitor.json: msprobe key module_ranks[0]: ...``).
        """
        import os

        from trainmon.config.msprobe import read_msprobe

        config, keys = read_msprobe(Path(path), environ=os.environ)
        try:
            monitor = cls(config)
        except ConfigError as exc:
            raise keys.reword(exc) from None
        monitor._msprobe = keys
        return monitor

    def on_anomaly(self, callback: AnomalyCallback) -> None:
        """Register ``callback(event: AnomalyEvent)``; called when the ``callback`` action is configured."""
        self._callbacks.append(callback)
        if self._session is not None:
            self._session.anomaly.on_anomaly(callback)

    @property
    def config(self) -> MonitorConfig:
        """The config in force (after a dynamic reload, the reloaded one)."""
        return self._session.config if self._session is not None else self._config

    def attach(self, model: Model, optimizer: Optimizer | None = None, *, grad_acc_steps: int = 1,
               tp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None,
               pp_group: ProcessGroup | None = None, start_step: int = 0,
               scaler: GradScaler | None = None) -> TrainerMonitor:
        """Hook into a model (and its optimizer); the framework is detected from the objects.

        Args:
            model: a ``torch.nn.Module``, a ``DeepSpeedEngine``, a list of Megatron model chunks
                or a MindSpore ``Cell``.
            optimizer: the optimizer whose ``step`` ends a monitor step (optional).
            grad_acc_steps: micro-steps per optimizer step.
            tp_group, dp_group, pp_group: process groups overriding the integration's defaults.
            start_step: the step number of the first step (when resuming).
            scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop: gradients are then
                reported unscaled (as the optimizer uses them), with ``loss_scale`` and
                ``step_skipped`` scalars, and a step the scaler skips still ends a step.
                Found automatically behind accelerate's optimizer.

        Raises:
            TargetError: a target pattern matches no module or parameter (close names are listed).
            RuntimeError: already attached or closed.
        """
        if self._closed:
            raise RuntimeError("this TrainerMonitor is closed; create a new one")
        if self._session is not None:
            raise RuntimeError("already attached; close() first or create another TrainerMonitor")
        if grad_acc_steps < 1 or start_step < 0:
            raise ValueError(f"grad_acc_steps must be >= 1 and start_step >= 0, got {grad_acc_steps}, {start_step}")
        from trainmon.runtime.session import Session

        try:
            self._session = Session(model, optimizer, self._config, self.config_path, self._callbacks,
                                    grad_acc_steps=grad_acc_steps, tp_group=tp_group, dp_group=dp_group,
                                    pp_group=pp_group, start_step=start_step, scaler=scaler)
        except ConfigError as exc:
            if self._msprobe is None:
                raise
            raise self._msprobe.reword(exc) from None
        if self._msprobe is not None:
            modules = self._session.attachment.modules
            self._msprobe.warn_unmatched_targets([name for name, _, _ in modules], _parameter_names(modules))
        if self._resumed is not None:
            self.resume(self._resumed)
        return self

    def step(self, loss: Scalar | None = None, *, batch: object = None, **scalars: Scalar) -> StepRecord | None:
        """End the current step (call it after ``optimizer.step()``).

        Args:
            loss: the step's loss (a tensor stays on the device until the step's one transfer).
            batch: which data the step trained on, as :meth:`batch` takes it (added to what :meth:`batch` was
                given during the step).
            **scalars: extra scalars written to ``scalars.csv``. The loss and these are checked and written on
                every step, collected or not (on an uncollected step without a host sync: their copy is
                checked once it has ended; docs/anomaly.md).

        Returns:
            The step's record when the step was collected, else None. With ``async_results: true``: the
            record of the previous collected step, finished now (None when there is none).

        Raises:
            AnomalyError: the ``raise`` action fired (after the step was fully recorded; with
                ``async_results``, at the end of the next step).
            RollbackExit: the ``rollback`` action stopped the run (a ``SystemExit`` whose code is
                ``anomaly.rollback.exit_code``), after the monitor closed; see docs/actions.md, "Rollback".
        """
        if self._session is None:
            raise RuntimeError("attach() a model before calling step()")
        for name, value in (("loss", loss), *scalars.items()):
            _check_scalar(name, value)
        if batch is not None:
            self.batch(batch)
        from trainmon.actions.rollback import RollbackExit

        try:
            return self._session.end_step(loss, scalars, by_user=True)
        except RollbackExit:
            self.close()  # the rollback, the skip list and every output written before the process ends
            raise

    def batch(self, samples: object) -> None:
        """Say which data the current step trains on (call it once per micro-batch, or pass ``step(batch=...)``):
        the step's anomaly events carry it, and the skip list and a rollback name it.

        Args:
            samples: the sample indices of the batch (a sequence, numpy array or CPU tensor, in any order), a sample
                range ``(start, end)`` (a tuple, end excluded: e.g. the samples consumed before and after the step),
                a ``range`` or one index.

        Raises:
            TypeError, ValueError: not sample indices (a float, a negative index, a tensor on a device).

        Example:
            >>> for indices, (x, y) in loader:  # the dataset returns each sample's index too  # doctest: +SKIP
            ...     ...
            ...     monitor.step(loss=loss, batch=indices)
        """
        if self._session is None:
            raise RuntimeError("attach() a model before calling batch()")
        from trainmon.actions.skip_list import batch_identity

        identity = batch_identity(samples)
        if self._session.keeper is not None:
            self._session.keeper.add_batch(identity)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until what the monitor handed to its outputs so far is written and flushed: the records of the
        steps whose values reached the host (``scalars.csv``, TensorBoard, the store, ...), one-off files, and
        ``anomalies.jsonl``. Training never waits on the outputs otherwise (they run on threads of their own and
        drop what they cannot keep up with); call this where a reader in the same process needs the files now
        (a test, a benchmark, before copying the run away). It does not wait for the device: an uncollected
        step whose copy has not ended yet is written later.

        Args:
            timeout: the most seconds this call waits (a stuck disk never blocks training longer).

        Returns:
            True when everything was written within ``timeout`` (also before ``attach`` and after ``close``,
            which writes everything itself); False when something is still queued.

        Raises:
            ValueError: ``timeout`` is not a finite number >= 0.

        Example:
            >>> TrainerMonitor({"sinks": []}).flush(timeout=1.0)  # not attached: nothing to wait for
            True
        """
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or timeout < 0:
            raise ValueError(f"flush(timeout=...) must be a finite number of seconds >= 0, got {timeout!r}")
        if self._session is None:
            return True
        return self._session.flush(float(timeout))

    def dump(self, modules: list[str], steps: list[int] | None = None) -> list[str]:
        """Dump ``modules`` (names, globs, ``re:``) on ``steps`` (default: the next step).

        Raises:
            ConfigError: ``dump.enabled`` is false.
        """
        return self._action("dump").request(modules, steps)

    def free_benchmark(self, modules: list[str], steps: list[int] | None = None) -> list[str]:
        """Re-check the forward of ``modules`` (names, globs, ``re:``) on ``steps`` (default: the next step).

        Returns:
            The module names that will be checked.

        Raises:
            ConfigError: ``free_benchmark.enabled`` is false.
            TargetError: a pattern matches no module.

        Example:
            >>> monitor.free_benchmark(["layers.2.mlp"], steps=[120])   # doctest: +SKIP
        """
        return self._action("free_benchmark").request(modules, steps)

    def _action(self, section: str) -> HandOffAction:
        """The attached session's ``section`` action (dump, free_benchmark), for a request by hand."""
        if self._session is None:
            raise RuntimeError(f"attach() a model before calling {section}()")
        action: HandOffAction | None = self._session.actions.get(section)
        if action is None:
            raise ConfigError(f"{section}.enabled", f"must be true to call monitor.{section}()")
        return action

    def state_dict(self, checkpoint: str | Path | None = None) -> dict[str, Any]:
        """The monitor's resumable state, JSON-compatible, to save with a training checkpoint.

        ``{"anomaly": <anomaly engine state: every detector's history and warm-up>, "step": <the number
        of the next step>, "healthy": <bool>, "health": {...}}``. Restore it with :meth:`load_state_dict` after
        attaching a new monitor with ``attach(..., start_step=state["step"])``, so detectors need no new warm-up.

        ``healthy`` is False when an event of ``anomaly.rollback.detectors`` came from a step whose update was
        applied since the last healthy state (loaded, or the start). To answer it, every ended step is checked
        first (the scalars of uncollected steps whose copies are on their way: a host synchronisation, here
        only). Call it after ``monitor.step()`` of the last step the checkpoint holds.

        Args:
            checkpoint: where this state is saved (a file or a folder): a healthy one is what a rollback names.

        Raises:
            RuntimeError: not attached (or closed).

        Example:
            >>> checkpoint["trainmon"] = monitor.state_dict()                     # doctest: +SKIP
            >>> monitor = TrainerMonitor(config).attach(model, optimizer,         # doctest: +SKIP
            ...                                         start_step=checkpoint["trainmon"]["step"])
            >>> monitor.load_state_dict(checkpoint["trainmon"])                   # doctest: +SKIP
        """
        if self._session is None:
            raise RuntimeError("attach() a model before calling state_dict()")
        session = self._session
        session.settle()
        step = int(session.ctx.step)
        state: dict[str, Any] = {"anomaly": session.anomaly.state_dict(), "step": step}
        if session.keeper is not None:
            health = session.keeper.checkpoint(step, None if checkpoint is None else str(checkpoint))
            state.update(healthy=health["healthy"], health=session.keeper.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into the attached monitor.

        The anomaly state and the health (the last healthy checkpoint) are applied; the step counter is set by
        ``attach(start_step=...)``. A state saved before health was recorded loads as a healthy one.

        Raises:
            RuntimeError: not attached (or closed).
            ValueError: the state does not match the configured detectors.
        """
        if self._session is None:
            raise RuntimeError("attach() a model before calling load_state_dict()")
        if not isinstance(state, dict) or "anomaly" not in state:
            raise ValueError("not a TrainerMonitor state (missing 'anomaly')")
        self._session.anomaly.load_state_dict(state["anomaly"])
        keeper = self._session.keeper
        if keeper is not None and isinstance(state.get("health"), dict):
            keeper.load_state_dict(state["health"])

    def resume(self, rollback: Rollback) -> None:
        """Say that this run resumes from ``rollback`` (:func:`trainmon.read_rollback`) and leaves out its data
        (``trainmon.SkipSampler``): a later rollback of this run leaves that data out too, and names the rollback's
        checkpoint until a newer healthy one is saved. Call it before or after ``attach``."""
        self._resumed = rollback
        if self._session is not None and self._session.keeper is not None:
            self._session.keeper.resume(rollback)

    @property
    def rollback(self) -> dict[str, Any] | None:
        """What ``rollback.json`` holds once the ``rollback`` action stopped the run (kept after ``close()``), else
        None. A loop whose steps end without ``monitor.step()`` (by the optimizer hook) checks it to stop."""
        keeper = self._session.keeper if self._session is not None else None
        return keeper.fired if keeper is not None else self._fired

    @property
    def run_dir(self) -> Path | None:
        """``{output_dir}/{run_name}`` once attached (kept after ``close()``, to find the outputs)."""
        return self._session.run_dir if self._session is not None else self._dirs[0]

    @property
    def rank_dir(self) -> Path | None:
        """``{run_dir}/rank{R}`` once attached (None on a rank that writes nothing); kept after ``close()``."""
        return self._session.rank_dir if self._session is not None else self._dirs[1]

    # ------------------------------------------------------------------ the seam for trainer callbacks
    @property
    def guard(self) -> Guard | None:
        """The attached monitor's fail-safe guard (None before ``attach`` and after ``close``).

        For callbacks of a loop a trainer owns (``trainmon.trainers``): they run their bodies with
        ``guard.run("step", fn)`` and wrap what they hand to the trainer with ``guard.wrap(part, fn)``, so that
        trainmon's own exception disarms the part, warns once and never reaches the trainer.
        """
        return self._session.guard if self._session is not None else None

    @property
    def lifecycle(self) -> StepLifecycle | None:
        """The attached monitor's step model (None before ``attach`` and after ``close``).

        For callbacks of a loop a trainer owns that tell it where micro-steps begin
        (``micro_step_begins``), where a backward ended (``backward_ended``) and when evaluation suspends
        recording (``suspend``/``resume``); call them under :attr:`guard` (part ``step``).
        """
        return self._session.lifecycle if self._session is not None else None

    def close(self) -> None:
        """Finish the pending step, remove every hook, flush and close the outputs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            self._config = session.config
            self._dirs = (session.run_dir, session.rank_dir)
            self._fired = session.keeper.fired if session.keeper is not None else None
            session.close()

    def __enter__(self) -> TrainerMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parameter_names(modules: list[tuple[str, Any, int]]) -> list[str]:
    """The parameter names of the root modules (named ``""``) of an attachment's modules (torch or MindSpore)."""
    from trainmon.base.targets import plain_name

    names: list[str] = []
    for name, module, _ in modules:
        named = getattr(module, "named_parameters", None) or getattr(module, "parameters_and_names", None)
        if not name and named is not None:
            names += [plain_name(param) for param, _ in named()]
    return names


def _check_scalar(name: str, value: Scalar | None) -> None:
    """A scalar given to ``step()`` is None, a tensor (any framework) or a number."""
    if value is None or hasattr(value, "detach") or hasattr(value, "asnumpy"):
        return
    try:
        float(value)
    except (TypeError, ValueError):
        raise TypeError(f"step(): {name} must be a number or a tensor, got {type(value).__name__} {value!r}") from None


__all__ = ["TrainerMonitor"]
