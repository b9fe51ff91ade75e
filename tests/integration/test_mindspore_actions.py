"""Dump, free benchmark and non-finite localisation on MindSpore (PyNative, CPU), through TrainerMonitor.

Dumped values are checked against numpy float64 recomputations of the same step; the layout is
msprobe's MindSpore L0 dump (``Cell.{name}.{Class}.forward.{n}``, ``"framework": "mindspore"``, ``.npy``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402
from trainmon.actions.free_benchmark import FreeBenchmark  # noqa: E402
from trainmon.config import FreeBenchmarkConfig  # noqa: E402
from trainmon.integrations import actions_framework  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")


class PoisonDense(nn.Dense):
    """A Dense layer whose output can be given a NaN (the fault injected into one cell)."""

    poison = False

    def construct(self, x: Tensor) -> Tensor:
        y = super().construct(x)
        return y * Tensor(float("nan"), ms.float32) if self.poison else y


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PoisonDense(6, 10)
        self.act = nn.Tanh()  # MindSpore's CPU ReLU maps NaN to 0: Tanh lets the NaN reach the loss
        self.fc2 = nn.Dense(10, 3)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def construct(self, x: Tensor) -> Tensor:
        return self.block(x)


def assert_stats(desc: dict, array: np.ndarray) -> None:
    assert desc["shape"] == list(array.shape)
    want = [array.max(), array.min(), array.mean(), np.sqrt(np.square(array).sum())]
    np.testing.assert_allclose([desc["Max"], desc["Min"], desc["Mean"], desc["Norm"]], want, rtol=1e-5, atol=1e-6)


def _train(tmp_path: Path, steps: int = 6, poison_from: int = 3) -> tuple[Path, dict[str, np.ndarray]]:
    """Default families (activations off) and the dump action; a NaN in block.fc1's output from
    ``poison_from`` on (those updates are skipped, as a loss scaler would). A clean dump at step 1."""
    ms.set_seed(0)
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump"]},
                              "dump": {"enabled": True, "mode": "tensor", "depth": 1}})
    monitor.attach(net, opt)
    monitor.dump(["block", "block.fc1"], steps=[1])
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    weights: dict[str, np.ndarray] = {}
    for step in range(steps):
        net.block.fc1.poison = step >= poison_from
        if step == 1:
            weights = {p.name: p.asnumpy().astype(np.float64) for p in net.trainable_params()}
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        if np.isfinite(loss.asnumpy()):
            opt(grads)
        monitor.step(loss=loss)
    monitor.close()
    return tmp_path / "run" / "rank0", weights


def test_nan_in_one_cell_with_default_config_is_localised_and_dumped(tmp_path: Path) -> None:
    rank_dir, _ = _train(tmp_path)
    (first,) = [json.loads(line) for line in (rank_dir / "anomalies.jsonl").read_text().splitlines()][:1]
    assert (first["step"], first["name"]) == (3, "loss")  # activations off: the loss is the first origin
    (found,) = [json.loads(line) for line in (rank_dir / "dump" / "localisation.jsonl").read_text().splitlines()]
    assert (found["anomaly_step"], found["step"], found["phase"], found["module"], found["kind"], found["dump_step"]) \
        == (3, 4, "forward", "block.fc1", "output", 5)
    assert sorted(p.name for p in (rank_dir / "dump").iterdir()) == ["localisation.jsonl", "step1", "step5"]
    dump = json.loads((rank_dir / "dump" / "step5" / "dump.json").read_text())
    assert (dump["framework"], dump["level"], dump["task"]) == ("mindspore", "L0", "tensor")
    assert {"Cell.block.Block.forward.0", "Cell.block.fc1.PoisonDense.forward.0",
            "Cell.block.fc1.PoisonDense.backward.0"} <= set(dump["data"])
    output = dump["data"]["Cell.block.fc1.PoisonDense.forward.0"]["output"][0]
    assert np.isnan(output["Max"]) and output["type"] == "mindspore.Tensor" and output["dtype"] == "Float32"


def test_clean_dump_equals_float64_reference(tmp_path: Path) -> None:
    rank_dir, w = _train(tmp_path, steps=3)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 6)).astype(np.float64), rng.standard_normal((5, 3)).astype(np.float64)
    h = x @ w["block.fc1.weight"].T + w["block.fc1.bias"]
    a = np.tanh(h)
    out = a @ w["block.fc2.weight"].T + w["block.fc2.bias"]
    d_h = (2 * (out - y) / out.size) @ w["block.fc2.weight"] * (1 - a * a)
    directory = rank_dir / "dump" / "step1"
    data = json.loads((directory / "dump.json").read_text())["data"]
    fc1 = data["Cell.block.fc1.PoisonDense.forward.0"]
    assert_stats(fc1["input_args"][0], x)
    assert_stats(fc1["output"][0], h)
    assert_stats(fc1["parameters"]["weight"], w["block.fc1.weight"])
    assert_stats(data["Cell.block.Block.forward.0"]["output"][0], out)
    backward = data["Cell.block.fc1.PoisonDense.backward.0"]
    assert_stats(backward["input"][0], d_h)      # gradient w.r.t. the forward output
    assert backward["output"] == [None]          # the data input has no gradient
    grads = data["Cell.block.fc1.PoisonDense.parameters_grad"]
    assert_stats(grads["weight"][0], d_h.T @ x)  # msprobe's layout: {param: [description]}
    assert_stats(grads["bias"][0], d_h.sum(0))
    loaded = np.load(directory / "dump_tensor_data" / fc1["output"][0]["data_name"])
    np.testing.assert_allclose(loaded, h, rtol=1e-5, atol=1e-6)
    assert fc1["output"][0]["data_name"] == "Cell.block.fc1.PoisonDense.forward.0.output.0.npy"
    construct = json.loads((directory / "construct.json").read_text())
    assert construct["Cell.block.fc1.PoisonDense.forward.0"] == "Cell.block.Block.forward.0"


class Variance(nn.Cell):
    """E[x^2] - E[x]^2: catastrophic cancellation in float16."""

    def construct(self, x: Tensor) -> Tensor:
        return (x * x).mean(-1, keep_dims=True) - x.mean(-1, keep_dims=True) ** 2


def test_free_benchmark_checks_only_and_fix(tmp_path: Path) -> None:
    def run(bench_config: FreeBenchmarkConfig | None) -> tuple[list[np.ndarray], FreeBenchmark | None]:
        ms.set_seed(0)
        net = Net()
        opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
        bench = FreeBenchmark(net, tmp_path, bench_config, framework=actions_framework(net)) if bench_config else None
        grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
        x, y = Tensor(np.ones((4, 6), np.float32)), Tensor(np.zeros((4, 3), np.float32))
        for step in range(3):
            if bench is not None:
                bench.begin_step(step)
            _, grads = grad_fn(x, y)
            opt(grads)
            if bench is not None:
                bench.end_step()
        if bench is not None:
            bench.close()
        for _, cell in net.cells_and_names():
            assert not (cell._forward_hook or cell._forward_pre_hook), "a hook was left behind"
        return [p.asnumpy().copy() for p in net.trainable_params()], bench

    plain, _ = run(None)
    observed, bench = run(FreeBenchmarkConfig(enabled=True, pert_mode="no_change", targets=["block", "block.fc1"]))
    for a, b in zip(plain, observed):
        np.testing.assert_array_equal(a, b)  # the checks only observed
    assert bench is not None and [(r.step, r.name) for r in bench.results] == [
        (s, n) for s in range(3) for n in ("block.fc1", "block")]
    assert all(r.max_rel == 1.0 for r in bench.results)  # a deterministic re-run reproduces the output

    variance = nn.SequentialCell(Variance())
    x = Tensor((100 + np.random.default_rng(1).standard_normal((8, 32))).astype(np.float16))
    reference = x.asnumpy().astype(np.float64).var(-1, keepdims=True)
    fixed = FreeBenchmark(variance, tmp_path / "fix", FreeBenchmarkConfig(
        enabled=True, pert_mode="improve_precision", handler="fix"), framework=actions_framework(variance))
    fixed.request(["0"])
    fixed.begin_step(0)
    out = variance(x)
    fixed.end_step()
    fixed.close()
    (result,) = fixed.results
    assert not result.passed and result.max_rel > 2 and result.dtype == "Float16"
    # float32 still cancels a little; float16 alone is off by tens
    np.testing.assert_allclose(out.asnumpy().astype(np.float64), reference, atol=0.1)
    assert np.abs(variance(x).asnumpy().astype(np.float64) - reference).max() > 1.0
