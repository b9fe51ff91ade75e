"""The detectors of the lead-time benchmark (``benchmarks/precursors.py``), run offline over a run's stored series.

Peers' rules are the one-value ports of ``benchmarks/detector_baselines.py`` (the reference), vectorised here over
the columns of a series (its layers) and over a grid of thresholds, so that a whole run is scored in one pass:
``tests/unit/test_precursor_rules.py`` checks every vectorised rule against its port, alarm for alarm, on random
series with spikes, NaN and Inf. trainmon's rules run through trainmon's own code: the anomaly engine with the
default detectors (a replay of what ran online), ``loss_spike`` and ``spike`` detectors built from specs, and the
``spike`` detector's log-level state (:class:`~trainmon.anomaly.detectors.loss_spike.LogLevelSeries`) for series
that are not a ``family/name/metric`` a spec can name.

Every function takes ``values`` of shape ``(steps, columns)`` (float64, NaN/Inf allowed) and returns alarms of
shape ``(thresholds, steps, columns)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks.detector_baselines import FoundryKillLossSpike
from trainmon.anomaly.detectors import GRAD_NORM_DEFAULT, PER_LAYER_DEFAULT, build_detectors
from trainmon.anomaly.detectors.loss_spike import LogLevelSeries
from trainmon.anomaly.detectors.spike import SpikeDetector
from trainmon.base.records import StepRecord

Array = npt.NDArray[np.float64]
Alarms = npt.NDArray[np.bool_]


def _thetas(thresholds: Sequence[float]) -> Array:
    return np.asarray(thresholds, dtype=np.float64)[:, None, None]


# ------------------------------------------------------------------------ rules whose state ignores the threshold
def skip_step(values: Array, thresholds: Sequence[float], window: int = 128) -> Alarms:
    """OLMo-core ``SkipStepOptimizer`` (:class:`~benchmarks.detector_baselines.OlmoSkipStep`): from the 64th value,
    flagged unless ``|value - mean| / std <= sigma`` over the up to 128 values before it."""
    steps, columns = values.shape
    z = np.full((steps, columns), -np.inf)
    first = max(20, window // 2) - 1
    with np.errstate(all="ignore"):
        for t in range(first, min(steps, window)):  # the window is still filling
            before = values[:t]
            z[t] = np.abs(values[t] - before.mean(axis=0)) / before.std(axis=0, ddof=1)
        if steps > window:
            windows = np.lib.stride_tricks.sliding_window_view(values, window, axis=0)[:steps - window]
            z[window:] = np.abs(values[window:] - windows.mean(axis=2)) / windows.std(axis=2, ddof=1)
        fails = ~(z[None] <= _thetas(thresholds))  # OLMo skips unless z <= sigma: a NaN z-score fails
        return np.asarray(fails & (np.arange(steps) >= first)[None, :, None], dtype=bool)


def megatron(values: Array, thresholds: Sequence[float], num_samples: int = 100,
             check_nonfinite: bool = True) -> Alarms:
    """Megatron ``is_unexpectedly_large`` (:class:`~benchmarks.detector_baselines.MegatronLarge`): the largest
    ``|value|`` of the first 100 finite values is the reference; later values ``>= factor * reference``."""
    finite = np.isfinite(values)
    seen = np.cumsum(finite, axis=0)  # finite values up to and including each step
    magnitude = np.where(finite, np.abs(values), 0.0)
    sampled = finite & (seen <= num_samples)
    reference = np.maximum.accumulate(np.where(sampled, magnitude, 0.0), axis=0)[-1] if len(values) else 0.0
    judged = finite & (seen > num_samples)
    large = judged[None] & (magnitude[None] >= _thetas(thresholds) * reference)
    return large | (~finite & check_nonfinite)[None]


def turbulence(values: Array, thresholds: Sequence[float], version: str = "ema", beta: float = 0.99) -> Alarms:
    """msprobe ``AnomalyTurbulence`` (:class:`~benchmarks.detector_baselines.MsprobeTurbulence`): ``1.2.1``
    against the cumulative mean of the earlier values, ``ema`` against an EMA of ``|value|`` (NaN fires)."""
    steps, columns = values.shape
    baselines = np.empty((steps, columns))
    average = np.full(columns, np.nan)
    started = False
    for t in range(steps):
        value = values[t] if version == "1.2.1" else np.abs(values[t])
        if not started:
            average, started = value.copy(), True
        baselines[t] = average
        # msprobe 1.2.1: the cumulative mean as it updates it; 26.2: the EMA of |value| (a NaN poisons either)
        average = (average * t + value) / (t + 1) if version == "1.2.1" else beta * average + (1 - beta) * value
    theta = _thetas(thresholds)
    with np.errstate(invalid="ignore"):
        bound = baselines[None] + baselines[None] * theta
        if version == "1.2.1":
            return np.where(baselines[None] > 0, values[None] > bound, values[None] < bound)
        return np.isnan(values)[None] | (np.abs(values)[None] > bound)


# ------------------------------------------------------------------------ rules whose state follows the threshold
def zclip(values: Array, thresholds: Sequence[float], alpha: float = 0.97, eps: float = 1e-6,
          warmup_steps: int = 25) -> Alarms:
    """ZClip's z-score clipping (:class:`~benchmarks.detector_baselines.ZClip`); the EMAs take the clipped value,
    so the state is kept per threshold."""
    steps, columns = values.shape
    theta = np.asarray(thresholds, dtype=np.float64)[:, None]
    alarms = np.zeros((len(thresholds), steps, columns), dtype=bool)
    if steps < warmup_steps:
        return alarms
    buffer = values[:warmup_steps]
    mean = np.broadcast_to(buffer.sum(axis=0) / warmup_steps, (len(thresholds), columns)).copy()
    var = np.broadcast_to(((buffer - buffer.sum(axis=0) / warmup_steps) ** 2).sum(axis=0) / warmup_steps,
                          mean.shape).copy()
    with np.errstate(all="ignore"):
        for t in range(warmup_steps, steps):
            norm = values[t][None]
            std = var ** 0.5
            z = (norm - mean) / (std + eps)
            clipped = z > theta
            effective = np.where(clipped, mean + (theta * std) / (z / theta), norm)
            mean = alpha * mean + (1 - alpha) * effective
            var = alpha * var + (1 - alpha) * (effective - mean) ** 2
            alarms[:, t] = clipped
    return alarms


def lightning(values: Array, thresholds: Sequence[float], window: int = 10, warmup: int = 1) -> Alarms:
    """Lightning ``SpikeDetection(mode="min")`` (:class:`~benchmarks.detector_baselines.LightningSpike`) with
    ``rtol`` as the threshold; spikes stay out of the running mean, so the state is kept per threshold."""
    steps, columns = values.shape
    shape = (len(thresholds), columns)
    rtol = np.asarray(thresholds, dtype=np.float64)[:, None]
    ring = np.zeros((*shape, window))
    filled = np.zeros(shape, dtype=np.int64)  # accepted values so far (the ring holds the last `window`)
    last = np.zeros(shape)
    alarms = np.zeros((len(thresholds), steps, columns), dtype=bool)
    slots = np.arange(window)
    with np.errstate(all="ignore"):
        for t in range(steps):
            value = np.broadcast_to(values[t], shape)
            count = np.minimum(filled, window)
            running = np.where(count > 0, np.where(slots < count[..., None], ring, 0.0).sum(axis=-1) / count, np.nan)
            rising = value - last > 0
            spike = ~np.isfinite(value) | (rising & (np.abs(value - running) >= np.abs(rtol * running)))
            spike &= t >= warmup
            accept = ~spike  # finite_only: every value that is not a spike is finite
            position = filled % window
            index = np.nonzero(accept)
            ring[index[0], index[1], position[index]] = value[index]
            filled += accept
            last = np.where(accept, value, last)
            alarms[:, t] = spike
    return alarms


def foundry(values: Array, thresholds: Sequence[float], total_steps: int) -> Alarms:
    """llm-foundry ``KillLossSpike`` (the port itself, one per threshold: ``outlier_multiplier``)."""
    steps, columns = values.shape
    alarms = np.zeros((len(thresholds), steps, columns), dtype=bool)
    for g, multiplier in enumerate(thresholds):
        for c in range(columns):
            rule = FoundryKillLossSpike(total_steps=total_steps, outlier_multiplier=multiplier)
            alarms[g, :, c] = [rule.update(float(v)) for v in values[:, c]]
    return alarms


# ------------------------------------------------------------------------ trainmon's own code
def trainmon_log(values: Array, thresholds: Sequence[float], spec: dict[str, Any] | None = None,
                 scale_range: bool = False) -> Alarms:
    """trainmon's ``spike`` (``method: log``) state per column, as the detector feeds it: non-finite and
    non-positive values are skipped. ``spec`` is the detector spec (default: the per-layer warning,
    ``persist: 3``); its ``threshold`` is replaced by each threshold and, with ``scale_range``, its
    ``range_factor`` (the other rule of the log method, which a threshold alone does not move) by
    ``1 + (range_factor - 1) * threshold / default threshold`` (6 -> 2.0, 12 -> 3.0 for the per-layer warning)."""
    steps, columns = values.shape
    alarms = np.zeros((len(thresholds), steps, columns), dtype=bool)
    base = dict(spec or PER_LAYER_DEFAULT)
    for g, threshold in enumerate(thresholds):
        detector = build_detectors([{**base, "threshold": float(threshold)}], "benchmark")[0]
        assert isinstance(detector, SpikeDetector)
        if scale_range:
            default = build_detectors([{k: v for k, v in base.items() if k != "threshold"}], "benchmark")[0]
            assert isinstance(default, SpikeDetector)
            factor = 1 + (default.config.range_factor - 1) * threshold / default.threshold
            detector = build_detectors([{**base, "threshold": float(threshold), "range_factor": factor}],
                                       "benchmark")[0]
            assert isinstance(detector, SpikeDetector)
        for c in range(columns):
            series = LogLevelSeries(detector.rules)
            column = values[:, c]
            for t in np.nonzero(np.isfinite(column) & (column > 0))[0]:
                alarms[g, t, c] = bool(series.observe(float(column[t])).rule)
    return alarms


def trainmon_scalar(values: Array, thresholds: Sequence[float], spec: dict[str, Any], name: str) -> Alarms:
    """A trainmon detector built from ``spec`` (its ``threshold`` replaced by each threshold) fed one scalar
    ``name`` per step as ``StepRecord`` scalars; alarms where it raised an event."""
    steps, columns = values.shape
    alarms = np.zeros((len(thresholds), steps, columns), dtype=bool)
    for g, threshold in enumerate(thresholds):
        for c in range(columns):
            detectors = build_detectors([{**spec, "threshold": float(threshold)}], "benchmark")
            for t in range(steps):
                record = StepRecord(step=t, rank=0, scalars={name: float(values[t, c])})
                alarms[g, t, c] = any(d.update(record, "") for d in detectors)
    return alarms


def trainmon_field(values: Array, thresholds: Sequence[float], spec: dict[str, Any], field: str) -> Alarms:
    """A trainmon detector of chosen series (``growth``, ``level``) built from ``spec`` with its ``field`` set to
    each threshold, fed every column of a step as a scalar of its own (``c0``, ``c1``, ...; each a series of the
    detector, as a layer's row is); alarms where a column raised an event."""
    steps, columns = values.shape
    alarms = np.zeros((len(thresholds), steps, columns), dtype=bool)
    names = [f"c{c}" for c in range(columns)]
    for g, threshold in enumerate(thresholds):
        detector = build_detectors([{**spec, "series": ["c*"], field: float(threshold)}], "benchmark")[0]
        for t in range(steps):
            record = StepRecord(step=t, rank=0, scalars=dict(zip(names, values[t].tolist())))
            for event in detector.update(record, ""):
                alarms[g, t, int(event.name[1:])] = True
    return alarms


GRAD_NORM_SPEC: dict[str, Any] = dict(GRAD_NORM_DEFAULT)
LOSS_SPIKE_SPEC: dict[str, Any] = {"type": "loss_spike"}


def any_column(alarms: Alarms) -> Alarms:
    """Alarm per threshold and step when any column (layer) fires: shape ``(thresholds, steps)``."""
    return np.asarray(alarms.any(axis=2), dtype=bool)


def finite_or_nan(values: Sequence[float]) -> Array:
    """Floats as a ``(steps, 1)`` column (``None`` becomes NaN)."""
    return np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)[:, None]


__all__ = ["GRAD_NORM_SPEC", "LOSS_SPIKE_SPEC", "any_column", "finite_or_nan", "foundry", "lightning", "megatron",
           "skip_step", "trainmon_field", "trainmon_log", "trainmon_scalar", "turbulence", "zclip"]
