"""On-device partial statistics of MindSpore tensors (the mirror of :mod:`trainmon.collect.stats`).

A tensor's statistics are an 8-slot float32 MindSpore tensor on the tensor's device,
``[norm, sum, min, max, zeros, nans, infs, numel]`` (slot indices in :mod:`trainmon.records`),
computed with MindSpore ops and no host synchronisation. Slots the configured metrics do not
need hold 0. The host side (``records.finalize``) is shared with PyTorch.

MindSpore's CPU ``min``/``max`` skip NaN, while torch's propagate it and the shared host side
relies on that to flag non-finite tensors; here ``min``/``max`` are set to NaN when the sum of
squares (computed anyway for ``norm``) is NaN, which happens exactly when the tensor holds a NaN.
Low-precision and integer tensors are measured in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mindspore as ms
from mindspore import Tensor, mint, ops

from trainmon.records import PARTIAL_SLOTS

if TYPE_CHECKING:
    from trainmon.collect.stats import StatsSpec

_F32 = ms.float32
_EXACT = (ms.float32, ms.float64)


class _Constants:
    """Cached 0-d float32 constants (0 and NaN), created on first use."""

    def __init__(self) -> None:
        self._zero: Tensor | None = None
        self._nan: Tensor | None = None

    @property
    def zero(self) -> Tensor:
        if self._zero is None:
            self._zero = Tensor(0.0, _F32)
        return self._zero

    @property
    def nan(self) -> Tensor:
        if self._nan is None:
            self._nan = Tensor(float("nan"), _F32)
        return self._nan


_const = _Constants()


def _f32(value: Tensor) -> Tensor:
    return value if value.dtype == _F32 else value.astype(_F32)


def partial_stats(tensor: Tensor, spec: StatsSpec | Any) -> Tensor:
    """Partial statistics of one MindSpore tensor, as a ``[8]`` float32 tensor on its device.

    Args:
        tensor: any MindSpore tensor (a ``Parameter`` too); it is not modified.
        spec: which slots to compute (:class:`trainmon.collect.stats.StatsSpec` or any object
            with the attributes ``norm``, ``sum``, ``zeros``, ``nans``, ``infs``, ``eps``).

    Returns:
        ``[norm, sum, min, max, zeros, nans, infs, numel]``; no host synchronisation.

    Example:
        >>> partial_stats(Tensor([3.0, -4.0]), spec).asnumpy()[:4]   # doctest: +SKIP
        array([ 5., -1., -4.,  3.], dtype=float32)
    """
    numel = int(tensor.size)
    zero = _const.zero
    if numel == 0:
        return ops.zeros((PARTIAL_SLOTS,), _F32)
    x = tensor.reshape(-1)
    if x.dtype not in _EXACT:
        x = x.astype(_F32)  # float16/bfloat16 accumulate in float32; ints and bools are measured as float32
    squares = _f32(mint.sum(x * x))
    has_nan = mint.isnan(squares)  # x*x >= 0 or NaN, so the sum is NaN exactly when x holds a NaN
    lo = ops.select(has_nan, _const.nan, _f32(mint.min(x)))
    hi = ops.select(has_nan, _const.nan, _f32(mint.max(x)))
    slots = [
        mint.sqrt(squares) if spec.norm else zero,
        _f32(mint.sum(x)) if spec.sum else zero,
        lo,
        hi,
        _count_small(x, spec.eps) if spec.zeros else zero,
        mint.sum(mint.isnan(x), dtype=_F32) if spec.nans else zero,
        mint.sum(mint.isinf(x), dtype=_F32) if spec.infs else zero,
        Tensor(float(numel), _F32),  # a host constant: copied to the device asynchronously, no sync
    ]
    return ops.stack(slots)


def _count_small(x: Tensor, eps: float) -> Tensor:
    if eps == 0.0:
        return mint.sum(x == 0, dtype=_F32)
    return mint.sum(mint.abs(x) < eps, dtype=_F32)


def sum_of_squares(tensors: list[Tensor]) -> Tensor:
    """``sum(x*x)`` over many tensors, in float32, on the device (for a global norm)."""
    total = _const.zero
    for t in tensors:
        x = t if t.dtype in _EXACT else t.astype(_F32)
        total = total + _f32(mint.sum(x * x))
    return total
