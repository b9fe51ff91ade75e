"""The lead-time benchmark's vectorised detectors (``benchmarks/precursor_rules.py``) against the one-value ports
they vectorise (``benchmarks/detector_baselines.py``) and against trainmon's detectors fed records: alarm for
alarm, on random positive series with spikes, level shifts, NaN and Inf, at several thresholds."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import precursor_rules as rules  # noqa: E402
from benchmarks.detector_baselines import (  # noqa: E402
    LightningSpike,
    MegatronLarge,
    MsprobeTurbulence,
    OlmoSkipStep,
    ZClip,
)
from trainmon.anomaly.detectors import PER_LAYER_DEFAULT, build_detectors  # noqa: E402
from trainmon.base.records import Row, RowKey, StepRecord  # noqa: E402


def series(seed: int, steps: int = 400, columns: int = 3, special: bool = True) -> np.ndarray:
    """Log-normal noise around a falling trend, with spikes, a level shift, a zero and (optionally) NaN/Inf."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)[:, None]
    values = (1 + 2 * np.exp(-t / 80)) * np.exp(rng.normal(0, 0.15, (steps, columns)))
    values[rng.integers(30, steps, 12), rng.integers(0, columns, 12)] *= rng.choice([2.0, 5.0, 30.0], 12)
    values[steps // 2:, 0] *= 3.0
    values[steps // 3, 1] = 0.0
    if special:
        values[250, 1] = math.nan
        values[260, 2] = math.inf
        values[300:305, 2] = math.nan
    return values


def reference(make: Callable[[float], Any], values: np.ndarray, thresholds: list[float]) -> np.ndarray:
    out = np.zeros((len(thresholds), *values.shape), dtype=bool)
    for g, theta in enumerate(thresholds):
        for c in range(values.shape[1]):
            rule = make(theta)
            out[g, :, c] = [rule.update(float(v)) for v in values[:, c]]
    return out


CASES: dict[str, tuple[Callable[[np.ndarray, list[float]], np.ndarray], Callable[[float], Any], list[float]]] = {
    "skip_step": (rules.skip_step, lambda th: OlmoSkipStep(sigma_factor=th), [3.0, 6.0]),
    "megatron": (rules.megatron, lambda th: MegatronLarge(threshold=th), [2.0, 10.0]),
    "turbulence 1.2.1": (lambda v, th: rules.turbulence(v, th, "1.2.1"), lambda th: MsprobeTurbulence("1.2.1", th),
                         [0.5, 4.0]),
    "turbulence ema": (lambda v, th: rules.turbulence(v, th, "ema"), lambda th: MsprobeTurbulence("ema", th),
                       [0.5, 4.0]),
    "zclip": (rules.zclip, lambda th: ZClip(z_thresh=th), [2.5, 6.0]),
    "lightning": (rules.lightning, lambda th: LightningSpike(rtol=th), [0.5, 2.0]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("special", [False, True])
def test_vectorised_rule_equals_its_port(name: str, special: bool) -> None:
    vectorised, make, thresholds = CASES[name]
    for seed in range(3):
        values = series(seed, special=special)
        expected = reference(make, values, thresholds)
        got = vectorised(values, thresholds)
        assert got.shape == expected.shape
        mismatches = np.argwhere(got != expected)
        assert not len(mismatches), f"{name}: first mismatches (threshold, step, column) {mismatches[:5].tolist()}"
        assert expected.any(), f"{name}: the series never fire it (a useless case)"


def test_skip_step_flags_a_constant_window_as_olmo_does() -> None:
    values = np.ones((100, 1))
    values[80] = 1.0  # 0 / 0: a NaN z-score fails the check
    assert rules.skip_step(values, [6.0])[0, 70:, 0].all()
    assert rules.skip_step(values, [6.0])[0, 70:, 0].tolist() == reference(
        lambda th: OlmoSkipStep(sigma_factor=th), values, [6.0])[0, 70:, 0].tolist()


def test_trainmon_log_equals_the_spike_detector_fed_rows() -> None:
    values = series(7)
    values[320:340, 1] *= 1.5 ** np.arange(20)  # a layer whose norm keeps growing: the warning's case
    thresholds = [4.5, 6.0]
    got = rules.trainmon_log(values, thresholds)
    keys = [RowKey("grad_reduced", f"layers.{c}.weight", 0, 0, c) for c in range(values.shape[1])]
    for g, threshold in enumerate(thresholds):
        detector = build_detectors([{**PER_LAYER_DEFAULT, "threshold": threshold}])[0]
        expected = np.zeros(values.shape, dtype=bool)
        for t in range(len(values)):
            rows = [Row(key, t, {"norm": float(v)}, not math.isfinite(v)) for key, v in zip(keys, values[t])]
            for event in detector.update(StepRecord(step=t, rank=0, rows=rows), ""):
                expected[t, int(event.name.split(".")[1])] = True
        assert (got[g] == expected).all()
        assert expected.any()


def test_trainmon_log_scales_its_range_factor_with_the_threshold() -> None:
    values = series(11, special=False)
    values[300:320, 0] *= 1.3 ** np.arange(20)
    got = rules.trainmon_log(values, [6.0, 12.0], scale_range=True)
    assert (got[0] == rules.trainmon_log(values, [6.0])[0]).all()  # 6: the default range factor, 2
    wider = rules.trainmon_log(values, [12.0], spec={**PER_LAYER_DEFAULT, "range_factor": 3.0})
    assert (got[1] == wider[0]).all() and got[1].sum() <= got[0].sum()


def test_any_column_and_scalar_detectors() -> None:
    values = series(3, special=False)[:, :1]
    values[350, 0] = 50.0
    fired = rules.trainmon_scalar(values, [6.0], rules.LOSS_SPIKE_SPEC, "loss")
    assert fired.shape == (1, len(values), 1) and fired[0, 350, 0]
    assert rules.any_column(np.zeros((2, 5, 3), dtype=bool)).shape == (2, 5)


@pytest.mark.parametrize("spec, field, thresholds", [
    ({"type": "growth", "series": ["x"], "window": 40, "min_value": 30.0}, "factor", (1.5, 3.0)),
    ({"type": "level", "series": ["x"], "persist": 5}, "threshold", (0.5, 0.9)),
])
def test_trainmon_field_equals_one_detector_per_row_series(spec: dict[str, Any], field: str,
                                                           thresholds: tuple[float, ...]) -> None:
    """The benchmark feeds columns as scalars; the detector fed ``attn``/``precursors`` rows fires on the same steps."""
    rng = np.random.default_rng(7)
    values = np.exp(np.cumsum(0.08 * rng.standard_normal((300, 3)), axis=0)) * (20.0 if field == "factor" else 0.5)
    values[200:, 0] *= 1.1 ** np.minimum(np.arange(100), 50)  # a column that climbs 117x over 50 steps
    values[50, 1], values[60, 2] = math.nan, math.inf
    family, metric = ("attn", "max_logit") if field == "factor" else ("precursors", "eps_underflow")
    alarms = rules.trainmon_field(values, thresholds, spec, field)
    for g, threshold in enumerate(thresholds):
        detector = build_detectors([{**spec, "series": [f"{family}/*/{metric}"], field: threshold}])[0]
        expected = np.zeros((300, 3), dtype=bool)
        for t in range(300):
            rows = [Row(RowKey(family, f"layer{c}", 0, 0, c), t, {metric: float(values[t, c])},
                        not math.isfinite(values[t, c])) for c in range(3)]
            for event in detector.update(StepRecord(step=t, rank=0, rows=rows), ""):
                expected[t, int(event.name[5:])] = True
        assert np.array_equal(alarms[g], expected), threshold
        assert expected.any(), threshold  # the series do cross: the comparison is not vacuous
