"""Partial statistics of real torch tensors against an independent float64 numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.reference import METRICS, np_stats
from trainmon.collect import stats
from trainmon.collect.optimizer import global_grad_norm
from trainmon.collect.stats import partial_stats
from trainmon.collect.stats_base import StatsSpec, zero_threshold

SPEC = StatsSpec.from_metrics(METRICS, eps=1e-8)
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _metrics(partial: torch.Tensor) -> dict[str, float]:
    p = partial.double().numpy()
    return {"norm": p[0], "mean": p[1] / p[7], "min": p[2], "max": p[3], "zeros": p[4] / p[7],
            "nans": p[5], "infs": p[6]}


def _assert_matches(tensor: torch.Tensor, eps: float = 1e-8, rtol: float = 1e-5) -> None:
    spec = StatsSpec.from_metrics(METRICS, eps=eps)
    got = _metrics(partial_stats(tensor, spec))
    want = np_stats(tensor.double().numpy(), eps=eps)  # every fp16/bf16 value is exact in float64
    for metric in METRICS:
        assert np.isclose(got[metric], want[metric], rtol=rtol, atol=1e-7, equal_nan=True), \
            (tensor.dtype, metric, got[metric], want[metric])


def _sample(dtype: torch.dtype, special: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 33, generator=generator, dtype=torch.float64)
    x[::3] = 0.0
    if special:
        x[1, 2], x[5, 7], x[6, 0] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


@pytest.fixture
def device_path(monkeypatch):
    """Forces the torch-op path that device tensors take, on CPU tensors."""
    monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_device_path_matches_numpy(device_path, dtype, special):
    _assert_matches(_sample(dtype, special))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zeros_device_path(device_path, dtype):
    _assert_matches(torch.zeros(10, dtype=dtype))


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_non_contiguous_float64_cpu(special):
    x = _sample(torch.float64, special).t()
    assert not x.is_contiguous()
    _assert_matches(x)


@pytest.mark.parametrize("path", ["cpu_numpy", "device"])
@pytest.mark.parametrize("eps", [1e-8, 0.0, 1e-3])
def test_fp16_relu_output_counts_zeros(monkeypatch, path, eps):
    if path == "device":
        monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())
    generator = torch.Generator().manual_seed(1)
    x = torch.relu(torch.randn(4096, generator=generator)).half()  # ~50% exact zeros
    x[:8] = torch.tensor([6e-8, 1e-4, 9.99e-4, 1.001e-3, -6e-8, 0.0, 5e-4, 2e-3]).half()  # near the thresholds
    values = x.double().numpy()
    # eps 0 is trainmon's "exact zeros" (|x| < 0 would count nothing)
    want = np.mean(values == 0) if eps == 0 else np_stats(values, eps=eps)["zeros"]
    got = _metrics(partial_stats(x, StatsSpec.from_metrics(["zeros"], eps=eps)))["zeros"]
    assert 0.4 < want < 0.6 if eps < 1e-3 else want > 0.4
    assert got == pytest.approx(want, abs=1e-12)


def test_zero_threshold_is_exact_in_dtype():
    assert zero_threshold(1e-8, torch.float16) == 2.0 ** -24  # smallest fp16 subnormal: exact zeros
    threshold = zero_threshold(1e-3, torch.bfloat16)
    assert threshold >= 1e-3 and torch.tensor(threshold, dtype=torch.bfloat16).item() == threshold
    assert zero_threshold(0.0, torch.float16) == 0.0


def test_global_grad_norm_of_bf16_grads_accumulates_in_float32():
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=generator).mul(1e-2).to(torch.bfloat16) for n in (70_000, 513, 1)]
    grads.append(torch.randn(300, generator=generator, dtype=torch.float64))  # float64 in its own dtype
    got = global_grad_norm(grads)
    assert got.dtype == torch.float32
    want = np.sqrt(sum(np.sum(g.double().numpy() ** 2) for g in grads))
    assert float(got) == pytest.approx(want, rel=2e-6)


@pytest.mark.parametrize("poison", [False, True])
def test_chunked_adam_partials_equal_the_materialised_update_and_ratio(poison):
    """The CPU fused path (several chunks, a partial last one) against update/ratio computed whole."""
    from tests.reference import np_stats
    from trainmon.collect.adam import _CHUNK, adam_partials_cpu, adam_update, update_ratio

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3 * _CHUNK + 123))
    with torch.no_grad():
        param[:50] = 0.0  # a zero parameter gives ratio 0, never Inf
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        optimizer.step()
    state, group = optimizer.state[param], optimizer.param_groups[0]
    if poison:
        state["exp_avg"][7 * _CHUNK // 3] = float("nan")
    spec = StatsSpec.from_metrics(["norm", "min", "max", "mean", "zeros", "nans", "infs"], 1e-8)
    fused_update, fused_ratio = adam_partials_cpu(state, group, param, spec, spec)
    update = adam_update(state, group)
    for fused, tensor in ((fused_update, update), (fused_ratio, update_ratio(update, param))):
        want = np_stats(tensor.double().numpy())
        got = fused.double().numpy()
        numel = got[7]
        assert numel == tensor.numel()
        values = {"norm": got[0], "min": got[2], "max": got[3], "mean": got[1] / numel, "zeros": got[4] / numel,
                  "nans": got[5], "infs": got[6]}
        for metric, value in values.items():
            if np.isnan(want[metric]):
                assert np.isnan(value), metric
            else:
                assert np.isclose(value, want[metric], rtol=1e-5, atol=1e-9), (metric, value, want[metric])
