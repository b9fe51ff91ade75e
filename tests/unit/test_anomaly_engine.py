"""AnomalyEvent JSON, the ordering rule, and the engine's actions on synthetic records."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest

from tests.unit.test_anomaly_detectors import record, row
from trainmon.anomaly.engine import AnomalyEngine
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.ordering import order_events
from trainmon.config import AnomalyConfig
from trainmon.errors import AnomalyError

NAN = math.nan
FIELDS = ["step", "micro_step", "rank", "phase", "family", "name", "metric", "value", "baseline", "detector",
          "message", "order", "pp_stage", "vpp_stage", "time"]


def event(step=0, micro=0, rank=0, phase="forward", pp=0, vpp=0, order=0, value=1.0):
    return AnomalyEvent(step, micro, rank, phase, "actv", f"m{rank}.{order}.output", "norm", value, NAN,
                        "spike", "msg", order, pp, vpp, "2026-11-21T10:00:00.123Z")


def nan_record(step, rank=0):
    return record(step, [row(step, "actv", "a.output", 0, norm=1.0), row(step, "actv", "b.output", 1, norm=NAN),
                         row(step, "actv_grad", "b.output_grad", 2, norm=NAN)], rank=rank, loss=NAN)


def test_event_json_schema_and_nonfinite_round_trip():
    e = event(value=math.inf)
    line = e.to_json()
    data = json.loads(line)  # strict JSON: no bare NaN/Infinity
    assert sorted(data) == sorted(FIELDS)
    assert data["value"] == "inf" and data["baseline"] == "nan"
    back = AnomalyEvent.from_json(line)
    assert back.value == math.inf and math.isnan(back.baseline) and back.to_json() == line
    with pytest.raises(ValueError, match="step"):
        AnomalyEvent.from_dict({**data, "step": "3"})
    with pytest.raises(ValueError, match="unknown"):
        AnomalyEvent.from_dict({**data, "extra": 1})


def test_ordering_rule():
    events = [event(step=2), event(step=1, micro=1), event(step=1, phase="optimizer"),
              event(step=1, phase="backward", pp=0), event(step=1, phase="backward", pp=1),
              event(step=1, phase="forward", pp=1), event(step=1, phase="forward", pp=0, order=5),
              event(step=1, phase="loss", pp=1)]
    got = [(e.step, e.micro_step, e.phase, e.pp_stage) for e in order_events(events)]
    assert got == [(1, 0, "forward", 0), (1, 0, "forward", 1), (1, 0, "loss", 1), (1, 0, "backward", 1),
                   (1, 0, "backward", 0), (1, 0, "optimizer", 0), (1, 1, "forward", 0), (2, 0, "forward", 0)]


def test_engine_actions_jsonl_log_callback(tmp_path, caplog):
    config = AnomalyConfig(actions=["log", "jsonl", "callback"], log_limit=2)
    engine = AnomalyEngine(config, rank=1, rank_dir=tmp_path)
    seen = []
    engine.on_anomaly(seen.append)
    engine.on_anomaly(lambda e: 1 / 0)  # a failing callback is logged once and disabled
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(5):
            events = engine.process(nan_record(step, rank=1))
            # the file holds the step's events once its writer thread caught up (process() never waits for it)
            assert engine.flush()
            lines = (tmp_path / "anomalies.jsonl").read_text().splitlines()
            assert len(lines) == step + 1 and AnomalyEvent.from_json(lines[-1]).step == step
        engine.process(record(5, loss=1.0))
        engine.process(nan_record(6, rank=1))
    assert [e.step for e in seen] == [0, 1, 2, 3, 4, 6]
    assert events[0].name == "b.output" and "b.output" in events[0].message
    messages = [r.getMessage() for r in caplog.records]
    failures = [m for m in messages if "failed and is disabled" in m]
    assert len(failures) == 1
    logged_steps = [m for m in messages if "first non-finite" in m]
    assert all(m.startswith("[rank 1] ") for m in logged_steps)
    # steps 0, 1, 3 of a streak (powers of two), then step 6 starts a new streak
    assert [int(m.split("at step ")[1].split(",")[0]) for m in logged_steps] == [0, 1, 3, 6]
    engine.close()
    engine.close()
    # a second engine (resumed run) appends, never rewrites
    again = AnomalyEngine(config, rank=1, rank_dir=tmp_path)
    again.process(nan_record(7, rank=1))
    again.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "anomalies.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 6, 7]


def test_log_limit_summarises(caplog):
    engine = AnomalyEngine(AnomalyConfig(detectors=[{"type": "spike", "series": ["actv/*/norm"], "warmup": 2}],
                                         actions=["log"], log_limit=3), rank=0, rank_dir=None)
    names = [f"l{i}.output" for i in range(10)]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(4):
            value = 100.0 if step == 3 else 1.0 + 0.01 * step
            engine.process(record(step, [row(step, "actv", n, i, norm=value) for i, n in enumerate(names)]))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "8 more anomalies at step 3" in messages[-1]


def test_raise_runs_after_other_actions_and_handoffs(tmp_path):
    engine = AnomalyEngine(AnomalyConfig(actions=["jsonl", "raise", "dump"]), rank=0, rank_dir=tmp_path)
    handed = []
    engine.register_action("dump", handed.append)
    with pytest.raises(AnomalyError, match="first non-finite value at step 4, micro-step 0, rank 0: "
                                           "forward output of b"):
        engine.process(nan_record(4))
    assert engine.flush()
    assert (tmp_path / "anomalies.jsonl").read_text().count("\n") == 1
    assert [[e.name for e in events] for events in handed] == [["b.output"]]
    assert engine.process(record(5, loss=1.0)) == []
    with pytest.raises(ValueError):
        engine.register_action("email", handed.append)
    engine.close()


def test_engine_state_dict_round_trip_and_mismatch():
    config = AnomalyConfig(detectors=[{"type": "nonfinite"}, {"type": "loss_spike"}], actions=[])
    engine = AnomalyEngine(config, 0, None)
    for step in range(20):
        engine.process(record(step, loss=1.0 + 0.01 * (step % 3)))
    state = json.loads(json.dumps(engine.state_dict()))
    other = AnomalyEngine(config, 0, None)
    other.load_state_dict(state)
    assert other.state_dict() == engine.state_dict()
    assert [e.step for e in other.process(record(20, loss=5.0))] == [20]
    with pytest.raises(ValueError, match="config has .*default_detectors: false"):
        AnomalyEngine(AnomalyConfig(detectors=[{"type": "nonfinite"}], default_detectors=False), 0,
                      None).load_state_dict(state)


@pytest.mark.parametrize("defaults", [3, 4])
def test_a_state_saved_with_earlier_defaults_loads_into_the_current_defaults(defaults):
    # A checkpoint of a run with an earlier default list ([nonfinite, loss_spike, per-layer spike], then with the
    # grad-norm watch) resumes with the defaults added since, which start fresh.
    earlier = [{"type": "nonfinite"}, {"type": "loss_spike"},
               {"type": "spike", "series": ["grad_reduced/*/norm"], "method": "log", "persist": 3},
               {"type": "spike", "series": ["grad_norm"], "method": "log", "threshold": 7.0,
                "min_relative_change": 2.2, "range_factor": 3.0}][:defaults]
    saved = AnomalyEngine(AnomalyConfig(detectors=earlier, default_detectors=False, actions=[]), 0, None)
    for step in range(20):
        saved.process(record(step, loss=1.0 + 0.01 * (step % 3), grad_norm=1.0))
    state = json.loads(json.dumps(saved.state_dict()))
    assert [d["type"] for d in state["detectors"]] == ["nonfinite", "loss_spike", "spike", "spike"][:defaults]
    resumed = AnomalyEngine(AnomalyConfig(actions=[]), 0, None)
    resumed.load_state_dict(state)
    now = resumed.state_dict()["detectors"]
    assert [d["type"] for d in now] == ["nonfinite", "loss_spike", "spike", "spike", "spike", "growth", "level",
                                        "level"]
    assert now[:defaults] == state["detectors"]
    assert all(d["state"] == {"series": []} for d in now[defaults:])  # fresh
    assert [e.name for e in resumed.process(record(20, loss=5.0, grad_norm=1.0))] == ["loss"]  # warm loss_spike
    with pytest.raises(ValueError, match="holds detectors"):
        AnomalyEngine(AnomalyConfig(detectors=[{"type": "spike", "series": ["lr"]}], actions=[]), 0,
                      None).load_state_dict(state)


def test_a_state_saved_before_the_zero_gradient_default_loads_into_the_current_defaults():
    """The seven defaults of the round before the zero-gradient level: their states load, the new level starts
    fresh."""
    from trainmon.anomaly.detectors import DEFAULT_DETECTORS, ZERO_GRAD_DEFAULT

    seven = [dict(spec) for spec in DEFAULT_DETECTORS if spec is not ZERO_GRAD_DEFAULT]
    saved = AnomalyEngine(AnomalyConfig(detectors=seven, default_detectors=False, actions=[]), 0, None)
    for step in range(20):
        saved.process(record(step, loss=1.0 + 0.01 * (step % 3), grad_norm=1.0))
    state = json.loads(json.dumps(saved.state_dict()))
    resumed = AnomalyEngine(AnomalyConfig(actions=[]), 0, None)
    resumed.load_state_dict(state)
    now = resumed.state_dict()["detectors"]
    assert now[:7] == state["detectors"] and now[7] == {"type": "level", "state": {"series": []}}


def test_anomaly_package_imports_no_framework():
    code = ("import sys, trainmon.anomaly, trainmon.tools.analyse, trainmon.anomaly.detectors; "
            "bad = [m for m in ('torch', 'mindspore', 'deepspeed', 'megatron') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_events_of_the_root_module_name_it():
    """``activations.root`` (msprobe's ``all_xy``) rows are named ``.output`` etc.; the message names the root."""
    from trainmon.anomaly.ordering import describe

    assert describe("actv_grad", ".output_grad", "backward") == "backward gradient w.r.t. the output of the root module"
    assert describe("actv", ".input.1", "forward") == "forward input of the root module (tensor 1)"
