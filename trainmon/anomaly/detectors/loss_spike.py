"""``loss_spike``: the loss against its recent level, its step-to-step noise and its recent range.

A long-window median lags a loss that still falls fast (a 4x jump can stay below the median of the
last 50 losses), and a z-score on raw values fires late in training, where the loss is tiny and
its relative noise large. So this preset works on the log of the loss, with three rules:

- **noise**: ``|log(loss / level)| > threshold * spread`` and the loss differs from its level by at
  least the factor ``1 + min_relative_change``. ``level`` is the median of the last ``level_window``
  losses (a few steps: it follows the trend); ``spread`` the robust standard deviation of the loss
  around it, from the log-ratios of consecutive losses over the last ``window`` steps
  (``1.4826 * MAD / sqrt(2)``: consecutive ratios hold the noise of two losses), at least ``min_spread``.
- **range**: the loss is more than ``range_factor`` times the largest of the ``range_window`` losses
  before the level window (below their smallest divided by it, going down). The spread of
  step-to-step ratios overstates how far a small-batch loss strays upwards (its log is skewed down);
  the range measures that tail directly. Leaving out the last ``level_window`` losses lets a steady
  rise leave the range too.
- **trend** (upward only): the mean of the last ``window`` losses rose above ``trend_factor`` (3) times
  its lowest value over the last ``trend_window`` steps: a slow divergence that each step hides
  from the other rules. It fires once per such rise (the reference restarts from the new level). The
  mean, not the median: a small batch's loss is bimodal (batches with and without a wrong label), and
  its median of 50 jumps 2-4x when the share of batches with one crosses a half; its mean moves with
  the expected loss. 3x: data that gets harder doubles a healthy loss within 200 steps.

A young run (its first ``range_window`` losses) has no range yet and a noise estimate that may have
seen only a smooth descent, so the range rule waits and the noise rule needs the factor
``1 + early_relative_change`` (3x). Tuned and checked on ``benchmarks/anomaly_detectors.py``
(docs/anomaly.md has the table).

Scale-free: the same settings work at loss 5 and at loss 1e-3. A value that fires the noise or
range rule enters the state clipped to the largest (smallest) value that would not have fired, so
one spike neither inflates the spread or range nor hides the next one, while a lasting level shift
is absorbed. NaN, Inf and non-positive values are skipped (the ``nonfinite`` detector reports the
former). :class:`LogLevelSeries` holds the state of one series; the ``spike`` detector's
``method: log`` applies the noise and range rules to any positive series (gradient norms).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from trainmon.anomaly.detectors.base import Detector, off_or_above_one, scalar_event
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import format_number
from trainmon.base.records import StepRecord
from trainmon.base.schema import setting

DIRECTIONS: tuple[str, ...] = ("up", "down", "both")
MAX_WINDOW = 10_000
"""Largest window of the log-level rules: a larger one only makes every step's median slower."""

_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation
_SERIES = "loss"


@dataclass(frozen=True)
class LogRules:
    """The settings :class:`LogLevelSeries` scores with (the fields of :class:`LossSpikeConfig`, plus
    ``persist``: out-of-band values in a row needed before one fires)."""

    threshold: float = 6.0
    min_relative_change: float = 0.5
    warmup: int = 10
    window: int = 50
    level_window: int = 7
    min_spread: float = 0.02
    range_factor: float = 1.5
    range_window: int = 100
    trend_factor: float = 3.0
    trend_window: int = 200
    early_relative_change: float = 2.0
    persist: int = 1
    direction: str = "up"


@dataclass
class Verdict:
    """What one value did: ``rule`` is ``noise``, ``range``, ``trend`` or ``""`` (no alarm);
    ``baseline`` is what it was compared with (the level, the range's edge, the lowest level)."""

    rule: str
    level: float
    score: float
    baseline: float


