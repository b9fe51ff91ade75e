"""Free-benchmark perturbation checks on real torch models, against numpy float64 references."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from trainmon.actions.dump import TargetedDump
from trainmon.actions.free_benchmark import CSV_HEADER, FreeBenchmark
from trainmon.actions.perturb import NOISE, perturb_tensor
from trainmon.config import DumpConfig, FreeBenchmarkConfig


class NaiveVariance(nn.Module):
    """Variance as E[x^2] - E[x]^2: catastrophic cancellation in low precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2


class Overflow(nn.Module):
    """Squares values that overflow float16 (but not float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1e4) ** 2


def fragile_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("layers", nn.Sequential(nn.Linear(32, 32), NaiveVariance()))
    with torch.no_grad():
        model.layers[0].weight.mul_(0.3)
        model.layers[0].bias.fill_(100.0)  # activations around 100 with unit spread
    return model.to(dtype)


def assert_no_hooks(model: nn.Module) -> None:
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks


def numpy_max_ratio(original: np.ndarray, perturbed: np.ndarray, tol: float) -> float:
    a, b = np.abs(original), np.abs(perturbed)
    big = np.maximum(a, b)
    ratio = np.where(big <= tol, 1.0, big / np.maximum(np.minimum(a, b), tol))
    return float(np.where((original * perturbed < 0) & (big > tol), np.inf, ratio).max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_improve_precision_fails_fragile_op_and_passes_linear(tmp_path: Path, dtype: torch.dtype) -> None:
    model = fragile_model(dtype)
    bench = FreeBenchmark(model, tmp_path / "rank0", FreeBenchmarkConfig(
        enabled=True, pert_mode="improve_precision", targets=["layers.*"]), rank=0)
    x = torch.randn(8, 32).to(dtype)
    bench.begin_step(3)
    model(x).float().mean().backward()
    results = bench.end_step()
    bench.close()
    bench.close()
    assert_no_hooks(model)

    by_name = {r.name: r for r in results}
    assert set(by_name) == {"layers.0", "layers.1"}
    linear, variance = by_name["layers.0"], by_name["layers.1"]
    assert linear.passed and variance.max_rel > 2 and not variance.passed
    assert linear.limit == {torch.float16: 1.002, torch.bfloat16: 1.004}[dtype]
    # Independent reference: the low-precision Linear output against float64 numpy.
    with torch.no_grad():
        original = model.layers[0](x).double().numpy()
    w, b = (model.layers[0].weight.detach().double().numpy(), model.layers[0].bias.detach().double().numpy())
    reference = x.double().numpy() @ w.T + b
    assert abs(linear.max_rel - numpy_max_ratio(original, reference, NOISE[dtype] ** 0.5)) < 1e-5

    table = pd.read_csv(tmp_path / "rank0" / "free_benchmark.csv")
    assert tuple(table.columns) == CSV_HEADER
    assert table["name"].tolist() == ["layers.1"]
    row = table.iloc[0]
    assert (row["rank"], row["pert_mode"], row["stage"], row["step"]) == (0, "improve_precision", "forward", 3)
    assert row["dtype"] == str(dtype) and row["shape"] == "[8, 1]" and row["output_index"] == 0
    assert row["max_rel"] == pytest.approx(variance.max_rel)


def build_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def train(tmp_path: Path | None, pert_mode: str | None, steps: int = 4) -> tuple[dict, torch.Tensor, list]:
    torch.manual_seed(0)
    net = build_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    actions: list = []
    if pert_mode is not None:
        assert tmp_path is not None
        dump = TargetedDump(net, tmp_path, DumpConfig(enabled=True, mode="tensor", depth=1))
        dump.request(["*"], steps=[1])
        bench = FreeBenchmark(net, tmp_path, FreeBenchmarkConfig(
            enabled=True, pert_mode=pert_mode, targets=["*"], max_per_step=16))
        actions = [dump, bench]
    for step in range(steps):
        for action in actions:
            action.begin_step(step)
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for action in actions:
            action.end_step()
    for action in actions:
        action.close()
    assert_no_hooks(net)
    return net.state_dict(), torch.get_rng_state(), actions


@pytest.mark.parametrize("pert_mode", ["no_change", "to_cpu"])
def test_weights_bit_identical_with_dump_and_free_benchmark(tmp_path: Path, pert_mode: str) -> None:
    plain, plain_rng, _ = train(None, None)
    observed, observed_rng, (dump, bench) = train(tmp_path, pert_mode)
    for key, value in plain.items():
        assert torch.equal(value, observed[key]), key  # weights and batch-norm running statistics
    assert torch.equal(plain_rng, observed_rng)
    assert [p.name for p in dump.written] == ["step1"]
    names = {r.name for r in bench.results}
    assert {"0", "1", "3", "4"} <= names  # Linear, BatchNorm, Dropout, Linear were re-run every step
    if pert_mode == "no_change":
        # Same dropout mask and same batch statistics: the re-run reproduces the output exactly.
        assert all(r.max_rel == 1.0 for r in bench.results)


def test_fix_handler_uses_the_float32_value(tmp_path: Path) -> None:
    model = fragile_model(torch.bfloat16)
    x = torch.randn(8, 32).to(torch.bfloat16)
    with torch.no_grad():
        hidden = model.layers[0](x).double().numpy()
        unfixed = model(x).double().numpy()
    reference = hidden.var(-1, keepdims=True)  # float64, population variance
    bench = FreeBenchmark(model, tmp_path, FreeBenchmarkConfig(
        enabled=True, pert_mode="improve_precision", handler="fix"))
    bench.request(["layers.1"])
    for step in range(2):  # fix stays on after the requested step
        bench.begin_step(step)
        out = model(x)
        out.float().sum().backward()
        bench.end_step()
        # float32 still cancels a little (~3e-4 absolute at 100**2); bfloat16 is off by ~64.
        np.testing.assert_allclose(out.detach().double().numpy(), reference, rtol=0, atol=1e-3)
    bench.close()
    assert np.abs(unfixed - reference).max() > 0.5 * np.abs(reference).max()  # bfloat16 alone: all zeros
    assert model.layers[0].weight.grad is not None and torch.isfinite(model.layers[0].weight.grad).all()
    with pytest.raises(ValueError, match="fix needs pert_mode"):
        FreeBenchmark(model, tmp_path, FreeBenchmarkConfig(enabled=True, pert_mode="add_noise", handler="fix"))


def test_nonfinite_outputs_and_budget(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Overflow(), nn.Linear(4, 4), nn.Linear(4, 4)).half()
    bench = FreeBenchmark(model, tmp_path, FreeBenchmarkConfig(
        enabled=True, pert_mode="improve_precision", targets=["*"], max_per_step=2, interval=2))
    x = torch.full((2, 4), 1.0).half()
    x[0, 0] = float("nan")
    for step in range(3):
        bench.begin_step(step)
        with torch.no_grad():
            model(x)
        bench.end_step()
    bench.close()
    assert [(r.step, r.name) for r in bench.results if r.output_index == 0] == [(0, "0"), (0, "1"), (2, "0"), (2, "1")]
    overflow = [r for r in bench.results if r.name == "1"]
    assert all(r.max_rel == float("inf") and not r.passed for r in overflow)  # inf in fp16, finite in fp32
    table = pd.read_csv(tmp_path / "free_benchmark.csv")
    assert table["name"].astype(str).tolist() == ["1", "1"] and np.isinf(table["max_rel"]).all()

    t = torch.tensor([1.0, -2.0, 0.0, 3.0], dtype=torch.bfloat16)
    assert perturb_tensor(t, "change_value").tolist() == [3.0, -2.0, 0.0, 1.0]
    flipped = perturb_tensor(t, "bit_noise")
    assert flipped[2] == 0 and ((flipped.view(torch.int16) ^ t.view(torch.int16)) == torch.tensor([1, 1, 0, 1])).all()
    assert perturb_tensor(t.float(), "add_noise").tolist() == (t.double() + torch.tensor([1e-8, 1e-8, 0, 1e-8],
                                                              dtype=torch.float64)).float().tolist()


class PlainTensorAttribute(nn.Module):
    """Holds a bf16 projection as a plain attribute (not a buffer): ``improve_precision`` converts the
    copy's parameters and inputs to float32 but not this tensor, so the re-run's matmul raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.projection = torch.randn(8, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) @ self.projection


