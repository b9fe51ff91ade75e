"""A plain torch training loop with checkpoints and trainmon's ``rollback`` action, written as a user writes it:
``python rollback_train.py OUT MODE STEP_INTERVAL``.

MODE ``train``: resumes from the newest rollback of the run, if any (its checkpoint, its data left out), else
starts from scratch; the samples ``POISON`` carry labels that make the loss overflow, and the monitor stops the run
with the rollback's exit status. MODE ``reference``: a run that never sees ``POISON`` (no monitor). Each run appends
``{"mode", "step", "loss"}`` lines to ``OUT/losses.jsonl`` and saves its final parameters to
``OUT/final_{mode}.pt``. ``STEP_INTERVAL`` is the monitor's ``step_interval`` (4: the poisoned step is not collected,
its loss is checked a step later, or when the next checkpoint asks for the state's health).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

import trainmon
from trainmon import TrainerMonitor

SAMPLES, BATCH, STEPS, SAVE_EVERY = 112, 8, 12, 3
POISON = (40, 48)  # the samples of step 5's batch


class Samples(Dataset):
    """``(index, x, y)``: the index of each sample comes with it, so the loop can say which data a step used."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = torch.randn(SAMPLES, 4, generator=g)
        self.y[POISON[0]:POISON[1]] = 3e19  # its square overflows float32: the loss is inf

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def main(out: Path, mode: str, step_interval: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_dir = out / "monitor" / "run"
    start, skip, rollback, state = 0, None, None, None
    if mode == "reference":
        skip = [POISON]
    else:
        rollback = trainmon.read_rollback(run_dir) if run_dir.exists() else None
        if rollback is not None:  # resume from the last healthy checkpoint, without the data it names
            skip, start = rollback, rollback.resume_step
            if rollback.checkpoint is not None:
                state = torch.load(rollback.checkpoint, weights_only=True)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
    data = Samples()
    loader = DataLoader(data, batch_size=BATCH, sampler=trainmon.SkipSampler(SequentialSampler(data), skip))
    monitor = None
    if mode == "train":
        monitor = TrainerMonitor({"output_dir": str(out / "monitor"), "run_name": "run", "sinks": ["csv"],
                                  "step_interval": step_interval,
                                  "anomaly": {"actions": ["log", "jsonl", "rollback"]}})
        monitor.attach(model, optimizer, start_step=start)
        if rollback is not None:
            monitor.resume(rollback)
            if state is not None:
                monitor.load_state_dict(json.loads(state["trainmon"]))
    batches = iter(loader)
    for _ in range(start):  # the batches the checkpoint has seen
        next(batches)
    with open(out / "losses.jsonl", "a") as log:
        for step in range(start, STEPS):
            indices, x, y = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            log.write(json.dumps({"mode": mode, "step": step, "loss": loss.item()}) + "\n")
            log.flush()
            if monitor is not None:
                monitor.step(loss=loss, batch=indices)
            if (step + 1) % SAVE_EVERY == 0:
                path = out / "checkpoints" / f"step{step + 1}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                trainmon_state = json.dumps(monitor.state_dict(checkpoint=path)) if monitor is not None else ""
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "trainmon": trainmon_state}, path)
    if monitor is not None:
        monitor.close()
    torch.save(model.state_dict(), out / f"final_{mode}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
