"""MindSpore lifecycle, import isolation, uncollected steps, and the cross-framework output contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402

from tests.integration.test_mindspore_families import Mlp, _data, _hooks_left  # noqa: E402
from tests.reference import read_family  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(autouse=True)
def no_leftovers():
    """See test_mindspore_families.no_leftovers; the MindSpore hooks are checked in each test."""
    yield


def test_import_trainmon_does_not_import_mindspore() -> None:
    code = "import sys, trainmon; assert 'mindspore' not in sys.modules, 'mindspore imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_lifecycle_hooks_only_on_collected_steps_and_none_after_close(tmp_path: Path) -> None:
    ms.set_seed(0)
    net = Mlp()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv", "tensorboard"],
                              "step_interval": 2, "activations": {"enabled": True}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    armed = []
    for step in range(4):
        armed.append(bool(net.fc1._forward_hook) and bool(net.fc1.weight.hooks()))
        x, y = _data(step)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        record = monitor.step(loss=loss)
        assert (record is not None) == (step % 2 == 0)
    assert armed == [True, False, True, False]
    monitor.close()
    monitor.close()
    assert not _hooks_left(net, opt)
    rank_dir = tmp_path / "run" / "rank0"
    assert sorted(set(read_family(rank_dir, "grad_reduced").step)) == [0, 2]
    # AdamWeightDecay: moments1/moments2 and its un-bias-corrected update m / (sqrt(v) + eps)
    update = read_family(rank_dir, "update")
    row = update[(update.step == 2) & (update.name == "fc2.weight")].iloc[0]
    m, v = opt.moments1[2].asnumpy().astype(np.float64), opt.moments2[2].asnumpy().astype(np.float64)
    assert np.isfinite(row["norm"]) and row["norm"] > 0
    assert list(read_family(rank_dir, "exp_avg").name.unique()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert m.shape == (3, 10) and v.shape == (3, 10)
    assert list(rank_dir.glob("events.out.tfevents.*"))


def test_same_config_gives_same_headers_and_rows_as_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class TorchMlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.act(self.fc1(x)))

    config = {"sinks": ["csv"], "activations": {"enabled": True, "metrics": ["max", "norm", "nans"]},
              "params": {"enabled": True}, "targets": {"modules": ["fc*", "act"], "params": ["*"]},
              "optimizer_states": {"states": ["exp_avg", "exp_avg_sq", "update", "ratio"]}}
    torch.manual_seed(0)
    tmodel = TorchMlp()
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2)
    with TrainerMonitor({**config, "output_dir": str(tmp_path), "run_name": "torch"}) as monitor:
        monitor.attach(tmodel, topt)
        for step in range(2):
            x, y = (torch.from_numpy(a) for a in _data(step))
            loss = torch.nn.functional.mse_loss(tmodel(x), y)
            loss.backward()
            topt.step()
            topt.zero_grad()
            monitor.step(loss=loss)
    ms.set_seed(0)
    net = Mlp()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    with TrainerMonitor({**config, "output_dir": str(tmp_path), "run_name": "mindspore"}) as monitor:
        monitor.attach(net, opt)
        grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
        for step in range(2):
            loss, grads = grad_fn(*(Tensor(a) for a in _data(step)))
            opt(grads)
            monitor.step(loss=loss)
    assert not _hooks_left(net, opt)
    torch_dir, ms_dir = tmp_path / "torch" / "rank0", tmp_path / "mindspore" / "rank0"
    files = sorted(p.name for p in torch_dir.glob("*.csv"))
    assert files == sorted(p.name for p in ms_dir.glob("*.csv"))
    assert "actv_grad.csv" in files and "ratio.csv" in files
    for name in files:
        t, m = read_family(torch_dir, name[:-4]), read_family(ms_dir, name[:-4])
        assert list(t.columns) == list(m.columns), name
        rows_t, rows_m = t[["step", "name"]].values.tolist(), m[["step", "name"]].values.tolist()
        if name == "scalars.csv":  # scalars: same names; their order within a step is not part of the contract
            rows_t, rows_m = sorted(rows_t), sorted(rows_m)
        assert rows_t == rows_m, name  # same rows, in the same execution order


def test_features_mindspore_lacks_warn_once_and_training_goes_on(tmp_path: Path, caplog) -> None:
    net = Mlp()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "grad_probe": {"enabled": True},
                              "communication": {"enabled": True}, "dump": {"enabled": True}})
    monitor.attach(net, opt)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    loss, grads = grad_fn(*(Tensor(a) for a in _data(0)))
    opt(grads)
    assert monitor.step(loss=loss) is not None
    monitor.close()
    warned = [r.getMessage() for r in caplog.records if "not supported with mindspore" in r.getMessage()]
    assert sorted(m.split()[1] for m in warned) == ["communication", "dump", "grad_probe"]
