"""The rollback through ``TrainerMonitor`` in this process: where the run stops (at the end of a step ended by
``monitor.step()``, never from a hook), the health of saved states, and a step the step guard skipped."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.loops.common import MLP, data
from trainmon import TrainerMonitor
from trainmon.actions.rollback import RollbackExit

BAD = 3


def _config(tmp_path, **anomaly) -> dict:
    return {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
            "anomaly": {"actions": ["log", "jsonl", "rollback"], **anomaly}}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data(step)
    if step == BAD:
        y = torch.full_like(y, float("nan"))
    return x, y


def test_monitor_step_stops_the_run_with_the_exit_status_after_closing(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor(_config(tmp_path)).attach(model, optimizer)
    states = {}
    with pytest.raises(SystemExit) as stopped:
        for step in range(6):
            x, y = _batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(loss=loss, batch=range(16 * step, 16 * step + 16))
            states[step] = monitor.state_dict(checkpoint=f"ckpt/{step}")
    assert isinstance(stopped.value, RollbackExit) and stopped.value.code == 17
    assert sorted(states) == list(range(BAD)) and all(state["healthy"] for state in states.values())
    assert monitor.rollback == stopped.value.rollback and monitor.rollback["checkpoint"] == f"ckpt/{BAD - 1}"
    assert monitor.guard is None  # closed: its hooks are gone, its files written
    written = json.loads((tmp_path / "run" / "rollback.json").read_text())
    assert written["skip"][0]["batch"] == {"samples": [[16 * BAD, 16 * BAD + 16]]}


def test_a_step_ended_by_a_hook_never_raises_the_rollback(tmp_path, caplog):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.ERROR, logger="trainmon"), TrainerMonitor(_config(tmp_path)) as monitor:
        monitor.attach(model, optimizer)
        for step in range(6):  # no monitor.step(): the next forward ends the step
            x, y = _batch(step)
            monitor.batch((16 * step, 16 * step + 16))
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if monitor.rollback is not None:
                break
    assert monitor.rollback is not None and monitor.rollback["step"] == BAD and step == BAD + 1
    assert "never stops a run from a hook" in caplog.text


def test_a_step_the_guard_skipped_keeps_the_state_healthy_and_enters_the_skip_list(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with TrainerMonitor(_config(tmp_path, guard={"enabled": True})) as monitor:
        monitor.attach(model, optimizer)
        for step in range(6):
            x, y = _batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(loss=loss, batch=[16 * step + i for i in range(16)])
        state = monitor.state_dict()
    assert state["healthy"] is True and monitor.rollback is None
    lines = (tmp_path / "run" / "rank0" / "skip_list.jsonl").read_text().splitlines()
    (entry,) = map(json.loads, lines)
    assert entry["step"] == BAD and entry["reason"] == "step_guard (nonfinite)" and entry["applied"] is False
    assert entry["batch"] == {"samples": [[16 * BAD, 16 * BAD + 16]]}


def test_health_of_a_state_and_of_a_state_saved_before_health_existed(tmp_path):
    model = MLP()
    with TrainerMonitor(_config(tmp_path)) as monitor:
        monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(TypeError, match="integers"):
            monitor.batch([0.5, 1.5])
        state = monitor.state_dict()
        assert state["healthy"] is True and state["health"]["last_healthy"] == {"step": 0, "checkpoint": None}
        monitor.load_state_dict({"anomaly": state["anomaly"], "step": 0})  # an older state: health kept as is
        assert monitor.state_dict()["healthy"] is True
    with pytest.raises(RuntimeError, match="attach"):
        TrainerMonitor(_config(tmp_path)).batch((0, 4))