def test_a_failing_check_warns_once_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def run(bench_dir: Path | None) -> tuple[dict, FreeBenchmark | None]:
        torch.manual_seed(0)
        model = nn.Sequential(PlainTensorAttribute()).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(6, 8).to(torch.bfloat16), torch.randn(6, 4).to(torch.bfloat16)
        bench = None
        if bench_dir is not None:
            bench = FreeBenchmark(model, bench_dir, FreeBenchmarkConfig(
                enabled=True, pert_mode="improve_precision", targets=["0"]))
        for step in range(3):
            if bench is not None:
                bench.begin_step(step)
            loss = (model(x).float() - y.float()).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bench is not None:
                bench.end_step()
        if bench is not None:
            bench.close()
        assert_no_hooks(model)
        return model.state_dict(), bench

    plain, _ = run(None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        observed, bench = run(tmp_path)
    assert bench is not None and bench.results == []
    for key, value in plain.items():
        assert torch.equal(value, observed[key]), key
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checking 0 failed" in warnings[0].getMessage(), warnings
    assert not (tmp_path / "free_benchmark.csv").exists()


def test_requests_for_later_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    bench = FreeBenchmark(model, tmp_path, FreeBenchmarkConfig(enabled=True, pert_mode="no_change"))
    assert bench.request(["0"], steps=[2, 4]) == ["0"]
    assert bench.request(["1"]) == ["1"]  # the next step
    x = torch.randn(3, 4)
    for step in range(6):
        bench.begin_step(step)
        model(x).sum().backward()
        bench.end_step()
    bench.close()
    assert [(r.step, r.name) for r in bench.results] == [(0, "1"), (2, "0"), (4, "0")]
    assert all(r.passed for r in bench.results)
