"""``loss_spike``: the loss against its short recent level, scaled by its step-to-step noise.

A long-window median lags a loss that still falls fast (a 4x jump can stay below the median of the
last 50 losses), and a z-score on raw values fires late in training, where the loss is tiny and
its relative noise large. So this preset works on the log of the loss:

- ``level``: the median of the last ``level_window`` losses (a few steps: it follows the trend);
- ``spread``: the robust standard deviation of the loss around its level, estimated from the
  log-ratios of consecutive losses over the last ``window`` steps (``1.4826 * MAD / sqrt(2)``:
  consecutive ratios hold the noise of two losses), never below ``min_spread``;
- fires when ``|log(loss / level)| > threshold * spread`` **and** the loss differs from its level by
  at least the factor ``1 + min_relative_change`` (2x by default), in the configured direction.

Scale-free: the same settings work at loss 5 and at loss 1e-3. A firing value enters the state
clipped to the threshold band, so one spike neither inflates the spread nor hides the next one.
NaN, Inf and non-positive losses are skipped (the ``nonfinite`` detector reports the former).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainmon.anomaly.detectors.base import Detector, scalar_event
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import format_number
from trainmon.errors import ConfigError
from trainmon.records import StepRecord

_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation
_SERIES = "loss"


@dataclass
class LossSpikeConfig:
    """Spec of the ``loss_spike`` preset (log-loss against its recent level, upward by default)."""

    threshold: float = 6.0
    """Robust z-score of ``log(loss / level)`` the loss must exceed."""
    min_relative_change: float = 1.0
    """The loss must also differ from its level by the factor ``1 + this`` (1.0: twice, or half going down)."""
    warmup: int = 10
    """Losses seen before it may fire."""
    window: int = 50
    """Consecutive log-ratios the noise (spread) is estimated over."""
    level_window: int = 7
    """Recent losses whose median is the level a new loss is compared with."""
    min_spread: float = 0.02
    """Floor of the spread in log units (0.02: the loss is never assumed steadier than about 2%)."""
    direction: str = "up"
    """up, down or both."""


class LossSpikeDetector(Detector):
    """Loss spikes: fires when the loss is far from (robust z > 6) and at least twice its median of the
    last 7 steps, the noise measured from the step-to-step log-ratios of the last 50, after 10 steps.

    Example:
        >>> d = LossSpikeDetector(LossSpikeConfig(warmup=3))
        >>> [len(d.update(StepRecord(s, 0, scalars={"loss": v}), "")) for s, v in enumerate([2, 2.1, 1.9, 2, 8])]
        [0, 0, 0, 0, 1]
    """

    type_name = "loss_spike"
    config_class = LossSpikeConfig
    choices = {"direction": ("up", "down", "both")}
    minimum = {"threshold": 0.0, "warmup": 0, "window": 3, "level_window": 1, "min_relative_change": 0.0,
               "min_spread": 0.0}
    maximum = {"window": 10_000, "level_window": 10_000}  # larger windows only make every step's median slower

    def __init__(self, config: LossSpikeConfig, path: str = "anomaly.detectors[0]") -> None:
        super().__init__(config)
        if not config.min_spread > 0:
            raise ConfigError(f"{path}.min_spread", f"must be > 0, got {config.min_spread}")
        self.count = 0
        self.values: deque[float] = deque(maxlen=config.level_window)  # recent losses (as fed), > 0
        self.log_ratios: deque[float] = deque(maxlen=config.window)  # log(loss[t] / loss[t-1])

    def _score(self, value: float) -> tuple[bool, float, float, float]:
        """``(fires, level, z, spread)`` of a positive finite loss against the current state."""
        config = self.config
        if not self.values:
            return False, math.nan, 0.0, 0.0
        level = statistics.median(self.values)
        if len(self.log_ratios) < 2:
            return False, level, 0.0, 0.0
        center = statistics.median(self.log_ratios)
        mad = statistics.median(abs(r - center) for r in self.log_ratios)
        spread = max(_MAD_TO_STD * mad / math.sqrt(2.0), config.min_spread)
        distance = math.log(value / level)
        score = distance / spread
        fires = False
        if self.count >= config.warmup and abs(distance) > math.log1p(config.min_relative_change):
            fires = ((score > config.threshold and config.direction != "down")
                     or (score < -config.threshold and config.direction != "up"))
        return fires, level, score, spread

    def _feed(self, value: float, fires: bool, level: float, score: float, spread: float) -> None:
        if fires:  # winsorise: the spike enters at the edge of the threshold band
            value = level * math.exp(math.copysign(self.config.threshold * spread, score))
        if self.values:
            self.log_ratios.append(math.log(value / self.values[-1]))
        self.values.append(value)
        self.count += 1

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        value = record.scalars.get(_SERIES)
        if value is None or not math.isfinite(value) or value <= 0:
            return []
        fires, level, score, spread = self._score(value)
        self._feed(value, fires, level, score, spread)
        if not fires:
            return []
        message = (f"loss_spike: loss at step {record.step} is {format_number(value)}, {format_number(value / level)}x "
                   f"its recent level {format_number(level)} (z={format_number(score)}, threshold "
                   f"{format_number(self.config.threshold)})")
        return [scalar_event(record, _SERIES, value=value, baseline=level, detector=self.type_name,
                             message=message, time=time)]

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "values": list(self.values), "log_ratios": list(self.log_ratios)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        count = int(state["count"])
        values = [float(v) for v in state["values"]]
        log_ratios = [float(r) for r in state["log_ratios"]]
        if count < 0 or not all(math.isfinite(v) and v > 0 for v in values) \
                or not all(math.isfinite(r) for r in log_ratios):
            raise ValueError(f"corrupt loss_spike state {dict(state)}")
        self.count = count
        self.values = deque(values, maxlen=self.config.level_window)
        self.log_ratios = deque(log_ratios, maxlen=self.config.window)
