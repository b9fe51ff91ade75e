"""MindSpore 2.x (PyNative, CPU): every family equals a float64 numpy reference; NaN attribution."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn, ops  # noqa: E402

from tests.reference import METRICS, adam_update_np, assert_close, np_stats, read_family  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

ALL_STATES = ["exp_avg", "exp_avg_sq", "update", "ratio"]


class Act(nn.Cell):
    """ReLU that can be told to emit NaN (a fault injected into one cell's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.poison = False

    def construct(self, x: Tensor) -> Tensor:
        y = ops.relu(x)
        return y * Tensor(float("nan"), ms.float32) if self.poison else y


class Mlp(nn.Cell):
    """fc1 -> act -> fc2; the same architecture as the torch ``Mlp`` of the cross-framework test."""

    def __init__(self, d_in: int = 6, d_hidden: int = 10, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Dense(d_in, d_hidden)
        self.act = Act()
        self.fc2 = nn.Dense(d_hidden, d_out)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _data(step: int, n: int = 5, d_in: int = 6, d_out: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((n, d_in)).astype(np.float32), rng.standard_normal((n, d_out)).astype(np.float32)


def _numpy_pass(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[dict, dict, dict, float]:
    """Forward and backward of Mlp + MSE in float64: activations, activation grads, weight grads, loss."""
    w1, b1, w2, b2 = (params[k].astype(np.float64) for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    h = x64 @ w1.T + b1
    a = np.maximum(h, 0)
    out = a @ w2.T + b2
    loss = float(np.mean((out - y64) ** 2))
    d_out = 2 * (out - y64) / out.size
    d_a = d_out @ w2
    d_h = d_a * (h > 0)
    actv = {"fc1.input": x64, "fc1.output": h, "act.input": h, "act.output": a, "fc2.input": a, "fc2.output": out}
    actv_grad = {"fc2.output_grad": d_out, "fc2.input_grad": d_a, "act.output_grad": d_a, "act.input_grad": d_h,
                 "fc1.output_grad": d_h}  # fc1.input_grad: the input needs no gradient, so there is no row
    grads = {"fc1.weight": d_h.T @ x64, "fc1.bias": d_h.sum(0), "fc2.weight": d_out.T @ a, "fc2.bias": d_out.sum(0)}
    return actv, actv_grad, grads, loss


@pytest.fixture(params=["host", "device"])
def stats_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both statistics paths on this CPU: ``host`` (MindSpore on the CPU: numpy after the step's one
    synchronisation) and ``device`` (MindSpore ops, as on Ascend or a GPU), chosen at attach."""
    if request.param == "device":
        monkeypatch.setattr("trainmon.integrations.mindspore.on_cpu", lambda: False)
    return str(request.param)


def _train(tmp_path: Path, config: dict, steps: int, poison_step: int | None = None, grad_acc: int = 1):
    ms.set_seed(0)
    net = Mlp()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-6)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], **config})
    monitor.attach(net, opt, grad_acc_steps=grad_acc)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    snapshots = []
    for step in range(steps):
        net.act.poison = step == poison_step
        before = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
        x, y = _data(step)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        after = {"moment1": [m.asnumpy().copy() for m in opt.moment1],
                 "moment2": [v.asnumpy().copy() for v in opt.moment2]}
        monitor.step(loss=loss)
        snapshots.append((before, x, y, after))
    monitor.close()
    monitor.close()
    assert not _hooks_left(net, opt)
    return snapshots, tmp_path / "run" / "rank0", [name for name, _ in net.parameters_and_names()]


def _hooks_left(net: nn.Cell, opt: nn.Optimizer) -> list[str]:
    left = [f"{name or 'root'}.{attr}" for name, cell in [*net.cells_and_names(), ("optimizer", opt)]
            for attr in ("_forward_hook", "_forward_pre_hook", "_backward_hook", "_backward_pre_hook")
            if getattr(cell, attr)]
    return left + [f"{p.name}.hooks" for p in net.get_parameters() if p.hooks()]


def test_every_family_matches_numpy_float64(tmp_path: Path, stats_path: str) -> None:
    config = {"activations": {"enabled": True}, "params": {"enabled": True},
              "optimizer_states": {"states": ALL_STATES}}
    snapshots, rank_dir, names = _train(tmp_path, config, steps=3)
    frames = {f: read_family(rank_dir, f) for f in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param",
                                                    *ALL_STATES)}
    scalars = read_family(rank_dir, "scalars")
    for f, frame in frames.items():
        assert list(frame.columns) == ["vpp_stage", "name", "step", "micro_step", *METRICS], f
    for step, (before, x, y, after) in enumerate(snapshots):
        actv, actv_grad, grads, loss = _numpy_pass(before, x, y)
        expected: dict[str, dict[str, np.ndarray]] = {"actv": actv, "actv_grad": actv_grad, "grad_unreduced": grads,
                                                      "grad_reduced": grads, "param": before}
        for family in ALL_STATES:
            expected[family] = {}
        for i, name in enumerate(names):
            m, v = after["moment1"][i], after["moment2"][i]
            update = adam_update_np(m, v, step + 1, (0.9, 0.99), 1e-6)
            expected["exp_avg"][name], expected["exp_avg_sq"][name] = m, v
            expected["update"][name] = update
            p = before[name] - 1e-2 * np.sqrt(1 - 0.99 ** (step + 1)) / (1 - 0.9 ** (step + 1)) * (
                m / (np.sqrt(v) + 1e-6))  # nn.Adam's own step, to get the parameter after it
            expected["ratio"][name] = np.where(p != 0, update / np.where(p != 0, p, 1), 0.0)
        for family, tensors in expected.items():
            rows = frames[family][frames[family]["step"] == step]
            assert sorted(rows["name"]) == sorted(tensors), (family, step)
            for _, row in rows.iterrows():
                assert_close(row, np_stats(tensors[row["name"]]), METRICS, rtol=2e-4, atol=1e-6,
                             label=f"{family} {row['name']} step {step}")
        got = dict(zip(scalars[scalars.step == step].name, scalars[scalars.step == step].value))
        assert np.isclose(got["loss"], loss, rtol=1e-5)
        grad_norm = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
        assert np.isclose(got["grad_norm"], grad_norm, rtol=1e-5)
        assert np.isclose(got["lr/group0"], 1e-2, rtol=1e-6)
    # activation rows are in execution order: forward before backward, fc1 before fc2
    first = frames["actv"][frames["actv"].step == 0]["name"].tolist()
    assert first == ["fc1.input", "fc1.output", "act.input", "act.output", "fc2.input", "fc2.output"]


def test_activation_copies_beyond_group_mb_are_measured_in_their_hook(tmp_path: Path) -> None:
    """On the CPU, activations are copied in their hook and measured on the host while the step's copies stay
    under ``activations.group_mb`` (here 200 bytes: the 120-byte input fits, the outputs do not); the others are
    measured with MindSpore ops in their hook. Both kinds equal float64 numpy, in execution order."""
    snapshots, rank_dir, _ = _train(tmp_path, {"activations": {"enabled": True, "group_mb": 200 / 2**20}}, steps=2)
    frame = read_family(rank_dir, "actv")
    for step, (before, x, y, _) in enumerate(snapshots):
        actv = _numpy_pass(before, x, y)[0]
        rows = frame[frame.step == step]
        assert rows.name.tolist() == ["fc1.input", "fc1.output", "act.input", "act.output", "fc2.input", "fc2.output"]
        for _, row in rows.iterrows():
            assert_close(row, np_stats(actv[row["name"]]), METRICS, rtol=2e-4, atol=1e-6,
                         label=f"actv {row['name']} step {step}")


def test_nan_in_one_cell_is_attributed_to_that_cell_step_and_phase(tmp_path: Path) -> None:
    config = {"activations": {"enabled": True}, "anomaly": {"detectors": [{"type": "nonfinite"}],
                                                            "actions": ["jsonl"]}}
    _, rank_dir, _ = _train(tmp_path, config, steps=4, poison_step=2)
    events = [json.loads(line) for line in (rank_dir / "anomalies.jsonl").read_text().splitlines()]
    assert events and {e["step"] for e in events} == {2, 3}  # the NaN weights of step 2 persist
    first = min((e for e in events), key=lambda e: (e["step"], e["order"]))
    assert (first["step"], first["phase"], first["family"], first["name"]) == (2, "forward", "actv", "act.output")
    assert first["metric"] in ("nans", "min", "max", "norm", "mean")
    actv = read_family(rank_dir, "actv")
    clean = actv[(actv.step == 2) & (actv.name.isin(["fc1.output", "act.input"]))]
    assert (clean["nans"] == 0).all()  # cells before the faulty one are clean


def test_gradient_accumulation_counts_micro_steps(tmp_path: Path, stats_path: str) -> None:
    ms.set_seed(0)
    net = Mlp()
    opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "activations": {"enabled": True, "backward": False},
                              "weight_grads": {"per_micro_step": True}, "optimizer_states": {"enabled": False}})
    monitor.attach(net, opt, grad_acc_steps=2)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    for step in range(2):
        total = None
        expected = []
        for micro in range(2):
            x, y = _data(10 * step + micro)
            before = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
            _, grads = grad_fn(Tensor(x), Tensor(y))
            expected.append(_numpy_pass(before, x, y)[2])
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        opt(total)
        monitor.step()
    monitor.close()
    rank_dir = tmp_path / "run" / "rank0"
    unreduced = read_family(rank_dir, "grad_unreduced")
    assert sorted(set(zip(unreduced.step, unreduced.micro_step))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    last = unreduced[(unreduced.step == 1) & (unreduced.micro_step == 1) & (unreduced.name == "fc1.weight")].iloc[0]
    assert_close(last, np_stats(expected[1]["fc1.weight"]), METRICS, rtol=2e-4, atol=1e-6)
    reduced = read_family(rank_dir, "grad_reduced")
    row = reduced[(reduced.step == 1) & (reduced.name == "fc1.weight")].iloc[0]
    assert_close(row, np_stats(expected[0]["fc1.weight"] + expected[1]["fc1.weight"]), METRICS, rtol=2e-4, atol=1e-6)
    assert sorted(set(read_family(rank_dir, "actv").micro_step)) == [0, 1]


@pytest.mark.parametrize("optimizer", ["adam", "adam_weight_decay"])
def test_precursors_match_numpy_float64(tmp_path: Path, stats_path: str, optimizer: str) -> None:
    """``precursors`` (docs/precursors.md) against float64 numpy from the tensors the step used: the gradients handed
    to the optimizer, the moments after the step, the weights before and after it. ``nn.Adam``'s weight decay is
    coupled (the moments took ``g + wd * p_before``); ``nn.AdamWeightDecay`` decays the weights and has no bias
    correction (``v_hat = v``)."""
    from tests.reference import precursors_np
    from trainmon.base.precursors import PRECURSOR_METRICS

    ms.set_seed(0)
    net = Mlp()
    decoupled = optimizer == "adam_weight_decay"
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-6,
                             weight_decay=0.1) if decoupled else \
        nn.Adam(net.trainable_params(), learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "optimizer_states": {"states": ["update"], "precursors": True}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    names = [name for name, _ in net.parameters_and_names()]
    want: dict[tuple[str, int], dict[str, float]] = {}
    for step in range(3):
        before = [p.asnumpy().astype(np.float64) for p in opt.parameters]
        x, y = _data(step)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        for i, name in enumerate(names):
            m = (opt.moments1 if decoupled else opt.moment1)[i].asnumpy()
            v = (opt.moments2 if decoupled else opt.moment2)[i].asnumpy()
            after = opt.parameters[i].asnumpy().astype(np.float64)
            want[(name, step)] = precursors_np(
                grads[i].asnumpy(), m, v, after, math.inf if decoupled else step + 1, (0.9, 0.99), 1e-6, 1e-2,
                adam_step=before[i] - after - 1e-2 * 0.1 * before[i] if decoupled else None,
                coupled_decay=0.0 if decoupled else 0.01, param_before=before[i])
        monitor.step(loss=loss)
    monitor.close()
    assert not _hooks_left(net, opt)
    frame = read_family(tmp_path / "run" / "rank0", "precursors")
    assert list(frame.columns) == ["vpp_stage", "name", "step", "micro_step", *PRECURSOR_METRICS]
    assert len(frame) == 3 * len(names)
    for _, row in frame.iterrows():
        for metric, value in want[(row["name"], row["step"])].items():
            assert math.isclose(row[metric], value, rel_tol=1e-3, abs_tol=1e-6), \
                (stats_path, optimizer, row["name"], row["step"], metric, row[metric], value)


@pytest.fixture(autouse=True)
def no_leftovers():
    """Overrides the torch-only conftest check, whose gc scan trips over MindSpore's weak proxies
    (ReferenceError); the MindSpore hooks are checked in ``_train`` and by each test."""
    yield
