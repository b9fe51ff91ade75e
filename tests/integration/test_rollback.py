"""The ``rollback`` action end to end, in a plain torch loop run as its own process (scripts/rollback_train.py).

A data range poisons training (labels whose square overflows: the loss is inf). The run stops with the rollback's
exit status, naming the last healthy checkpoint and the poisoned samples; run again, the same script resumes from
that checkpoint without those samples. The truth is the same loop run once without the range and without trainmon:
the resumed run's losses and final parameters equal it bit for bit (the same operations on the same data, on the
CPU), and the stopped run's losses before the poison equal it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.scripts.rollback_train import BATCH, POISON, SAVE_EVERY, STEPS

SCRIPT = Path(__file__).parent / "scripts" / "rollback_train.py"
ROOT = Path(__file__).resolve().parents[2]
EXIT = 17  # anomaly.rollback.exit_code's default


def _run(out: Path, mode: str, step_interval: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), str(out), mode, str(step_interval)], env=env, text=True,
                          capture_output=True, timeout=300)


def _losses(out: Path, mode: str) -> list[tuple[int, float]]:
    lines = (out / "losses.jsonl").read_text().splitlines()
    return [(row["step"], row["loss"]) for row in map(json.loads, lines) if row["mode"] == mode]


@pytest.mark.parametrize("step_interval", [1, 4], ids=["collected", "checked-at-the-checkpoint"])
def test_a_poisoned_range_rolls_back_and_the_resumed_run_follows_a_run_without_it(tmp_path, step_interval):
    poisoned_step = POISON[0] // BATCH  # 5
    first = _run(tmp_path, "train", step_interval)
    assert first.returncode == EXIT, first.stderr[-3000:]
    assert "trainmon rollback" in first.stderr

    run_dir = tmp_path / "monitor" / "run"
    rollback = json.loads((run_dir / "rollback.json").read_text())
    healthy = poisoned_step // SAVE_EVERY * SAVE_EVERY  # the last checkpoint saved before the poisoned step: 3
    assert rollback["exit_code"] == EXIT and rollback["resume_step"] == healthy
    assert rollback["checkpoint"] == str(tmp_path / "checkpoints" / f"step{healthy}.pt")
    # only the poisoned step's data: the steps after it fail because of the weights, not their data
    assert [(entry["step"], entry["batch"]) for entry in rollback["skip"]] == [
        (poisoned_step, {"samples": [list(POISON)]})]
    assert rollback["events"][0]["detector"] == "nonfinite" and rollback["events"][0]["name"] == "loss"
    events = [json.loads(line) for line in (run_dir / "rank0" / "anomalies.jsonl").read_text().splitlines()]
    assert events[0]["step"] == poisoned_step and events[0]["batch"] == {"samples": [list(POISON)]}
    skip_list = [json.loads(line) for line in (run_dir / "rank0" / "skip_list.jsonl").read_text().splitlines()]
    assert skip_list == rollback["skip"]
    # the checkpoint saved after the poisoned step (when there is one before the run stops) is tagged unhealthy
    later = tmp_path / "checkpoints" / f"step{healthy + SAVE_EVERY}.pt"
    if later.exists():
        assert json.loads(torch.load(later, weights_only=True)["trainmon"])["healthy"] is False
    assert json.loads(torch.load(rollback["checkpoint"], weights_only=True)["trainmon"])["healthy"] is True

    resumed = _run(tmp_path, "train", step_interval)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = _run(tmp_path, "reference", step_interval)
    assert reference.returncode == 0, reference.stderr[-3000:]

    expected = dict(_losses(tmp_path, "reference"))
    assert len(expected) == STEPS
    train = _losses(tmp_path, "train")
    stopped, after = train[:len(train) - (STEPS - healthy)], train[len(train) - (STEPS - healthy):]
    assert [step for step, _ in after] == list(range(healthy, STEPS))
    assert after == [(step, expected[step]) for step in range(healthy, STEPS)]  # the resumed run: bit for bit
    assert stopped[:poisoned_step] == [(step, expected[step]) for step in range(poisoned_step)]
    assert stopped[poisoned_step][1] == float("inf")
    final, reference_final = (torch.load(tmp_path / f"final_{mode}.pt", weights_only=True)
                              for mode in ("train", "reference"))
    for name, value in reference_final.items():
        assert torch.equal(final[name], value), name
