"""``level``: a series past an absolute threshold for ``persist`` values in a row.

For quantities whose scale is known and whose normal value may be exactly 0, where a relative rule has no
reference: the fraction of Adam's elements whose ``sqrt(v)`` fell under ``eps`` (``precursors/*/eps_underflow``,
0 in healthy training), an attention logit beyond what softmax can still spread over keys. A z-score of a
constant 0 is 0/0 and a ratio to 0 fires on everything; a level is what such a series says.

It fires once per excursion: on the ``persist``-th value in a row past ``threshold``, then not again until a
value is back on the quiet side. With ``from_below`` (the default) a series must first be seen on the quiet side
after ``warmup``: a tensor that sits past the threshold from its first value on (an embedding whose unused rows
never get a gradient, all of them under ``eps``) is past it by its nature, not by a fault. Non-finite values
are skipped (``nonfinite`` reports them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainmon.anomaly.detectors.base import Detector, row_event, scalar_event
from trainmon.anomaly.detectors.loss_spike import MAX_WINDOW
from trainmon.anomaly.detectors.spike import check_series
from trainmon.anomaly.detectors.watch import SeriesKey, SeriesWatch, key_from_list, key_to_list
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import format_number
from trainmon.base.records import StepRecord
from trainmon.base.schema import setting
from trainmon.errors import ConfigError

LEVEL_DIRECTIONS: tuple[str, ...] = ("up", "down")


@dataclass
class LevelConfig:
    """Spec of the ``level`` detector: a series past an absolute ``threshold`` for ``persist`` values in a row."""

    series: list[str] = setting(["loss"], check=check_series)
    """Scalars by name or rows as ``family/name/metric`` (``precursors/*/eps_underflow``)."""
    threshold: float | None = setting(None)
    """The absolute level (required): ``up`` fires above it, ``down`` below it."""
    direction: str = setting("up", choices=LEVEL_DIRECTIONS)
    """up (values above ``threshold`` are out) or down (values below it are)."""
    persist: int = setting(3, minimum=1, maximum=MAX_WINDOW)
    """Values in a row past the threshold before it fires."""
    warmup: int = setting(0, minimum=0)
    """Values a series must have seen before a value counts (on either side)."""
    from_below: bool = True
    """Fire only on a series seen on the quiet side after ``warmup`` (a series past the threshold from the start
    is left alone)."""
    note: str = ""
    """Said after the event's message: what being past the level means (the default on ``grad_norm`` says what a
    zero gradient comes from)."""

    def cross_check(self, path: str) -> None:
        """``threshold`` is given and finite."""
        where = f"{path}.threshold" if path else "threshold"
        if self.threshold is None:
            raise ConfigError(where, "is required for a level detector (the absolute level, e.g. 0.5)")
        if self.threshold != self.threshold or abs(self.threshold) == float("inf"):
            raise ConfigError(where, f"must be finite, got {self.threshold}")


class LevelDetector(Detector[LevelConfig]):
    """Fires when a series stays past an absolute threshold ``persist`` values in a row, once per excursion.

    Example:
        >>> d = LevelDetector(LevelConfig(series=["grad_norm"], threshold=1.0, persist=2))
        >>> [len(d.update(StepRecord(s, 0, scalars={"grad_norm": v}), "")) for s, v in enumerate([0, 2, 0, 2, 2, 2])]
        [0, 0, 0, 0, 1, 0]
    """

    type_name = "level"
    config_class = LevelConfig

    def __init__(self, config: LevelConfig) -> None:
        super().__init__(config)
        self.watch = SeriesWatch(config.series)
        assert config.threshold is not None  # cross_check
        self.threshold: float = config.threshold
        # per series: [values seen, values past in a row (-1: not armed yet), fired in this excursion (0/1)]
        self.series: dict[SeriesKey, list[int]] = {}

    def _past(self, value: float) -> bool:
        return value > self.threshold if self.config.direction == "up" else value < self.threshold

    def _observe(self, key: SeriesKey, value: float) -> bool:
        state = self.series.get(key)
        if state is None:
            state = self.series[key] = [0, 0 if not self.config.from_below else -1, 0]
        state[0] += 1
        if state[0] <= self.config.warmup:
            return False
        if not self._past(value):
            state[1], state[2] = 0, 0  # armed (again): the next excursion may fire
            return False
        if state[1] < 0 or state[2]:
            return False  # never seen on the quiet side, or this excursion already fired
        state[1] += 1
        if state[1] < self.config.persist:
            return False
        state[2] = 1
        return True

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        events: list[AnomalyEvent] = []
        side = "above" if self.config.direction == "up" else "below"
        for seen in self.watch.values(record):
            if not self._observe(seen.key, seen.value):
                continue
            message = (f"{self.type_name}: {seen.where} at step {record.step} is {format_number(seen.value)}, {side} "
                       f"{format_number(self.threshold)} for {self.config.persist} values in a row"
                       + (f": {self.config.note}" if self.config.note else ""))
            if seen.row is None:
                events.append(scalar_event(record, seen.key[1], value=seen.value, baseline=self.threshold,
                                           detector=self.type_name, message=message, time=time))
            else:
                events.append(row_event(record, seen.row, metric=seen.key[2], value=seen.value,
                                        baseline=self.threshold, detector=self.type_name, message=message, time=time))
        return events

    def state_dict(self) -> dict[str, Any]:
        return {"series": [[key_to_list(key), list(state)] for key, state in self.series.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        series: dict[SeriesKey, list[int]] = {}
        for key, data in state.get("series", []):
            if not isinstance(data, (list, tuple)) or len(data) != 3:
                raise ValueError(f"corrupt level state {data!r}"[:200])
            series[key_from_list(key)] = [int(v) for v in data]
        self.series = series
