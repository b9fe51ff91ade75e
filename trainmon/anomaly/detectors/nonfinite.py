"""``nonfinite``: NaN or Inf in any monitored tensor, the loss or the global grad norm."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainmon.anomaly.detectors.base import (SCALAR_FAMILY, Detector, row_event, scalar_event,
                                             scalar_location)
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import describe, format_number, sort_key_fields
from trainmon.records import FAMILIES, Row, StepRecord


@dataclass
class NonfiniteConfig:
    """Spec of the ``nonfinite`` detector."""

    scalars: list[str] = field(default_factory=lambda: ["loss", "grad_norm"])
    """Scalars checked besides every monitored tensor (missing scalars are skipped)."""
    families: list[str] | None = None
    """Row families checked; null means all."""


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


class NonfiniteDetector(Detector):
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
    choices = {"families": FAMILIES}

    def __init__(self, config: NonfiniteConfig, path: str = "anomaly.detectors[0]") -> None:
        super().__init__(config)
        self.steps_with_nonfinite = 0

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        families = set(self.config.families) if self.config.families is not None else None
        hits: list[tuple[tuple[int, ...], Row | None, str]] = []
        for row in record.rows:
            if row.nonfinite and (families is None or row.key.family in families):
                key = row.key
                hits.append((sort_key_fields(record.step, key.micro_step, key.phase, record.pp_stage,
                                             key.vpp_stage, key.order, record.rank), row, key.family))
        for name in self.config.scalars:
            value = record.scalars.get(name)
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
        if first_row is not None:
            metric, value = _row_metric(first_row)
            where = describe(first_row.key.family, first_row.key.name, first_row.key.phase)
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
        if first_row is not None:
            event = row_event(record, first_row, metric=metric, value=value, baseline=0.0,
                              detector=self.type_name, message=message, time=time)
        else:
            event = scalar_event(record, first_label, value=value, baseline=math.nan,
                                 detector=self.type_name, message=message, time=time)
        return [event]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_with_nonfinite": self.steps_with_nonfinite}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps_with_nonfinite = int(state.get("steps_with_nonfinite", 0))
