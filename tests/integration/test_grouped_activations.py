"""Activations measured in groups on the device path (``activations.group_mb``): the same rows and values as
measured in their hooks, with a few statistics calls per forward and backward instead of one per tensor;
a tensor the model modifies in place after its hook keeps the value it had at the hook. References are
the test's own float64 copies of the tensors, taken where the model computes them."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.reference import METRICS, assert_close, np_stats, read_family
from trainmon import TrainerMonitor
from trainmon.collect import stats


class _AddsInPlace(torch.nn.Module):
    """fc1 -> (its output modified in place by the parent, from step ``from_step`` on) -> fc2 -> fc3.

    ``seen`` holds float64 copies of every target's input and output as the hooks see them.
    """

    def __init__(self, from_step: int = 0) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4)
        self.from_step, self.step = from_step, 0
        self.seen: dict[str, np.ndarray] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.seen["fc1.input"], self.seen["fc1.output"] = _f64(x), _f64(h)
        if self.step >= self.from_step:
            h += 1.5  # after fc1's forward hook: its row must keep the value before this
        out = self.fc2(torch.tanh(h))
        self.seen["fc2.output"] = _f64(out)
        return self.fc3(out)  # fc3's input is fc2's output: one tensor, two rows


def _f64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().double().numpy().copy()


def _config(tmp_path, **activations):
    return {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "weight_grads": {"enabled": False},
            "optimizer_states": {"enabled": False},
            "activations": {"enabled": True, "metrics": METRICS, "grad_hooks": "tensor", **activations}}


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    """Every CPU tensor takes the device path (what CUDA and Ascend run), with the fused kernel."""
    monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())


def _count_calls(monkeypatch) -> list[int]:
    """Counts the statistics calls (one kernel call each, whatever the group size)."""
    sizes: list[int] = []
    original = stats.device_partials

    def counted(tensors, spec):
        sizes.append(len(tensors))
        return original(tensors, spec)

    monkeypatch.setattr(stats, "device_partials", counted)
    return sizes


@pytest.mark.parametrize("from_step", [0, 2])
def test_a_tensor_modified_after_its_hook_keeps_its_value(tmp_path, caplog, from_step):
    """From the first step (learned, no row lost) or from step 2 (that row is skipped once, with a warning)."""
    torch.manual_seed(0)
    model = _AddsInPlace(from_step)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[tuple[str, int], np.ndarray] = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"), TrainerMonitor(_config(tmp_path)) as monitor:
        monitor.attach(model, optimizer)
        for step in range(5):
            model.step = step
            torch.nn.functional.mse_loss(model(torch.randn(6, 8)), torch.randn(6, 4)).backward()
            seen.update({(name, step): value for name, value in model.seen.items()})
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    actv = read_family(tmp_path / "run" / "rank0", "actv")
    lost = {(2, "fc1.output")} if from_step == 2 else set()
    for step in range(5):
        for name in ("fc1.input", "fc1.output", "fc2.output"):
            rows = actv[(actv.step == step) & (actv.name == name)]
            if (step, name) in lost:
                assert rows.empty
                continue
            assert len(rows) == 1, (step, name)
            assert_close(rows.iloc[0], np_stats(seen[(name, step)]), METRICS, rtol=1e-5, label=f"{name} {step}")
    warned = "fc1.output was modified in place after its hook" in caplog.text
    assert warned == (from_step == 2)


def test_rows_are_measured_together_and_equal_those_measured_in_hooks(tmp_path, monkeypatch):
    torch.manual_seed(0)
    runs = {}
    for group_mb in (256, 0, 1e-5):  # grouped; each in its hook; groups of about one tensor (the bound)
        model = _AddsInPlace(from_step=99)
        model.load_state_dict(_AddsInPlace(99).state_dict() if not runs else runs["state"])
        runs.setdefault("state", {k: v.clone() for k, v in model.state_dict().items()})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        calls = _count_calls(monkeypatch)
        out = tmp_path / str(group_mb)
        with TrainerMonitor(_config(out, group_mb=group_mb)) as monitor:
            monitor.attach(model, optimizer)
            generator = torch.Generator().manual_seed(1)
            for _ in range(3):
                x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                monitor.step()
        runs[group_mb] = (read_family(out / "run" / "rank0", "actv"), read_family(out / "run" / "rank0", "actv_grad"),
                          list(calls))
    grouped, in_hook, bounded = runs[256], runs[0], runs[1e-5]
    for family in (0, 1):
        for other in (in_hook, bounded):
            a, b = grouped[family], other[family]  # rows in execution order, as written
            assert a[["step", "name"]].values.tolist() == b[["step", "name"]].values.tolist() and len(a) > 0
            np.testing.assert_allclose(a[METRICS].to_numpy(float), b[METRICS].to_numpy(float), rtol=1e-6)
    rows_per_step = (len(grouped[0]) + len(grouped[1])) // 3
    # In hooks: one call per tensor (the next module's input is the same tensor: measured once).
    assert len(in_hook[2]) >= rows_per_step - 1
    # Grouped: the first step measures in the hooks (learning), then one call per family and flush point.
    first = len(in_hook[2]) // 3
    assert sum(grouped[2][first:]) == sum(in_hook[2][first:])  # the same tensors, in fewer calls
    assert len(grouped[2][first:]) == 2 * 2  # steps 1 and 2: the forward's group and the backward's
    assert max(bounded[2]) == 1  # a bound below one tensor: measured as they come


def test_a_forward_that_raises_leaves_none_of_its_grouped_rows(tmp_path):
    torch.manual_seed(0)
    model = _AddsInPlace(from_step=99)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainerMonitor(_config(tmp_path)) as monitor:
        monitor.attach(model, optimizer)
        for step in range(3):
            handle = model.fc2.register_forward_hook(_raise) if step == 1 else None
            try:
                torch.nn.functional.mse_loss(model(torch.randn(6, 8)), torch.randn(6, 4)).backward()
            except RuntimeError:  # the user skips the batch and takes the next
                handle.remove()
                torch.nn.functional.mse_loss(model(torch.randn(6, 8)), torch.randn(6, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    actv = read_family(tmp_path / "run" / "rank0", "actv")
    counts = actv.groupby("step").size()
    assert counts[1] == counts[0] == counts[2]
    assert set(actv.micro_step) == {0}


def _raise(module, args, output):
    raise RuntimeError("out of memory (simulated)")
