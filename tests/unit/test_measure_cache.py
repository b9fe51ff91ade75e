"""The step's dedup cache (``StepContext.cached``): a tensor measured once a step, also when it comes back as
another view of the same elements (torch hands a module backward hook's forward hooks aliases of the inputs
and outputs); never across an in-place change, another view of other elements, or a base that died."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from tests.reference import METRICS, np_stats
from trainmon.collect.context import StepContext, alias_key
from trainmon.collect.stats_base import StatsSpec

SPEC = StatsSpec.from_metrics(METRICS, eps=1e-8)


def _context() -> StepContext:
    ctx = StepContext(specs={"actv": SPEC}, metrics={"actv": list(METRICS)})
    ctx.collecting = True
    return ctx


def _counting(ctx: StepContext) -> list[torch.Tensor]:
    measured: list[torch.Tensor] = []
    original = ctx.stats_fn

    def stats_fn(tensor, spec):
        measured.append(tensor)
        return original(tensor, spec)

    ctx.stats_fn = stats_fn
    return measured


def _host_rows(ctx: StepContext) -> dict[str, np.ndarray]:
    host = ctx.buffer.transfer()
    return {key.name: row for key, row in zip(host.keys, host.partials)}


def test_a_view_of_the_same_elements_is_measured_once():
    ctx = _context()
    measured = _counting(ctx)
    x = torch.randn(4, 8)
    ctx.record("actv", "a", x)
    ctx.record("actv", "b", x.view(4, 8))  # an alias: same memory, shape and strides
    ctx.record("actv", "c", x.view_as(x).view(4, 8))  # a view of a view: the same base
    assert len(measured) == 1
    rows = _host_rows(ctx)
    np.testing.assert_array_equal(rows["b"], rows["a"])
    np.testing.assert_array_equal(rows["c"], rows["a"])
    reference = np_stats(x.double().numpy())
    assert rows["a"][2] == pytest.approx(reference["min"]) and rows["a"][3] == pytest.approx(reference["max"])


@pytest.mark.parametrize("other", ["reshaped", "sliced", "transposed", "dtype", "negated"])
def test_a_view_of_other_elements_or_another_reading_is_measured(other):
    ctx = _context()
    measured = _counting(ctx)
    x = torch.randn(4, 8)
    ctx.record("actv", "a", x)
    view = {"reshaped": lambda: x.view(8, 4), "sliced": lambda: x[1:], "transposed": lambda: x.t(),
            "dtype": lambda: x.view(torch.int32).view(torch.float32)[:, :4],
            "negated": lambda: torch._neg_view(x)}[other]()
    ctx.record("actv", "b", view)
    assert len(measured) == 2  # not answered from the cache
    rows = _host_rows(ctx)
    if other == "negated":  # the CPU path does not read a negative-bit view (no row): not the cache's concern
        return
    reference = np_stats(view.resolve_neg().double().numpy())
    assert rows["b"][0] == pytest.approx(reference["norm"], rel=1e-5)
    assert rows["b"][2] == pytest.approx(reference["min"]) and rows["b"][3] == pytest.approx(reference["max"])


def test_a_change_through_any_view_is_seen():
    ctx = _context()
    measured = _counting(ctx)
    x = torch.randn(16)
    ctx.record("actv", "a", x.view(16))
    x.view(4, 4).mul_(2)  # the shared version counter moves
    ctx.record("actv", "b", x.view(16))
    assert len(measured) == 2
    rows = _host_rows(ctx)
    assert rows["b"][3] == pytest.approx(float(x.max()))


def test_a_dead_base_is_not_taken_for_a_new_one():
    ctx = _context()
    measured = _counting(ctx)
    for _ in range(20):  # ids and addresses of freed tensors are reused: never their statistics
        x = torch.randn(64)
        ctx.record("actv", "a", x.view(64))
        del x
        gc.collect()
    assert len(measured) == 20


def test_subclasses_are_measured_by_identity_only():
    parameter = torch.nn.Parameter(torch.randn(3))
    assert alias_key(parameter) is None and alias_key(torch.randn(2).to_sparse()) is None
    ctx = _context()
    measured = _counting(ctx)
    ctx.record("actv", "a", parameter)
    ctx.record("actv", "b", parameter)
    assert len(measured) == 1


def test_a_tensor_without_memory_of_its_own_is_measured_by_identity_only():
    keys = []

    def hook_like(x):
        keys.append(alias_key(x))  # a batched tensor's data_ptr raises: no key, no exception
        return x * 2

    torch.func.vmap(hook_like)(torch.randn(3, 4))
    assert keys == [None]


def test_the_cache_is_forgotten_with_the_step():
    ctx = _context()
    measured = _counting(ctx)
    x = torch.randn(5)
    ctx.record("actv", "a", x)
    ctx.forget_measured()
    ctx.record("actv", "b", x.view(5))
    ctx.new_step()
    ctx.record("actv", "c", x.view(5))
    assert len(measured) == 3
