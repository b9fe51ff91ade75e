"""``nonfinite``: NaN or Inf in any monitored tensor, the loss or the global grad norm."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainmon.anomaly.detectors.base import SCALAR_FAMILY, Detector, row_event, scalar_event, scalar_location
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import describe, format_number, sort_key_fields
from trainmon.base.records import FAMILIES, Row, StepRecord
from trainmon.base.schema import setting


@dataclass
class NonfiniteConfig:
    """Spec of the ``nonfinite`` detector."""

    scalars: list[str] = setting(["loss", "grad_norm"])
    """Scalars checked besides every monitored tensor (missing scalars are skipped)."""
    families: list[str] | None = setting(None, choices=FAMILIES)
    """Row families checked; null means all."""
    max_skipped_steps: int = setting(10, minimum=0)
    """Consecutive steps dynamic loss scaling may skip before it is an anomaly. On a step skipped under
    loss scaling (scalar ``step_skipped`` = 1 with ``loss_scale`` > 1) non-finite gradients and
    ``grad_norm`` are the scaler's routine overflow, not an alarm; one event reports a longer run of
    skips. A step skipped without loss scaling (bf16, a constant scale of 1) is always reported."""


SKIP_SCALAR = "step_skipped"
"""The scalar (1 = the optimizer did not apply the step) written by every integration."""
GRADIENT_FAMILIES = frozenset({"grad_unreduced", "grad_reduced", "actv_grad"})
"""Families whose non-finite values a skipped step explains (an overflow in the scaled backward)."""
GRADIENT_SCALARS = frozenset({"grad_norm"})


def _row_metric(row: Row) -> tuple[str, float]:
    """The most telling metric of a non-finite row: the NaN count, the Inf count, the first
    non-finite statistic, or ``nonfinite`` (NaN) when no statistic was configured."""
    values = row.values
    for metric in ("nans", "infs"):
        if values.get(metric, 0.0) > 0:
            return metric, values[metric]
    for metric, value in values.items():
        if not math.isfinite(value):
            return metric, value
    return "nonfinite", math.nan


class NonfiniteDetector(Detector[NonfiniteConfig]):
    """Reports the first non-finite value of a step in execution order, and counts the rest.

    Rows carry an exact non-finite flag (computed on device with the statistics), so tensors are
    covered even when ``nans``/``infs`` are not configured. One event per step and rank: the
    first origin; the downstream values it contaminated are summarised in its message.

    Example:
        >>> NonfiniteDetector(NonfiniteConfig()).update(StepRecord(step=0, rank=0), "")
        []
    """

    type_name = "nonfinite"
    config_class = NonfiniteConfig

    def __init__(self, config: NonfiniteConfig) -> None:
        super().__init__(config)
        self.steps_with_nonfinite = 0
        self.skipped_in_a_row = 0

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        # an overflow that dynamic loss scaling handles by skipping the step and lowering the scale
        skipped = record.scalars.get(SKIP_SCALAR, 0.0) > 0 and record.scalars.get("loss_scale", 1.0) > 1
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if skipped and self.skipped_in_a_row == self.config.max_skipped_steps + 1:
            return [self._skips_event(record, time)]
        families = set(self.config.families) if self.config.families is not None else None
        hits: list[tuple[tuple[int, ...], Row | None, str]] = []
        for row in record.rows:
            if skipped and row.key.family in GRADIENT_FAMILIES:
                continue  # the overflow that made the scaler skip this step: recorded, not an alarm
            if row.nonfinite and (families is None or row.key.family in families):
                key = row.key
                hits.append((sort_key_fields(record.step, key.micro_step, key.phase, record.pp_stage,
                                             key.vpp_stage, key.order, record.rank), row, key.family))
        for name in self.config.scalars:
            value = record.scalars.get(name)
            if skipped and name in GRADIENT_SCALARS:
                continue
            if value is not None and not math.isfinite(value):
                phase, micro_step, order = scalar_location(record, name)
                hits.append((sort_key_fields(record.step, micro_step, phase, record.pp_stage, 0, order,
                                             record.rank), None, name))
        if not hits:
            return []
        self.steps_with_nonfinite += 1
        hits.sort(key=lambda hit: hit[0])
        _, first_row, first_label = hits[0]
        rest = Counter(SCALAR_FAMILY if row is None else label for _, row, label in hits[1:])
        hint = ""
        if first_row is not None:
            metric, value = _row_metric(first_row)
            where = describe(first_row.key.family, first_row.key.name, first_row.key.phase)
            if first_row.key.family == "param" and first_row.key.phase == "forward":  # collect/param_check.py
                where += " as training began"
                hint = ("; a parameter not finite before its first update: memory left uninitialised (to_empty() "
                        "without re-initialising every module) or a checkpoint saved after a non-finite step")
            micro_step = first_row.key.micro_step
            detail = f"{first_row.key.family}/{first_row.key.name} {metric}={format_number(value)}"
        else:
            metric, value = "value", record.scalars[first_label]
            where = describe(SCALAR_FAMILY, first_label, "loss")
            micro_step = scalar_location(record, first_label)[1]
            detail = f"{first_label}={format_number(value)}"
        message = (f"first non-finite value at step {record.step}, micro-step {micro_step}, "
                   f"rank {record.rank}: {where} ({detail})")
        if rest:
            counts = ", ".join(f"{family} {n}" for family, n in sorted(rest.items()))
            message += f"; {len(hits) - 1} more non-finite values later in this step ({counts})"
        message += hint
        if first_row is not None:
            event = row_event(record, first_row, metric=metric, value=value, baseline=0.0,
                              detector=self.type_name, message=message, time=time)
        else:
            event = scalar_event(record, first_label, value=value, baseline=math.nan,
                                 detector=self.type_name, message=message, time=time)
        return [event]

    def _skips_event(self, record: StepRecord, time: str) -> AnomalyEvent:
        count = self.skipped_in_a_row
        message = (f"{count} steps in a row skipped by the loss scaler / overflow check (steps "
                   f"{record.step - count + 1}..{record.step}, rank {record.rank}): gradients stay non-finite "
                   f"whatever the loss scale")
        return scalar_event(record, SKIP_SCALAR, value=float(count), baseline=float(self.config.max_skipped_steps),
                            detector=self.type_name, message=message, time=time)

    def state_dict(self) -> dict[str, Any]:
        return {"steps_with_nonfinite": self.steps_with_nonfinite, "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps_with_nonfinite = int(state.get("steps_with_nonfinite", 0))
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
