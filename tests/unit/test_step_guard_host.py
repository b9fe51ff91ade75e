"""The step guard's host side (:mod:`trainmon.anomaly.skips`) and the engine's ``act``: verdicts in, events out."""

from __future__ import annotations

import json
import math

import pytest

from trainmon.anomaly.engine import AnomalyEngine
from trainmon.anomaly.skips import SkipReporter
from trainmon.base.records import StepRecord
from trainmon.config import AnomalyConfig, GuardConfig
from trainmon.errors import AnomalyError

NAMES = ["embed.weight", "layers.0.fc1.weight", "head.bias"]


def verdict(step: int, reason: int, param: int = 1, **values: float) -> StepRecord:
    """A record as the device side sends it: ``step_skipped`` and the ``step_guard/*`` scalars."""
    scalars = {"loss": 2.0, "step_skipped": float(reason > 0), "step_guard/reason": float(reason),
               "step_guard/param": float(param), "step_guard/value": 4.0, "step_guard/baseline": 1.0,
               "step_guard/z": 12.0, "step_guard/grad_norm": 9.0, "step_guard/grad_norm_mean": 3.0,
               "step_guard/grad_norm_z": 8.0}
    scalars.update({f"step_guard/{key}": value for key, value in values.items()})
    return StepRecord(step=step, rank=2, scalars=scalars)


def test_the_verdict_leaves_the_record_and_a_skip_names_its_parameter():
    reporter = SkipReporter(GuardConfig(enabled=True, max_grad_norm=5.0), NAMES, rank=2)
    applied = verdict(0, 0)
    assert reporter.take(applied, "t") == ([], None)
    assert applied.scalars == {"loss": 2.0, "step_skipped": 0.0}  # the sinks keep step_skipped only
    messages = {}
    for reason in (1, 2, 3, 4):
        record = verdict(reason, reason, value=math.nan if reason == 1 else 4.0)
        (event,), escalation = reporter.take(record, "t")
        assert (event.step, event.rank, event.name, event.family, event.metric, event.detector, event.phase) == \
            (reason, 2, "layers.0.fc1.weight", "grad_reduced", "norm", "step_guard", "optimizer")
        messages[reason] = event.message
    assert "(nonfinite): the gradient of layers.0.fc1.weight is not finite (norm nan)" in messages[1]
    assert "gradient norm 9 is above max_grad_norm 5" in messages[2]
    assert "gradient norm 9 is 8 standard deviations above its mean 3 (z_threshold 6" in messages[3]
    assert "gradient norm of layers.0.fc1.weight, 4, is 12 standard deviations above its mean 1" in messages[4]
    assert "(4 skipped so far, 4 in a row)" in messages[4]
    assert reporter.summary() == ("trainmon: the step guard skipped 4 of the 5 steps it judged (rank 2); "
                                  "see anomalies.jsonl")


def test_skips_in_a_row_escalate_at_each_multiple_and_an_applied_step_starts_again():
    reporter = SkipReporter(GuardConfig(enabled=True, escalate_after=2), NAMES, rank=0)
    escalations = []
    for step, reason in enumerate([1, 0, 3, 3, 3, 3, 0, 1]):
        _, escalation = reporter.take(verdict(step, reason), "t")
        if escalation is not None:
            escalations.append((escalation.step, escalation.value, escalation.metric))
            assert escalation.message.startswith(f"{int(escalation.value)} steps in a row skipped by the step guard")
    assert escalations == [(3, 2.0, "skipped_in_a_row"), (5, 4.0, "skipped_in_a_row")]
    assert reporter.take(StepRecord(step=9, rank=0, scalars={"loss": 1.0}), "t") == ([], None)  # no verdict
    never = SkipReporter(GuardConfig(enabled=True, escalate_after=None), NAMES, rank=0)
    assert all(never.take(verdict(step, 1), "t")[1] is None for step in range(20))


def test_an_unknown_parameter_index_or_reason_does_not_break_the_host_side():
    reporter = SkipReporter(GuardConfig(enabled=True), NAMES, rank=0)
    (event,), _ = reporter.take(verdict(0, 1, param=7), "t")
    assert event.name == "optimizer parameter 7"
    record = verdict(1, 0)
    record.scalars["step_guard/reason"] = math.nan
    assert reporter.take(record, "t") == ([], None)


def test_act_applies_the_actions_it_is_given(tmp_path):
    """The escalation's actions need not be anomaly.actions: here jsonl and raise, with no action configured."""
    engine = AnomalyEngine(AnomalyConfig(actions=[]), rank=0, rank_dir=tmp_path)
    reporter = SkipReporter(GuardConfig(enabled=True, escalate_after=1), NAMES, rank=0)
    found, escalation = reporter.take(verdict(4, 1), "t")
    assert engine.process(verdict(4, 0), found) == found  # the guard's event goes through the engine
    assert escalation is not None
    with pytest.raises(AnomalyError, match="1 steps in a row"):
        engine.act([escalation], ["jsonl", "raise"])
    engine.close()
    (line,) = (tmp_path / "anomalies.jsonl").read_text().splitlines()
    assert json.loads(line)["metric"] == "skipped_in_a_row"
