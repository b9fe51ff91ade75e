"""The step guard behind a trainer's optimizer wrapper: accelerate's ``AcceleratedOptimizer`` (HF Trainer) and
Lightning's ``LightningOptimizer`` (automatic optimisation: ``step(closure)``; manual optimisation). The guard sits
on the real torch optimizer, so it sees the real step.

The truth is the same trainer run on the same data without the poisoned batch (and one optimizer step fewer),
without trainmon: the parameters and the optimizer states of the guarded run equal it bit for bit. A constant
learning rate keeps the two runs' schedules the same (the guarded run counts the skipped step, the reference
does not).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.loops.common import MLP, data

STEPS, BAD = 5, 2


def _assert_same_state(model, optimizer, reference_model, reference_optimizer) -> None:
    for (name, param), expected in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.equal(param, expected), f"parameter {name} differs from the run without the poisoned batch"
    state, expected = optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    assert state.keys() == expected.keys() and len(state) > 0
    for index, values in expected.items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(state[index][key]), torch.as_tensor(value)), (index, key)


def _guard_events(rank_dir) -> list[dict]:
    lines = (rank_dir / "anomalies.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["detector"] == "step_guard"]


# ----------------------------------------------------------------------------- HF Trainer
class _ScaledLM(torch.nn.Module):
    """A causal LM whose loss is multiplied by the batch's ``scale`` (NaN in the poisoned batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None, scale=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))
        return {"loss": loss * scale.mean(), "logits": logits}


class _Items(torch.utils.data.IterableDataset):
    """Token rows in a fixed order (no sampler shuffles them), two per batch; ``skip``: leave a batch out."""

    def __init__(self, poisoned: int | None, skip: int | None) -> None:
        self.poisoned, self.skip = poisoned, skip

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(2 * STEPS):
            ids = torch.randint(0, 64, (8,), generator=g)
            if i // 2 != self.skip:
                yield {"input_ids": ids, "labels": ids,
                       "scale": torch.tensor(float("nan") if i // 2 == self.poisoned else 1.0)}


def _hf_run(tmp_path, guarded: bool):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from trainmon.trainers.hf import TrainmonCallback

    torch.manual_seed(0)
    model = _ScaledLM()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"hf{guarded}"), max_steps=STEPS if guarded else STEPS - 1,
        per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0, logging_steps=1)
    monitor = {"output_dir": str(tmp_path / "tm"), "run_name": "hf", "sinks": ["csv"],
               "anomaly": {"guard": {"enabled": True}}}
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=_Items(BAD, None) if guarded else _Items(None, BAD),
                                   callbacks=[TrainmonCallback(monitor)] if guarded else [])
    trainer.train()
    return model, trainer.optimizer.optimizer


def test_hf_trainer_skips_the_poisoned_batch(tmp_path):
    model, optimizer = _hf_run(tmp_path, guarded=True)
    _assert_same_state(model, optimizer, *_hf_run(tmp_path, guarded=False))
    (event,) = _guard_events(tmp_path / "tm" / "hf" / "rank0")
    assert event["step"] == BAD + 1 and "(nonfinite)" in event["message"]  # the Trainer counts steps from 1


# ----------------------------------------------------------------------------- Lightning
def _lightning_run(tmp_path, guarded: bool, manual: bool):
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    from trainmon.trainers.lightning import TrainmonCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if manual:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)

    batches = []
    for step in range(STEPS):
        x, y = data(step)
        if step == BAD:
            if not guarded:
                continue
            x = x.clone()
            x[0, 0] = float("nan")
        batches.append((x, y))
    torch.manual_seed(0)
    module = Module()
    monitor = {"output_dir": str(tmp_path / "tm"), "run_name": "lightning", "sinks": ["csv"],
               "anomaly": {"guard": {"enabled": True}}}
    trainer = L.Trainer(max_steps=len(batches), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[TrainmonCallback(monitor)] if guarded else [])
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return module, trainer.optimizers[0]


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_lightning_skips_the_poisoned_batch(tmp_path, manual):
    module, optimizer = _lightning_run(tmp_path, guarded=True, manual=manual)
    _assert_same_state(module, optimizer, *_lightning_run(tmp_path, guarded=False, manual=manual))
    (event,) = _guard_events(tmp_path / "tm" / "lightning" / "rank0")
    assert event["step"] == BAD and event["name"] == "net.fc1.weight" and "(nonfinite)" in event["message"]
