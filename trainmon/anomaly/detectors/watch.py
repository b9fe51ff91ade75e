"""The values of a step that a detector's ``series`` selects: scalars by name and ``family/name/metric`` rows.

Shared by the detectors that watch chosen series one by one (``growth``, ``level``); ``spike`` keeps its own loop
(its state key and wording came first). Selection uses :class:`~trainmon.anomaly.detectors.spike.SeriesSelector`,
so a series is written and validated the same way for every detector.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from trainmon.anomaly.detectors.spike import SeriesSelection
from trainmon.anomaly.ordering import describe
from trainmon.base.records import Row, StepRecord

SeriesKey = tuple[str, str, str, int, int]
"""``(family, name, metric, vpp_stage, micro_step)``; ``("", scalar, "value", 0, 0)`` for a scalar."""


@dataclass(frozen=True)
class Observed:
    """One finite selected value of a step: its state key, its wording and the row it came from (None: a scalar)."""

    key: SeriesKey
    where: str
    value: float
    row: Row | None


class SeriesWatch(SeriesSelection):
    """The selected finite values of each step (non-finite values are left to ``nonfinite``).

    Args:
        series: the detector's ``series`` entries (validated by the spec).

    Example:
        >>> watch = SeriesWatch(["grad_norm"])
        >>> [(o.key, o.value) for o in watch.values(StepRecord(0, 0, scalars={"grad_norm": 2.0, "loss": 1.0}))]
        [(('', 'grad_norm', 'value', 0, 0), 2.0)]
    """

    def values(self, record: StepRecord) -> Iterator[Observed]:
        """The step's selected finite values: rows in record order, then scalars."""
        for row in record.rows:
            key = row.key
            for metric in self.metrics_for(key.family, key.name):
                value = row.values.get(metric)
                if value is None or not math.isfinite(value):
                    continue
                yield Observed((key.family, key.name, metric, key.vpp_stage, key.micro_step),
                               f"{describe(key.family, key.name, key.phase)} ({metric})", value, row)
        for name, value in record.scalars.items():
            if self.metrics_for("", name) and math.isfinite(value):
                yield Observed(("", name, "value", 0, 0), describe("scalars", name, ""), value, None)


def key_to_list(key: SeriesKey) -> list[object]:
    """A state key as JSON."""
    return list(key)


def key_from_list(data: object) -> SeriesKey:
    """A state key read back from :func:`key_to_list`.

    Raises:
        ValueError: not a 5-item list.
    """
    if not isinstance(data, (list, tuple)) or len(data) != 5:
        raise ValueError(f"corrupt series key {data!r}"[:200])
    family, name, metric, vpp_stage, micro_step = data
    return str(family), str(name), str(metric), int(vpp_stage), int(micro_step)
