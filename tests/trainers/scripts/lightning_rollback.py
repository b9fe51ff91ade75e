"""A Lightning fit with trainmon's ``rollback`` action, as a user writes it: ``python lightning_rollback.py OUT SCENARIO
MODE``.

The data: ``SAMPLES`` samples in a map-style dataset, batches of ``BATCH`` from a plain ``DataLoader`` (no
SkipSampler: trainmon leaves the batches out). The batch at position ``p`` of epoch ``e`` is poisoned (its loss is
NaN) when ``(e, p)`` is in the scenario's ``poison``.

MODE ``train``: resumes from the newest rollback, if any (``trainer.fit(..., ckpt_path=rollback.checkpoint)``: the
callback finds the rollback naming that checkpoint and leaves its batches out), else starts from scratch; a
poisoned batch stops the run with the rollback's exit status. MODE ``reference``: the same fit without trainmon,
whose ``train_dataloader`` never yields the poisoned batches. Writes ``OUT/losses_{mode}.json`` (``[global_step,
loss]`` of every training step, appended to by a resumed run) and ``OUT/final_{mode}.pt``.

Scenarios: ``mid``: checkpoints every 3 steps (mid-epoch), two poisoned batches of epoch 0 (two rollbacks), two
epochs (``reload_dataloaders_every_n_epochs=1``: the epochs have different lengths); ``end``: checkpoints at the
end of each epoch, a poisoned batch in epoch 1; ``user``: as ``mid`` in one epoch, with a ``trainmon.SkipSampler``
of the user's in the loader (``SkipSampler(SequentialSampler(data), rollback)``) and ``batch_ids``: its samples.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

import trainmon
from trainmon.trainers.lightning import TrainmonCallback

SAMPLES, BATCH = 40, 4  # 10 batches per epoch
SCENARIOS = {
    "mid": {"poison": [(0, 4), (0, 7)], "epochs": 2, "every_n_train_steps": 3},
    "end": {"poison": [(1, 2)], "epochs": 2, "every_n_train_steps": None},
    "user": {"poison": [(0, 4), (0, 7)], "epochs": 1, "every_n_train_steps": 3},
}


class Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index], "index": torch.tensor(index)}


class Positions(torch.utils.data.Sampler[int]):
    """The reference's sampler: the samples of the batches not poisoned in ``epoch``, in order."""

    def __init__(self, poison: list[tuple[int, int]], epoch: int) -> None:
        super().__init__()
        self.indices = [i for i in range(SAMPLES) if (epoch, i // BATCH) not in poison]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Module(L.LightningModule):
    def __init__(self, scenario: str, mode: str, rollback) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
        self.data = Samples()
        self.scenario, self.mode, self.rollback = scenario, mode, rollback
        self.poison = [tuple(p) for p in SCENARIOS[scenario]["poison"]]
        self.losses: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        position = int(batch["index"][0]) // BATCH  # the sampler is sequential: a batch's position in the epoch
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        if (self.current_epoch, position) in self.poison:
            loss = loss * float("nan")
        self.losses.append([self.global_step, float(loss)])
        return loss

    def train_dataloader(self):
        if self.mode == "reference":
            sampler = Positions(self.poison, self.current_epoch)
        elif self.scenario == "user":
            sampler = trainmon.SkipSampler(torch.utils.data.SequentialSampler(self.data), self.rollback)
        else:
            return torch.utils.data.DataLoader(self.data, batch_size=BATCH)  # a plain DataLoader
        return torch.utils.data.DataLoader(self.data, batch_size=BATCH, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out: Path, scenario: str, mode: str) -> None:
    setting = SCENARIOS[scenario]
    run_dir = out / "tm" / "run"
    rollback = trainmon.read_rollback(run_dir) if mode == "train" and run_dir.exists() else None
    callbacks: list[L.Callback] = []
    if mode == "train":
        monitor = {"output_dir": str(out / "tm"), "run_name": "run", "sinks": ["csv"],
                   "anomaly": {"actions": ["log", "jsonl", "rollback"]}}
        batch_ids = (lambda batch: batch["index"]) if scenario == "user" else None
        callbacks.append(TrainmonCallback(monitor, batch_ids=batch_ids))
        every = setting["every_n_train_steps"]
        callbacks.append(L.callbacks.ModelCheckpoint(
            dirpath=out / "ckpt", save_top_k=-1, every_n_train_steps=every,
            every_n_epochs=None if every else 1, save_on_train_epoch_end=True))
    module = Module(scenario, mode, rollback)
    # the reference's epochs have their own lengths (its loader is asked for again every epoch); the train runs'
    # too in ``mid``, where the resumed epoch 0 is shorter than epoch 1
    reload = 1 if mode == "reference" or scenario == "mid" else 0
    trainer = L.Trainer(max_epochs=setting["epochs"], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks,
                        enable_checkpointing=mode == "train", reload_dataloaders_every_n_epochs=reload)
    log = out / f"losses_{mode}.json"
    try:
        trainer.fit(module, ckpt_path=rollback.checkpoint if rollback is not None else None)
    finally:
        earlier = json.loads(log.read_text()) if log.exists() else []
        log.write_text(json.dumps(earlier + [module.losses]))
    torch.save(module.net.state_dict(), out / f"final_{mode}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
