"""Multi-tensor statistics (``partial_stats_many``, ``StepContext.record_many``, the Adam update/ratio
partials) on every path: numpy (CPU), the fused kernel, plain torch ops. Each against the per-tensor
path and an independent float64 numpy reference."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.reference import METRICS, np_stats, precursors_np
from trainmon.base.precursors import PRECURSOR_METRICS, finalize_precursors
from trainmon.collect import kernels, stats
from trainmon.collect.adam import (
    _CHUNK,
    _adam_fused,
    _adam_items,
    adam_partials_many,
    precursor_partials,
)
from trainmon.collect.adam_fallback import adam_partials_torch
from trainmon.collect.context import StepContext
from trainmon.collect.stats import partial_stats, partial_stats_many
from trainmon.collect.stats_base import StatsSpec

SPEC = StatsSpec.from_metrics(METRICS, eps=1e-8)
PATHS = ["numpy", "fused", "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """``numpy``: CPU tensors as they come; ``fused``: the device path with the fused kernel (its CPU
    implementation: the structure CUDA runs with Triton); ``torch``: the device path in plain torch ops."""
    if request.param != "numpy":
        monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())
    if request.param == "torch":
        monkeypatch.setattr(stats, "fused_enabled", False)
    return request.param


def _metrics(row: np.ndarray) -> dict[str, float]:
    p = np.asarray(row, np.float64)
    numel = p[7]
    return {"norm": p[0], "mean": p[1] / numel if numel else np.nan, "min": p[2] if numel else np.nan,
            "max": p[3] if numel else np.nan, "zeros": p[4] / numel if numel else np.nan, "nans": p[5],
            "infs": p[6], "numel": numel}


def _reference(tensor: torch.Tensor, eps: float = 1e-8) -> dict[str, float]:
    x = tensor.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    values = x.double().numpy()  # every float16/bfloat16 value is exact in float64
    if values.size == 0:
        return {"norm": 0.0, "mean": np.nan, "min": np.nan, "max": np.nan, "zeros": np.nan, "nans": 0.0,
                "infs": 0.0, "numel": 0.0}
    return {**np_stats(values, eps=eps), "numel": float(values.size)}


def _assert_row(row: np.ndarray, tensor: torch.Tensor, rtol: float = 1e-5, label: str = "") -> None:
    got, want = _metrics(row), _reference(tensor)
    for metric, value in want.items():
        assert np.isclose(got[metric], value, rtol=rtol, atol=1e-6, equal_nan=True), \
            (label, tensor.dtype, tuple(tensor.shape), metric, got[metric], value)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=g, dtype=torch.float64)
    base[::3] = 0.0
    special = base.clone()
    special[1, 2], special[5, 7], special[6, 0] = float("nan"), float("inf"), float("-inf")
    only_inf = torch.ones(50, dtype=torch.float64)
    only_inf[3] = float("inf")
    big = torch.randn(3 * _CHUNK + 321, generator=g)  # several chunks of the CPU kernel, a partial last one
    big[5 * _CHUNK // 2] = float("nan")
    return [
        base.float(), base.to(torch.bfloat16), special.to(torch.bfloat16), base.half(), base,  # mixed dtypes
        special.float(), only_inf.to(torch.bfloat16), torch.zeros(0, dtype=torch.bfloat16),  # an empty tensor
        torch.zeros(0), base.to(torch.bfloat16).t(),  # non-contiguous bfloat16
        big.to(torch.bfloat16), big, torch.randn(4, 5, generator=g).to(torch.bfloat16)[:, ::2],
        torch.arange(-3, 7), torch.tensor(2.5, dtype=torch.bfloat16),  # integers, a 0-d tensor
        torch.zeros(10, dtype=torch.bfloat16),
    ]


def test_many_equals_reference_and_per_tensor(path):
    tensors = _tensors()
    groups = partial_stats_many(tensors, SPEC)
    assert sorted(i for indices, _ in groups for i in indices) == list(range(len(tensors)))
    for indices, block in groups:
        assert block.dtype == torch.float32 and block.dim() == 1 and block.numel() == 8 * len(indices)
        rows = block.view(-1, 8).numpy()
        for i, row in zip(indices, rows):
            _assert_row(row, tensors[i], label=f"{path} #{i}")
            single = partial_stats(tensors[i], SPEC).numpy()
            np.testing.assert_allclose(row, single, rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=f"#{i}")


def test_groups_follow_device_and_dtype(monkeypatch):
    monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(4), torch.zeros(0)]
    groups = {tuple(indices) for indices, _ in partial_stats_many(tensors, SPEC)}
    assert groups == {(0, 2), (1,), (3,)}


@pytest.mark.parametrize("metrics", [["norm"], ["max"], ["nans"], ["zeros", "infs"], ["mean", "min"]])
def test_unrequested_slots_stay_zero(path, metrics):
    spec = StatsSpec.from_metrics(metrics, eps=1e-3)
    x = torch.tensor([float("nan"), float("inf"), 0.0, 1e-4, -2.0]).to(torch.bfloat16)
    row = partial_stats_many([x, x.float()], spec)[0][1].view(-1, 8)[0].numpy()
    want = {0: "norm" in metrics, 1: "mean" in metrics, 4: "zeros" in metrics, 5: "nans" in metrics,
            6: "infs" in metrics}
    for slot, computed in want.items():
        if not computed:
            assert row[slot] == 0, (slot, row)
    if "nans" in metrics:
        assert row[5] == 1
    if "zeros" in metrics:
        assert row[4] == 2  # |x| < 1e-3: 0.0 and 1e-4
    assert np.isnan(row[2]) and np.isnan(row[3]) and row[7] == 5  # min/max always: the non-finite flag


def _context(**families: StatsSpec) -> StepContext:
    ctx = StepContext(specs=dict(families), metrics={family: METRICS for family in families})
    ctx.collecting = True
    return ctx


def _rows(ctx: StepContext) -> dict[tuple[str, str], tuple[np.ndarray, int]]:
    host = ctx.buffer.transfer()
    return {(key.family, key.name): (row, key.order) for key, row in zip(host.keys, host.partials)}


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "loss-scale"])
def test_record_many_equals_record(path, scaled):
    tensors = _tensors()
    names = [f"t{i}" for i in range(len(tensors))]
    scale = torch.tensor(1024.0) if scaled else None
    one, many = _context(grad=SPEC), _context(grad=SPEC)
    for name, tensor in zip(names, tensors):
        one.record("grad", name, tensor, scale=scale)
    many.record_many("grad", names, tensors, scale=scale)
    rows_one, rows_many = _rows(one), _rows(many)
    assert list(rows_one) == list(rows_many) or sorted(rows_one) == sorted(rows_many)
    for key, (row, order) in rows_one.items():
        got, got_order = rows_many[key]
        assert got_order == order
        np.testing.assert_allclose(got, row, rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=str(key))
        tensor = tensors[names.index(key[1])]
        if scaled:  # the statistics of tensor / scale: exact in float64 for a power of two
            tensor = (tensor.double() if not tensor.is_complex() else tensor) / 1024.0
        _assert_row(got, tensor, label=str(key))


def test_record_many_reuses_the_dedup_cache_and_its_own_results(path, monkeypatch):
    tensors = [torch.randn(100).to(torch.bfloat16), torch.randn(7), torch.randn(3, 3).half()]
    ctx = _context(actv=SPEC, param=SPEC)
    ctx.record("actv", "first", tensors[0])
    calls = []
    original = stats.partial_stats_many

    def counting(many, spec):
        calls.append(len(many))
        return original(many, spec)

    monkeypatch.setattr("trainmon.collect.context.partial_stats_many", counting)
    ctx.record_many("actv", ["a", "b", "c"], tensors)
    assert calls == [2]  # the first tensor was measured already
    ctx.record("actv", "again", tensors[1])  # measured by record_many: reused
    assert calls == [2]
    tensors[2].mul_(2)  # a new version: measured again
    ctx.record_many("actv", ["c2"], [tensors[2]])
    assert calls == [2, 1]
    rows = _rows(ctx)
    np.testing.assert_array_equal(rows[("actv", "a")][0], rows[("actv", "first")][0])
    np.testing.assert_array_equal(rows[("actv", "again")][0], rows[("actv", "b")][0])
    _assert_row(rows[("actv", "c2")][0], tensors[2])
    assert [rows[("actv", n)][1] for n in ("first", "a", "b", "c", "again", "c2")] == list(range(6))


def test_record_many_skips_an_unmeasurable_tensor_with_one_warning(path, caplog):
    ctx = _context(grad=SPEC)
    sparse = torch.eye(3).to_sparse()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for _ in range(2):
            ctx.record_many("grad", ["dense", "sparse", "dense2"], [torch.ones(3), sparse, torch.zeros(2)])
    assert caplog.text.count("cannot measure grad/sparse") == 1
    rows = ctx.buffer.transfer()
    assert [key.name for key in rows.keys] == ["dense", "dense2"] * 2


def test_record_many_with_orders_and_stages(path):
    ctx = _context(grad=SPEC)
    ctx.record_many("grad", ["a", "b"], [torch.ones(2), torch.ones(3, dtype=torch.bfloat16)], [1, 2], orders=[7, 3])
    host = ctx.buffer.transfer()
    keys = {key.name: key for key in host.keys}
    assert (keys["a"].order, keys["a"].vpp_stage, keys["b"].order, keys["b"].vpp_stage) == (7, 1, 3, 2)


# ------------------------------------------------------------------------------------------ Adam


def _adam_states(dtype: torch.dtype, poison: bool = False, amsgrad: bool = False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (3 * _CHUNK + 123, 257, 1)]
    params.append(torch.nn.Parameter(torch.randn(6, 5).to(dtype)))
    with torch.no_grad():
        params[0][:50] = 0.0  # a zero parameter gives ratio 0, never Inf
        params[1][3] = 0.0
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, amsgrad=amsgrad)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 2:  # a parameter that skips a step keeps an older step counter
            params[2].grad = None
        optimizer.step()
    if poison:
        optimizer.state[params[0]]["exp_avg"][7 * _CHUNK // 3] = float("nan")
    group = optimizer.param_groups[0]
    return [(p, optimizer.state[p], group) for p in params]


def _adam_reference(param, state, group) -> tuple[np.ndarray, np.ndarray]:
    step = float(state["step"])
    beta1, beta2 = group["betas"]
    v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
    m = state["exp_avg"].double().numpy() / (1 - beta1 ** step)
    v = v.double().numpy() / (1 - beta2 ** step)
    update = m / (np.sqrt(v) + group["eps"])
    p = param.detach().double().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(p != 0, update / np.where(p != 0, p, 1), 0.0)
    return update, ratio


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adam_partials_many_match_float64(path, dtype, poison, amsgrad):
    entries = _adam_states(dtype, poison, amsgrad)
    entries.insert(1, (torch.nn.Parameter(torch.ones(3)), {"momentum_buffer": torch.ones(3)}, entries[0][2]))
    adam, blocks = adam_partials_many(entries, SPEC, SPEC, SPEC)
    assert adam == [0, 2, 3, 4]
    assert sorted(i for indices, *_ in blocks for i in indices) == adam
    for indices, update_block, ratio_block, states, _ in blocks:
        # exp_avg and exp_avg_sq from the same read: by the fused kernel on the device path (not the CPU
        # fast path's float32 numpy views), and only where v is exp_avg_sq itself (AMSGrad reads max_exp_avg_sq)
        fast_path = stats.numpy_viewable(entries[indices[0]][1]["exp_avg"])  # float32 on CPU, unless forced off
        assert (states is not None) == (path != "torch" and not fast_path and not amsgrad), (path, amsgrad)
        for row, i in enumerate(indices):
            update, ratio = _adam_reference(*entries[i])
            checks = [("update", update_block, update), ("ratio", ratio_block, ratio)]
            if states is not None:
                checks += [(family, block, entries[i][1][family].double().numpy())
                           for family, block in zip(("exp_avg", "exp_avg_sq"), states)]
            for label, block, want in checks:
                got = _metrics(block.view(-1, 8)[row].numpy())
                reference = {**np_stats(want), "numel": float(want.size)}
                for metric, value in reference.items():
                    # float32 arithmetic against float64: a relative 1e-5 (sums of ~200 K terms)
                    assert np.isclose(got[metric], value, rtol=2e-5, atol=1e-6, equal_nan=True), \
                        (label, i, metric, got[metric], value)


@pytest.mark.parametrize("which", ["update", "ratio"])
def test_adam_partials_many_computes_only_what_is_asked(path, which):
    entries = _adam_states(torch.float32)
    update_spec, ratio_spec = (SPEC, None) if which == "update" else (None, SPEC)
    _, blocks = adam_partials_many(entries, update_spec, ratio_spec)
    (_, update_block, ratio_block, states, _), = blocks
    assert states is None  # not asked for
    skipped = ratio_block if which == "update" else update_block
    assert not skipped.any()
    assert (update_block if which == "update" else ratio_block).view(-1, 8)[:, 7].tolist() == \
        [float(p.numel()) for p, _, _ in entries]


@pytest.mark.parametrize("implementation", ["fused", "torch"])
def test_adam_constants_as_device_scalars(implementation):
    """The branch of step counters on the device (capturable/fused Adam): 0-d tensor constants."""
    entries = _adam_states(torch.float32)
    items = [(m, v, p, *(torch.tensor(c, dtype=torch.float64) for c in constants[:4]), *constants[4:])
             for m, v, p, *constants in _adam_items(entries)]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p, _, _ in entries]
    with torch.no_grad():  # as adam_partials_many calls them
        if implementation == "fused":
            update_block, ratio_block, _, precursors = _adam_fused(items, SPEC, SPEC, None, torch.device("cpu"), grads)
        else:
            update_block, ratio_block, _, precursors = adam_partials_torch(items, SPEC, SPEC, torch.device("cpu"),
                                                                           grads)
    heads, tails = (block.view(-1, 8).numpy() for block in precursors)
    values, _ = finalize_precursors(heads, tails)
    for row, entry in enumerate(entries):
        update, ratio = _adam_reference(*entry)
        for block, want in ((update_block, update), (ratio_block, ratio)):
            got = _metrics(block.view(-1, 8)[row].numpy())
            for metric, value in np_stats(want).items():
                assert np.isclose(got[metric], value, rtol=2e-5, atol=1e-6, equal_nan=True), (row, metric)
        param, state, group = entry
        want_precursors = precursors_np(grads[row].numpy(), state["exp_avg"].numpy(), state["exp_avg_sq"].numpy(),
                                        param.detach().numpy(), float(state["step"]), group["betas"], group["eps"],
                                        group["lr"])
        for metric, value in want_precursors.items():
            assert np.isclose(values[metric][row], value, rtol=1e-4, atol=1e-6), (row, metric)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_precursors_match_float64(path, dtype, poison, amsgrad):
    """The precursor rows (docs/precursors.md) on every path against float64 from the optimizer's own tensors;
    a parameter without a gradient has none; a NaN in ``exp_avg`` makes the row non-finite."""
    entries = _adam_states(dtype, poison, amsgrad)
    with torch.no_grad():
        entries[1][0].grad[:5] = 0.0  # elements without a gradient: r = 0 there
        entries[1][1]["max_exp_avg_sq" if amsgrad else "exp_avg_sq"][:3] = 0.0  # sqrt(v_hat) < eps, with g = 0
    grads = [p.grad for p, _, _ in entries]
    got = precursor_partials(entries, grads)
    assert got[2] is None and all(row is not None for i, row in enumerate(got) if i != 2)
    for i, ((param, state, group), grad, row) in enumerate(zip(entries, grads, got)):
        if row is None:
            continue
        values, nonfinite = finalize_precursors(row[:8].numpy()[None], row[8:].numpy()[None])
        v = state["max_exp_avg_sq"] if amsgrad else state["exp_avg_sq"]
        want = precursors_np(grad.double().numpy(), state["exp_avg"].double().numpy(), v.double().numpy(),
                             param.detach().double().numpy(), float(state["step"]), group["betas"], group["eps"],
                             group["lr"])
        assert nonfinite == [poison and i == 0]
        assert list(values) == list(PRECURSOR_METRICS)
        for metric, value in want.items():
            assert np.isclose(values[metric][0], value, rtol=2e-5, atol=1e-7, equal_nan=True), \
                (i, metric, values[metric][0], value)
    assert precursor_partials(entries, [None] * len(entries)) == [None] * len(entries)


def test_fused_kernels_are_torch_operators():
    """One dispatched operator per group (what a profiler or TorchDispatchMode sees)."""
    assert torch.ops.trainmon.partials.default is not None
    x = [torch.ones(3, dtype=torch.bfloat16), torch.full((2, 2), 2.0, dtype=torch.bfloat16)]
    out = torch.ops.trainmon.partials(x, kernels.spec_flags(SPEC), 1e-8)
    np.testing.assert_allclose(out.view(-1, 8).numpy()[:, [0, 1, 2, 3, 7]],
                               [[np.sqrt(3), 3, 1, 1, 3], [4, 8, 2, 2, 4]], rtol=1e-6)
