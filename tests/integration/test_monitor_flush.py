"""``monitor.flush(timeout)``: what was handed to the outputs is on disk when it returns True, and a stuck output
never holds the caller longer than the timeout."""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest
import torch
from torch import nn

from trainmon import TrainerMonitor


def _steps(monitor: TrainerMonitor, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
        losses.append(float(loss.detach()))
    return losses


def test_flush_writes_every_record_and_event_before_close(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # flush_seconds far away: without flush() nothing would be flushed during the test
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "flush_seconds": 3600, "anomaly": {"actions": ["jsonl"], "default_detectors": False,
                                                                 "detectors": [{"type": "level", "series": ["loss"],
                                                                                "threshold": -1.0, "persist": 1,
                                                                                "from_below": False}]}})
    with monitor.attach(model, optimizer):
        losses = _steps(monitor, model, optimizer, 7)
        assert monitor.flush(timeout=30) is True
        scalars = pd.read_csv(tmp_path / "run" / "rank0" / "scalars.csv")
        loss = scalars[scalars["name"] == "loss"].sort_values("step")
        assert loss["step"].tolist() == list(range(7))
        assert loss["value"].to_numpy() == pytest.approx(losses, rel=1e-6)  # the values the loop computed
        events = (tmp_path / "run" / "rank0" / "anomalies.jsonl").read_text().splitlines()
        assert len(events) == 1  # the loss is above -1 from step 0: one excursion, one event
    assert monitor.flush() is True  # after close: close wrote everything


def test_flush_gives_up_after_its_timeout_on_a_stuck_output(tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"]})
    release = threading.Event()
    with monitor.attach(model, optimizer):
        sink = monitor._session.writer.sinks[0]  # the test plays a disk that hangs
        write = sink.write
        sink.write = lambda record: (release.wait(60), write(record))  # type: ignore[method-assign]
        _steps(monitor, model, optimizer, 3)
        start = time.monotonic()
        assert monitor.flush(timeout=0.3) is False
        assert time.monotonic() - start < 5.0
        _steps(monitor, model, optimizer, 2)  # training goes on meanwhile
        release.set()
        assert monitor.flush(timeout=30) is True
    assert (tmp_path / "run" / "rank0" / "scalars.csv").exists()


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), "5", True])
def test_flush_rejects_a_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        TrainerMonitor({"sinks": []}).flush(timeout=timeout)


def test_flush_before_attach_has_nothing_to_wait_for():
    assert TrainerMonitor({"sinks": []}).flush(timeout=0) is True
