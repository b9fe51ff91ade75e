"""``spike``: robust spike detection on chosen series (loss, grad norms, activation norms, ...).

Three methods, each per series and NaN-proof (a non-finite value is never fed to the state; the
``nonfinite`` detector reports it):

- ``ema``: exponentially weighted mean and variance; fires when ``|z| > threshold``.
- ``mad``: median and median absolute deviation of the last ``window`` values; robust z-score.
- ``relative``: msprobe ``AnomalyTurbulence``: fires when ``value > mean * (1 + threshold)``
  (``value < mean * (1 + threshold)`` for a non-positive mean), ``mean`` being the running mean
  of all earlier values, as msprobe computes it - except that NaN does not poison it.

For ``ema`` and ``mad`` a value that fires enters the state clipped to the threshold band
(winsorised), so one spike neither inflates the spread nor hides the next one, while a lasting
level shift is absorbed after a while.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import translate
from typing import Any

from trainmon.anomaly.detectors.base import Detector, row_event, scalar_event
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import describe, format_number
from trainmon.errors import ConfigError
from trainmon.records import FAMILIES, METRICS, StepRecord

_DEFAULT_THRESHOLD = {"ema": 6.0, "mad": 6.0, "relative": 0.5}
_DEFAULT_WARMUP = {"ema": 10, "mad": 10, "relative": 1}
_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass
class SpikeConfig:
    """Spec of the ``spike`` detector."""

    series: list[str] = field(default_factory=lambda: ["loss"])
    """Scalars by name (``loss``, ``grad_norm``, ``lr/group0``; globs allowed) or rows as
    ``family/name/metric`` (``grad_reduced/layers.*/norm``; name glob or ``re:`` regex)."""
    method: str = "ema"
    """ema, mad or relative (msprobe AnomalyTurbulence)."""
    threshold: float | None = None
    """z-score for ema/mad (default 6), relative rise for relative (default 0.5)."""
    warmup: int | None = None
    """Finite values a series must have seen before it may fire (default 10; 1 for relative)."""
    direction: str = "up"
    """up, down or both."""
    alpha: float = 0.1
    """ema: weight of the newest value."""
    window: int = 50
    """mad: number of recent values kept."""
    min_relative_change: float = 0.0
    """ema/mad: also require ``|value - baseline| > min_relative_change * |baseline|``."""


class _Selector:
    """One entry of ``series``: a scalar name pattern or a ``family/name/metric`` row pattern."""

    def __init__(self, text: str, path: str) -> None:
        head, _, rest = text.partition("/")
        self.family: str | None = None
        if head in FAMILIES:
            name, sep, metric = rest.rpartition("/")
            if not sep or not name or metric not in METRICS:
                raise ConfigError(path, f"row series must be 'family/name/metric' with a metric in "
                                        f"{list(METRICS)}, got {text!r}")
            self.family, self.metric = head, metric
            pattern = name
        else:
            self.metric = "value"
            pattern = text
        if not pattern:
            raise ConfigError(path, "must not be empty")
        try:
            self.regex = re.compile(pattern[3:]) if pattern.startswith("re:") else re.compile(translate(pattern))
        except re.error as exc:
            raise ConfigError(path, f"invalid regex {pattern[3:]!r}: {exc}") from None
        self.search = pattern.startswith("re:")

    def matches(self, name: str) -> bool:
        return bool(self.regex.search(name) if self.search else self.regex.fullmatch(name))


class _Series:
    """Running state of one series (never holds a non-finite value)."""

    __slots__ = ("count", "mean", "var", "window")

    def __init__(self, window: int) -> None:
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self.window: deque[float] = deque(maxlen=window)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "var": self.var, "window": list(self.window)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], window: int) -> _Series:
        series = cls(window)
        series.count, series.mean, series.var = int(data["count"]), float(data["mean"]), float(data["var"])
        series.window.extend(float(v) for v in data["window"])
        values = [series.mean, series.var, *series.window]
        if not all(math.isfinite(v) for v in values) or series.var < 0 or series.count < 0:
            raise ValueError(f"corrupt series state {dict(data)}")
        return series


class SpikeDetector(Detector):
    """Rolling z-score (EMA or median/MAD) or msprobe-style relative spike detection.

    Args:
        config: the detector's spec.

    Example:
        >>> from trainmon.records import StepRecord
        >>> d = SpikeDetector(SpikeConfig(series=["loss"], warmup=3))
        >>> [len(d.update(StepRecord(s, 0, scalars={"loss": v}), "")) for s, v in enumerate([1, 1.1, 0.9, 1, 9])]
        [0, 0, 0, 0, 1]
    """

    type_name = "spike"
    config_class = SpikeConfig
    choices = {"method": ("ema", "mad", "relative"), "direction": ("up", "down", "both")}
    minimum = {"threshold": 0.0, "warmup": 0, "alpha": 1e-6, "window": 3, "min_relative_change": 0.0}
    maximum = {"alpha": 1.0, "window": 10_000}  # a larger window only makes every step's median slower

    def __init__(self, config: SpikeConfig, path: str = "anomaly.detectors[0]") -> None:
        super().__init__(config)
        if config.alpha > 1:
            raise ConfigError(f"{path}.alpha", f"must be <= 1, got {config.alpha}")
        if not config.series:
            raise ConfigError(f"{path}.series", "must name at least one series")
        self.selectors = [_Selector(text, f"{path}.series[{i}]") for i, text in enumerate(config.series)]
        self.threshold = config.threshold if config.threshold is not None else _DEFAULT_THRESHOLD[config.method]
        self.warmup = config.warmup if config.warmup is not None else _DEFAULT_WARMUP[config.method]
        self.warmup = max(self.warmup, 1)  # a baseline needs at least one earlier value
        self.series: dict[tuple[str, str, str, int, int], _Series] = {}
        self._wanted: dict[tuple[str, str], list[str]] = {}  # (family, name) -> metrics (cache)

    # ----------------------------------------------------------------- selection
    def _metrics_for(self, family: str, name: str) -> list[str]:
        cached = self._wanted.get((family, name))
        if cached is None:
            cached = sorted({s.metric for s in self.selectors
                             if (s.family == family if family else s.family is None) and s.matches(name)})
            self._wanted[(family, name)] = cached
        return cached

    # ----------------------------------------------------------------- scoring
    def _check(self, state: _Series, value: float) -> tuple[bool, float, float]:
        """``(fires, baseline, score)``; updates ``state``."""
        method, threshold = self.config.method, self.threshold
        if method == "relative":
            baseline = state.mean
            fires = False
            if state.count >= self.warmup:
                up_bound = baseline + baseline * threshold
                rises = value > up_bound if baseline > 0 else value < up_bound
                low_bound = baseline - baseline * threshold
                drops = value < low_bound if baseline > 0 else value > low_bound
                direction = self.config.direction
                fires = (rises and direction != "down") or (drops and direction != "up")
            state.count += 1
            state.mean += (value - state.mean) / state.count  # msprobe: cumulative mean of all values
            score = (value - baseline) / abs(baseline) if baseline else math.inf
            return fires, baseline, score
        if method == "ema":
            baseline, spread = state.mean, math.sqrt(state.var)
        else:
            baseline = statistics.median(state.window) if state.window else 0.0
            spread = _MAD_TO_STD * statistics.median(abs(v - baseline) for v in state.window) if state.window else 0.0
        spread = max(spread, 1e-6 * abs(baseline), 1e-30)
        score = (value - baseline) / spread
        fires = False
        if state.count >= self.warmup:
            direction = self.config.direction
            fires = (score > threshold and direction != "down") or (score < -threshold and direction != "up")
            fires = fires and abs(value - baseline) > self.config.min_relative_change * abs(baseline)
        # Winsorise: a firing value enters the state at the edge of the threshold band.
        fed = min(max(value, baseline - threshold * spread), baseline + threshold * spread) if fires else value
        state.count += 1
        if method == "ema":
            alpha = max(self.config.alpha, 1.0 / state.count)  # plain average while warming up
            diff = fed - state.mean
            state.mean += alpha * diff
            state.var = (1 - alpha) * (state.var + alpha * diff * diff)
        else:
            state.window.append(fed)
        return fires, baseline, score

    def _observe(self, key: tuple[str, str, str, int, int], value: float) -> tuple[bool, float, float]:
        state = self.series.get(key)
        if state is None:
            state = self.series[key] = _Series(self.config.window)
        return self._check(state, value)

    def _message(self, where: str, step: int, value: float, baseline: float, score: float) -> str:
        kind = "relative change" if self.config.method == "relative" else "z"
        return (f"{self.type_name}: {where} at step {step} is {format_number(value)}, baseline "
                f"{format_number(baseline)} ({kind}={format_number(score)}, threshold {format_number(self.threshold)})")

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        events: list[AnomalyEvent] = []
        for row in record.rows:
            key = row.key
            for metric in self._metrics_for(key.family, key.name):
                value = row.values.get(metric)
                if value is None or not math.isfinite(value):
                    continue
                fires, baseline, score = self._observe((key.family, key.name, metric, key.vpp_stage,
                                                        key.micro_step), value)
                if fires:
                    where = f"{describe(key.family, key.name, key.phase)} ({metric})"
                    events.append(row_event(record, row, metric=metric, value=value, baseline=baseline,
                                            detector=self.type_name, time=time,
                                            message=self._message(where, record.step, value, baseline, score)))
        for name, value in record.scalars.items():
            if not self._metrics_for("", name) or not math.isfinite(value):
                continue
            fires, baseline, score = self._observe(("", name, "value", 0, 0), value)
            if fires:
                events.append(scalar_event(record, name, value=value, baseline=baseline, detector=self.type_name,
                                           time=time, message=self._message(describe("scalars", name, ""),
                                                                            record.step, value, baseline, score)))
        return events

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"series": [[list(key), state.to_dict()] for key, state in self.series.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        series: dict[tuple[str, str, str, int, int], _Series] = {}
        for key, data in state.get("series", []):
            family, name, metric, vpp_stage, micro_step = key
            series[(str(family), str(name), str(metric), int(vpp_stage), int(micro_step))] = \
                _Series.from_dict(data, self.config.window)
        self.series = series
