"""The step guard's host side: each skipped step as an anomaly event, counted; a run of skips escalated.

The device side (:mod:`trainmon.collect.step_guard`) sends what it found at each guarded step as the scalars
``step_guard/{name}`` of :data:`~trainmon.base.records.GUARD_VERDICT`, with the step's record (collected or not).
:class:`SkipReporter` takes them out of the record before the sinks see it (the sinks keep ``step_skipped``), and
turns a skipped step into an event of the ``step_guard`` detector naming the parameter it blames: the first with a
non-finite gradient, else the one with the largest z-score, else the largest norm. Framework-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

from trainmon.anomaly.detectors.base import scalar_location
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import format_number
from trainmon.base.records import GUARD_PREFIX, GUARD_REASONS, StepRecord

DETECTOR = "step_guard"


class GuardSettings(Protocol):
    """What the reporter reads of ``anomaly.guard`` (:class:`trainmon.config.GuardConfig`)."""

    @property
    def max_grad_norm(self) -> float | None: ...
    @property
    def z_threshold(self) -> float | None: ...
    @property
    def escalate_after(self) -> int | None: ...


class SkipReporter:
    """Reads the step guard's verdicts off the records, in step order.

    Args:
        settings: the ``anomaly.guard`` section.
        names: the optimizer's parameter names, in the verdict's ``param`` order (the device side's list: it
            follows the optimizer's parameters).
        rank: the rank the events are from.

    Example:
        >>> from trainmon.config import GuardConfig
        >>> reporter = SkipReporter(GuardConfig(enabled=True), ["fc.weight"], rank=0)
        >>> record = StepRecord(step=3, rank=0, scalars={"step_skipped": 1.0, "step_guard/reason": 1.0,
        ...                     "step_guard/param": 0.0, "step_guard/value": float("nan")})
        >>> events, escalation = reporter.take(record, "")
        >>> events[0].name, sorted(record.scalars), escalation is None
        ('fc.weight', ['step_skipped'], True)
    """

    def __init__(self, settings: GuardSettings, names: Sequence[str], rank: int) -> None:
        self.settings = settings
        self.names = names
        self.rank = rank
        self.guarded = 0
        """Steps whose verdict reached the host."""
        self.skipped = 0
        self.in_a_row = 0

    def take(self, record: StepRecord, time: str) -> tuple[list[AnomalyEvent], AnomalyEvent | None]:
        """Take the verdict out of ``record``: ``([event of a skipped step], escalation event or None)``."""
        found = {name[len(GUARD_PREFIX):]: record.scalars.pop(name)
                 for name in [name for name in record.scalars if name.startswith(GUARD_PREFIX)]}
        if not found:
            return [], None
        self.guarded += 1
        reason = found.get("reason", 0.0)
        if not (math.isfinite(reason) and 0 < reason < len(GUARD_REASONS)):
            self.in_a_row = 0
            return [], None
        self.skipped += 1
        self.in_a_row += 1
        event = self._event(record, found, int(reason), time)
        after = self.settings.escalate_after
        if after is None or self.in_a_row % after:
            return [event], None
        first = record.step - self.in_a_row + 1
        message = (f"{self.in_a_row} steps in a row skipped by the step guard (steps {first}..{record.step}, rank "
                   f"{self.rank}; escalate_after: {after}): the gradients stay poisoned; the last: {event.message}")
        return [event], dataclasses.replace(event, metric="skipped_in_a_row", value=float(self.in_a_row),
                                            baseline=float(after), message=message)

    def summary(self) -> str | None:
        """One line for the end of the run, when a step was skipped."""
        if not self.skipped:
            return None
        return (f"trainmon: the step guard skipped {self.skipped} of the {self.guarded} steps it judged (rank "
                f"{self.rank}); see anomalies.jsonl")

    def _event(self, record: StepRecord, found: dict[str, float], reason: int, time: str) -> AnomalyEvent:
        index = found.get("param", math.nan)
        name = self.names[int(index)] if math.isfinite(index) and 0 <= index < len(self.names) \
            else f"optimizer parameter {format_number(index)}"

        def number(key: str) -> str:
            return format_number(found.get(key, math.nan))

        limit = format_number(self.settings.max_grad_norm or math.nan)
        threshold = format_number(self.settings.z_threshold or math.nan)
        why = {
            1: f"the gradient of {name} is not finite (norm {number('value')})",
            2: f"the gradient norm {number('grad_norm')} is above max_grad_norm {limit} (largest: {name}, norm "
               f"{number('value')})",
            3: f"the gradient norm {number('grad_norm')} is {number('grad_norm_z')} standard deviations above its mean "
               f"{number('grad_norm_mean')} (z_threshold {threshold}; largest z-score: {name}, norm {number('value')}, "
               f"z {number('z')})",
            4: f"the gradient norm of {name}, {number('value')}, is {number('z')} standard deviations above its mean "
               f"{number('baseline')} (z_threshold {threshold})",
        }[reason]
        message = (f"step {record.step}, rank {self.rank}: the step guard skipped the update "
                   f"({GUARD_REASONS[reason]}): {why}; parameters and optimizer state unchanged ({self.skipped} "
                   f"skipped so far, {self.in_a_row} in a row)")
        phase, micro_step, order = scalar_location(record, "grad_norm")
        return AnomalyEvent(step=record.step, micro_step=micro_step, rank=self.rank, phase=phase, family="grad_reduced",
                            name=name, metric="norm", value=found.get("value", math.nan),
                            baseline=found.get("baseline", math.nan), detector=DETECTOR, message=message, order=order,
                            pp_stage=record.pp_stage, time=time)
