"""Activation checkpointing (``torch.utils.checkpoint``, what HF ``gradient_checkpointing_enable()``, torchtitan and
Lightning use): the forward re-run inside the backward is not measured again. One ``actv`` row per module and
micro-step, with the values of the real forward (the test's own float64 copies of the first call of each
module in each step); gradient rows equal those of the same model without checkpointing (whose values the
float64 tests of tests/integration/test_torch_families.py check). On both statistics paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.loops.common import config, rows
from tests.reference import METRICS, assert_close, np_stats
from trainmon import TrainerMonitor
from trainmon.collect import stats


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = torch.nn.Linear(8, 8), torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class _Net(torch.nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.mode == "none" else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


def _train(tmp_path, mode: str, name: str):
    torch.manual_seed(0)
    model = _Net(mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first_calls: dict[tuple[int, str], np.ndarray] = {}
    step_now = [0]

    def capture(module_name):
        def hook(module, args, output):  # the first call of a module in a step is the real forward
            first_calls.setdefault((step_now[0], f"{module_name}.output"), output.detach().double().numpy().copy())
        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in model.named_modules() if n and n != "blocks"]
    monitor = TrainerMonitor(config(tmp_path / name, activations={"enabled": True, "metrics": METRICS},
                                    weight_grads={"enabled": False}, optimizer_states={"enabled": False}))
    monitor.attach(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        step_now[0] = step
        x = torch.randn(4, 8, generator=generator).requires_grad_()  # reentrant checkpointing needs an input with grad
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    for handle in handles:
        handle.remove()
    return rows(tmp_path / name, "actv"), rows(tmp_path / name, "actv_grad"), first_calls


@pytest.mark.parametrize("device_path", [False, True], ids=["numpy-path", "device-path"])
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_the_forward_rerun_in_the_backward_is_not_measured_again(tmp_path, monkeypatch, mode, device_path):
    if device_path:
        monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())  # what CUDA and Ascend run (grouped activations)
    actv, actv_grad, first_calls = _train(tmp_path, mode, "checkpointed")
    plain_actv, plain_grad, _ = _train(tmp_path, "none", "plain")
    assert not actv.duplicated(["step", "micro_step", "name"]).any()
    assert actv[["step", "name"]].values.tolist() == plain_actv[["step", "name"]].values.tolist()
    outputs = actv[actv.name.str.endswith(".output")]
    assert len(outputs) == 3 * 7  # blocks.{0,1}, their fc and act, head; three steps
    for _, row in outputs.iterrows():
        assert_close(row, np_stats(first_calls[(row["step"], row["name"])]), METRICS, rtol=1e-5,
                     label=f"{mode} {row['name']} {row['step']}")
    assert actv_grad[["step", "name"]].values.tolist() == plain_grad[["step", "name"]].values.tolist()
    np.testing.assert_allclose(actv_grad[METRICS].to_numpy(float), plain_grad[METRICS].to_numpy(float), rtol=1e-5,
                               atol=1e-7)
