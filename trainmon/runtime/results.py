"""What becomes of a :class:`~trainmon.runtime.session.Session`'s ended steps on the host (:class:`StepResults`, a
base of the session): a collected step's record made after its transfer (at once, or when an ``async_results``
transfer in flight is finished), the uncollected steps' scalars taken when their copies arrived, each record handed
to the writer and checked by the step guard's host side, the anomaly engine and the rollback keeper, the ``raise``
action's error of a step settled early kept for the end of the next step; and the session's one-off files
(``module_struct.json``, ``failures.json``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING

from trainmon.anomaly.events import utc_now
from trainmon.base.records import StepRecord, build_record
from trainmon.base.safe_io import write_json
from trainmon.collect.param_check import ParameterCheck, held_parameters
from trainmon.errors import AnomalyError
from trainmon.runtime.rundir import unused_name

if TYPE_CHECKING:
    from pathlib import Path

    from trainmon.actions.rollback import RollbackKeeper
    from trainmon.anomaly.engine import AnomalyEngine
    from trainmon.anomaly.events import AnomalyEvent
    from trainmon.anomaly.skips import SkipReporter
    from trainmon.base.guard import Guard
    from trainmon.base.types import Model
    from trainmon.collect.buffer import HostStep, PendingScalars, Transfer
    from trainmon.collect.context import StepContext
    from trainmon.collect.struct import StructRecorder
    from trainmon.config import MonitorConfig
    from trainmon.integrations.base import Attachment
    from trainmon.runtime.replicas import ReplicaPlan
    from trainmon.sinks import SinkWriter

logger = logging.getLogger("trainmon")


class StepResults:
    """The host side of a session's ended steps and its one-off files (a base of
    :class:`~trainmon.runtime.session.Session`, which sets what is declared below)."""

    config: MonitorConfig
    model: Model
    ctx: StepContext
    guard: Guard
    attachment: Attachment
    writes: bool
    run_dir: Path
    rank_dir: Path | None
    writer: SinkWriter
    anomaly: AnomalyEngine
    replicas: ReplicaPlan
    keeper: RollbackKeeper | None
    skips: SkipReporter | None
    struct: StructRecorder | None
    pending: PendingScalars
    in_flight: tuple[int, Transfer] | None
    deferred: AnomalyError | None
    parameter_check: ParameterCheck | None
    """The parameters' NaN/Inf counts as training began (:mod:`trainmon.collect.param_check`), until the detectors
    get them with the first record checked."""

    def settle(self) -> None:
        """Check every ended step now (the uncollected steps' scalars waiting for their copies, the collected step
        in flight): a host synchronisation, for a checkpoint's health. Their ``raise`` error (or the rollback)
        comes at the end of the next step."""
        if self.guard.stopped:
            return
        try:
            _, error = self.finish_in_flight()
            error = self._take_pending(before=math.inf) or error
        except Exception as exc:
            self.guard.fail("step", exc)
            return
        if error is not None and self.deferred is None:
            self.deferred = error

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until what was handed to the outputs (the records, one-off files, the
        anomaly events) is written and flushed; False when something is still queued then. Never raises."""
        deadline = time.monotonic() + timeout
        try:
            written = self.writer.wait(timeout)
            return self.anomaly.flush(max(0.0, deadline - time.monotonic())) and written
        except Exception as exc:  # trainmon's own failure must not reach the training loop
            logger.warning("trainmon: flush failed (%s: %s)", type(exc).__name__, exc)
            return False

    def _check_parameters(self) -> None:
        """As the first training forward begins: count the parameters' NaN and Inf values, for the detectors."""
        self.parameter_check = ParameterCheck(held_parameters(self.attachment.roots), self.ctx.step)

    def _finish(self, step: int, host: HostStep) -> tuple[StepRecord, AnomalyError | None]:
        """The host side of a collected step: its record, handed to the writer and the anomaly engine."""
        record = build_record(step, self.attachment.rank, self.ctx.pp_stage, host.keys, host.partials, host.scalars,
                              self.ctx.metrics)
        return record, self._check(record) if self.writes else None

    def _check(self, record: StepRecord) -> AnomalyError | None:
        """A record of this rank to the writer and the anomaly engine (the step guard's verdict taken out first:
        its event goes with the detectors'; a run of skips escalates). Returns the ``raise`` action's error."""
        found: list[AnomalyEvent] = []
        escalation: AnomalyEvent | None = None
        keeper = self.keeper
        record.batch = keeper.batch_of(record.step) if keeper is not None else None
        if self.skips is not None:  # the guard's host side, under its part (failing, the whole guard goes off)
            found, escalation = self.guard.run("step_guard", self.skips.take, record, utc_now()) or ([], None)
            if escalation is not None:
                escalation.batch = record.batch
        self.writer.submit(self.replicas.stored(record))  # the detectors below get every row
        self.anomaly.last_events = []
        error = None
        checked = record  # the detectors see the parameters found non-finite as training began before its rows
        if self.parameter_check is not None and self.parameter_check.step <= record.step:
            check, self.parameter_check = self.parameter_check, None
            if rows := self.guard.run("param_check", check.rows):
                checked = dataclasses.replace(record, rows=[*rows, *record.rows])
        try:
            self.guard.run("anomaly", self.anomaly.process, checked, found)
            if escalation is not None:
                self.guard.run("anomaly", self.anomaly.act, [escalation], self.config.anomaly.guard.escalate)
        except AnomalyError as exc:
            error = exc
        if keeper is not None:  # health, the skip list, the rollback action: after the engine's actions
            self.guard.run("rollback", keeper.observe, record, self.anomaly.last_events, escalation)
        return error

    def finish_in_flight(self) -> tuple[StepRecord | None, AnomalyError | None]:
        """Finish the step whose transfer is in flight (``async_results``), if any, after the uncollected steps
        before it (their copies ended before its own: waiting for it waits for nothing more)."""
        if self.in_flight is None:
            return None, None
        (step, transfer), self.in_flight = self.in_flight, None
        error = self._take_pending(before=step)
        record, late = self._finish(step, transfer.result())
        return record, error or late

    def _take_pending(self, before: float = 0) -> AnomalyError | None:
        """Record and check the uncollected steps' scalars that are on the host (all those before step
        ``before``, waiting for their copies if needed): each a record of scalars only, to the writer and the
        anomaly engine, oldest first. Returns the ``raise`` action's first error."""
        error = None
        for step, scalars in self.guard.run("loss", lambda: list(self.pending.take(before))) or ():
            record = StepRecord(step, self.attachment.rank, scalars=scalars, pp_stage=self.ctx.pp_stage,
                                collected=False)
            error = error or self._check(record)
        return error

    def _write_struct(self) -> None:
        assert self.struct is not None
        self.struct.done = True
        self.struct.disarm()
        tree = self.struct.tree()
        logger.info("trainmon: module structure of %s (%d modules)", type(self.model).__name__, len(self.struct.seen))
        if self.rank_dir is not None:
            rank_dir, run_dir = self.rank_dir, self.run_dir
            self.writer.submit(lambda: write_json(unused_name(rank_dir, "module_struct", ".json", "resume"), tree,
                                                  root=run_dir))

    def _write_failures(self) -> None:
        """``rank{R}/failures.json``: what the fail-safe guard caught in this run (only when it caught something)."""
        if not self.guard.failures or self.rank_dir is None:
            return
        try:
            write_json(unused_name(self.rank_dir, "failures", ".json", "resume"), self.guard.summary(),
                       root=self.run_dir)
        except Exception as exc:
            logger.warning("trainmon: could not write failures.json (%s: %s)", type(exc).__name__, exc)
