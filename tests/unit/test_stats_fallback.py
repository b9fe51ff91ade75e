"""The plain torch fallback of the device path (no fused kernel: Ascend, CUDA without Triton, float64 or
non-contiguous tensors), forced on CPU, against independent float64 numpy references: the multi-tensor
path (``_foreach`` ops per batch), the per-tensor path (one tensor alone, large tensors in bounded pieces),
with and without the optional multi-tensor ops of newer torch, and the Adam update/ratio fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.reference import METRICS, np_stats
from tests.unit.test_stats_many import _adam_reference, _adam_states
from trainmon.collect import adam, adam_fallback, fallback, stats
from trainmon.collect.adam import _adam_items
from trainmon.collect.adam_fallback import adam_partials_torch
from trainmon.collect.fallback import partials_torch
from trainmon.collect.stats import partial_stats, partial_stats_many
from trainmon.collect.stats_base import StatsSpec, zero_threshold

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def no_fused_kernel(monkeypatch):
    """The device path without a fused kernel, for every dtype (as CUDA/Ascend run it)."""
    monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())
    monkeypatch.setattr(stats, "fused_enabled", False)


@pytest.fixture(params=["foreach", "no-foreach-max", "no-powsum", "no-float64-sum"])
def variant(request, monkeypatch):
    """``foreach``: this torch as it is; the others drop a capability the fallback uses when present
    (``_foreach_max``: torch < 2.4; ``_foreach_powsum``: older torch; float64 reductions: e.g. Ascend)."""
    if request.param == "no-foreach-max":
        monkeypatch.setattr(fallback, "_FOREACH_MAX", False)
    elif request.param == "no-powsum":
        monkeypatch.setattr(fallback, "_FOREACH_POWSUM", False)
    elif request.param == "no-float64-sum":
        monkeypatch.setattr(fallback, "_FLOAT64_DEVICES", ())
    return request.param


def _values(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Tensors of ``dtype``: plain, with zeros and values near eps, NaN/Inf in every combination,
    non-contiguous, 1-element, 0-d and empty."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(24, 17, generator=g, dtype=torch.float64) * 3
    base[::4] = 0.0
    base[1, :3] = torch.tensor([1e-9, -1e-7, 2e-8], dtype=torch.float64)  # around the default eps 1e-8
    tensors = [base, base.t(), base[:, ::3], torch.randn(5, 1, 7, generator=g, dtype=torch.float64)]
    for specials in ([NAN], [INF], [-INF], [INF, -INF], [NAN, INF, -INF, NAN], [INF, INF, 0.0]):
        x = torch.randn(40, generator=g, dtype=torch.float64)
        x[: len(specials)] = torch.tensor(specials, dtype=torch.float64)
        tensors.append(x[torch.randperm(40, generator=g)])
    tensors += [torch.tensor([-2.5], dtype=torch.float64), torch.tensor(0.75, dtype=torch.float64),
                torch.zeros(0, dtype=torch.float64), torch.full((3, 3), -INF, dtype=torch.float64)]
    return [t.to(dtype) for t in tensors]


def _reference(tensor: torch.Tensor, eps: float) -> dict[str, float]:
    values = tensor.double().numpy()  # every fp16/bf16/fp32 value is exact in float64
    if values.size == 0:
        return {"norm": 0.0, "sum": 0.0, "nans": 0.0, "infs": 0.0, "numel": 0.0}
    threshold = zero_threshold(eps, tensor.dtype)  # eps as the tensor's dtype can tell it
    with np.errstate(invalid="ignore", over="ignore"):
        reference = np_stats(values, eps=threshold)
        total = float(np.sum(values))
    del reference["mean"]  # the sum is checked instead
    # eps 0 (or below the dtype's smallest subnormal): trainmon counts the exact zeros
    zeros = np.count_nonzero(values == 0) if threshold == 0 else reference["zeros"] * values.size
    return {**reference, "sum": total, "zeros": float(zeros), "numel": float(values.size)}


def _assert_rows(block: torch.Tensor, tensors: list[torch.Tensor], eps: float, label: str = "") -> None:
    assert block.dtype == torch.float32 and block.shape == (8 * len(tensors),)
    rows = block.view(-1, 8).numpy().astype(np.float64)
    slots = {"norm": 0, "sum": 1, "min": 2, "max": 3, "zeros": 4, "nans": 5, "infs": 6, "numel": 7}
    for i, (row, tensor) in enumerate(zip(rows, tensors)):
        for metric, want in _reference(tensor, eps).items():
            got = row[slots[metric]]
            if metric in ("sum", "norm") and tensor.dtype != torch.float64:
                # float32 accumulation against float64: a relative 1e-6 of the sum of magnitudes
                scale = float(np.sum(np.abs(tensor.double().numpy()))) if np.isfinite(want) else 1.0
                ok = np.isclose(got, want, rtol=1e-6, atol=1e-6 * scale, equal_nan=True)
            else:  # exact, but for float64 values rounded to the block's float32
                rtol = 1e-7 if tensor.dtype == torch.float64 else 0.0
                ok = np.isclose(got, want, rtol=rtol, atol=0.0, equal_nan=True) or got == want
            assert ok, (label, i, tensor.dtype, tuple(tensor.shape), metric, got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-8, 0.0, 0.5], ids=["eps1e-8", "eps0", "eps0.5"])
def test_group_equals_float64_reference(variant, dtype, eps):
    tensors = _values(dtype, seed=1)
    spec = StatsSpec.from_metrics(METRICS, eps=eps)
    groups = partial_stats_many(tensors, spec)
    assert sorted(i for indices, _ in groups for i in indices) == list(range(len(tensors)))
    for indices, block in groups:
        _assert_rows(block, [tensors[i] for i in indices], eps, label=variant)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_tensor_alone_equals_float64_reference(variant, dtype):
    spec = StatsSpec.from_metrics(METRICS, eps=1e-8)
    for i, tensor in enumerate(_values(dtype, seed=2)):
        _assert_rows(partial_stats(tensor, spec), [tensor], 1e-8, label=f"{variant} #{i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large_tensors_in_bounded_pieces_and_batches(variant, dtype, monkeypatch):
    """Tensors above the small size are measured one by one, in pieces of at most the bound when larger
    (contiguous: flat; strided: along dim 0); small ones in batches of at most the bound; no op makes a
    temporary larger than the bound."""
    monkeypatch.setattr(fallback, "_SCRATCH_ELEMENTS", 1000)
    monkeypatch.setattr(fallback, "_SMALL_ELEMENTS", 500)
    g = torch.Generator().manual_seed(3)
    big = torch.randn(4321, generator=g, dtype=torch.float64)
    big[[5, 1500, 4000]] = torch.tensor([NAN, INF, -INF], dtype=torch.float64)
    wide = torch.randn(30, 200, generator=g, dtype=torch.float64)
    wide[::7] = 0.0
    wide[17, 3] = NAN
    smalls = [torch.randn(300, generator=g) for _ in range(7)]
    tensors = [t.to(dtype) for t in (big, wide.t(), wide, torch.randn(700, generator=g), *smalls)]
    spec = StatsSpec.from_metrics(METRICS, eps=1e-8)
    sizes = _OutputSizes()
    with sizes:
        block = partials_torch(tensors, spec)
    _assert_rows(block, tensors, 1e-8, label=variant)
    assert sizes.largest <= 1000, sizes.largest  # not one full-size temporary of the 6,000-element tensors


def test_multi_tensor_path_costs_the_same_ops_for_3_or_30_tensors():
    """O(1) dispatched ops per batch: the count does not grow with the number of tensors."""
    spec = StatsSpec.from_metrics(METRICS, eps=1e-8)
    counts = []
    for n in (3, 30):
        tensors = [torch.randn(50 + i).to(torch.bfloat16) for i in range(n)]
        partials_torch(tensors, spec)  # the numel constants are made once, then cached
        ops = _OutputSizes()
        with ops:
            partials_torch(tensors, spec)
        counts.append(ops.ops)
    assert counts[0] == counts[1], counts


def test_unrequested_slots_stay_zero_and_counts_only_when_asked(variant):
    x = torch.tensor([NAN, INF, 0.0, 1e-4, -2.0, -INF, 3.0]).to(torch.bfloat16)
    for metrics in (["norm"], ["max"], ["nans"], ["infs"], ["zeros"], ["mean", "min"], ["nans", "infs"]):
        spec = StatsSpec.from_metrics(metrics, eps=1e-3)
        block = partials_torch([x, x * 2, x[::2], x.flip(0)], spec).view(-1, 8)
        wanted = {0: "norm" in metrics, 1: "mean" in metrics, 4: "zeros" in metrics, 5: "nans" in metrics,
                  6: "infs" in metrics}
        for slot, computed in wanted.items():
            if not computed:
                assert not block[:, slot].any(), (metrics, slot, block)
        row = block[0].tolist()
        assert np.isnan(row[2]) and np.isnan(row[3]) and row[7] == 7  # min/max always: the non-finite flag
        if "nans" in metrics:
            assert row[5] == 1
        if "infs" in metrics:
            assert row[6] == 2
        if "zeros" in metrics:
            assert row[4] == 2  # |x| < 1e-3: 0.0 and 1e-4


# ------------------------------------------------------------------------------------------ Adam


def _adam_entries(dtype: torch.dtype, amsgrad: bool = False):
    """test_stats_many's AdamW states (zero parameters, an older step counter), an empty parameter, and
    NaN/Inf/0 in the states, one NaN where the parameter is 0 (the ratio is 0 there whatever the update)."""
    entries = _adam_states(dtype, amsgrad=amsgrad)
    empty = torch.nn.Parameter(torch.zeros(0, dtype=dtype))
    optimizer = torch.optim.AdamW([empty])
    empty.grad = torch.zeros_like(empty)
    optimizer.step()
    entries.append((empty, optimizer.state[empty], optimizer.param_groups[0]))
    state = entries[0][1]
    state["exp_avg"][7] = NAN  # params[0][:50] are 0
    state["exp_avg"][2000] = NAN
    state["exp_avg_sq"][2500] = 0.0  # with exp_avg 0 too: 0 / eps
    state["exp_avg"][2500] = 0.0
    entries[3][1]["exp_avg"][3, 4] = INF
    return entries


def _assert_adam(update_block, ratio_block, entries, label=""):
    for row, entry in enumerate(entries):
        for name, block, want in zip(("update", "ratio"), (update_block, ratio_block), _adam_reference(*entry)):
            got = block.view(-1, 8)[row].double().numpy()
            if want.size == 0:
                assert not got.any(), (label, name, row, got)
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                reference = np_stats(want)
                expected = [reference["norm"], float(np.sum(want)), reference["min"], reference["max"], None,
                            reference["nans"], reference["infs"], float(want.size)]
            finite = want[np.isfinite(want)]
            scale = float(np.sum(np.abs(finite))) if finite.size else 1.0
            for slot, value in enumerate(expected):
                if value is None:
                    continue
                # float32 arithmetic (as the fused kernels) against float64: a relative 2e-6
                ok = np.isclose(got[slot], value, rtol=2e-6, atol=2e-6 * scale * (slot < 2), equal_nan=True)
                assert ok, (label, name, row, slot, got[slot], value)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_adam_fallback_matches_float64(variant, dtype, amsgrad, monkeypatch):
    monkeypatch.setattr(adam_fallback, "TEMPORARY_ELEMENTS", 50000)  # the 196,731-element parameter in 4 pieces
    entries = _adam_entries(dtype, amsgrad)
    spec = StatsSpec.from_metrics(["norm", "min", "max", "mean", "nans", "infs"], eps=1e-8)
    adam_indices, blocks = adam.adam_partials_many(entries, spec, spec)
    assert adam_indices == list(range(len(entries)))
    (indices, update_block, ratio_block, _, _), = blocks
    assert indices == adam_indices
    _assert_adam(update_block, ratio_block, entries, label=variant)


def test_adam_fallback_with_device_scalar_constants():
    """Step counters on the device (capturable/fused Adam): 0-d tensor constants, per-piece ops."""
    entries = _adam_entries(torch.float32)
    items = [(m, v, p, *(torch.tensor(c, dtype=torch.float64) for c in constants[:4]), *constants[4:])
             for m, v, p, *constants in _adam_items(entries)]
    spec = StatsSpec.from_metrics(["norm", "min", "max", "mean", "nans", "infs"], eps=1e-8)
    with torch.no_grad():
        update_block, ratio_block, _, precursors = adam_partials_torch(items, spec, spec, torch.device("cpu"), [])
    assert precursors is None  # not asked for
    _assert_adam(update_block, ratio_block, entries)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_precursor_fallback_in_pieces_matches_float64(dtype, monkeypatch):
    """A parameter cut into pieces (the fallback's bounded temporaries) combines its precursor sums exactly."""
    from tests.reference import precursors_np
    from trainmon.base.precursors import finalize_precursors

    monkeypatch.setattr(stats, "fused_enabled", False)
    monkeypatch.setattr(adam_fallback, "TEMPORARY_ELEMENTS", 50000)  # the 196,731-element parameter in 4 pieces
    entries = _adam_states(dtype)
    grads = [p.grad for p, _, _ in entries]
    got = adam.precursor_partials(entries, grads)
    for (param, state, group), grad, row in zip(entries, grads, got):
        assert (row is None) == (grad is None)
        if row is None:
            continue
        values, _ = finalize_precursors(row[:8].numpy()[None], row[8:].numpy()[None])
        want = precursors_np(grad.double().numpy(), state["exp_avg"].double().numpy(),
                             state["exp_avg_sq"].double().numpy(), param.detach().double().numpy(),
                             float(state["step"]), group["betas"], group["eps"], group["lr"])
        for metric, value in want.items():
            assert np.isclose(values[metric][0], value, rtol=2e-5, atol=1e-7), (metric, values[metric][0], value)


class _OutputSizes(TorchDispatchMode):
    """Counts dispatched aten ops and the largest tensor any of them makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not func.is_view:
            leaves = out if isinstance(out, (list, tuple)) else [out]
            self.largest = max([self.largest] + [t.numel() for t in leaves if isinstance(t, torch.Tensor)])
        return out
