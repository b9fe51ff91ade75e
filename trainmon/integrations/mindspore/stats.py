"""On-device partial statistics of MindSpore tensors (the mirror of :mod:`trainmon.collect.stats`).

A tensor's statistics are 8 float32 values on the tensor's device,
``[norm, sum, min, max, zeros, nans, infs, numel]`` (slot indices in :mod:`trainmon.base.records`),
computed with MindSpore ops and no host synchronisation. Slots the configured metrics do not
need hold 0. The host side (``partials.finalize``) is shared with PyTorch.

What makes this fast in PyNative mode (docs/performance.md has the profile):

- **No blocking metadata reads.** MindSpore runs ops asynchronously; reading ``dtype``, ``shape``,
  ``size`` or ``_version`` of a tensor an op has just been queued for waits until the queue has
  inferred it (~2.5 ms each on a busy CPU queue). Only the tensors handed to a hook (already
  inferred) are asked for their dtype and shape; the dtype of every result is known beforehand.
- **Only kernels that exist on the device and dispatch asynchronously.** ``ops.stack`` and the other
  primitives without a PyBoost kernel run through ``_run_op``, about 1 ms each and synchronous; the
  ``mint`` kernels used here are queued in a few µs. (``mint.stack``, ``mint.zeros_like`` and
  ``mint.full`` have no CPU kernel in MindSpore 2.10; a missing kernel fails asynchronously, in the
  user's next op, so none is used.)
- **Tensors of one size and dtype are measured together**: concatenated into one ``[m, n]`` matrix and
  reduced along its rows, about 18 kernels for the whole group (the layers of a deep model share a
  few shapes). A group holds at most :data:`GROUP_ELEMENTS` elements; a tensor above it is measured
  alone, from a view (no copy).

MindSpore's CPU ``min``/``max`` skip NaN, while torch's propagate it and the shared host side
relies on that to flag non-finite tensors; here ``min``/``max`` are set to NaN when the sum of
squares (computed anyway for ``norm``) is NaN, which happens exactly when the row holds a NaN.
float64 tensors are measured in float64, every other dtype (float16, bfloat16, integers, bools) in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint

from trainmon.base.partials import PARTIAL_SLOTS

if TYPE_CHECKING:
    from trainmon.collect.stats_base import StatsSpec

_F32, _F64 = ms.float32, ms.float64
GROUP_ELEMENTS = 1 << 22
"""The most elements concatenated into one matrix (16 MiB in float32): the bound on the temporaries of a group."""
_CACHE_LIMIT = 1024
_NUMPY = {ms.float16: np.float16, _F32: np.float32, _F64: np.float64}


def working_dtype(dtype: Any) -> Any:
    """The dtype a tensor of ``dtype`` is measured in: float64 stays, everything else is float32."""
    return _F64 if dtype == _F64 else _F32


class _Constants:
    """Constant tensors made once from host values (no kernel, no sync): per dtype and shape."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], Tensor] = {}

    def get(self, kind: str, dtype: Any, rows: int = 1, value: float = 0.0) -> Tensor:
        key = (kind, dtype, rows, value)
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= _CACHE_LIMIT:  # many distinct activation sizes: start again
                self._cache.clear()
            numpy_dtype = _NUMPY.get(dtype, np.float32)
            shape: tuple[int, ...] = () if kind == "scalar" else (rows, 1)
            found = self._cache[key] = Tensor(np.full(shape, value, numpy_dtype), dtype)
        return found

    def scalar(self, value: float, dtype: Any = _F32) -> Tensor:
        """A 0-d tensor."""
        return self.get("scalar", dtype, 1, value)

    def column(self, rows: int, value: float, dtype: Any) -> Tensor:
        """A ``[rows, 1]`` tensor filled with ``value``."""
        return self.get("column", dtype, rows, value)


constants = _Constants()


