"""The grad-probe collector on real torch optimizers, checked against numpy float64 references."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from trainmon.collect.buffer import StepBuffer
from trainmon.collect.context import StepContext
from trainmon.collect.hooks import HookRegistry
from trainmon.config import load_config
from trainmon.probe import device as dev
from trainmon.probe.collector import GradProbe
from trainmon.probe.storage import read_direction_header


def _probe(tmp_path: Path, params, optimizer, **settings) -> tuple[GradProbe, StepContext, HookRegistry]:
    config = load_config({"grad_probe": {"enabled": True, **settings}, "sinks": ["csv"]})  # the per-file layout
    ctx = StepContext(specs={}, metrics={})
    registry = HookRegistry()
    probe = GradProbe(ctx, params, config, registry, optimizer, rank_dir=tmp_path / "rank0")
    return probe, ctx, registry


def _run_step(probe: GradProbe, ctx: StepContext, step: int, body, collect: bool = True) -> dict[str, float]:
    """One monitor step as the session runs it: arm, train, before_transfer, the one transfer."""
    ctx.step, ctx.collecting = step, collect
    probe.arm() if collect else probe.disarm()
    body()
    scalars = {}
    if collect:
        probe.before_transfer()
        scalars = ctx.buffer.transfer().scalars
    ctx.buffer = StepBuffer()
    return scalars


def _summary(tmp_path: Path) -> pd.DataFrame:
    return pd.read_csv(tmp_path / "rank0/grad_probe/grad_summary.csv", keep_default_na=False, na_values=["nan"])


def test_issue_example_l2_and_direction_file_size(tmp_path):
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    big = torch.nn.Parameter(torch.zeros(1001))
    optimizer = torch.optim.SGD([weight, big], lr=0.1)
    probe, ctx, _ = _probe(tmp_path, [("w", weight, 0), ("big", big, 0)], optimizer, level="L2", bounds=[-1, 0, 1])
    grad = np.array([[-2.0, 2.0], [0.2, 0.3]], dtype=np.float32)
    big_grad = np.linspace(-1, 1, 1001).astype(np.float32)
    big_grad[[0, 500, 501]] = 0.0  # exact zeros

    def body():
        weight.grad = torch.from_numpy(grad.copy())
        big.grad = torch.from_numpy(big_grad.copy())
        optimizer.step()

    _run_step(probe, ctx, 0, body)
    _run_step(probe, ctx, 1, body, collect=False)  # an uncollected step writes nothing
    probe.close()
    probe.close()
    df = _summary(tmp_path)
    assert list(df["step"]) == [0, 0]
    row = df[df["name"] == "w"].iloc[0]
    ref = grad.astype(np.float64).ravel()
    assert np.isclose(row["(-inf, -1]"], 0.25) and row["(-1, 0]"] == 0.0
    assert np.isclose(row["(0, 1]"], 0.5) and np.isclose(row["(1, inf)"], 0.25)
    assert row["zero_fraction"] == 0.0 and row["shape"] == "[2, 2]" and row["numel"] == 4
    assert row["max"] == ref.max() == 2.0 and row["min"] == ref.min() == -2.0
    assert np.isclose(row["norm"], np.sqrt(np.sum(ref * ref)), rtol=1e-6) and round(row["norm"], 4) == 2.8513
    b = big_grad.astype(np.float64)
    row = df[df["name"] == "big"].iloc[0]
    for column, want in [("(-inf, -1]", np.mean(b <= -1)), ("(-1, 0]", np.mean((b > -1) & (b <= 0))),
                         ("(0, 1]", np.mean((b > 0) & (b <= 1))), ("zero_fraction", 3 / 1001)]:
        assert np.isclose(row[column], want, atol=1e-6), column
    for name, n in (("w", 4), ("big", 1001)):
        info = read_direction_header(tmp_path / f"rank0/grad_probe/step0/{name}.bits")
        assert info.path.stat().st_size == info.offset + math.ceil(n / 8)
    expected = np.packbits(grad.ravel() > 0, bitorder="little")
    np.testing.assert_array_equal(read_direction_header(tmp_path / "rank0/grad_probe/step0/w.bits").bits(), expected)
    assert not (tmp_path / "rank0/grad_probe/step1").exists()


def test_in_run_similarities_match_numpy(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    named = list(model.named_parameters())
    sample = 50  # smaller than 0.weight (240) and 2.weight (120): those are sampled
    probe, ctx, _ = _probe(tmp_path, [(n, p, 0) for n, p in named], optimizer, level="L1",
                           sample_elements=sample, scalars="param")
    seen: list[dict[str, tuple[np.ndarray, np.ndarray | None]]] = []

    def capture(opt, args, kwargs):  # the test's own reference copy, independent of the probe
        seen.append({n: (p.grad.double().numpy().ravel().copy(),
                         opt.state[p]["exp_avg"].double().numpy().ravel().copy() if opt.state.get(p) else None)
                     for n, p in named})

    handle = optimizer.register_step_pre_hook(capture)
    x = torch.randn(16, 6)
    all_scalars = []
    for step in range(3):
        def body():
            torch.nn.functional.mse_loss(model(x), x[:, :3].sin()).backward()
            optimizer.step()
            optimizer.zero_grad()

        all_scalars.append(_run_step(probe, ctx, step, body))
    handle.remove()
    probe.close()
    df = _summary(tmp_path).set_index(["step", "name"])
    pos = lambda a: a > 0  # noqa: E731 - the sign convention: x > 0
    cos = lambda a, b: float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))  # noqa: E731
    for step in (1, 2):
        weighted = {"prev": [0, 0], "m": [0, 0]}
        for name, _ in named:
            g, m = seen[step][name]
            g_prev = seen[step - 1][name][0]
            if g.size > sample:
                idx = dev.sample_indices(g.size, sample, torch.device("cpu")).numpy()
            else:
                idx = np.arange(g.size)
            row = df.loc[(step, name)]
            agree_prev = np.mean(pos(g[idx]) == pos(g_prev[idx]))
            assert np.isclose(row["sign_agree_prev"], agree_prev, atol=1e-6), name
            assert np.isclose(row["cos_prev"], cos(g[idx], g_prev[idx]), atol=1e-5), name
            assert np.isclose(row["sign_agree_exp_avg"], np.mean(pos(g) == pos(m)), atol=1e-6), name
            assert np.isclose(row["cos_exp_avg"], cos(g, m), atol=1e-5), name
            assert np.isclose(all_scalars[step][f"grad_probe/{name}/cos_exp_avg"], cos(g, m), atol=1e-5)
            weighted["prev"][0] += np.sum(pos(g[idx]) != pos(g_prev[idx]))
            weighted["prev"][1] += idx.size
            weighted["m"][0] += np.sum(pos(g) != pos(m))
            weighted["m"][1] += g.size
            assert np.isclose(row["norm"], np.linalg.norm(g), rtol=1e-5)
            assert np.float32(row["max"]) == np.float32(g.max())
        prev_flips, prev_count = weighted["prev"]
        m_flips, m_count = weighted["m"]
        assert np.isclose(all_scalars[step]["grad_probe/sign_agree_prev"], 1 - prev_flips / prev_count)
        assert np.isclose(all_scalars[step]["grad_probe/sign_agree_exp_avg"], 1 - m_flips / m_count)
        g_all = np.concatenate([seen[step][n][0] for n, _ in named])
        m_all = np.concatenate([seen[step][n][1] for n, _ in named])
        assert np.isclose(all_scalars[step]["grad_probe/cos_exp_avg"], cos(g_all, m_all), atol=1e-5)
    assert all(np.isnan(df.loc[(0, n)]["sign_agree_prev"]) for n, _ in named)  # no previous step at step 0
    assert not any(k.startswith("grad_probe/") for k in all_scalars[0])  # unavailable values are not sent
    header = read_direction_header(tmp_path / "rank0/grad_probe/step2/0.weight.bits").header
    assert header["count"] == sample and header["sample"]["elements"] == sample and header["numel"] == 240


def test_l0_hash_is_deterministic_and_detects_one_ulp(tmp_path):
    hashes = []
    for run, bump in enumerate((False, False, True)):
        weight = torch.nn.Parameter(torch.zeros(64, 3))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        probe, ctx, _ = _probe(tmp_path / str(run), [("w", weight, 0)], optimizer, level="L0")
        grad = torch.randn(64, 3, generator=torch.Generator().manual_seed(7))
        if bump:
            grad[10, 1] = torch.nextafter(grad[10, 1], torch.tensor(float("inf")))

        def body(weight=weight, grad=grad, optimizer=optimizer):
            weight.grad = grad.clone()
            optimizer.step()

        _run_step(probe, ctx, 0, body)
        probe.close()
        df = _summary(tmp_path / str(run))
        assert list(df.columns) == ["vpp_stage", "name", "step", "shape", "numel", "max", "min", "norm", "hash"]
        hashes.append(df["hash"].iloc[0])
        assert not (tmp_path / str(run) / "rank0/grad_probe/step0").exists()  # L0 stores no directions
    assert hashes[0] == hashes[1] != hashes[2]
