"""Issue 30, the way a user meets it: a msprobe config whose AnomalyTurbulence rule fires on every step, a real
torch training loop, a NaN entering at step 60.

Before: the console throttle (powers of two) was shared by every detector, so the NaN was first printed at
step 64, and ``trainmon analyse`` named a step-1 turbulence event as the first origin. Now the NaN line is
printed while step 60 is processed, and ``trainmon analyse`` names the first non-finite value (step 60) and
the first spike (step 1) apart. References: the step at which the NaN was put into the batch, and the events
of ``anomalies.jsonl`` read with ``json`` and ordered by hand.
"""

from __future__ import annotations

import json
import logging
import math

import torch
from torch import nn

from trainmon import TrainerMonitor
from trainmon.tools.cli import main

NAN_STEP = 60
STEPS = 70
MSPROBE_CONFIG = {
    "targets": {},
    "xy_distribution": True,
    "ops": ["norm", "max"],
    "format": "csv",
    # threshold 0: a value above the mean of the series' earlier values fires. The inputs grow by 1% a step,
    # so the input norm of layer 0 fires on every step from step 1 (msprobe's warm-up is one value).
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.0}}], "dump": True},
}
PHASES = {"forward": 0, "loss": 1, "backward": 2, "communication": 3, "optimizer": 4}


def train(tmp_path, monkeypatch, caplog) -> tuple[dict[int, list[str]], object]:
    """The user's loop; returns the lines printed while each step was processed, and the run directory."""
    config = tmp_path / "monitor_config.json"
    config.write_text(json.dumps(MSPROBE_CONFIG))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    base, target = torch.randn(32, 8), torch.randn(32, 1)
    printed: dict[int, list[str]] = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"), TrainerMonitor.from_msprobe(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(STEPS):
            x = base * (1 + 0.01 * step)
            if step == NAN_STEP:
                x[3, 5] = math.nan  # a corrupt sample
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            before = len(caplog.records)
            monitor.step(loss=loss)
            printed[step] = [r.getMessage() for r in caplog.records[before:] if r.name == "trainmon"]
    (run,) = (tmp_path / "out").iterdir()
    return printed, run


def test_nan_printed_at_its_step_and_analysed_apart_from_the_turbulence(tmp_path, monkeypatch, caplog, capsys):
    printed, run = train(tmp_path, monkeypatch, caplog)
    events = [json.loads(line) for line in (run / "rank0" / "anomalies.jsonl").read_text().splitlines()]
    spikes = {e["step"] for e in events if e["detector"] == "spike"}
    assert spikes >= set(range(1, NAN_STEP)), "the turbulence rule must fire on every step before the NaN"

    # the console: the NaN line while step 60 is processed; the rule firing every step is throttled on its own
    nan_lines = [line for line in printed[NAN_STEP] if "first non-finite value" in line]
    assert len(nan_lines) == 1
    assert nan_lines[0].startswith(f"[rank 0] first non-finite value at step {NAN_STEP}, micro-step 0, rank 0: "
                                   "forward input of 0")
    spike_printed = [step for step, lines in printed.items() if any(line.startswith("[rank 0] spike:") for line in
                                                                     lines)]
    assert [step for step in spike_printed if step < NAN_STEP] == [1, 2, 4, 8, 16, 32]

    # trainmon analyse, as run from the command line
    assert main(["analyse", str(run), "--top", "3"]) == 0
    out = capsys.readouterr().out
    written = json.loads((run / "anomaly_analyse.json").read_text())

    def key(e):
        return (e["step"], e["micro_step"], PHASES[e["phase"]], e["pp_stage"], e["order"], e["rank"])

    ordered = sorted(events, key=key)
    first_nonfinite = next(e for e in ordered if e["detector"] == "nonfinite")
    first_spike = next(e for e in ordered if e["detector"] == "spike")
    assert (first_nonfinite["step"], first_nonfinite["name"]) == (NAN_STEP, "0.input")  # where the NaN was put
    assert first_spike["step"] == 1
    assert written["first_nonfinite"] == first_nonfinite and written["first_origin"] == first_nonfinite
    assert written["first_spike"] == first_spike
    assert f"first non-finite: step {NAN_STEP}, rank 0 [nonfinite]: {first_nonfinite['message']}" in out
    assert f"first spike: step 1, rank 0 [spike]: {first_spike['message']}" in out
    assert f"first origin: {first_nonfinite['message']}" in out

    # only the turbulence rule's events
    assert main(["analyse", str(run), "--detector", "spike", "-o", str(tmp_path / "spikes.json")]) == 0
    only = json.loads((tmp_path / "spikes.json").read_text())
    assert only["events"] == sum(e["detector"] == "spike" for e in events)
    assert only["first_nonfinite"] is None and only["first_origin"] == only["first_spike"] == first_spike