def matrix_partials(matrix: Tensor, spec: StatsSpec | Any, rows: int, numel: int, dtype: Any) -> tuple[Tensor, Tensor]:
    """The partial statistics of each row of ``matrix``, one kernel per slot for all rows.

    Args:
        matrix: a ``[rows, numel]`` float32 or float64 tensor (``numel`` > 0); it is not modified.
        spec: which slots to compute (:class:`trainmon.collect.stats_base.StatsSpec` or any object with
            the attributes ``norm``, ``sum``, ``zeros``, ``nans``, ``infs``, ``eps``).
        rows, numel: the matrix's shape, given: reading it would wait for the queue (module docstring).
        dtype: the matrix's dtype, given for the same reason.

    Returns:
        ``(block, squares)``: the flat float32 ``[rows * 8]`` partials, row after row, and the ``[rows, 1]``
        sums of squares in ``dtype`` (a global norm reuses them). No host synchronisation.
    """
    zero = constants.column(rows, 0.0, dtype)
    squares = mint.sum(mint.mul(matrix, matrix), 1, True)
    has_nan = mint.isnan(squares)  # x*x >= 0 or NaN, so the sum is NaN exactly when the row holds a NaN
    nan = constants.scalar(math.nan, dtype)
    columns = [
        mint.sqrt(squares) if spec.norm else zero,
        mint.sum(matrix, 1, True) if spec.sum else zero,
        mint.where(has_nan, nan, mint.min(matrix, 1, True)[0]),  # min/max with dim: 7x faster than amin/amax on CPU
        mint.where(has_nan, nan, mint.max(matrix, 1, True)[0]),
        mint.sum(_small(matrix, spec.eps), 1, True, dtype=dtype) if spec.zeros else zero,
        mint.sum(mint.isnan(matrix), 1, True, dtype=dtype) if spec.nans else zero,
        mint.sum(mint.isinf(matrix), 1, True, dtype=dtype) if spec.infs else zero,
        constants.column(rows, float(numel), dtype),
    ]
    block = mint.cat(columns, 1).reshape(-1)
    return (block if dtype == _F32 else block.astype(_F32)), squares


def precursor_partials(update: Tensor, m: Tensor, v_hat: Tensor, param: Tensor, grad: Tensor, eps: Tensor,
                       lr: Tensor, rows: int, numel: int) -> tuple[Tensor, Tensor]:
    """The precursor heads and tails (:mod:`trainmon.base.precursors`) of ``rows`` parameters, as two flat
    float32 ``[rows * 8]`` blocks, from ``[rows, numel]`` float32 matrices: the update, ``m``, the bias-corrected
    ``v_hat`` the update divided by, the parameter after the step and the gradient the moments took. ``eps`` and
    ``lr`` are 0-d float32 tensors. A few kernels per slot for all rows; no host synchronisation."""
    zero = constants.column(rows, 0.0, _F32)
    count = constants.column(rows, float(numel), _F32)
    floor = mint.mul(eps, eps)
    squares = mint.mul(grad, grad)
    stale = mint.where(mint.ne(squares, constants.scalar(0.0)), mint.div(squares, mint.maximum(v_hat, floor)),
                       constants.scalar(0.0))
    total = mint.sum(stale, 1, True)
    top = mint.where(mint.isnan(total), constants.scalar(math.nan), mint.max(stale, 1, True)[0])
    head = mint.cat([mint.sqrt(mint.sum(mint.mul(update, update), 1, True)), mint.sum(mint.mul(update, grad), 1, True),
                     zero, top, mint.sum(mint.mul(m, grad), 1, True), total,
                     mint.sum(mint.lt(v_hat, floor), 1, True, dtype=_F32), count], 1)
    tail = mint.cat([mint.sqrt(mint.sum(mint.mul(param, param), 1, True)), mint.mul(count, lr), zero, zero,
                     mint.sum(squares, 1, True), mint.sum(mint.mul(m, m), 1, True), zero, count], 1)
    return head.reshape(-1), tail.reshape(-1)


def _small(matrix: Tensor, eps: float) -> Tensor:
    return matrix == 0 if eps == 0.0 else mint.abs(matrix) < eps


@dataclass(frozen=True)
class Group:
    """Tensors measured together: their positions, their common element count and dtype."""

    indices: tuple[int, ...]
    numel: int
    dtype: Any

    @property
    def working_dtype(self) -> Any:
        return working_dtype(self.dtype)


def tensor_meta(tensor: Tensor) -> tuple[Any, int]:
    """``(dtype, numel)`` of a tensor handed to a hook (already inferred: no wait)."""
    return tensor.dtype, math.prod(tensor.shape)


