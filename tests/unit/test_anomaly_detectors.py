"""Detectors on synthetic step records, checked against independent numpy references."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from trainmon.anomaly.detectors import build_detectors
from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.config import load_config
from trainmon.errors import ConfigError

NAN, INF = math.nan, math.inf

# Synthetic host records (what build_record produces after a transfer); also used by test_anomaly_engine.


def row(step: int, family: str, name: str, order: int, micro_step: int = 0, vpp_stage: int = 0,
        **values: float) -> Row:
    """A row whose non-finite flag follows its values (``nonfinite=True`` may be forced)."""
    forced = values.pop("nonfinite", None)
    nonfinite = any(not math.isfinite(v) for v in values.values()) if forced is None else bool(forced)
    return Row(RowKey(family, name, micro_step, vpp_stage, order), step, values, nonfinite)


def record(step: int, rows: list[Row] | None = None, rank: int = 0, pp_stage: int = 0, **scalars: float) -> StepRecord:
    return StepRecord(step=step, rank=rank, rows=rows or [], scalars=dict(scalars), pp_stage=pp_stage)


def run(detectors, records):
    return [event for rec in records for d in detectors for event in d.update(rec, "t")]


@pytest.mark.parametrize("spec, key", [
    ({"type": "spikes"}, "anomaly.detectors[0].type"),
    ({"type": "spike", "treshold": 3}, "anomaly.detectors[0].treshold"),
    ({"type": "spike", "threshold": "3"}, "anomaly.detectors[0].threshold"),
    ({"type": "spike", "method": "zscore"}, "anomaly.detectors[0].method"),
    ({"type": "spike", "series": ["grad_reduced/*/l2"]}, "anomaly.detectors[0].series[0]"),
    ({"type": "spike", "window": 1}, "anomaly.detectors[0].window"),
    ({"type": "loss_spike", "series": ["loss"]}, "anomaly.detectors[0].series"),
    ({"type": "nonfinite", "families": ["activations"]}, "anomaly.detectors[0].families"),
])
def test_bad_specs_fail_at_config_construction(spec, key):
    with pytest.raises(ConfigError) as info:
        load_config({"anomaly": {"detectors": [spec]}})
    assert info.value.key == key
    assert "allowed" in str(info.value) or "must" in str(info.value)


def test_nonfinite_reports_first_origin_and_summarises_the_rest():
    rows = [row(5, "actv", "layers.0.mlp.output", 0, norm=1.0),
            row(5, "actv", "layers.1.mlp.output", 1, norm=2.0),
            row(5, "actv", "layers.2.mlp.output", 2, norm=NAN, nans=4.0),
            row(5, "actv", "layers.3.mlp.output", 3, norm=NAN, nans=16.0),
            # backward rows come in reverse module order; the NaN reached them from the forward pass
            row(5, "actv_grad", "layers.3.mlp.output_grad", 4, norm=NAN),
            row(5, "actv_grad", "layers.2.mlp.input_grad", 5, nonfinite=True),  # no stats configured
            row(5, "grad_reduced", "layers.0.fc1.weight", 6, norm=INF)]
    (event,) = run(build_detectors([{"type": "nonfinite"}]), [record(5, rows, rank=3, loss=NAN, grad_norm=NAN)])
    assert (event.step, event.micro_step, event.rank, event.phase) == (5, 0, 3, "forward")
    assert (event.family, event.name, event.metric, event.value, event.order) == (
        "actv", "layers.2.mlp.output", "nans", 4.0, 2)
    assert "forward output of layers.2.mlp" in event.message
    assert "6 more non-finite values" in event.message
    assert "actv 1, actv_grad 2, grad_reduced 1, scalars 2" in event.message


def test_nonfinite_backward_only_and_loss_only():
    rows = [row(1, "actv", "a.output", 0, norm=1.0),
            row(1, "actv_grad", "b.input_grad", 1, norm=1.0),
            row(1, "actv_grad", "a.input_grad", 2, norm=INF, infs=1.0)]
    (event,) = run(build_detectors([{"type": "nonfinite"}]), [record(1, rows, loss=2.0)])
    assert (event.phase, event.name, event.metric) == ("backward", "a.input_grad", "infs")
    assert "backward gradient w.r.t. the input of a" in event.message
    (event,) = run(build_detectors([{"type": "nonfinite"}]), [record(2, rows[:1], loss=NAN)])
    assert (event.family, event.name, event.phase) == ("scalars", "loss", "loss")


def test_nonfinite_orders_micro_steps_before_phases():
    rows = [row(0, "actv", "a.output", 0, micro_step=0, norm=1.0),
            row(0, "actv_grad", "a.output_grad", 1, micro_step=0, norm=NAN),
            row(0, "actv", "a.output", 2, micro_step=1, norm=NAN)]
    (event,) = run(build_detectors([{"type": "nonfinite"}]), [record(0, rows)])
    assert (event.micro_step, event.phase) == (0, "backward")


def ema_reference(values, alpha, warmup, threshold):
    """Independent float64 EMA z-score: plain mean/var during warm-up weights, winsorised spikes."""
    fired, mean, var = [], 0.0, 0.0
    for n, x in enumerate(values):
        sd = max(math.sqrt(var), 1e-6 * abs(mean), 1e-30)
        z = (x - mean) / sd
        fire = n >= warmup and z > threshold
        fired.append(fire)
        fed = np.clip(x, mean - threshold * sd, mean + threshold * sd) if fire else x
        a = max(alpha, 1 / (n + 1))
        d = fed - mean
        mean, var = mean + a * d, (1 - a) * (var + a * d * d)
    return fired


def test_spike_ema_and_mad_match_numpy_references_and_ignore_nan():
    rng = np.random.default_rng(0)
    values = list(1.0 + 0.05 * rng.standard_normal(120))
    values[60] = 3.0
    values[90] = 1.6
    with_nan = values[:30] + [NAN, INF] + values[30:]
    ema = build_detectors([{"type": "spike", "series": ["grad_norm"], "method": "ema", "alpha": 0.2}])
    fired = {e.step for e in run(ema, [record(s, grad_norm=v) for s, v in enumerate(with_nan)])}
    expected = {s + (2 if s >= 30 else 0) for s, f in enumerate(ema_reference(values, 0.2, 10, 6.0)) if f}
    assert fired == expected and {62, 92} <= fired

    mad = build_detectors([{"type": "spike", "series": ["grad_norm"], "method": "mad", "window": 20}])
    events = run(mad, [record(s, grad_norm=v) for s, v in enumerate(values)])
    window = values[40:60]
    med = float(np.median(window))
    scale = 1.4826 * float(np.median(np.abs(np.array(window) - med)))
    assert [e.step for e in events] == [60, 90]
    assert events[0].baseline == pytest.approx(med, rel=1e-12)
    assert f"z={(3.0 - med) / scale:.4g}" in events[0].message


def test_relative_mode_reproduces_msprobe_turbulence_without_nan_poisoning():
    values = [1.0, 1.2, 0.9, 1.1, 2.0, NAN, 1.0, 1.9, -1.0]
    det = build_detectors([{"type": "spike", "series": ["loss"], "method": "relative", "threshold": 0.5}])
    fired = [e.step for e in run(det, [record(s, loss=v) for s, v in enumerate(values)])]
    # msprobe: baseline = mean of every earlier value; fires when value > baseline * 1.5
    expected, history = [], []
    for s, v in enumerate(values):
        if math.isnan(v):
            continue
        if history and v > np.mean(history) * 1.5:
            expected.append(s)
        history.append(v)
    assert fired == expected == [4, 7]


def test_loss_spike_fires_on_4x_jump_only_and_not_on_healthy_noise():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        t = np.arange(200)
        healthy = (2.5 * np.exp(-t / 50) + 0.5) * np.exp(0.1 * rng.standard_normal(200))
        assert run(build_detectors([{"type": "loss_spike"}]), [record(s, loss=v) for s, v in enumerate(healthy)]) == []
        spiky = healthy.copy()
        spiky[30] *= 4
        events = run(build_detectors([{"type": "loss_spike"}]), [record(s, loss=v) for s, v in enumerate(spiky)])
        assert [(e.step, e.detector, e.name) for e in events] == [(30, "loss_spike", "loss")]


@pytest.mark.parametrize("method", ["ema", "mad", "relative"])
def test_spike_direction_up_down_and_both(method):
    rng = np.random.default_rng(3)
    values = 1 + 0.05 * rng.standard_normal(120)
    values[30] = 3.0  # a rise
    values[100] = 0.2  # a drop (late enough for the EMA to forget the rise when it was not clipped)

    def fired(direction):
        detectors = build_detectors([{"type": "spike", "series": ["grad_norm"], "method": method,
                                      "direction": direction}])
        return run(detectors, [record(s, grad_norm=float(v)) for s, v in enumerate(values)])

    assert [e.step for e in fired("up")] == [30]
    (drop,) = fired("down")
    assert drop.step == 100 and drop.value == pytest.approx(0.2) and drop.baseline > 0.8
    assert [e.step for e in fired("both")] == [30, 100]


@pytest.mark.parametrize("direction, expected", [("up", [30]), ("down", [45]), ("both", [30, 45])])
def test_loss_spike_direction(direction, expected):
    rng = np.random.default_rng(4)
    losses = 2.0 * np.exp(-np.arange(60) / 40) * np.exp(0.05 * rng.standard_normal(60))
    losses[30] *= 4
    losses[45] /= 4
    detectors = build_detectors([{"type": "loss_spike", "direction": direction}])
    assert [e.step for e in run(detectors, [record(s, loss=float(v)) for s, v in enumerate(losses)])] == expected


def test_loss_spike_is_scale_free_and_skips_nonpositive_losses():
    rng = np.random.default_rng(5)
    base = np.exp(0.1 * rng.standard_normal(80))
    base[50] *= 4
    for scale in (1e3, 1.0, 1e-4):  # the same run at any loss scale: the same single event
        detectors = build_detectors([{"type": "loss_spike"}])
        events = run(detectors, [record(s, loss=float(v * scale)) for s, v in enumerate(base)])
        assert [e.step for e in events] == [50] and events[0].value / events[0].baseline > 3
    detector = build_detectors([{"type": "loss_spike"}])[0]
    assert run([detector], [record(s, loss=v) for s, v in enumerate([1.0, 0.0, -2.0, NAN, INF, 1.1])]) == []
    assert detector.state_dict()["count"] == 2


def test_layer_gradient_spike_fires_before_the_loss():
    rng = np.random.default_rng(1)
    detectors = build_detectors([{"type": "spike", "series": ["grad_reduced/*/norm"], "method": "mad"},
                                 {"type": "loss_spike"}])
    records = []
    for s in range(80):
        norms = np.exp(0.2 * rng.standard_normal(4))
        if s == 50:
            norms[2] *= 30
        rows = [row(s, "grad_reduced", f"layers.{i}.weight", i, norm=float(n)) for i, n in enumerate(norms)]
        loss = (1.0 + 0.05 * rng.standard_normal()) * (5.0 if s == 51 else 1.0)
        records.append(record(s, rows, loss=loss))
    events = run(detectors, records)
    assert [(e.step, e.detector, e.name) for e in events] == [
        (50, "spike", "layers.2.weight"), (51, "loss_spike", "loss")]


@pytest.mark.parametrize("spec", [{"type": "nonfinite"}, {"type": "loss_spike", "warmup": 3},
                                  {"type": "loss_spike", "warmup": 3, "range_window": 8, "trend_window": 10},
                                  {"type": "spike", "series": ["loss", "actv/*/norm"], "method": "log",
                                   "range_window": 8},
                                  {"type": "spike", "series": ["loss", "actv/*/norm"], "method": "ema"},
                                  {"type": "spike", "series": ["actv/re:^l/norm"], "method": "mad", "window": 5},
                                  {"type": "spike", "series": ["loss"], "method": "relative"}])
def test_state_dict_round_trip_resumes_identically(spec):
    rng = np.random.default_rng(2)
    records = []
    for s in range(60):
        value = float(1 + 0.1 * rng.standard_normal()) * (6 if s in (20, 45) else 1)
        rows = [row(s, "actv", f"l{i}.output", i, micro_step=m, norm=value * (i + 1))
                for m in range(2) for i in range(2)]
        records.append(record(s, rows, loss=NAN if s == 30 else value))
    whole = build_detectors([spec])
    expected = [e.to_dict() for e in run(whole, records)]
    first = build_detectors([spec])
    events = run(first, records[:25])
    state = json.loads(json.dumps(first[0].state_dict()))  # checkpoints may go through JSON
    resumed = build_detectors([spec])
    resumed[0].load_state_dict(state)
    events += run(resumed, records[25:])
    assert [e.to_dict() for e in events] == expected
    assert resumed[0].state_dict() == whole[0].state_dict()
    assert len(expected) > 0


def test_spike_state_never_holds_nan():
    det = build_detectors([{"type": "spike", "series": ["loss", "actv/*/norm"], "method": "ema"}])[0]
    for s, v in enumerate([1.0, NAN, INF, -INF, 1.1, NAN]):
        det.update(record(s, [row(s, "actv", "a.output", 0, norm=v)], loss=v), "t")
    state = json.dumps(det.state_dict(), allow_nan=False)  # raises on NaN/Inf
    assert '"count": 2' in state


def _overflow_step(step: int, **scalars: float) -> StepRecord:
    """What a step with a loss-scale overflow looks like: Inf gradients, a finite loss."""
    rows = [row(step, "actv", "fc.output", 0, norm=1.0),
            row(step, "actv_grad", "fc.output_grad", 1, norm=INF),
            row(step, "grad_unreduced", "fc.weight", 2, norm=INF)]
    return record(step, rows, loss=1.0, grad_norm=INF, **scalars)


def test_a_step_skipped_by_dynamic_loss_scaling_is_not_an_alarm_until_it_repeats():
    detectors = build_detectors([{"type": "nonfinite", "max_skipped_steps": 3}])
    quiet = [_overflow_step(s, step_skipped=1.0, loss_scale=2.0 ** (16 - s)) for s in range(3)]
    assert run(detectors, quiet) == []
    (event,) = run(detectors, [_overflow_step(3, step_skipped=1.0, loss_scale=2.0 ** 13)])
    assert event.name == "step_skipped" and "4 steps in a row" in event.message
    assert run(detectors, [_overflow_step(4, step_skipped=1.0, loss_scale=2.0 ** 12)]) == []  # said once per run
    # the counter survives a checkpoint round trip
    state = json.loads(json.dumps(detectors[0].state_dict()))
    again = build_detectors([{"type": "nonfinite", "max_skipped_steps": 3}])
    again[0].load_state_dict(state)
    assert again[0].skipped_in_a_row == 5


def test_a_skip_without_loss_scaling_and_a_nonfinite_loss_are_still_alarms():
    detectors = build_detectors([{"type": "nonfinite"}])
    (event,) = run(detectors, [_overflow_step(0, step_skipped=1.0, loss_scale=1.0)])  # constant scale: a real NaN
    assert event.family == "actv_grad"
    (event,) = run(detectors, [_overflow_step(1, step_skipped=0.0, loss_scale=2.0 ** 16)])  # applied step
    assert event.family == "actv_grad"
    skipped_with_nan_loss = _overflow_step(2, step_skipped=1.0, loss_scale=2.0 ** 16)
    skipped_with_nan_loss.scalars["loss"] = NAN
    (event,) = run(detectors, [skipped_with_nan_loss])
    assert event.name == "loss"


# --------------------------------------------------------------------------- loss_spike's rules
def log_rules_reference(values, threshold=6.0, min_rel=0.5, early=2.0, warmup=10, window=50, level_window=7,
                        min_spread=0.02, range_factor=1.5, range_window=100, trend_factor=3.0, trend_window=200,
                        persist=1):
    """Independent float64 reference of loss_spike / spike method log (upward): returns ``{step: rule}``."""

    def robust_spread(r):
        return 1.4826 * float(np.median(np.abs(r - np.median(r)))) / math.sqrt(2)

    fed, ratios, levels, fired, streak = [], [], [], {}, 0

    def feed(x):
        if fed:
            ratios.append(math.log(x / fed[-1]))
        fed.append(x)
        levels.append(float(np.mean(fed[-window:])))  # the trend rule's level: a mean
        del levels[:-trend_window]

    for step, x in enumerate(values):
        if not math.isfinite(x) or x <= 0:
            continue
        if len(ratios) < 2:
            feed(x)
            continue
        level = float(np.median(fed[-level_window:]))
        r = np.array(ratios[-window:])
        young = len(fed) < range_window
        spread = max(robust_spread(r), min_spread)
        edge = level * math.exp(max(threshold * spread, math.log1p(early if young else min_rel)))
        upper = edge
        if range_factor and not young:
            upper = min(edge, range_factor * max(fed[-(range_window + level_window):-level_window]))
        out = len(fed) >= warmup and x > upper
        streak = streak + 1 if out else 0
        if out and streak < persist:
            continue  # held back
        if out:
            fired[step] = "noise" if x > edge else "range"
            feed(upper)
            continue
        feed(x)
        if trend_factor and len(fed) > warmup and levels[-1] > trend_factor * min(levels):
            fired[step] = "trend"
            levels[:] = levels[-1:]
    return fired


def _rules_fired(detector, values, scalar="loss"):
    fired = {}
    for step, value in enumerate(values):
        for event in detector.update(record(step, **{scalar: float(value)}), "t"):
            fired[step] = event.message.split("(")[1].split(")")[0].split(", ")[-1]
    return fired


@pytest.mark.parametrize("seed", range(4))
def test_loss_spike_matches_numpy_reference_on_spikes_plateaus_and_divergence(seed):
    rng = np.random.default_rng(seed)
    steps = 900
    t = np.arange(steps)
    losses = (2.0 * np.exp(-t / 150) + 0.4) * np.exp(rng.uniform(0.02, 0.3) * rng.standard_normal(steps))
    for at in rng.integers(20, 600, 8):
        losses[at] *= rng.choice([1.5, 2.0, 3.0, 4.0, 10.0])
    losses[300:320] *= 3.0  # a plateau
    losses[650:] *= 2.0 ** ((t[650:] - 650) / 50)  # a divergence
    losses[[100, 400]] = [NAN, -1.0]  # skipped
    fired = _rules_fired(build_detectors([{"type": "loss_spike"}])[0], losses)
    assert fired == log_rules_reference(losses)
    assert {"noise", "range", "trend"} >= set(fired.values()) and "trend" in fired.values()


def test_loss_spike_range_rule_catches_a_jump_the_noise_rule_misses():
    # A small-batch-like loss whose log is skewed down: a 4x batch is 2x the largest of the last 100
    # losses, but only z ~ 5 against the step-to-step noise (the held-out case of the benchmark).
    rng = np.random.default_rng(0)
    losses = 0.6 * np.exp(-np.abs(0.55 * rng.standard_normal(200)))
    losses[150] = 4 * np.median(losses[143:150])
    assert losses[150] > 2 * losses[43:143].max()
    (event,) = run(build_detectors([{"type": "loss_spike"}]), [record(s, loss=float(v)) for s, v in enumerate(losses)])
    assert event.step == 150 and "loss_spike (range)" in event.message and "(z=4.956, threshold 6)" in event.message
    assert event.baseline == pytest.approx(losses[43:143].max())  # the range before the level window
    old = [{"type": "loss_spike", "min_relative_change": 1.0, "early_relative_change": 1.0, "range_factor": 0,
            "trend_factor": 0}]  # the rule before the range existed
    assert run(build_detectors(old), [record(s, loss=float(v)) for s, v in enumerate(losses)]) == []


def test_loss_spike_trend_rule_fires_once_per_tripling_of_a_slow_divergence():
    rng = np.random.default_rng(8)
    t = np.arange(600)
    losses = np.exp(0.05 * rng.standard_normal(600)) * np.where(t < 300, 1.0, 2.0 ** ((t - 300) / 50))
    events = run(build_detectors([{"type": "loss_spike"}]), [record(s, loss=float(v)) for s, v in enumerate(losses)])
    trend = [e.step for e in events if "loss_spike (trend)" in e.message]
    assert len(trend) >= 3 and 300 < trend[0] < 420
    assert all(b - a >= 40 for a, b in itertools.pairwise(trend))  # once per rise, not every step
    assert "rose to" in events[[e.step for e in events].index(trend[0])].message


def test_loss_spike_young_run_ignores_a_smooth_descent_turning_noisy_but_not_a_3x_jump():
    rng = np.random.default_rng(9)
    losses = list(np.geomspace(2.0, 0.5, 30)) + list(0.5 * np.exp(0.35 * rng.standard_normal(60)))
    detectors = build_detectors([{"type": "loss_spike"}])
    assert run(detectors, [record(s, loss=float(v)) for s, v in enumerate(losses)]) == []
    losses[70] = 10 * float(np.median(losses[63:70]))  # young: only a 3x jump with z > 6 fires
    (event,) = run(build_detectors([{"type": "loss_spike"}]), [record(s, loss=float(v)) for s, v in enumerate(losses)])
    assert event.step == 70 and "(noise)" in event.message


def test_loss_spike_loads_a_state_saved_before_the_range_and_trend_rules():
    old_state = {"count": 12, "values": [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0], "log_ratios": [0.1, -0.2, 0.1] * 3}
    detector = build_detectors([{"type": "loss_spike"}])[0]
    detector.load_state_dict(json.loads(json.dumps(old_state)))
    assert detector.state_dict()["count"] == 12 and detector.state_dict()["streak"] == 0
    assert run([detector], [record(12, loss=5.0)])[0].step == 12
    with pytest.raises(ValueError):
        detector.load_state_dict({**old_state, "levels": [1.0, NAN]})


def test_spike_log_method_persist_ignores_one_step_outliers_and_catches_a_growing_norm():
    rng = np.random.default_rng(10)
    norms = np.exp(0.2 * rng.standard_normal(400))
    norms[[150, 220]] *= 30  # one odd batch each: ignored with persist 3
    norms[300:] *= 1.3 ** np.arange(100)  # a blow-up
    spec = {"type": "spike", "series": ["grad_reduced/*/norm"], "method": "log", "persist": 3}
    rows = [[row(s, "grad_reduced", "fc.weight", 0, norm=float(v))] for s, v in enumerate(norms)]
    events = run(build_detectors([spec]), [record(s, r) for s, r in enumerate(rows)])
    expected = log_rules_reference(norms, min_rel=1.0, range_factor=2.0, trend_factor=0, persist=3)
    assert [e.step for e in events] == sorted(expected)
    assert 300 < events[0].step < 312 and events[0].name == "fc.weight" and "spike (log, " in events[0].message
    single = run(build_detectors([{**spec, "persist": 1}]), [record(s, r) for s, r in enumerate(rows)])
    assert {150, 220} <= {e.step for e in single}
    first = build_detectors([spec])  # a checkpoint in the middle of a streak resumes it
    resumed = run(first, [record(s, r) for s, r in enumerate(rows[:306])])
    again = build_detectors([spec])
    again[0].load_state_dict(json.loads(json.dumps(first[0].state_dict())))
    resumed += run(again, [record(s, r) for s, r in enumerate(rows) if s >= 306])
    assert [e.to_dict() for e in resumed] == [e.to_dict() for e in events]


@pytest.mark.parametrize("spec, key", [
    ({"type": "loss_spike", "range_factor": 0.5}, "anomaly.detectors[0].range_factor"),
    ({"type": "loss_spike", "trend_factor": 1.0}, "anomaly.detectors[0].trend_factor"),
    ({"type": "loss_spike", "range_window": 0}, "anomaly.detectors[0].range_window"),
    ({"type": "spike", "method": "log", "range_factor": 1.0}, "anomaly.detectors[0].range_factor"),
    ({"type": "spike", "method": "log", "persist": 0}, "anomaly.detectors[0].persist"),
    ({"type": "spike", "method": "logarithmic"}, "anomaly.detectors[0].method"),
])
def test_new_detector_fields_are_validated_at_config_construction(spec, key):
    with pytest.raises(ConfigError) as info:
        load_config({"anomaly": {"detectors": [spec]}})
    assert info.value.key == key
