"""``growth``: a positive series that climbs steadily over a long window (attention logits, a gradient norm).

A spike rule compares each value with its recent level, so a series that doubles over a hundred steps never
looks out of band: its level follows it. This detector looks at the shape of the window instead. The last
``window`` values are cut into ``blocks`` consecutive blocks; the series **climbs** when every block's median is
above the one before by at least ``factor ** (1 / (2 * (blocks - 1)))`` (half the even share of the rise) and
the last block's median is at least ``factor`` times the first's. Medians of blocks ignore single odd values
(one batch), and the block-after-block rise tells a climb from a level shift: a series that jumps once and stays
has flat blocks on both sides of the jump, which the rule refuses however large the jump (``spike`` reports
those).

Each series fires once per rise: after an alarm it fires again only once its last block's median is ``factor``
times the one that fired (or after it fell back below it). ``persist`` asks the climb to hold that many values
in a row; ``min_value`` ignores climbs that end below an absolute level (a series that grows from a small start,
as attention logits do early in training). Values that are not finite or not positive are skipped (not fed).
``reduce: max`` watches one series instead of each: the largest selected value of every step (a model's largest
attention logit, whichever head holds it; one head that triples while the largest barely moves, a head catching
up with the others, is not a climb of the model's logits).

Cost per selected series and collected step: ``blocks`` medians of ``window / blocks`` values (14-40 us measured on
the 2-core development machine under load, 100 series, windows of 100 and 40).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
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

REDUCTIONS: tuple[str, ...] = ("none", "max")
_LARGEST: SeriesKey = ("*", "max", "value", 0, 0)
"""The state key of the one series of ``reduce: max`` (no family is named ``*``)."""


@dataclass
class GrowthConfig:
    """Spec of the ``growth`` detector: a steady climb of a positive series over ``window`` values."""

    series: list[str] = setting(["loss"], check=check_series)
    """Scalars by name (``grad_norm``; globs allowed) or rows as ``family/name/metric`` (``attn/*/max_logit``)."""
    window: int = setting(100, minimum=4, maximum=MAX_WINDOW)
    """Values the climb is measured over (the last ``blocks * (window // blocks)`` of them)."""
    blocks: int = setting(4, minimum=2, maximum=100)
    """Consecutive blocks of the window whose medians must rise block after block."""
    factor: float = setting(2.0, above=1.0)
    """The last block's median over the first block's median that fires (2.0: doubled within the window)."""
    persist: int = setting(1, minimum=1, maximum=MAX_WINDOW)
    """Values in a row the climb must hold before it fires."""
    min_value: float = setting(0.0, minimum=0.0)
    """Fires only when the last block's median is above this absolute level (0: any level)."""
    warmup: int = setting(0, minimum=0)
    """Values a series must have seen before it may fire (it needs a full window anyway)."""
    reduce: str = setting("none", choices=REDUCTIONS)
    """none: each selected series climbs on its own; max: the largest selected value of each step is one series
    (the event names the row or scalar that held it)."""

    def cross_check(self, path: str) -> None:
        """``window`` holds at least 2 values per block."""
        if self.window // self.blocks < 2:
            where = f"{path}.blocks" if path else "blocks"
            raise ConfigError(where, f"must leave at least 2 values per block of the window ({self.window}), "
                                     f"got {self.blocks}")


class _Climb:
    """The state of one series: its last values, the current run of climbing values and the level that fired."""

    __slots__ = ("count", "fired_at", "streak", "values")

    def __init__(self, kept: int) -> None:
        self.values: deque[float] = deque(maxlen=kept)
        self.count = 0
        self.streak = 0
        self.fired_at = 0.0  # last block's median when it last fired (0: armed)

    def to_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "count": self.count, "streak": self.streak, "fired_at": self.fired_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], kept: int) -> _Climb:
        state = cls(kept)
        values = [float(v) for v in data["values"]]
        state.count, state.streak, state.fired_at = int(data["count"]), int(data["streak"]), float(data["fired_at"])
        if not all(math.isfinite(v) and v > 0 for v in values) or not math.isfinite(state.fired_at) \
                or state.count < 0 or state.streak < 0 or state.fired_at < 0:
            raise ValueError(f"corrupt growth state {dict(data)}"[:300])
        state.values.extend(values)
        return state


class GrowthDetector(Detector[GrowthConfig]):
    """Fires when a positive series climbs block after block to ``factor`` times its level of ``window`` values
    before (see the module).

    Example:
        >>> d = GrowthDetector(GrowthConfig(series=["grad_norm"], window=8, blocks=4, factor=2.0))
        >>> fired = [len(d.update(StepRecord(s, 0, scalars={"grad_norm": 1.2 ** s}), "")) for s in range(12)]
        >>> fired.index(1), sum(fired)  # 1.2^6.5 / 1.2^0.5 at step 7, then once per doubling
        (7, 2)
    """

    type_name = "growth"
    config_class = GrowthConfig

    def __init__(self, config: GrowthConfig) -> None:
        super().__init__(config)
        self.watch = SeriesWatch(config.series)
        self.block = config.window // config.blocks
        self.kept = self.block * config.blocks
        self.step_rise = config.factor ** (1.0 / (2 * (config.blocks - 1)))
        self.series: dict[SeriesKey, _Climb] = {}

    def _medians(self, values: deque[float]) -> list[float]:
        ordered = list(values)
        return [statistics.median(ordered[i:i + self.block]) for i in range(0, self.kept, self.block)]

    def _observe(self, key: SeriesKey, value: float) -> list[float] | None:
        """The block medians when ``value`` fires, else None; feeds the state."""
        state = self.series.get(key)
        if state is None:
            state = self.series[key] = _Climb(self.kept)
        state.values.append(value)
        state.count += 1
        if len(state.values) < self.kept:
            return None
        config = self.config
        medians = self._medians(state.values)
        last = medians[-1]
        if state.fired_at and last < state.fired_at:
            state.fired_at = 0.0  # fell back below the level that fired: armed again
        climbing = (state.count > config.warmup and last > config.min_value and last >= config.factor * medians[0]
                    and all(b >= a * self.step_rise for a, b in zip(medians, medians[1:]))
                    and (not state.fired_at or last >= config.factor * state.fired_at))
        state.streak = state.streak + 1 if climbing else 0
        if state.streak < config.persist:
            return None
        state.streak = 0
        state.fired_at = last
        return medians

    def _message(self, where: str, step: int, medians: list[float]) -> str:
        rise = " -> ".join(format_number(m) for m in medians)
        return (f"{self.type_name}: {where} at step {step} climbed block after block over its last {self.kept} "
                f"values (block medians {rise}: {format_number(medians[-1] / medians[0])}x, factor "
                f"{format_number(self.config.factor)})")

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        events: list[AnomalyEvent] = []
        watched = [(seen.key, seen.where, seen) for seen in self.watch.values(record) if seen.value > 0]
        if self.config.reduce == "max" and watched:
            largest = max((seen for *_, seen in watched), key=lambda seen: seen.value)
            watched = [(_LARGEST, f"the largest of {', '.join(self.config.series)} (now {largest.where})", largest)]
        for key, where, seen in watched:
            medians = self._observe(key, seen.value)
            if medians is None:
                continue
            message = self._message(where, record.step, medians)
            if seen.row is None:
                events.append(scalar_event(record, seen.key[1], value=seen.value, baseline=medians[0],
                                           detector=self.type_name, message=message, time=time))
            else:
                events.append(row_event(record, seen.row, metric=seen.key[2], value=seen.value,
                                        baseline=medians[0], detector=self.type_name, message=message, time=time))
        return events

    def state_dict(self) -> dict[str, Any]:
        return {"series": [[key_to_list(key), state.to_dict()] for key, state in self.series.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.series = {key_from_list(key): _Climb.from_dict(data, self.kept) for key, data in state.get("series", [])}
