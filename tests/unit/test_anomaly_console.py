"""The console (the ``log`` action): throttled per detector; a first non-finite value is always printed at its step.

Issue 30: a rule firing every step (msprobe's AnomalyTurbulence) shared the powers-of-two throttle with
the ``nonfinite`` detector, so the NaN at step 60 was first printed at step 64.
"""

from __future__ import annotations

import logging
import math
import re

from tests.unit.test_anomaly_detectors import record, row
from trainmon.anomaly.engine import AnomalyEngine
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.responses import LogAction
from trainmon.base.records import StepRecord
from trainmon.config import AnomalyConfig

NAN = math.nan
NOISY = {"type": "spike", "method": "relative", "threshold": 0.0, "series": ["actv/*/norm"]}
"""Fires on every step: each norm is above the running mean of the earlier ones (msprobe's turbulence rule)."""


def rising_rows(step: int, layers: int = 3) -> list:
    return [row(step, "actv", f"layers.{i}.output", i, norm=1.0 + step + i) for i in range(layers)]


def logged(caplog) -> list[tuple[int, str]]:
    """(step, line) of every line that names its step."""
    out = []
    for message in (r.getMessage() for r in caplog.records):
        found = re.search(r"at step (\d+)", message)
        if found:
            out.append((int(found.group(1)), message))
    return out


def train(engine: AnomalyEngine, steps: int, nan_steps: dict[int, str]) -> None:
    """``nan_steps``: step -> what is NaN there (``loss`` or a row name)."""
    for step in range(steps):
        rows = rising_rows(step)
        scalars = {"loss": NAN if nan_steps.get(step) == "loss" else 1.0 / (step + 1)}
        if nan_steps.get(step, "loss") != "loss":
            rows.append(row(step, "actv_grad", nan_steps[step], 9, norm=NAN))
        engine.process(record(step, rows, **scalars))


def test_noisy_detector_does_not_bury_the_nan(caplog):
    engine = AnomalyEngine(AnomalyConfig(detectors=[{"type": "nonfinite"}, NOISY], actions=["log"]),
                           rank=0, rank_dir=None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        train(engine, 70, {step: "loss" for step in range(60, 70)})
    lines = logged(caplog)
    nonfinite = [step for step, line in lines if "first non-finite" in line]
    # printed at its own step (the shared throttle printed it first at step 64); its repeats at powers of two
    assert nonfinite == [60, 61, 63, 67]
    spike_steps = sorted({step for step, line in lines if line.startswith("[rank 0] spike:")})
    # the noisy rule fires on every step from step 1 (warm-up 1): its own streak, logged at 1, 2, 4, 8, ...
    assert spike_steps == [1, 2, 4, 8, 16, 32, 64]
    note = next(line for step, line in lines if step == 64 and "consecutive" in line)
    assert "(spike (actv/*/norm): anomalies in 64 consecutive steps; logging at powers of two)" in note


def test_first_nonfinite_comes_first_within_the_line_limit(caplog):
    """log_limit 2 at a step where the noisy rule's 3 lines are also due: the NaN line, then the summary."""
    engine = AnomalyEngine(AnomalyConfig(detectors=[NOISY, {"type": "nonfinite"}], actions=["log"], log_limit=2),
                           rank=3, rank_dir=None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        train(engine, 33, {32: "layers.2.output_grad"})
    at_32 = [r.getMessage() for r in caplog.records if "step 32" in r.getMessage()]
    assert len(at_32) == 2
    assert at_32[0].startswith("[rank 3] first non-finite value at step 32")
    assert at_32[1] == "[rank 3] ... and 3 more anomalies at step 32 (see anomalies.jsonl)"


def test_a_new_nonfinite_tensor_is_printed_inside_a_streak(caplog):
    """Steps 10..19 are NaN, the loss first; at 14 and 15 a gradient is NaN first: a new tensor, printed at 14."""
    engine = AnomalyEngine(AnomalyConfig(detectors=[{"type": "nonfinite"}], actions=["log"]), rank=0, rank_dir=None)
    nan_steps: dict[int, str] = {step: "loss" for step in range(10, 20)}
    nan_steps[14] = nan_steps[15] = "layers.0.output_grad"
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        train(engine, 20, nan_steps)
    printed = [step for step, line in logged(caplog) if "first non-finite" in line]
    # streak steps 1, 2, 4, 8 are 10, 11, 13, 17; 14 (streak 5) names a new tensor; 15 repeats it: throttled
    assert printed == [10, 11, 13, 14, 17]


def test_two_detectors_of_one_type_are_throttled_apart(caplog):
    """A spike rule on the loss is not silenced by a noisy spike rule on the activations."""
    loss_rule = {"type": "spike", "series": ["loss"], "method": "relative", "threshold": 2.0}
    engine = AnomalyEngine(AnomalyConfig(detectors=[NOISY, loss_rule], actions=["log"]), rank=0, rank_dir=None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(40):
            engine.process(record(step, rising_rows(step), loss=50.0 if step == 37 else 1.0))
    lines = logged(caplog)
    assert [step for step, line in lines if "spike: loss at step" in line] == [37]
    notes = [line for step, line in lines if "consecutive" in line]
    assert notes and all("(spike (actv/*/norm): anomalies in" in line for line in notes)


def test_log_action_alone_keys_on_the_event_detector(caplog):
    def event(step: int, detector: str, value: float) -> AnomalyEvent:
        return AnomalyEvent(step, 0, 0, "forward", "actv", "m.output", "norm", value, 1.0, detector,
                            f"{detector} at step {step}", 0)

    action = LogAction(rank=0, limit=10)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(6):
            action([event(step, "spike", 2.0)] + ([event(step, "custom", math.inf)] if step == 5 else []))
        action.quiet()
        action([event(6, "spike", 2.0)])
    assert [step for step, _ in logged(caplog)] == [0, 1, 3, 5, 6]  # 5: a NaN/Inf value is non-finite


def test_steps_that_are_not_collected_do_not_end_a_row_detectors_streak(caplog):
    """Every step's loss is checked (its record has the loss only); a rule on statistics rows fires on every
    collected step (every 5th): its run goes on across the steps in between, and the loss detector's own run
    ends on them."""
    engine = AnomalyEngine(AnomalyConfig(detectors=[{"type": "nonfinite"}, NOISY], actions=["log"]),
                           rank=0, rank_dir=None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(90):
            loss = NAN if step in (41, 43) else 1.0
            if step % 5 == 0:
                engine.process(record(step, rising_rows(step), loss=loss))
            else:
                engine.process(StepRecord(step, 0, scalars={"loss": loss}, collected=False))
    lines = logged(caplog)
    assert sorted({step for step, line in lines if line.startswith("[rank 0] spike:")}) == [5, 10, 20, 40, 80]
    assert [step for step, line in lines if "non-finite" in line] == [41, 43]
