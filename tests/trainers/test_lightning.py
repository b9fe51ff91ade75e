"""Lightning with trainmon's one-line callback: automatic optimisation (closures) with accumulation,
gradient clipping and validation every few batches, and manual optimisation. References: the test's
own callback (gradients after the closure, i.e. what the optimizer used; the pre-clip norm in
``on_before_optimizer_step``) and the losses ``training_step`` returned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from tests.loops.common import MLP, data  # noqa: E402
from tests.reference import read_family  # noqa: E402
from trainmon.trainers.lightning import TrainmonCallback  # noqa: E402


class _Module(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = MLP()
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)  # training_step calls a submodule, not forward
        self.losses.append(float(loss))
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Reference(L.Callback):
    def __init__(self) -> None:
        self.pre_clip: list[float] = []
        self.used: list[dict[str, np.ndarray]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after the backward, before clipping
        grads = [p.grad.detach().double() for p in pl_module.parameters() if p.grad is not None]
        self.pre_clip.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.used) < trainer.global_step:  # an optimizer step ran in this batch: grads are still there
            self.used.append({f"net.{n}": p.grad.detach().double().numpy().copy()
                              for n, p in pl_module.net.named_parameters() if p.grad is not None})


def _loader(n: int, seed: int):
    xs, ys = zip(*(data(seed + i) for i in range(n)))
    return torch.utils.data.DataLoader(list(zip(torch.cat(xs).split(8), torch.cat(ys).split(8))), batch_size=None)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_lightning_with_the_callback(tmp_path, manual):
    torch.manual_seed(0)
    module = _Module(manual=manual)
    acc = 1 if manual else 2
    config = {"output_dir": str(tmp_path / "tm"), "run_name": "run", "sinks": ["csv"],
              "activations": {"enabled": True, "metrics": ["norm"]}, "targets": {"modules": ["net.fc1"]},
              "weight_grads": {"metrics": ["norm", "min", "max", "mean"]}}
    reference = _Reference()
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=acc, gradient_clip_val=None if manual else 0.05,
                        val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, callbacks=[TrainmonCallback(config), reference])
    trainer.fit(module, _loader(16, 0), _loader(4, 100))
    rank_dir = tmp_path / "tm" / "run" / "rank0"
    scalars = read_family(rank_dir, "scalars").pivot(index="step", columns="name", values="value")
    assert list(scalars.index) == [0, 1, 2, 3]
    reduced = read_family(rank_dir, "grad_reduced")
    for step in range(4):
        assert np.isclose(scalars.loc[step, "loss"], np.mean(module.losses[step * acc:(step + 1) * acc]), rtol=1e-5)
        if not manual:
            assert np.isclose(scalars.loc[step, "grad_norm"], reference.pre_clip[step], rtol=1e-5)
            assert reference.pre_clip[step] > 0.05  # clipping was active
        at = reduced[reduced.step == step].set_index("name")
        for name, grad in reference.used[step].items():
            assert np.isclose(at.loc[name, "norm"], np.linalg.norm(grad), rtol=1e-5), (step, name)
            assert np.isclose(at.loc[name, "max"], grad.max(), rtol=1e-5, atol=1e-8), (step, name)
    actv = read_family(rank_dir, "actv")
    fc1 = actv[actv.name == "net.fc1.output"]
    assert sorted(set(fc1.step)) == [0, 1, 2, 3]
    assert all(sorted(g.micro_step) == list(range(acc)) for _, g in fc1.groupby("step"))  # no validation rows
    unreduced = read_family(rank_dir, "grad_unreduced")
    assert set(unreduced.micro_step) == {acc - 1}


@pytest.mark.parametrize("kind", ["callback", "optimizer_pre_hook"])
def test_a_failure_of_trainmon_inside_lightning_never_reaches_fit(tmp_path, monkeypatch, caplog, kind):
    """Fail-safe: trainmon's own exception in a callback body (part ``step``) or in an optimizer hook (part
    ``weights``) during ``trainer.fit``: fit completes, the weights are bit-identical to a fit without trainmon,
    one warning names the part."""
    import logging

    from tests.faults import patched
    from trainmon.runtime.lifecycle import StepLifecycle

    def fit(callbacks):
        torch.manual_seed(0)
        module = _Module()
        trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                            limit_val_batches=0, callbacks=callbacks)
        trainer.fit(module, _loader(16, 0))
        return {name: p.detach().clone() for name, p in module.named_parameters()}

    expected = fit([])
    if kind == "callback":
        calls = [0]
        original = StepLifecycle.micro_step_begins

        def failing(self):
            calls[0] += 1
            if calls[0] >= 3:
                raise RuntimeError("injected fault in micro_step_begins")
            original(self)

        monkeypatch.setattr(StepLifecycle, "micro_step_begins", failing)
        part = "step"
    else:
        part = patched(monkeypatch, kind, after=2).part
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"]}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = fit([TrainmonCallback(config)])
    for name, param in expected.items():
        assert torch.equal(got[name], param), name
    warnings = [r.getMessage() for r in caplog.records if "is off for the rest of this run" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"trainmon: {part} failed"), warnings


class _TwoOptimizers(_Module):
    """A GAN-shaped module: two optimizers, manual optimisation."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.other = MLP()

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt, net in zip(self.optimizers(), (self.net, self.other)):
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.parameters(), lr=1e-2), torch.optim.SGD(self.other.parameters(), lr=1e-2)]


def test_several_optimizers_are_warned_about_once(tmp_path, caplog):
    """The monitor follows the first optimizer (docs/lightning.md): a module with two says so when the fit starts."""
    torch.manual_seed(0)
    config = {"output_dir": str(tmp_path / "tm"), "run_name": "run", "sinks": ["csv"]}
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[TrainmonCallback(config)])
    with caplog.at_level("WARNING", logger="trainmon"):
        trainer.fit(_TwoOptimizers(), _loader(4, 0))
    warned = [r.getMessage() for r in caplog.records if "has 2 optimizers" in r.getMessage()]
    assert len(warned) == 1, caplog.text
