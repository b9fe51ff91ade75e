"""``spike``: robust spike detection on chosen series (loss, grad norms, activation norms, ...).

Four methods, each per series and NaN-proof (a non-finite value is never fed to the state; the
``nonfinite`` detector reports it):

- ``log``: ``loss_spike``'s noise and range rules (:mod:`trainmon.anomaly.detectors.loss_spike`) on
  any positive series: scale-free, for gradient and activation norms (non-positive values are
  skipped). With ``persist: 3`` single-step outliers (one odd batch) are ignored and a norm that keeps
  growing fires on its third step out of band: the per-layer early warning of docs/anomaly.md.
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
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from trainmon.anomaly.detectors.base import Detector, off_or_above_one, row_event, scalar_event
from trainmon.anomaly.detectors.loss_spike import DIRECTIONS, MAX_WINDOW, LogLevelSeries, LogRules, describe_verdict
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import describe, format_number
from trainmon.base.records import StepRecord, metrics_of, split_row_series
from trainmon.base.schema import setting
from trainmon.base.targets import compile_pattern
from trainmon.errors import ConfigError

_DEFAULT_THRESHOLD = {"ema": 6.0, "mad": 6.0, "relative": 0.5, "log": 6.0}
_DEFAULT_WARMUP = {"ema": 10, "mad": 10, "relative": 1, "log": 10}
_DEFAULT_RELATIVE_CHANGE = {"ema": 0.0, "mad": 0.0, "relative": 0.0, "log": 1.0}
METHODS: tuple[str, ...] = ("ema", "mad", "relative", "log")
_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation


class SeriesSelector:
    """One entry of ``series``: a scalar name pattern or a ``family/name/metric`` row pattern."""

    def __init__(self, text: str, path: str) -> None:
        row = split_row_series(text)
        self.family: str | None = None
        self.metric = "value"
        pattern = text
        if row is not None:
            self.family, pattern, self.metric = row
            if not pattern or self.metric not in metrics_of(self.family):
                raise ConfigError(path, f"row series must be 'family/name/metric' with a metric of {self.family} in "
                                        f"{list(metrics_of(self.family))}, got {text!r}")
        self.pattern = compile_pattern(pattern, path)

    def matches(self, name: str) -> bool:
        return self.pattern.matches(name)


class SeriesSelection:
    """What a detector's ``series`` select: the metrics of each row or scalar, cached by ``(family, name)``.

    Example:
        >>> SeriesSelection(["grad_reduced/*/norm", "loss"]).metrics_for("grad_reduced", "fc.weight")
        ['norm']
    """

    def __init__(self, series: list[str]) -> None:
        self.selectors = [SeriesSelector(text, f"series[{i}]") for i, text in enumerate(series)]
        self._wanted: dict[tuple[str, str], list[str]] = {}  # (family, name) -> metrics (cache)

    def metrics_for(self, family: str, name: str) -> list[str]:
        """The metrics of a row (``family`` ``""``: a scalar) that the series select."""
        cached = self._wanted.get((family, name))
        if cached is None:
            cached = sorted({s.metric for s in self.selectors
                             if (s.family == family if family else s.family is None) and s.matches(name)})
            self._wanted[(family, name)] = cached
        return cached


def check_series(series: list[str], path: str) -> None:
    """The ``series`` rule: at least one, each a valid selector (:class:`SeriesSelector`)."""
    if not series:
        raise ConfigError(path, "must name at least one series")
    for i, text in enumerate(series):
        SeriesSelector(text, f"{path}[{i}]")


@dataclass
class SpikeConfig:
    """Spec of the ``spike`` detector."""

    series: list[str] = setting(["loss"], check=check_series)
    """Scalars by name (``loss``, ``grad_norm``, ``lr/group0``; globs allowed) or rows as
    ``family/name/metric`` (``grad_reduced/layers.*/norm``, ``precursors/layers.*/g2_v_rms``; name glob or
    ``re:`` regex)."""
    method: str = setting("ema", choices=METHODS)
    """ema, mad, log (loss_spike's rules on any positive series) or relative (msprobe AnomalyTurbulence)."""
    threshold: float | None = setting(None, minimum=0.0)
    """z-score for ema/mad/log (default 6), relative rise for relative (default 0.5)."""
    warmup: int | None = setting(None, minimum=0)
    """Finite values a series must have seen before it may fire (default 10; 1 for relative)."""
    direction: str = setting("up", choices=DIRECTIONS)
    """up, down or both."""
    alpha: float = setting(0.1, minimum=1e-6, maximum=1.0)
    """ema: weight of the newest value."""
    window: int = setting(50, minimum=3, maximum=MAX_WINDOW)
    """mad: number of recent values kept; log: consecutive log-ratios the noise is estimated over."""
    min_relative_change: float | None = setting(None, minimum=0.0)
    """ema/mad: also require ``|value - baseline| > min_relative_change * |baseline|`` (default 0);
    log: the noise rule's factor ``1 + this`` between a value and its level (default 1.0: 2x)."""
    level_window: int = setting(7, minimum=1, maximum=MAX_WINDOW)
    """log: recent values whose median is the level."""
    range_factor: float = setting(2.0, minimum=0.0, check=off_or_above_one)
    """log: fires when a value is more than this times the largest of the ``range_window`` values before
    the level window (less than their smallest over this, going down); 0 turns the range rule off."""
    range_window: int = setting(100, minimum=1, maximum=MAX_WINDOW)
    """log: values the range rule compares with; also the length of the young phase (jumps of
    3x, or 1 + min_relative_change when larger)."""
    persist: int = setting(1, minimum=1, maximum=MAX_WINDOW)
    """log: fire only when this many values in a row are out of band (the earlier ones are held back
    from the state meanwhile): 3 ignores one-step outliers and still catches a growing norm."""


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


class SpikeDetector(Detector[SpikeConfig]):
    """Rolling z-score (EMA or median/MAD), loss_spike's log-level rules, or msprobe-style relative
    spike detection.

    Args:
        config: the detector's spec.

    Example:
        >>> from trainmon.base.records import StepRecord
        >>> d = SpikeDetector(SpikeConfig(series=["loss"], warmup=3))
        >>> [len(d.update(StepRecord(s, 0, scalars={"loss": v}), "")) for s, v in enumerate([1, 1.1, 0.9, 1, 9])]
        [0, 0, 0, 0, 1]
    """

    type_name = "spike"
    config_class = SpikeConfig

    def __init__(self, config: SpikeConfig) -> None:
        super().__init__(config)
        self._metrics_for = SeriesSelection(config.series).metrics_for
        self.threshold = config.threshold if config.threshold is not None else _DEFAULT_THRESHOLD[config.method]
        self.warmup = config.warmup if config.warmup is not None else _DEFAULT_WARMUP[config.method]
        self.warmup = max(self.warmup, 1)  # a baseline needs at least one earlier value
        self.min_relative_change = (config.min_relative_change if config.min_relative_change is not None
                                    else _DEFAULT_RELATIVE_CHANGE[config.method])
        self.rules = LogRules(threshold=self.threshold, min_relative_change=self.min_relative_change,
                              warmup=self.warmup, window=config.window, level_window=config.level_window,
                              range_factor=config.range_factor, range_window=config.range_window,
                              trend_factor=0.0, persist=config.persist, direction=config.direction,
                              # the young phase is never less strict than the rest of the run
                              early_relative_change=max(LogRules.early_relative_change, self.min_relative_change))
        self.series: dict[tuple[str, str, str, int, int], _Series | LogLevelSeries] = {}

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
            fires = fires and abs(value - baseline) > self.min_relative_change * abs(baseline)
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

    def _observe(self, key: tuple[str, str, str, int, int], value: float, where: str,
                 step: int) -> tuple[float, str] | None:
        """``(baseline, message)`` when ``value`` fires, else None; updates the series' state."""
        # One method per detector: every series holds the state of that method.
        if self.config.method == "log":
            if value <= 0:
                return None  # no log level for it; not fed
            levels = cast("LogLevelSeries | None", self.series.get(key))
            if levels is None:
                levels = self.series[key] = LogLevelSeries(self.rules)
            verdict = levels.observe(value)
            if not verdict.rule:
                return None
            return verdict.level, f"{self.type_name} (log, {verdict.rule}): " + describe_verdict(
                where, step, value, verdict, self.rules)
        state = cast("_Series | None", self.series.get(key))
        if state is None:
            state = self.series[key] = _Series(self.config.window)
        fires, baseline, score = self._check(state, value)
        if not fires:
            return None
        kind = "relative change" if self.config.method == "relative" else "z"
        return baseline, (f"{self.type_name}: {where} at step {step} is {format_number(value)}, baseline "
                          f"{format_number(baseline)} ({kind}={format_number(score)}, threshold "
                          f"{format_number(self.threshold)})")

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        events: list[AnomalyEvent] = []
        for row in record.rows:
            key = row.key
            for metric in self._metrics_for(key.family, key.name):
                value = row.values.get(metric)
                if value is None or not math.isfinite(value):
                    continue
                where = f"{describe(key.family, key.name, key.phase)} ({metric})"
                fired = self._observe((key.family, key.name, metric, key.vpp_stage, key.micro_step), value,
                                      where, record.step)
                if fired:
                    events.append(row_event(record, row, metric=metric, value=value, baseline=fired[0],
                                            detector=self.type_name, time=time, message=fired[1]))
        for name, value in record.scalars.items():
            if not self._metrics_for("", name) or not math.isfinite(value):
                continue
            fired = self._observe(("", name, "value", 0, 0), value, describe("scalars", name, ""), record.step)
            if fired:
                events.append(scalar_event(record, name, value=value, baseline=fired[0], detector=self.type_name,
                                           time=time, message=fired[1]))
        return events

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"series": [[list(key), state.to_dict()] for key, state in self.series.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        series: dict[tuple[str, str, str, int, int], _Series | LogLevelSeries] = {}
        for key, data in state.get("series", []):
            family, name, metric, vpp_stage, micro_step = key
            series[(str(family), str(name), str(metric), int(vpp_stage), int(micro_step))] = (
                LogLevelSeries.from_dict(data, self.rules) if self.config.method == "log"
                else _Series.from_dict(data, self.config.window))
        self.series = series
