"""Every step's loss reaches the detectors, collected or not, without a host synchronisation on the steps that
are not collected (issue 30): detection on the loss no longer depends on ``step_interval``.

The acceptance case runs a nanoGPT-style script (``scripts/nanogpt_lr_fault.py``) with the README's sample config
(``examples/monitor.yaml``, as a user copies it) and a learning-rate bug from step 60 on; the reference for the
recorded losses is the script's own log (``loss.item()`` printed per step), not trainmon.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainmon import TrainerMonitor

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "nanogpt_lr_fault.py"


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "rank0" / "anomalies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _scalars(run_dir: Path, name: str) -> dict[int, float]:
    """Rank 0's scalar ``name`` by step, from the run store (the default output) as a user queries it."""
    from trainmon.tools.store import open_run

    connection = open_run(run_dir)
    try:
        rows = connection.execute("SELECT step, value FROM scalars WHERE rank = 0 AND name = ? ORDER BY step",
                                  [name]).fetchall()
    finally:
        connection.close()
    return {int(step): float(value) for step, value in rows}


@pytest.mark.parametrize("bad_step", [60, -1])
def test_readme_config_reports_an_lr_bug_within_a_few_steps_on_a_nanogpt_run(tmp_path, bad_step):
    shutil.copy(ROOT / "examples" / "monitor.yaml", tmp_path / "monitor.yaml")  # as a user copies it
    done = subprocess.run([sys.executable, str(SCRIPT), "monitor.yaml", "--bad-step", str(bad_step)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = {int(m[1]): float(m[2]) for m in re.finditer(r"^iter (\d+): loss (\S+)$", done.stdout, re.M)}
    assert len(logged) == 80
    run_dir = tmp_path / re.search(r"^run_dir (.+)$", done.stdout, re.M)[1]
    assert run_dir.parent == tmp_path / "trainmon_output"
    # every step's loss is recorded (step_interval is 10), equal to what the script logged (4 decimals there)
    recorded = _scalars(run_dir, "loss")
    assert sorted(recorded) == list(range(80))
    assert all(abs(recorded[s] - logged[s]) <= 6e-5 * max(1.0, logged[s]) for s in logged)
    spikes = [e for e in _events(run_dir) if e["detector"] == "loss_spike"]
    if bad_step < 0:
        assert _events(run_dir) == []  # the healthy run: no false alarm from any default detector
        return
    # the lr bug at step 60 first shows in the loss of step 61 (its update is applied after step 60's loss)
    assert logged[61] > 3 * logged[59]
    assert spikes and 61 <= spikes[0]["step"] <= 63, spikes[:3]
    assert re.search(rf"loss_spike \(\w+\): loss at step {spikes[0]['step']} is", done.stderr), done.stderr[-2000:]


def _train(tmp_path: Path, config: dict, losses: dict[int, float], steps: int = 12) -> tuple[list, Path]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run",
                              "anomaly": {"actions": ["log", "jsonl", "callback"]}, **config})
    monitor.on_anomaly(seen.append)
    monitor.attach(model, optimizer)
    x = torch.randn(16, 4)
    for step in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = losses.get(step)
        monitor.step(loss=loss if value is None else loss.detach() * 0 + value, tokens=torch.tensor(float(step)))
    monitor.close()
    return seen, tmp_path / "run"


@pytest.mark.parametrize("async_results", [False, True])
def test_uncollected_steps_reach_the_detectors_in_step_order(tmp_path, async_results):
    seen, run_dir = _train(tmp_path, {"step_interval": 5, "async_results": async_results},
                           {3: math.nan, 5: math.inf, 7: math.nan, 11: math.nan})
    nonfinite = [(e.step, e.name) for e in seen if e.detector == "nonfinite"]
    assert [step for step, _ in nonfinite] == [3, 5, 7, 11] and {name for _, name in nonfinite} == {"loss"}
    tokens = _scalars(run_dir, "tokens")
    assert tokens == {s: float(s) for s in range(12)}  # every scalar given to step(), every step


def test_a_disabled_monitor_checks_nothing(tmp_path):
    seen, _ = _train(tmp_path / "off", {"enabled": False}, {3: math.nan})
    assert seen == []


def test_the_readme_shows_the_sample_config_as_it_is():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"`examples/monitor\.yaml`.*?\n```yaml\n(.*?)```", readme, re.S)
    assert block is not None
    assert block[1] == (ROOT / "examples" / "monitor.yaml").read_text(encoding="utf-8")


def test_a_model_without_submodules_and_without_optimizer_with_the_sample_config(tmp_path, monkeypatch):
    """pytorch/examples' ``regression/main.py`` as written there (one ``nn.Linear``, a hand-written SGD update, a
    loop until the loss is small) with the sample config added: the default targets ``["*"]`` select the model
    itself, its rows equal float64 numpy of the tensors the loop used, every step's loss is recorded."""
    shutil.copy(ROOT / "examples" / "monitor.yaml", tmp_path / "monitor.yaml")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    fc = nn.Linear(4, 1)
    monitor = TrainerMonitor("monitor.yaml")
    monitor.attach(fc)
    inputs, losses = {}, {}
    for batch_idx in range(25):
        x = torch.randn(32, 4)
        y = x @ torch.tensor([[0.5], [-1.0], [2.0], [0.3]]) + 1.0
        fc.zero_grad()
        output = torch.nn.functional.smooth_l1_loss(fc(x), y)
        inputs[batch_idx], losses[batch_idx] = x.double().numpy(), output.item()
        output.backward()
        for param in fc.parameters():
            param.data.add_(-0.1 * param.grad)
        monitor.step(loss=output)
    monitor.close()
    run_dir = monitor.run_dir
    assert _scalars(run_dir, "loss") == pytest.approx(losses, rel=1e-6)
    from trainmon.tools.store import open_run

    connection = open_run(run_dir)
    try:
        frame = connection.sql("SELECT * FROM actv WHERE rank = 0").df()
    finally:
        connection.close()
    rows = {(int(r["step"]), r["name"]): r for _, r in frame.iterrows()}
    assert sorted({step for step, _ in rows}) == [0, 10, 20]
    for step in (0, 10, 20):
        assert float(rows[step, ".input"]["norm"]) == pytest.approx(float(np.linalg.norm(inputs[step])), rel=1e-6)