def plan_groups(metas: Sequence[tuple[Any, int]], limit: int = GROUP_ELEMENTS) -> list[Group]:
    """Group positions by ``(dtype, numel)`` in first-seen order, at most ``limit`` elements a group
    (a larger tensor alone). Empty tensors form groups of their own (:func:`group_partials` gives them zeros)."""
    by_kind: dict[tuple[Any, int], list[int]] = {}
    for i, (dtype, numel) in enumerate(metas):
        by_kind.setdefault((dtype, numel), []).append(i)
    groups: list[Group] = []
    for (dtype, numel), indices in by_kind.items():
        per_group = max(1, limit // numel) if numel else len(indices)
        for start in range(0, len(indices), per_group):
            groups.append(Group(tuple(indices[start:start + per_group]), numel, dtype))
    return groups


def group_matrix(tensors: Sequence[Tensor], group: Group, dtype: Any = None) -> Tensor:
    """The group's tensors as the rows of one ``[m, numel]`` matrix in ``dtype`` (default: the group's
    working dtype): a view for one tensor already in it, else one concatenation and at most one cast."""
    target = group.working_dtype if dtype is None else dtype
    rows = [tensors[i].reshape(1, group.numel) for i in group.indices]
    matrix = rows[0] if len(rows) == 1 else mint.cat(rows, 0)
    return matrix if group.dtype == target else matrix.astype(target)


def group_partials(tensors: Sequence[Tensor], group: Group, spec: StatsSpec | Any) -> Tensor:
    """The flat ``[m * 8]`` float32 partials of the group's tensors, in the group's order."""
    rows = len(group.indices)
    if group.numel == 0:
        return mint.zeros((rows * PARTIAL_SLOTS,), dtype=_F32)
    return matrix_partials(group_matrix(tensors, group), spec, rows, group.numel, group.working_dtype)[0]


def partial_blocks(tensors: Sequence[Tensor], spec: StatsSpec | Any,
                   metas: Sequence[tuple[Any, int]] | None = None) -> list[tuple[tuple[int, ...], Tensor]]:
    """Partial statistics of many tensors: ``(positions, flat [8 m] block)`` per group of one size and dtype.

    Args:
        tensors: MindSpore tensors handed to a hook (parameters, gradients, optimizer states).
        spec: which slots to compute.
        metas: ``(dtype, numel)`` per tensor when known; by default read from the tensors (:func:`tensor_meta`).
    """
    if metas is None:
        metas = [tensor_meta(t) for t in tensors]
    return [(group.indices, group_partials(tensors, group, spec)) for group in plan_groups(metas)]


def partial_stats(tensor: Tensor, spec: StatsSpec | Any) -> Tensor:
    """Partial statistics of one MindSpore tensor, as a ``[8]`` float32 tensor on its device.

    Args:
        tensor: any MindSpore tensor handed to a hook (a ``Parameter`` too); it is not modified.
        spec: which slots to compute (:class:`trainmon.collect.stats_base.StatsSpec` or any object
            with the attributes ``norm``, ``sum``, ``zeros``, ``nans``, ``infs``, ``eps``).

    Returns:
        ``[norm, sum, min, max, zeros, nans, infs, numel]``; no host synchronisation.

    Example:
        >>> partial_stats(Tensor([3.0, -4.0]), spec).asnumpy()[:4]   # doctest: +SKIP
        array([ 5., -1., -4.,  3.], dtype=float32)
    """
    dtype, numel = tensor_meta(tensor)
    return group_partials([tensor], Group((0,), numel, dtype), spec)


def sum_of_squares(tensors: Sequence[Tensor], metas: Sequence[tuple[Any, int]] | None = None) -> Tensor:
    """``sum(x*x)`` over many tensors, in float32, on the device (for a global norm): one ``[1]`` tensor."""
    if metas is None:
        metas = [tensor_meta(t) for t in tensors]
    totals = []
    for group in plan_groups(metas):
        if group.numel:
            matrix = group_matrix(tensors, group)
            total = mint.sum(mint.mul(matrix, matrix)).reshape(1)
            totals.append(total if group.working_dtype == _F32 else total.astype(_F32))
    if not totals:
        return constants.scalar(0.0).reshape(1)
    return totals[0] if len(totals) == 1 else mint.sum(mint.cat(totals)).reshape(1)
