"""Lightning resumes from a rollback with the rollback's batches left out, with a plain ``DataLoader``.

End to end, in processes of their own (scripts/lightning_rollback.py): a poisoned batch makes the loss NaN, the run
stops with the rollback's exit status naming the last healthy checkpoint, and ``trainer.fit(..., ckpt_path=
rollback.checkpoint)`` with the callback runs on without that batch. The truth is the same fit without trainmon
whose ``train_dataloader`` never yields the poisoned batches: the losses ``training_step`` computed and the final
parameters equal it bit for bit (one process on the CPU runs the same operations on the same data in the same
order; the checkpoint round trip is exact). Checkpoints mid-epoch (two rollbacks in a row: the second run's
positions count the batch it left out) and at the end of an epoch; with a ``trainmon.SkipSampler`` of the user's
in the loader, the same result (nothing left out twice).

Under DDP (2 processes, gloo; scripts/lightning_ddp_skip.py): after Lightning's ``DistributedSampler`` injection each
rank leaves out its own batches at the rollback's positions.

In process: the sampler wrapper under a ``DistributedSampler`` (the per-rank batches Lightning's injection makes),
a short last batch, the user's SkipSampler found inside Lightning's ``DistributedSamplerWrapper``, ``rollback=``
without a checkpoint, a shuffled loader (samples left out), and the set-ups refused when the fit starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from trainmon.actions.resume import Rollback  # noqa: E402
from trainmon.actions.skip_batches import BatchPlan, SkipBatches  # noqa: E402
from trainmon.actions.skip_list import SkipList, SkipSampler  # noqa: E402
from trainmon.errors import UnsupportedSetupError  # noqa: E402
from trainmon.trainers.lightning import TrainmonCallback  # noqa: E402
from trainmon.trainers.lightning_data import user_skip_samplers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXIT = 17


def _run(out: Path, scenario: str, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = Path(__file__).parent / "scripts" / "lightning_rollback.py"
    return subprocess.run([sys.executable, str(script), str(out), scenario, mode], env=env, text=True,
                          capture_output=True, timeout=600)


def _check_against_reference(out: Path, runs: int) -> None:
    """Every finite loss of every run equals the reference's at its step; the last run ends where the reference
    ends; the final parameters are the reference's, bit for bit."""
    (expected,) = json.loads((out / "losses_reference.json").read_text())
    expected = {step: loss for step, loss in expected}
    assert sorted(expected) == list(range(len(expected)))
    histories = json.loads((out / "losses_train.json").read_text())
    assert len(histories) == runs
    for number, history in enumerate(histories):
        steps = [step for step, _ in history]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        stopped = number < runs - 1  # a stopped run's last step is the poisoned one
        finite = history[:-1] if stopped else history
        assert not stopped or math.isnan(history[-1][1])
        assert {step: loss for step, loss in finite} == {step: expected[step] for step, _ in finite}, number
    assert histories[-1][-1][0] == max(expected)
    final, reference = (torch.load(out / f"final_{mode}.pt", weights_only=True) for mode in ("train", "reference"))
    for name, value in reference.items():
        assert torch.equal(final[name], value), name


def _rollback(out: Path, name: str = "rollback.json") -> dict:
    return json.loads((out / "tm" / "run" / name).read_text())


def _skipped(rollback: dict) -> list:
    return sorted(batch for entry in rollback["skip"] for batch in entry["batch"]["batches"])


