"""The ``rollback`` action with trainer callbacks.

HF Trainer, end to end in processes of its own (scripts/hf_rollback.py): the batch of one step makes the loss NaN;
the run stops with the rollback's exit status, naming the last healthy checkpoint (``trainmon_health.json`` in each
checkpoint folder says which are); run again with ``trainer.train(resume_from_checkpoint=<that checkpoint>)``, the
callback leaves that batch out. The truth is the same Trainer without trainmon on data without that batch: the
Trainer's own logged losses and the final parameters equal it bit for bit.

Lightning: saved checkpoints carry the state's health (``on_save_checkpoint``), each step's events name the
step's batch (``[epoch, position, position + 1]``), and the resumed fit leaves the poisoned batch out of a plain
``DataLoader(batch_size=None)`` (end to end against a reference: test_lightning_rollback.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.loops.common import MLP, data

ROOT = Path(__file__).resolve().parents[2]
EXIT = 17


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / script), *args], env=env,
                          text=True, capture_output=True, timeout=600)


def _losses(logs: list[list[dict]]) -> dict[int, float]:
    """The Trainer's logged loss of every step (a resumed run's history repeats the checkpoint's steps)."""
    return {entry["step"]: entry["loss"] for history in logs for entry in history if "loss" in entry}


def test_hf_trainer_rolls_back_and_resumes_without_the_poisoned_batch(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    from tests.trainers.scripts.hf_rollback import BAD, SAVE_EVERY, STEPS

    first = _run("hf_rollback.py", str(tmp_path), "train")
    assert first.returncode == EXIT, first.stderr[-3000:]
    healthy = (BAD - 1) // SAVE_EVERY * SAVE_EVERY  # the last checkpoint before the poisoned step: 4
    folder = tmp_path / "hf_train" / f"checkpoint-{healthy}"
    rollback = json.loads((tmp_path / "tm" / "run" / "rollback.json").read_text())
    assert rollback["checkpoint"] == str(folder) and rollback["resume_step"] == healthy + 1
    assert [(entry["step"], entry["batch"]) for entry in rollback["skip"]] == [(BAD, {"batches": [[0, BAD - 1, BAD]]})]
    health = json.loads((folder / "trainmon_health.json").read_text())
    assert health["healthy"] is True and health["step"] == healthy + 1

    resumed = _run("hf_rollback.py", str(tmp_path), "train")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = _run("hf_rollback.py", str(tmp_path), "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]

    expected = _losses(json.loads((tmp_path / "log_reference.json").read_text()))
    logs = json.loads((tmp_path / "log_train.json").read_text())
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert {step: loss for step, loss in _losses(logs[1:]).items()} == expected  # the resumed run, bit for bit
    stopped = _losses(logs[:1])
    assert {step: stopped[step] for step in range(1, BAD)} == {step: expected[step] for step in range(1, BAD)}
    final, reference_final = (torch.load(tmp_path / f"final_{mode}.pt", weights_only=True)
                              for mode in ("train", "reference"))
    for name, value in reference_final.items():
        assert torch.equal(final[name], value), name
    events = [json.loads(line) for line in (tmp_path / "tm" / "run" / "rank0" / "anomalies.jsonl").read_text()
              .splitlines()]
    assert events[0]["step"] == BAD and events[0]["batch"] == {"batches": [[0, BAD - 1, BAD]]}


def test_lightning_tags_checkpoints_rolls_back_and_finds_the_rollback_on_resume(tmp_path):
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    from trainmon.trainers.lightning import TrainmonCallback

    steps, bad = 6, 3

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    batches = []
    for step in range(steps):
        x, y = data(step)
        if step == bad:
            y = torch.full_like(y, float("nan"))
        batches.append((x, y))
    monitor = {"output_dir": str(tmp_path / "tm"), "run_name": "run", "sinks": ["csv"],
               "anomaly": {"actions": ["log", "jsonl", "rollback"]}}

    def fit(ckpt_path=None) -> TrainmonCallback:
        callback = TrainmonCallback(monitor)
        checkpoints = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu", devices=1, callbacks=[callback, checkpoints])
        trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
        return callback

    with pytest.raises(SystemExit) as stopped:
        fit()
    assert stopped.value.code == EXIT
    saved = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    state = torch.load(saved, weights_only=False)["trainmon"]
    assert (state["healthy"], state["step"], state["checkpoint"]) == (True, 2, str(saved))
    rollback = json.loads((tmp_path / "tm" / "run" / "rollback.json").read_text())
    assert rollback["checkpoint"] == str(saved) and rollback["resume_step"] == 2
    assert [(entry["step"], entry["batch"]) for entry in rollback["skip"]] == [(bad, {"batches": [[0, bad, bad + 1]]})]
    events = [json.loads(line) for line in (tmp_path / "tm" / "run" / "rank0" / "anomalies.jsonl").read_text()
              .splitlines()]
    assert events[0]["step"] == bad and events[0]["batch"] == {"batches": [[0, bad, bad + 1]]}

    resumed = fit(ckpt_path=str(saved))  # the poisoned batch is still in the data: the callback leaves it out
    assert resumed.rollback is not None and resumed.rollback.checkpoint == str(saved)
    later = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=False)["trainmon"]
    assert later["healthy"] is True and later["monitor"]["health"]["last_healthy"]["checkpoint"] == later["checkpoint"]
