"""Localising the module that makes a non-finite value when the first origin names none (plain torch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.integration.test_dump import Net, assert_no_hooks, assert_stats
from trainmon import TrainerMonitor
from trainmon.actions.frameworks import TorchFramework
from trainmon.actions.localise import NonfiniteLocaliser
from trainmon.actions.modules import ModuleTable


def test_default_config_dumps_the_poisoned_layer(tmp_path: Path) -> None:
    """Activations off (the default): the loss is the first origin; the localiser finds layers.2 on the
    next step and its neighbourhood is dumped on the step after, with the values of that step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.ones(4, 1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": [], "dump": {"enabled": True},
                              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump"]}})
    monitor.attach(model, opt)
    inputs = {}

    def keep_input(module: nn.Module, args: tuple) -> None:
        inputs.setdefault(step, args[0].detach().double().numpy())

    handle = model.layers[2].register_forward_pre_hook(keep_input)
    for step in range(7):
        model.layers[2].poison = step >= 3
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if torch.isfinite(loss):  # skip the poisoned steps, as a loss scaler would
            opt.step()
        monitor.step(loss=loss)
    monitor.close()
    handle.remove()
    assert_no_hooks(model)
    rank_dir = tmp_path / "run" / "rank0"
    first = json.loads((rank_dir / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["name"]) == (3, "loss")
    found = [json.loads(line) for line in (rank_dir / "dump" / "localisation.jsonl").read_text().splitlines()]
    assert [(f["anomaly_step"], f["step"], f["module"], f["kind"], f["dump_step"]) for f in found] == [
        (3, 4, "layers.2", "output", 5)]  # the anomaly of step 6 is localised on step 7, which never came
    assert "localised at step 4 to the forward of layers.2" in found[0]["message"]
    assert sorted(p.name for p in (rank_dir / "dump").iterdir()) == ["localisation.jsonl", "step5"]
    data = json.loads((rank_dir / "dump" / "step5" / "dump.json").read_text())["data"]
    assert {"Module.layers.2.Block.forward.0", "Module.layers.2.fc.Linear.forward.0",
            "Module.layers.2.act.Tanh.forward.0", "Module.layers.2.fc.Linear.parameters_grad"} <= set(data)
    block = data["Module.layers.2.Block.forward.0"]
    assert_stats(block["input_args"][0], inputs[5])
    assert np.isnan(block["output"][0]["Max"])


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class NanGrad(torch.autograd.Function):
    """Identity forward; a NaN gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Outer(nn.Module):
    """``mode`` picks where a non-finite value is made."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = Inner(), Inner(), nn.Linear(4, 1)
        self.mode = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.mode == "own_code":
            h = h * float("nan")           # the parent's own code, between its submodules
        h = self.second(h)
        if self.mode == "backward":
            h = NanGrad.apply(h)           # finite forward, NaN gradient
        return self.head(h)


def _localise(mode: str, steps: int = 1) -> list:
    torch.manual_seed(0)
    model = Outer()
    model.mode = mode
    x = torch.randn(3, 4)
    if mode == "data":
        x[0, 0] = float("nan")
    if mode == "parameters":
        with torch.no_grad():
            model.second.fc.weight[0, 0] = float("inf")
    localiser = NonfiniteLocaliser(ModuleTable(model, TorchFramework()))
    localiser.request(0, "loss")
    results = []
    for step in range(1, steps + 1):
        localiser.begin_step(step)
        out = model(x)
        loss = out.sqrt().sum() if mode == "loss_backward" else out.sum()
        loss.backward()
        results.append(localiser.end_step())
    localiser.close()
    assert_no_hooks(model)
    return results


@pytest.mark.parametrize(("mode", "phase", "module", "kind", "seen_at"), [
    ("own_code", "forward", "second", "model_code", "second"),  # the model's own code, between submodules
    ("data", "forward", "first", "model_input", "first"),
    ("parameters", "forward", "second.fc", "parameters", "second.fc"),
    ("backward", "backward", "second", "output_grad", "second"),  # made by the model's code after second
])
def test_kinds(mode: str, phase: str, module: str, kind: str, seen_at: str) -> None:
    (found,) = _localise(mode)
    assert (found.found, found.phase, found.module, found.kind, found.seen_at) == (True, phase, module, kind, seen_at)


def test_backward_origin_inside_a_module() -> None:
    """A NaN made by a module's backward from finite gradients: its input gradient is the first one."""
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return NanGrad.apply(self.inner(x))

    torch.manual_seed(0)
    model = nn.Sequential(Inner(), Wrapped(), nn.Linear(4, 1))
    localiser = NonfiniteLocaliser(ModuleTable(model, TorchFramework()))
    localiser.request(0, "loss")
    localiser.begin_step(1)
    model(torch.randn(3, 4)).sum().backward()
    found = localiser.end_step()
    # The gradient w.r.t. 1.inner's output (also 1.inner.fc's) is the first non-finite one: made by the
    # backward code of the module that encloses it, 1 (NanGrad in its forward).
    assert (found.phase, found.module, found.kind, found.seen_at) == ("backward", "1", "output_grad", "1.inner")
    assert "own backward code (outside its submodules) made the gradient w.r.t. the output of 1.inner" \
        in found.message

    localiser.request(0, "loss")  # the loss's own gradient: nothing encloses the module it reaches
    localiser.begin_step(2)
    model(torch.randn(3, 4)).abs().sqrt().sum().backward()  # sqrt'(0) is inf where the output is 0
    localiser.end_step()


def test_no_nonfinite_value_gives_up_after_three_steps() -> None:
    results = _localise("none", steps=4)
    assert results[:2] == [None, None]  # tried again
    assert results[2] is not None and not results[2].found and "in 3 step(s)" in results[2].message
    assert results[3] is None  # nothing pending any more