@pytest.mark.parametrize("scenario", ["mid", "user"])
def test_lightning_resumes_mid_epoch_checkpoints_without_the_poisoned_batches(tmp_path, scenario):
    first = _run(tmp_path, scenario, "train")
    assert first.returncode == EXIT, first.stderr[-3000:]
    rollback = _rollback(tmp_path)  # step 4 (position 4) poisoned; checkpoints every 3 steps
    assert rollback["checkpoint"] == str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt") and rollback["resume_step"] == 3
    assert _skipped(rollback) == [[0, 4, 5]]

    second = _run(tmp_path, scenario, "train")
    assert second.returncode == EXIT, second.stderr[-3000:]
    rollback = _rollback(tmp_path, "rollback.1.json")  # position 7 is step 6: position 4 was left out
    assert rollback["checkpoint"] == str(tmp_path / "ckpt" / "epoch=0-step=6.ckpt") and rollback["resume_step"] == 6
    assert _skipped(rollback) == [[0, 4, 5], [0, 7, 8]]
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=6.ckpt", weights_only=False)["trainmon"]
    assert [entry["batch"]["batches"] for entry in saved["skip"]] == [[[0, 4, 5]]]  # what its run left out
    if scenario == "user":  # batch_ids: the entries name the samples too, which the user's SkipSampler leaves out
        assert [entry["batch"]["samples"] for entry in rollback["skip"]] == [[[16, 20]], [[28, 32]]]

    third = _run(tmp_path, scenario, "train")
    assert third.returncode == 0, third.stderr[-3000:]
    reference = _run(tmp_path, scenario, "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    _check_against_reference(tmp_path, runs=3)
    assert "reload_dataloaders_every_n_epochs" not in third.stderr  # the epochs' lengths are planned right


def test_lightning_resumes_an_end_of_epoch_checkpoint_without_the_poisoned_batch(tmp_path):
    first = _run(tmp_path, "end", "train")
    assert first.returncode == EXIT, first.stderr[-3000:]
    rollback = _rollback(tmp_path)  # epoch 1's batch 2 (step 12) poisoned; a checkpoint at each epoch's end
    assert rollback["checkpoint"] == str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt") and rollback["resume_step"] == 10
    assert _skipped(rollback) == [[1, 2, 3]]
    resumed = _run(tmp_path, "end", "train")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = _run(tmp_path, "end", "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    _check_against_reference(tmp_path, runs=2)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_under_ddp_each_rank_leaves_out_its_own_batches_after_lightnings_sampler_injection(tmp_path):
    """Two ranks (gloo), a plain ``DataLoader``: Lightning injects ``DistributedSampler(shuffle=True)``; with a rollback
    naming batches 1 and 3 of epoch 0, each rank trains on its own batches less its batches 1 and 3."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = Path(__file__).parent / "scripts" / "lightning_ddp_skip.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, text=True, capture_output=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    for seen in ranks:
        assert len(seen["plain"]) == 5
        assert seen["skipped"] == [batch for i, batch in enumerate(seen["plain"]) if i not in (1, 3)]
    assert sorted(i for seen in ranks for batch in seen["plain"] for i in batch) == list(range(40))  # split by rank


# ----------------------------------------------------------------------------- in process
def test_the_wrapper_leaves_out_each_ranks_own_batches_under_a_distributed_sampler():
    """Lightning injects ``DistributedSampler(dataset)`` before the strategy's ``process_dataloader``: positions are
    the rank's own batches, and ``set_epoch`` still reaches the distributed sampler."""
    data = list(range(42))
    for rank in (0, 1):
        plain = torch.utils.data.distributed.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True)
        inner = torch.utils.data.distributed.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True)
        plan = BatchPlan({1: [(1, 3)]}, {}, None, epoch=lambda inner=inner: inner.epoch)
        wrapped = SkipBatches(inner, plan, per_batch=4)
        for number in (0, 1):
            plain.set_epoch(number)
            wrapped.set_epoch(number)
            batches = list(torch.utils.data.BatchSampler(list(plain), 4, drop_last=False))  # 21 samples: 6 batches
            kept = [b for i, b in enumerate(batches) if number != 1 or i not in (1, 2)]
            got = list(torch.utils.data.BatchSampler(wrapped, 4, drop_last=False))
            assert got == kept and len(torch.utils.data.BatchSampler(wrapped, 4, drop_last=False)) == len(kept)
            assert [plan.position(number, taken) for taken in range(len(kept))] == \
                [i for i in range(6) if number != 1 or i not in (1, 2)]


def test_the_wrapper_leaves_out_a_short_last_batch_and_resumes_mid_epoch():
    plan = BatchPlan({0: [(4, 5)]}, {}, (0, 2), epoch=lambda: 0)
    wrapped = SkipBatches(range(18), plan, per_batch=4)  # batches 0-3 of 4, batch 4 of 2 (left out)
    assert len(wrapped) == 16  # Lightning counts the epoch's batches the checkpoint's run took
    assert list(wrapped) == list(range(8, 16)) and plan.starts == {0: 2}
    assert len(wrapped) == 16 and list(wrapped) == list(range(16))  # the next pass: the whole epoch


def test_the_users_skip_sampler_is_found_inside_lightnings_distributed_wrapper():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    user = SkipSampler(torch.utils.data.SequentialSampler(range(16)), [(4, 8)])
    loader = torch.utils.data.DataLoader(range(16), batch_size=4,
                                         sampler=DistributedSamplerWrapper(user, num_replicas=2, rank=0))
    assert user_skip_samplers(loader) == [user]
    assert user_skip_samplers(torch.utils.data.DataLoader(range(16), batch_size=4)) == []