class LogLevelSeries:
    """The state of one positive series (never holds a non-finite or non-positive value)."""

    __slots__ = ("count", "levels", "log_ratios", "rules", "streak", "values")

    def __init__(self, rules: LogRules) -> None:
        self.rules = rules
        self.count = 0
        self.streak = 0  # consecutive out-of-band values: > 0 above, < 0 below
        kept = max(rules.level_window + (rules.range_window if rules.range_factor else 0),
                   rules.window if rules.trend_factor else 1)
        self.values: deque[float] = deque(maxlen=kept)  # recent values as fed
        self.log_ratios: deque[float] = deque(maxlen=rules.window)  # log(value[t] / value[t-1])
        self.levels: deque[float] = deque(maxlen=rules.trend_window if rules.trend_factor else 1)

    def _median_of_last(self, n: int) -> float:
        values = self.values
        return statistics.median(values if len(values) <= n else list(values)[-n:])

    @staticmethod
    def _spread(ratios: Sequence[float]) -> float:
        center = statistics.median(ratios)
        return _MAD_TO_STD * statistics.median(abs(r - center) for r in ratios) / math.sqrt(2.0)

    def observe(self, value: float) -> Verdict:
        """Score a positive finite ``value`` against the state, then feed it."""
        rules = self.rules
        if len(self.log_ratios) < 2:
            verdict = Verdict("", self._median_of_last(rules.level_window) if self.values else math.nan, 0.0, math.nan)
            self._feed(value)
            return verdict
        level = self._median_of_last(rules.level_window)
        spread = max(self._spread(self.log_ratios), rules.min_spread)
        score = math.log(value / level) / spread
        young = self.count < rules.range_window
        factor = 1 + (rules.early_relative_change if young else rules.min_relative_change)
        band = math.exp(max(rules.threshold * spread, math.log(factor)))
        upper, lower = level * band, level / band  # the quiet band of the noise rule
        high = low = math.nan
        if rules.range_factor and not young and len(self.values) > rules.level_window:
            older = list(self.values)[-(rules.range_window + rules.level_window):-rules.level_window]
            high, low = max(older), min(older)
            upper, lower = min(upper, high * rules.range_factor), max(lower, low / rules.range_factor)
        rule, baseline, side = "", level, 0
        if self.count >= rules.warmup:
            if value > upper and rules.direction != "down":
                rule, baseline, side = ("noise", level, 1) if value > level * band else ("range", high, 1)
            elif value < lower and rules.direction != "up":
                rule, baseline, side = ("noise", level, -1) if value < level / band else ("range", low, -1)
        self.streak = self.streak + side if side and self.streak * side > 0 else side
        if rule and abs(self.streak) < rules.persist:
            return Verdict("", level, score, baseline)  # held back (not fed) until persist in a row
        self._feed(min(max(value, lower), upper) if rule else value)  # winsorised: the edge of the quiet band
        if not rule and rules.trend_factor and self.count > rules.warmup and rules.direction != "down":
            new_level, lowest = self.levels[-1], min(self.levels)
            if new_level > rules.trend_factor * lowest:
                self.levels.clear()  # once per rise: the next alarm needs another rise of trend_factor
                self.levels.append(new_level)
                return Verdict("trend", new_level, math.log(new_level / lowest) / spread, lowest)
        return Verdict(rule, level, score, baseline)

    def _feed(self, value: float) -> None:
        if self.values:
            self.log_ratios.append(math.log(value / self.values[-1]))
        self.values.append(value)
        self.count += 1
        if self.rules.trend_factor:
            recent = self.values if len(self.values) <= self.rules.window else list(self.values)[-self.rules.window:]
            self.levels.append(statistics.fmean(recent))

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "values": list(self.values), "log_ratios": list(self.log_ratios),
                "levels": list(self.levels), "streak": self.streak}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], rules: LogRules) -> LogLevelSeries:
        """Restore :meth:`to_dict` output (a state saved before ``levels`` and ``streak`` existed loads too)."""
        series = cls(rules)
        count = int(state["count"])
        values = [float(v) for v in state["values"]]
        log_ratios = [float(r) for r in state["log_ratios"]]
        levels = [float(v) for v in state.get("levels", [])]
        if count < 0 or not all(math.isfinite(v) and v > 0 for v in values + levels) \
                or not all(math.isfinite(r) for r in log_ratios):
            raise ValueError(f"corrupt log-level state {dict(state)}"[:300])
        series.count = count
        series.values.extend(values)
        series.log_ratios.extend(log_ratios)
        series.levels.extend(levels)
        series.streak = int(state.get("streak", 0))
        return series


