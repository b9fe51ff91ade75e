"""A ``transformers.Trainer`` run with trainmon's ``rollback`` action, as a user writes it: ``python hf_rollback.py
OUT MODE``.

MODE ``train``: resumes from the newest rollback, if any (``trainer.train(resume_from_checkpoint=...)``: the
callback finds the rollback naming that checkpoint and leaves out its batches), else starts from scratch; the batch
of step ``BAD`` makes the loss NaN, and the callback stops the run with the rollback's exit status. MODE
``reference``: the same Trainer without trainmon, on data without that batch. Writes ``OUT/log_{mode}.json`` (the
Trainer's ``log_history``, appended to by a resumed run) and ``OUT/final_{mode}.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

import trainmon
from trainmon.trainers.hf import TrainmonCallback

STEPS, BAD, SAVE_EVERY, BATCH = 8, 5, 2, 2  # BAD: the Trainer's step (counted from 1)


class ScaledLM(torch.nn.Module):
    """A causal LM whose loss is multiplied by the batch's ``scale`` (NaN in the poisoned batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None, scale=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))
        return {"loss": loss * scale.mean(), "logits": logits}


class Rows(torch.utils.data.IterableDataset):
    """Token rows in a fixed order, ``BATCH`` per batch; the batch of step ``BAD`` poisoned, or left out."""

    def __init__(self, leave_out: bool) -> None:
        self.leave_out = leave_out

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(BATCH * (STEPS + 4)):
            ids = torch.randint(0, 64, (8,), generator=g)
            poisoned = i // BATCH == BAD - 1
            if not (poisoned and self.leave_out):
                yield {"input_ids": ids, "labels": ids, "scale": torch.tensor(float("nan") if poisoned else 1.0)}


def main(out: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = ScaledLM()
    args = transformers.TrainingArguments(
        output_dir=str(out / f"hf_{mode}"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        lr_scheduler_type="constant", save_strategy="steps", save_steps=SAVE_EVERY, report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, logging_steps=1)
    callbacks, resume = [], None
    if mode == "train":
        monitor = {"output_dir": str(out / "tm"), "run_name": "run", "sinks": ["csv"],
                   "anomaly": {"actions": ["log", "jsonl", "rollback"]}}
        callbacks = [TrainmonCallback(monitor)]
        run_dir = out / "tm" / "run"
        rollback = trainmon.read_rollback(run_dir) if run_dir.exists() else None
        resume = rollback.checkpoint if rollback is not None else None
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(leave_out=mode == "reference"),
                                   callbacks=callbacks)
    log = out / f"log_{mode}.json"
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        earlier = json.loads(log.read_text()) if log.exists() else []
        log.write_text(json.dumps(earlier + [trainer.state.log_history]))
    torch.save(model.state_dict(), out / f"final_{mode}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