class _Module(L.LightningModule):
    def __init__(self, loader) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.loader = loader
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        index, ones = batch
        self.seen += index.reshape(-1).tolist()
        return self.net(ones.reshape(-1, 2)).sum()

    def train_dataloader(self):
        return self.loader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(module, callback, max_epochs=1, **options) -> L.Trainer:
    trainer = L.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, accelerator="cpu", devices=1, callbacks=[callback], **options)
    trainer.fit(module)
    return trainer


def _given(tmp_path, batches, samples=None) -> Rollback:
    entries = [{"step": 0, "batch": {"batches": [list(b)]}} for b in batches]
    for entry, ranges in zip(entries, samples or []):
        entry["batch"]["samples"] = ranges
    return Rollback(path=tmp_path / "rollback.json", step=0, rank=0, exit_code=EXIT, reason="", checkpoint=None,
                    resume_step=0, skip=SkipList(entries))


def test_a_given_rollback_is_left_out_from_the_start_and_the_strategy_is_restored(tmp_path):
    data = [(torch.tensor([i]), torch.ones(2)) for i in range(6)]
    module = _Module(torch.utils.data.DataLoader(data, batch_size=None))  # batches without a BatchSampler
    callback = TrainmonCallback({"output_dir": str(tmp_path / "tm"), "sinks": []},
                                rollback=_given(tmp_path, [(0, 2, 4)]))
    trainer = _fit(module, callback)
    assert module.seen == [0, 1, 4, 5]
    assert "process_dataloader" not in vars(trainer.strategy)  # the wrapper is gone after the fit


def test_a_shuffled_loader_leaves_out_the_samples_or_is_refused_without_them(tmp_path):
    """torch's ``RandomSampler`` draws its order anew in the resumed run: positions name other data there, so the
    rollback's samples (``batch_ids=``) are left out, in every epoch; without samples the fit is refused."""
    data = [(torch.tensor([i]), torch.ones(2)) for i in range(12)]
    config = {"output_dir": str(tmp_path / "tm"), "sinks": []}
    module = _Module(torch.utils.data.DataLoader(data, batch_size=3, shuffle=True))
    rollback = _given(tmp_path, [(0, 1, 2)], samples=[[[3, 6]]])
    _fit(module, TrainmonCallback(config, rollback=rollback), max_epochs=2)
    assert sorted(module.seen) == sorted(2 * [i for i in range(12) if not 3 <= i < 6])

    module = _Module(torch.utils.data.DataLoader(data, batch_size=3, shuffle=True))
    with pytest.raises(UnsupportedSetupError, match="RandomSampler.*batch_ids="):
        L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, accelerator="cpu", devices=1,
                  callbacks=[TrainmonCallback(config, rollback=_given(tmp_path, [(0, 1, 2)]))]).fit(module)
    assert module.seen == []


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ((torch.tensor([i]), torch.ones(2)) for i in range(6))


class _Pairs(torch.utils.data.Sampler):
    def __init__(self) -> None:
        super().__init__()

    def __iter__(self):
        return iter([[0, 1], [2, 3], [4, 5]])

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize("kind", ["iterable", "batch_sampler"])
def test_a_loader_whose_batches_cannot_be_left_out_is_refused_before_training(tmp_path, kind):
    data = [(torch.tensor([i]), torch.ones(2)) for i in range(6)]
    loader = (torch.utils.data.DataLoader(_Stream(), batch_size=None) if kind == "iterable"
              else torch.utils.data.DataLoader(data, batch_sampler=_Pairs()))
    module = _Module(loader)
    callback = TrainmonCallback({"output_dir": str(tmp_path / "tm"), "sinks": []},
                                rollback=_given(tmp_path, [(0, 1, 2)]))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, accelerator="cpu", devices=1, callbacks=[callback])
    with pytest.raises(UnsupportedSetupError, match="cannot leave batches out") as refused:
        trainer.fit(module)
    assert module.seen == [] and "process_dataloader" not in vars(trainer.strategy)  # nothing trained; undone
    assert ("IterableDataset" if kind == "iterable" else "_Pairs") in str(refused.value)


def test_without_a_rollback_the_loader_is_lightnings_own(tmp_path):
    data = [(torch.tensor([i]), torch.ones(2)) for i in range(6)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    module = _Module(loader)
    trainer = _fit(module, TrainmonCallback({"output_dir": str(tmp_path / "tm"), "sinks": []}))
    assert module.seen == list(range(6)) and trainer.train_dataloader is loader
