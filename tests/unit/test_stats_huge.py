"""Finite tensors whose float32 squares overflow (values up to ~1e37): the norm stays right on every path (the
CPU numpy path, the CPU kernel, the plain torch fallback, shard combination, the global norm), against float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainmon.base.records import combine_partials
from trainmon.collect import stats
from trainmon.collect.optimizer import global_grad_norm
from trainmon.collect.stats import combine_partials_torch, partial_stats, partial_stats_many
from trainmon.collect.stats_base import StatsSpec

SPEC = StatsSpec.from_metrics(["norm", "min", "max", "mean"], eps=1e-8)


def _huge(n: int = 100_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e35
    x[n // 3] = -1e37
    return x


def _norm64(x: torch.Tensor) -> float:
    return float(np.linalg.norm(x.double().numpy().ravel()))


@pytest.fixture(params=["numpy", "kernel", "fallback"])
def path(request, monkeypatch):
    if request.param != "numpy":
        monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())  # the device path, on CPU tensors
    if request.param == "fallback":
        monkeypatch.setattr(stats, "fused_enabled", False)
    return request.param


@pytest.mark.parametrize("layout", ["contiguous", "strided", "bf16"])
def test_norm_of_a_huge_finite_tensor(path, layout):
    x = _huge()
    if layout == "strided":
        x = x.view(1000, 100).t()
    elif layout == "bf16":
        x = x.to(torch.bfloat16)
    assert np.isinf(np.float32(np.sum(x.double().numpy() ** 2)))  # float32 squares would overflow
    for partial in (partial_stats(x, SPEC), partial_stats_many([x, x[:7]], SPEC)[0][1][:8]):
        got = partial.double().numpy()
        assert np.isclose(got[0], _norm64(x), rtol=1e-5), (path, layout, got[0], _norm64(x))
        assert got[2] == float(x.min()) and got[3] == float(x.max())


def test_non_finite_values_still_give_inf_and_nan(path):
    x = _huge()
    x[5] = float("inf")
    assert np.isinf(partial_stats(x, SPEC)[0].item())
    x[6] = float("nan")
    assert np.isnan(partial_stats(x, SPEC)[0].item())


def test_shards_of_a_huge_tensor_combine_exactly():
    x = _huge(30_000)
    shards = x.chunk(3)
    gathered = torch.stack([partial_stats(shard, SPEC) for shard in shards])[:, None, :]  # [shards, 1, 8]
    on_device = combine_partials_torch(gathered)[0].double().numpy()
    on_host = combine_partials(gathered.double().numpy())[0]
    for combined in (on_device, on_host):
        assert np.isclose(combined[0], _norm64(x), rtol=1e-5), combined[0]


def test_global_grad_norm_of_huge_gradients():
    grads = [_huge(1000, seed) for seed in range(3)]
    want = float(np.sqrt(sum(_norm64(g) ** 2 for g in grads)))
    assert np.isclose(float(global_grad_norm(grads)), want, rtol=1e-5)
    assert np.isclose(float(global_grad_norm([g.to(torch.bfloat16) for g in grads])), want, rtol=1e-2)
    assert np.isinf(float(global_grad_norm([torch.full((4,), float("inf"))])))
