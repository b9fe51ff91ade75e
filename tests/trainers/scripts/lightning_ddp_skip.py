"""Two Lightning DDP fits on 2 CPU processes (gloo), Lightning injecting its ``DistributedSampler`` into a plain
``DataLoader``: ``python lightning_ddp_skip.py OUT``.

The first fit leaves nothing out; the second is given a rollback (``TrainmonCallback(config, rollback=...)``) whose
skip list names the loader's batches 1 and 3 of epoch 0. Each rank writes ``OUT/seen_rank{R}.json``: the sample
indices of every batch ``training_step`` got in each fit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

from trainmon.actions.resume import Rollback
from trainmon.actions.skip_list import SkipList
from trainmon.trainers.lightning import TrainmonCallback

SAMPLES, BATCH, LEFT_OUT = 40, 4, [(0, 1, 2), (0, 3, 4)]


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((2,), float(index)), "index": torch.tensor(index)}


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["index"].tolist())
        return self.net(batch["x"]).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Samples(), batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(out: Path, rollback: Rollback | None) -> tuple[list[list[int]], int]:
    module = Module()
    config = {"output_dir": str(out / ("tm_skip" if rollback else "tm_plain")), "run_name": "run", "sinks": []}
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[TrainmonCallback(config, rollback=rollback)])
    trainer.fit(module)
    return module.seen, trainer.global_rank


def main(out: Path) -> None:
    entries = [{"step": i, "batch": {"batches": [list(batch)]}} for i, batch in enumerate(LEFT_OUT)]
    rollback = Rollback(path=out / "rollback.json", step=3, rank=0, exit_code=17, reason="", checkpoint=None,
                        resume_step=0, skip=SkipList(entries))
    plain, rank = fit(out, None)
    skipped, _ = fit(out, rollback)
    (out / f"seen_rank{rank}.json").write_text(json.dumps({"plain": plain, "skipped": skipped}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
