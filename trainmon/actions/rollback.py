"""Healthy states, the skip list and the ``rollback`` action (``anomaly.rollback``; docs/actions.md, "Rollback").

The session's :class:`RollbackKeeper` reads each checked step's record and events after the anomaly engine
(framework-free, on the host):

- **health**: the training state is healthy until an event of a detector of ``anomaly.rollback.detectors`` comes
  from a step whose update was applied (a step the step guard or a ``GradScaler`` skipped left the weights as they
  were); from then on it is unhealthy, until a healthy state is loaded (``monitor.load_state_dict``).
  ``monitor.state_dict(checkpoint=...)`` asks it, and remembers the last healthy checkpoint;
- **the skip list**: such a step, and every step the step guard skipped, is appended to
  ``{run}/rank{R}/skip_list.jsonl`` with the identity of its data (:mod:`trainmon.actions.skip_list`), on a writer
  thread, while the state is healthy (after an unhealthy step, the weights explain what follows, not the data);
- **the rollback action** (``rollback`` in ``anomaly.actions``, or in ``anomaly.guard.escalate``): such an event
  stops the run. The keeper writes ``{run}/rollback.json`` (the last healthy checkpoint and the data to skip when
  resuming from it; a new name when it exists) and returns a :class:`RollbackExit`, which ``monitor.step()``
  raises at the end of the step: the process ends with the exit status ``anomaly.rollback.exit_code`` (17).

:func:`~trainmon.actions.resume.read_rollback` reads a rollback back for the resumed run.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from trainmon.actions.resume import ROLLBACK_FILE, VERSION, Rollback
from trainmon.actions.skip_list import SKIP_LIST_FILE, SkipList, merge_identities
from trainmon.anomaly.events import AnomalyEvent, utc_now
from trainmon.anomaly.skips import DETECTOR as GUARD_DETECTOR
from trainmon.base.records import StepRecord
from trainmon.base.safe_io import open_output, write_atomic
from trainmon.base.threads import CLOSE_TIMEOUT, OutputThread

logger = logging.getLogger("trainmon")

_KEPT_STEPS = 256
"""Steps whose data identity is kept until their record is checked (a record comes at most a few steps late)."""
_EVENTS_KEPT = 8
_GUARD_RULE = re.compile(r"skipped the update \((\w+)\)")
"""The rule a step guard event names (:mod:`trainmon.anomaly.skips`)."""
"""Events of the stopping step written into the rollback."""


class RollbackSettings(Protocol):
    """What the keeper reads of ``anomaly.rollback`` (:class:`trainmon.config.RollbackConfig`)."""

    @property
    def detectors(self) -> Sequence[str]: ...
    @property
    def exit_code(self) -> int: ...
    @property
    def skip_list(self) -> bool: ...


class RollbackExit(SystemExit):
    """The ``rollback`` action stops the run: raised by ``monitor.step()`` at the end of the step, after the monitor
    closed (its files are written). Uncaught, the process exits with :attr:`code` (``anomaly.rollback.exit_code``).

    Attributes:
        rollback: what ``rollback.json`` holds.
    """

    def __init__(self, code: int, rollback: dict[str, Any]) -> None:
        super().__init__(code)
        self.rollback = rollback


class RollbackKeeper:
    """The health of the training state, the skip list and the ``rollback`` action of one attached monitor.

    Args:
        settings: ``anomaly.rollback``.
        actions: ``anomaly.actions`` (the action fires when ``rollback`` is among them).
        escalate: ``anomaly.guard.escalate`` (the step guard's escalation rolls back when ``rollback`` is among them).
        rank: this rank.
        run_dir: the run directory (``rollback.json``); rank_dir: ``{run}/rank{R}`` (the skip list), None on a rank
            that writes nothing.
        start_step: the first step of this attach (0: the initial state counts as a healthy state to resume from).
        checks: whether this rank's records are checked (a rank that writes): else no step's data is kept.

    Example:
        >>> from trainmon.config import RollbackConfig
        >>> keeper = RollbackKeeper(RollbackConfig(), ["log"], [], rank=0, run_dir=None, rank_dir=None)
        >>> event = AnomalyEvent(3, 0, 0, "loss", "scalars", "loss", "value", float("nan"), 1.0, "nonfinite",
        ...                      "loss is nan", 0)
        >>> keeper.observe(StepRecord(3, 0, scalars={"loss": float("nan")}), [event], None) is None
        True
        >>> keeper.checkpoint(4, "ckpt/4.pt")["healthy"], keeper.unhealthy_since
        (False, 3)
    """

    def __init__(self, settings: RollbackSettings, actions: Sequence[str], escalate: Sequence[str], rank: int,
                 run_dir: Path | None, rank_dir: Path | None, start_step: int = 0, checks: bool = True) -> None:
        self.configure(settings, actions, escalate)
        self.rank, self.run_dir, self.rank_dir = rank, run_dir, rank_dir
        self.start_step = start_step
        self.checks = checks
        self.healthy = True
        self.unhealthy_since: int | None = None
        self.last_healthy: dict[str, Any] | None = {"step": 0, "checkpoint": None} if start_step == 0 else None
        """``{"step": resume step, "checkpoint": path or None}`` of the last healthy state saved (or loaded)."""
        self.entries: list[dict[str, Any]] = []
        """This attach's skip-list entries."""
        self.honoured = SkipList()
        """The data this run leaves out (the rollback it resumes from: :meth:`resume`)."""
        self.fired: dict[str, Any] | None = None
        """The rollback, once the action stopped the run."""
        self.due: RollbackExit | None = None
        """The exit not raised yet (:meth:`exit_due`)."""
        self._hook_warned = False
        self._current: dict[str, Any] | None = None
        self._batches: dict[int, dict[str, Any]] = {}
        self._output: OutputThread | None = None
        self._file: IO[str] | None = None  # the skip list, opened by the writer thread

    def configure(self, settings: RollbackSettings, actions: Sequence[str], escalate: Sequence[str]) -> None:
        """The settings in force (at attach; a dynamic reload of the config sets them again)."""
        self.settings = settings
        self.kinds = frozenset(settings.detectors)
        self.acts = "rollback" in actions
        self.escalates = "rollback" in escalate

    # ------------------------------------------------------------------ the data of each step
    def add_batch(self, identity: dict[str, Any] | None) -> None:
        """The current step (also) trains on ``identity`` (see :func:`~trainmon.actions.skip_list.batch_identity`)."""
        if self.checks:
            self._current = merge_identities(self._current, identity)

    def end_step(self, step: int) -> None:
        """The current step, ``step``, ends: its data is kept until its record is checked."""
        if self._current is not None:
            self._batches[step] = self._current
            self._current = None
            while len(self._batches) > _KEPT_STEPS:
                del self._batches[next(iter(self._batches))]

    def batch_of(self, step: int) -> dict[str, Any] | None:
        """The identity of ``step``'s data (None when not given), forgotten once asked."""
        return self._batches.pop(step, None)

    # ------------------------------------------------------------------ each checked step
    def observe(self, record: StepRecord, events: Sequence[AnomalyEvent],
                escalation: AnomalyEvent | None) -> RollbackExit | None:
        """Read one checked step (its record and its events, after the anomaly engine; the step guard's escalation
        event); the :class:`RollbackExit` to raise at the end of the step when the action stops the run (also kept
        for :meth:`exit_due`)."""
        if not events and escalation is None:
            return None
        applied = not record.scalars.get("step_skipped", 0.0) > 0  # NaN: not known to be skipped
        flagged = [e for e in events if e.detector in self.kinds or e.detector == GUARD_DETECTOR]
        if flagged and self.healthy:  # once unhealthy, the weights explain what follows, not the data
            guarded = [e for e in flagged if e.detector == GUARD_DETECTOR]  # the step guard's verdict says most
            self._add_entry(record, (guarded or flagged)[0], applied)
        if applied and self.healthy and any(e.detector in self.kinds for e in events):
            self.healthy, self.unhealthy_since = False, record.step
        cause = [e for e in flagged if e.detector in self.kinds and (applied or e.detector == GUARD_DETECTOR)]
        if self.acts and cause:
            return self._fire(record.step, cause)
        if self.escalates and escalation is not None:
            return self._fire(record.step, [escalation])
        return None

    def _add_entry(self, record: StepRecord, event: AnomalyEvent, applied: bool) -> None:
        reason = event.detector
        rule = _GUARD_RULE.search(event.message) if event.detector == GUARD_DETECTOR else None
        if rule is not None:
            reason += f" ({rule.group(1)})"
        entry = {"step": record.step, "rank": self.rank, "reason": reason, "applied": applied,
                 "message": event.message, "batch": record.batch, "time": event.time or utc_now()}
        self.entries.append(entry)
        if self.settings.skip_list:
            self._submit(("line", json.dumps(entry, allow_nan=False, separators=(",", ":"))))

    def _fire(self, step: int, cause: list[AnomalyEvent]) -> RollbackExit | None:
        if self.fired is not None:  # once per attach
            return None
        resume = self.last_healthy
        resume_step = resume["step"] if resume is not None else None
        new = SkipList(self.entries) if resume_step is None else SkipList(self.entries).after(resume_step)
        skip = self.honoured.union(new)
        rollback = {"version": VERSION, "step": step, "rank": self.rank, "start_step": self.start_step,
                    "exit_code": self.settings.exit_code, "time": utc_now(), "reason": cause[0].message,
                    "checkpoint": resume["checkpoint"] if resume is not None else None, "resume_step": resume_step,
                    "skip": skip.entries, "events": [event.to_dict() for event in cause[:_EVENTS_KEPT]]}
        self.fired = rollback
        self.due = RollbackExit(self.settings.exit_code, rollback)
        where = (f"checkpoint {rollback['checkpoint']} (step {resume_step})" if rollback["checkpoint"] is not None
                 else f"step {resume_step} (no checkpoint was named)" if resume_step is not None
                 else "nowhere known (no healthy state was saved with monitor.state_dict(checkpoint=...))")
        logger.error("[rank %d] trainmon rollback: %s; stopping the run at the end of step %d with exit status %d: "
                     "resume from %s, leaving out the data of %d step(s) (%s in %s)", self.rank, cause[0].message,
                     step, self.settings.exit_code, where, len(skip), ROLLBACK_FILE, self.run_dir)
        if self.run_dir is not None and self.rank_dir is not None:
            self._submit(("rollback", rollback))
        return self.due

    def exit_due(self, by_user: bool) -> RollbackExit | None:
        """At the end of a step: the exit to raise now, when the action stopped the run and the step was ended by
        ``monitor.step()`` (``by_user``); trainmon never raises it from a hook, and says so once."""
        if self.due is None:
            return None
        if by_user:
            due, self.due = self.due, None
            return due
        if not self._hook_warned:
            self._hook_warned = True
            logger.error("[rank %d] trainmon rollback: this step was ended by a hook, not by monitor.step(), and "
                         "trainmon never stops a run from a hook: the run stops at the next monitor.step(); a loop "
                         "that never calls it must stop itself when monitor.rollback is set", self.rank)
        return None

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, next_step: int, checkpoint: str | None) -> dict[str, Any]:
        """A state is saved for ``next_step`` (the step a resume starts at) at ``checkpoint``: whether it is
        healthy; a healthy one becomes the last healthy state."""
        if self.healthy:
            self.last_healthy = {"step": next_step, "checkpoint": checkpoint}
        return {"healthy": self.healthy, "step": next_step, "checkpoint": checkpoint,
                "unhealthy_since": self.unhealthy_since, "last_healthy": self.last_healthy}

    def state_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "unhealthy_since": self.unhealthy_since, "last_healthy": self.last_healthy}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (from ``monitor.state_dict()``'s ``health``).

        Raises:
            ValueError: not a health state.
        """
        healthy, since, last = state.get("healthy"), state.get("unhealthy_since"), state.get("last_healthy")
        if not isinstance(healthy, bool) or not (since is None or isinstance(since, int)) or not (
                last is None or isinstance(last, dict) and isinstance(last.get("step"), int)):
            raise ValueError(f"not a trainmon health state: {dict(state)!r}"[:300])
        self.healthy, self.unhealthy_since, self.last_healthy = healthy, since, last

    def resume(self, rollback: Rollback) -> None:
        """This run resumes from ``rollback`` and leaves out its data: a later rollback leaves it out too."""
        self.honoured = self.honoured.union(rollback.skip)
        if rollback.resume_step is not None and rollback.resume_step != self.start_step:
            logger.warning("[rank %d] trainmon: resuming the rollback of %s, which resumes at step %d, with "
                           "attach(start_step=%d)", self.rank, rollback.path, rollback.resume_step, self.start_step)
        if rollback.checkpoint is not None or rollback.resume_step == 0:
            self.last_healthy = {"step": rollback.resume_step, "checkpoint": rollback.checkpoint}

    # ------------------------------------------------------------------ output (a writer thread)
    def _submit(self, item: tuple[str, Any]) -> None:
        if self.rank_dir is None:
            return
        if self._output is None:
            self._output = OutputThread("skip_list", self._write, self._flush, self._close, disable_on_error=False)
        self._output.submit(item)

    def _write(self, item: tuple[str, Any]) -> None:
        kind, value = item
        assert self.rank_dir is not None and self.run_dir is not None
        if kind == "line":
            if self._file is None:
                self._file = open_output(self.rank_dir / SKIP_LIST_FILE, "a", self.run_dir, newline=None)
            self._file.write(value + "\n")
            return
        self._flush()
        data = _readable_json(value).encode("utf-8")
        for n in range(1000):
            path = self.run_dir / (ROLLBACK_FILE if n == 0 else f"rollback.{n}.json")
            try:
                write_atomic(path, data, root=self.run_dir, exclusive=True)  # never replaces another's
            except FileExistsError:
                continue
            logger.warning("[rank %d] trainmon rollback written to %s", self.rank, path)
            return

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _close(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait until what was queued is written (tests, readers in the same process)."""
        return self._output.wait(timeout) if self._output is not None else True

    def close(self) -> None:
        """Write what is queued and close the skip list; idempotent, never raises."""
        if self._output is not None:
            self._output.close()
            self._output.report()


def _readable_json(data: Mapping[str, Any]) -> str:
    """A rollback as JSON a person reads: a key per line, a list's items one per line, each item on one line.

    Example:
        >>> print(_readable_json({"step": 6, "skip": [{"step": 6}, {"step": 7}]}), end="")
        {
         "step": 6,
         "skip": [
          {"step": 6},
          {"step": 7}
         ]
        }
    """

    def one(value: object) -> str:
        return json.dumps(value, allow_nan=False, separators=(", ", ": "))

    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            items = ",\n".join(f"  {one(item)}" for item in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {one(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
