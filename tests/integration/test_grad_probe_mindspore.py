"""Grad probe under MindSpore (PyNative, CPU, one process): summaries, in-run similarities and direction
files against numpy float64 references of the gradients handed to the optimizer, and `grad-compare`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402
from trainmon.probe.storage import read_direction_header  # noqa: E402
from trainmon.tools.cli import main as cli_main  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
STEPS = 3
BOUNDS = [-0.01, 0.0, 0.01]


def _train(out: Path, name: str, optimizer_kind: str = "Adam", level: str = "L2", sample: int | None = None):
    """Train 3 steps; return per step ``{name: float64 grad}`` and ``{name: float64 exp_avg before the step}``."""
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(8, 13), nn.Tanh(), nn.Dense(13, 3))  # 13, 39: not multiples of 8
    opt = getattr(nn, optimizer_kind)(net.trainable_params(), learning_rate=1e-2)
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(5)
    config = {"output_dir": str(out), "run_name": name, "sinks": ["csv"], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False},
              "grad_probe": {"enabled": True, "level": level, "bounds": BOUNDS, "scalars": "param",
                             "sample_elements": sample}}
    names = [p.name for p in opt.parameters]
    moments = opt.moment1 if hasattr(opt, "moment1") else opt.moments1
    grads, exp_avgs = [], []
    monitor = TrainerMonitor(config).attach(net, opt)
    for _ in range(STEPS):
        x = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
        y = Tensor(rng.standard_normal((4, 3)).astype(np.float32))
        loss, g = grad_fn(x, y)
        grads.append({n: t.asnumpy().astype(np.float64).copy() for n, t in zip(names, g)})
        exp_avgs.append({n: m.asnumpy().astype(np.float64).copy() for n, m in zip(names, moments)})
        opt(g)
        monitor.step(loss=loss)
    monitor.close()
    return grads, exp_avgs


def _summary(run: Path) -> pd.DataFrame:
    return pd.read_csv(run / "rank0" / "grad_probe" / "grad_summary.csv", keep_default_na=False, na_values=["nan"])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("optimizer_kind", ["Adam", "AdamWeightDecay"])
def test_mindspore_probe_matches_numpy(tmp_path, optimizer_kind, capsys):
    grads, exp_avgs = _train(tmp_path, "ms", optimizer_kind)
    summary = _summary(tmp_path / "ms")
    assert len(summary) == 4 * STEPS and sorted(summary["step"].unique()) == list(range(STEPS))
    for _, row in summary.iterrows():
        step, name = row["step"], row["name"]
        g = grads[step][name].ravel()
        assert row["shape"] == str(list(grads[step][name].shape)) and row["numel"] == g.size
        np.testing.assert_allclose([row["max"], row["min"], row["norm"]], [g.max(), g.min(), np.linalg.norm(g)],
                                   rtol=1e-5, err_msg=f"{name} {step}")
        intervals = [np.mean(g <= -0.01), np.mean((g > -0.01) & (g <= 0)), np.mean((g > 0) & (g <= 0.01)),
                     np.mean(g > 0.01), np.mean(g == 0)]
        np.testing.assert_allclose(row[["(-inf, -0.01]", "(-0.01, 0]", "(0, 0.01]", "(0.01, inf)", "zero_fraction"]]
                                   .to_numpy(float), intervals, atol=1e-6)
        m = exp_avgs[step][name].ravel()
        if step == 0:
            assert np.isnan(row["sign_agree_prev"])
        else:
            prev = grads[step - 1][name].ravel()
            assert np.isclose(row["sign_agree_prev"], np.mean((g > 0) == (prev > 0)), atol=1e-6)
            np.testing.assert_allclose(row["sign_agree_exp_avg"], np.mean((g > 0) == (m > 0)), atol=1e-6)
            np.testing.assert_allclose(row["cos_exp_avg"], _cos(g, m), rtol=1e-5)
        info = read_direction_header(tmp_path / "ms" / "rank0" / "grad_probe" / f"step{step}" / f"{name}.bits")
        bits = np.unpackbits(info.bits(), bitorder="little")[: info.header["count"]]
        np.testing.assert_array_equal(bits, (g > 0).astype(np.uint8))
    scalars = pd.read_csv(tmp_path / "ms" / "rank0" / "scalars.csv")
    assert "grad_probe/sign_agree_exp_avg" in set(scalars["name"])
    # a second, identical run: grad-compare gives 1.0 everywhere
    _train(tmp_path, "ms_again", optimizer_kind)
    out = tmp_path / "cmp"
    argv = ["grad-compare", str(tmp_path / "ms"), str(tmp_path / "ms_again"), "-o", str(out), "--no-plots"]
    assert cli_main(argv) == 0
    sims = pd.read_csv(out / "similarities.csv")
    assert len(sims[sims["kind"] == "param"]) == 4 * STEPS and (sims["similarity"] == 1.0).all()
    assert not (out / "problems.txt").exists()
    capsys.readouterr()


def test_mindspore_probe_sampled_cos_prev_and_l0_hash(tmp_path):
    grads, _ = _train(tmp_path, "sampled", level="L1", sample=20)  # 13-element biases whole, the rest sampled
    summary = _summary(tmp_path / "sampled")
    bias = summary[(summary["name"] == summary["name"].iloc[0]) & (summary["step"] == 1)]
    whole = summary[summary["numel"] <= 20]
    for _, row in whole[whole["step"] > 0].iterrows():
        g, prev = grads[row["step"]][row["name"]].ravel(), grads[row["step"] - 1][row["name"]].ravel()
        np.testing.assert_allclose(row["cos_prev"], _cos(g, prev), rtol=1e-5)
    assert len(bias) == 1
    _train(tmp_path, "h1", level="L0")
    _train(tmp_path, "h2", level="L0")
    h1, h2 = _summary(tmp_path / "h1"), _summary(tmp_path / "h2")
    assert (h1["hash"] == h2["hash"]).all() and h1["hash"].nunique() == len(h1)


def test_mindspore_probe_needs_the_optimizer(tmp_path):
    net = nn.Dense(2, 1)
    with pytest.raises(ValueError, match="needs the optimizer"):
        TrainerMonitor({"output_dir": str(tmp_path), "grad_probe": {"enabled": True}}).attach(net)