def describe_verdict(what: str, step: int, value: float, verdict: Verdict, rules: LogRules) -> str:
    """The event message for a verdict with a rule."""
    if verdict.rule == "trend":
        return (f"{what} at step {step}: its mean over the last {rules.window} rose to "
                f"{format_number(verdict.level)}, {format_number(verdict.level / verdict.baseline)}x its lowest "
                f"{format_number(verdict.baseline)} of the last {rules.trend_window} steps (trend_factor "
                f"{format_number(rules.trend_factor)})")
    text = (f"{what} at step {step} is {format_number(value)}, {format_number(value / verdict.level)}x its recent "
            f"level {format_number(verdict.level)} (z={format_number(verdict.score)}, threshold "
            f"{format_number(rules.threshold)})")
    if verdict.rule == "range":
        side = "largest" if value > verdict.level else "smallest"
        text += (f"; {format_number(value / verdict.baseline)}x the {side} ({format_number(verdict.baseline)}) of "
                 f"the {rules.range_window} before (range_factor {format_number(rules.range_factor)})")
    return text


@dataclass
class LossSpikeConfig:
    """Spec of the ``loss_spike`` preset (log-loss against its recent level and range, upward by default)."""

    threshold: float = setting(6.0, minimum=0.0)
    """Noise rule: robust z-score of ``log(loss / level)`` the loss must exceed."""
    min_relative_change: float = setting(0.5, minimum=0.0)
    """Noise rule: the loss must also differ from its level by the factor ``1 + this`` (0.5: 1.5x, or
    1/1.5 going down)."""
    warmup: int = setting(10, minimum=0)
    """Losses seen before it may fire."""
    window: int = setting(50, minimum=3, maximum=MAX_WINDOW)
    """Consecutive log-ratios the noise (spread) is estimated over; the trend rule's mean too."""
    level_window: int = setting(7, minimum=1, maximum=MAX_WINDOW)
    """Recent losses whose median is the level a new loss is compared with."""
    min_spread: float = setting(0.02, above=0.0)
    """Floor of the spread in log units (0.02: the loss is never assumed steadier than about 2%)."""
    range_factor: float = setting(1.5, minimum=0.0, check=off_or_above_one)
    """Range rule: fires when the loss is more than this times the largest of the ``range_window``
    losses before the level window (less than their smallest over this, going down); 0 turns it off."""
    range_window: int = setting(100, minimum=1, maximum=MAX_WINDOW)
    """Losses the range rule compares with; also the length of the young phase."""
    trend_factor: float = setting(3.0, minimum=0.0, check=off_or_above_one)
    """Trend rule: fires when the mean of the last ``window`` losses rises above this times its
    lowest value of the last ``trend_window`` steps (once per such rise); 0 turns it off."""
    trend_window: int = setting(200, minimum=1, maximum=MAX_WINDOW)
    """Steps the trend rule looks back over."""
    early_relative_change: float = setting(2.0, minimum=0.0)
    """Noise rule during the first ``range_window`` losses: the factor is ``1 + this`` (3x) instead, as
    a young run's noise and range are not known yet (a smooth descent that turns noisy is no spike)."""
    direction: str = setting("up", choices=DIRECTIONS)
    """up, down or both (the trend rule only looks up)."""


class LossSpikeDetector(Detector[LossSpikeConfig]):
    """Loss spikes and divergence: fires when the loss is far from its median of the last 7 steps
    (robust z > 6 and 1.5x), or more than 1.5x the largest of the 100 losses before those; and when
    the mean of the last 50 losses triples within 200 steps. After 10 losses (3x jumps only until 100).

    Example:
        >>> d = LossSpikeDetector(LossSpikeConfig(warmup=3))
        >>> [len(d.update(StepRecord(s, 0, scalars={"loss": v}), "")) for s, v in enumerate([2, 2.1, 1.9, 2, 8])]
        [0, 0, 0, 0, 1]
    """

    type_name = "loss_spike"
    config_class = LossSpikeConfig

    def __init__(self, config: LossSpikeConfig) -> None:
        super().__init__(config)
        self.rules = LogRules(**{f.name: getattr(config, f.name) for f in fields(LossSpikeConfig)})
        self.series = LogLevelSeries(self.rules)

    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        value = record.scalars.get(_SERIES)
        if value is None or not math.isfinite(value) or value <= 0:
            return []
        verdict = self.series.observe(value)
        if not verdict.rule:
            return []
        message = f"loss_spike ({verdict.rule}): " + describe_verdict("loss", record.step, value, verdict, self.rules)
        return [scalar_event(record, _SERIES, value=value, baseline=verdict.baseline, detector=self.type_name,
                             message=message, time=time)]

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        return self.series.to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.series = LogLevelSeries.from_dict(state, self.rules)
