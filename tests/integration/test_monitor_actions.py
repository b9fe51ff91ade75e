"""Dump and free benchmark through TrainerMonitor (anomaly-triggered and by hand), and the monitor's
state_dict round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from tests.integration.test_dump import Net  # layer 2 can be poisoned with a NaN
from trainmon import TrainerMonitor
from trainmon.errors import ConfigError


def train(monitor: TrainerMonitor | None, steps: int = 8) -> dict[str, torch.Tensor]:
    """Adam on a fixed batch; layer 2's output gets a NaN at step 5 (that step's update is skipped)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.ones(4, 1)
    if monitor is not None:
        monitor.attach(model, optimizer)
        monitor.dump(["layers.0"], steps=[2])
        monitor.free_benchmark(["layers.1"], steps=[3])
    for step in range(steps):
        model.layers[2].poison = step == 5
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if torch.isfinite(loss):  # skip the poisoned step, as a loss scaler would
            optimizer.step()
        if monitor is not None:
            monitor.step(loss=loss)
    if monitor is not None:
        monitor.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_anomaly_actions_and_manual_requests_through_the_monitor(tmp_path: Path) -> None:
    monitor = TrainerMonitor({
        "output_dir": str(tmp_path), "run_name": "run", "sinks": [],
        "activations": {"enabled": True, "metrics": ["norm", "nans"]},
        "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
        "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump", "free_benchmark"]},
        "dump": {"enabled": True, "depth": 0},
        # change_value swaps the first and last input elements: a Linear fails it, so every check is in the CSV.
        "free_benchmark": {"enabled": True, "pert_mode": "change_value"},
    })
    observed = train(monitor)
    plain = train(None)
    for key, value in plain.items():
        assert torch.equal(value, observed[key]), key  # the monitor and both actions only observed

    rank_dir = tmp_path / "run" / "rank0"
    first = json.loads((rank_dir / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["name"]) == (5, "layers.2.output")
    assert sorted(p.name for p in (rank_dir / "dump").iterdir()) == ["step2", "step6"]
    anomaly_dump = json.loads((rank_dir / "dump" / "step6" / "dump.json").read_text())["data"]
    assert set(anomaly_dump) == {"Module.layers.2.Block.forward.0", "Module.layers.2.Block.backward.0"}
    backward = anomaly_dump["Module.layers.2.Block.backward.0"]
    assert len(backward["input"]) == 1 and len(backward["output"]) == 1
    manual_dump = json.loads((rank_dir / "dump" / "step2" / "dump.json").read_text())["data"]
    assert {key.split(".")[1] + "." + key.split(".")[2] for key in manual_dump} == {"layers.0"}

    checks = pd.read_csv(rank_dir / "free_benchmark.csv")
    assert list(zip(checks["step"], checks["name"])) == [(3, "layers.1"), (6, "layers.2")]
    assert set(checks["pert_mode"]) == {"change_value"}


def test_manual_requests_need_the_action_enabled(tmp_path: Path) -> None:
    model = Net()
    with TrainerMonitor({"output_dir": str(tmp_path), "sinks": []}).attach(model) as monitor:
        with pytest.raises(ConfigError, match="free_benchmark.enabled"):
            monitor.free_benchmark(["layers.0"])
        with pytest.raises(ConfigError, match="dump.enabled"):
            monitor.dump(["layers.0"])


def _losses_run(tmp_path: Path, name: str, scales: list[float], state: dict | None = None,
                start_step: int = 0) -> tuple[dict, list[dict]]:
    """Train on a fixed batch whose target is scaled per step (a large scale is a loss spike)."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": name, "sinks": [],
                              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
                              "anomaly": {"detectors": [{"type": "loss_spike", "warmup": 4}], "actions": ["jsonl"]}})
    with monitor.attach(model, optimizer, start_step=start_step):
        if state is not None:
            monitor.load_state_dict(state)
        for scale in scales:
            loss = nn.functional.mse_loss(model(x), torch.full((8, 1), scale))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(loss=loss)
        saved = monitor.state_dict()
    path = tmp_path / name / "rank0" / "anomalies.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return saved, events


def test_state_dict_round_trip_keeps_the_detector_warm(tmp_path: Path) -> None:
    state, events = _losses_run(tmp_path, "before", [1.0] * 6)
    assert events == [] and state["step"] == 6
    state = json.loads(json.dumps(state))  # JSON-compatible, as saved in a checkpoint

    # Resumed: the spike right after the resume is detected, with no new warm-up.
    resumed_state, events = _losses_run(tmp_path, "resumed", [30.0], state=state, start_step=state["step"])
    assert [(e["step"], e["detector"], e["name"]) for e in events] == [(6, "loss_spike", "loss")]
    assert resumed_state["step"] == 7

    # Control: a fresh monitor is still warming up and misses the same spike.
    _, events = _losses_run(tmp_path, "fresh", [30.0], start_step=6)
    assert events == []

    with pytest.raises(ValueError):
        _losses_run(tmp_path, "bad", [1.0], state={"anomaly": {"version": 1, "detectors": []}})
