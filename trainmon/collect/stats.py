"""On-device partial statistics of torch tensors.

A tensor's statistics are an 8-slot float32 vector on the tensor's device,
``[norm, sum, min, max, zeros, nans, infs, numel]`` (slot indices in :mod:`trainmon.records`),
computed without any host synchronisation and without copying the tensor. Slots that the
configured metrics do not need hold 0 and cost nothing; ``min``/``max`` are always computed
(one fused pass) because they double as the exact non-finite flag of the tensor.
Low-precision tensors accumulate in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainmon.records import PARTIAL_SLOTS

_F32 = torch.float32
_NUMPY_VIEWABLE = (torch.float32, torch.float64, torch.float16)
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_TORCH_FLOATS = {numpy_type: torch_type for torch_type, numpy_type in _NUMPY_FLOATS.items()}


@dataclass(frozen=True)
class StatsSpec:
    """Which slots to compute; built once from the configured metrics."""

    norm: bool
    sum: bool
    zeros: bool
    nans: bool
    infs: bool
    eps: float

    @classmethod
    def from_metrics(cls, metrics: Sequence[str], eps: float) -> StatsSpec:
        return cls(norm="norm" in metrics, sum="mean" in metrics, zeros="zeros" in metrics,
                   nans="nans" in metrics, infs="infs" in metrics, eps=eps)


class _Zeros:
    """One cached 0-d float32 zero per device, used for slots that are not computed."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        zero = self._by_device.get(device)
        if zero is None:
            zero = self._by_device[device] = torch.zeros((), dtype=_F32, device=device)
        return zero


_zero = _Zeros()


def partial_stats(tensor: torch.Tensor, spec: StatsSpec) -> torch.Tensor:
    """Partial statistics of one tensor, as a ``[8]`` float32 tensor on its device.

    Never synchronises with the host. The device path is :func:`partial_stats_many`'s for one
    tensor (a fused kernel where the device has one, else plain torch ops).
    """
    if tensor.layout != torch.strided:
        raise TypeError(f"{tensor.layout} tensors are not measured")
    if tensor.numel() == 0:
        return empty_partial(tensor.device)
    if numpy_viewable(tensor):
        return _partial_cpu(tensor.detach(), spec)
    return device_partials([tensor], spec)  # under no_grad: no detach (a view op per tensor) needed


def partial_stats_many(tensors: Sequence[torch.Tensor], spec: StatsSpec
                       ) -> list[tuple[list[int], torch.Tensor]]:
    """Partial statistics of many tensors, computed together: ``[(indices, block), ...]``.

    Tensors are grouped by device and dtype; each group's partials are one flat float32 ``block``
    of ``8 * len(indices)`` values on the group's device (row ``j`` is ``tensors[indices[j]]``).
    A group costs O(1) kernels where the device has a fused kernel (one read of each tensor),
    else ``_foreach`` norms and a few plain torch ops per tensor (:func:`partials_torch`);
    numpy-viewable CPU tensors take the numpy path into one CPU block. Empty tensors get
    empty partials. Never synchronises with the host.

    Raises:
        TypeError: a tensor that is not strided (sparse, nested).
    """
    groups: dict[tuple[str, torch.device, torch.dtype | None], list[int]] = {}
    xs = list(tensors)  # not detached one by one (a view op each): the device path runs under no_grad
    for i, x in enumerate(xs):
        if x.layout != torch.strided:
            raise TypeError(f"{x.layout} tensors are not measured")
        if x.numel() == 0:
            key = ("empty", x.device, None)
        elif numpy_viewable(x):
            key = ("numpy", x.device, None)
        else:
            key = ("device", x.device, x.dtype)
        groups.setdefault(key, []).append(i)
    out = []
    for (path, device, _), indices in groups.items():
        if path == "empty":
            block = torch.zeros(PARTIAL_SLOTS * len(indices), dtype=_F32, device=device)
        elif path == "numpy":
            block = torch.zeros(PARTIAL_SLOTS * len(indices), dtype=_F32)
            rows = block.numpy().reshape(-1, PARTIAL_SLOTS)  # CPU view: no sync
            for row, i in zip(rows, indices):
                partial_numpy(xs[i].detach().numpy(), spec, row)  # CPU view, no sync
        else:
            block = device_partials([xs[i] for i in indices], spec)
        out.append((indices, block))
    return out


def device_partials(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
    """Flat ``[8 N]`` float32 partials of non-empty tensors of one device and dtype (the device path)."""
    kernel = fused_kernel(tensors[0].device)
    with torch.no_grad():
        return kernel(tensors, spec) if kernel is not None else partials_torch(tensors, spec)


fused_enabled = True
"""Whether fused kernels are used (tests and benchmarks switch them off to measure the plain torch path)."""


def fused_kernel(device: torch.device) -> Callable[[Sequence[torch.Tensor], StatsSpec], torch.Tensor] | None:
    """The fused single-pass group kernel for ``device`` (:mod:`trainmon.collect.kernels`), or None."""
    if not fused_enabled:
        return None
    # imported lazily: registers the torch operators on first use
    from trainmon.collect import kernels

    return kernels.partials_kernel(device.type)


def partials_torch(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
    """The plain torch fallback of the device path: :func:`trainmon.collect.fallback.partials_torch`."""
    from trainmon.collect import fallback  # imported here: it builds on this module

    return fallback.partials_torch(tensors, spec)


def numpy_viewable(x: torch.Tensor) -> bool:
    """Whether ``x.numpy()`` is a zero-copy view numpy can compute on: the CPU fast paths."""
    return x.device.type == "cpu" and x.dtype in _NUMPY_VIEWABLE


def _partial_cpu(x: torch.Tensor, spec: StatsSpec) -> torch.Tensor:
    """CPU tensors: statistics on a zero-copy numpy view of the tensor.

    torch's CPU kernels for isnan/isinf/comparisons are unvectorised (10-16x slower than
    numpy's SIMD loops on this kind of machine); no data is copied or moved.
    """
    out = torch.zeros(PARTIAL_SLOTS, dtype=_F32)
    partial_numpy(x.numpy(), spec, out.numpy())  # CPU views of `x` and `out`: no transfer, no sync
    return out


def partial_numpy(values: np.ndarray, spec: StatsSpec, out: np.ndarray) -> np.ndarray:
    """Fill the 8-slot partial ``out`` from a float16/32/64 numpy array (no copy of ``values``).

    The norm of a contiguous float32/float64 array is a BLAS dot (2x ``vector_norm`` on
    cache-sized arrays); the NaN and Inf counts are only computed when min or max is not finite
    (they are exactly 0 otherwise). Also the building block of chunked statistics
    (:func:`trainmon.collect.optimizer.adam_partials_cpu`).
    """
    if spec.norm:
        if values.dtype != np.float16 and values.flags.c_contiguous:
            flat = values.reshape(-1)  # contiguous: a view
            out[0] = np.sqrt(np.dot(flat, flat))
        else:
            out[0] = _norm(torch.from_numpy(values)).numpy()  # CPU views, no sync
    if spec.sum:
        out[1] = torch.from_numpy(values).sum(dtype=_F32).numpy()  # torch's CPU sum (4x numpy's); CPU view: no sync
    lo, hi = values.min(), values.max()
    out[2], out[3] = lo, hi
    if spec.zeros:
        threshold = zero_threshold(spec.eps, _TORCH_FLOATS[values.dtype.type])
        out[4] = np.count_nonzero(values == 0) if threshold == 0 else np.count_nonzero(
            (values > -threshold) & (values < threshold))
    if not (np.isfinite(lo) and np.isfinite(hi)):  # finite min and max: no NaN or Inf anywhere
        if spec.nans:
            out[5] = np.count_nonzero(np.isnan(values))
        if spec.infs:
            out[6] = np.count_nonzero(np.isinf(values))
    out[7] = values.size
    return out


def _norm(x: torch.Tensor) -> torch.Tensor:
    """L2 norm as a float32 0-d tensor; fp16/bf16 accumulate in float32, float64 in float64.

    ``vector_norm(dtype=float32)`` rejects float64 input (a narrowing cast), so only
    low-precision tensors get the accumulation dtype.
    """
    if x.dtype in _LOW_PRECISION:
        return torch.linalg.vector_norm(x, dtype=_F32)
    return torch.linalg.vector_norm(x).to(_F32)


@functools.lru_cache(maxsize=64)
def zero_threshold(eps: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` that is >= ``eps``, so ``|x| < eps`` is exact in ``dtype``.

    Comparing an fp16 tensor with ``eps`` directly rounds ``eps`` to fp16 first: the default
    1e-8 becomes 0 and nothing would count as a zero. For ``eps`` at or below the smallest
    subnormal the threshold is that subnormal, i.e. exactly the zeros are counted. Plain host
    arithmetic (no tensor), cached per ``(eps, dtype)``.

    Example:
        >>> zero_threshold(1e-8, torch.float16)  # the smallest fp16 subnormal, 2**-24
        5.960464477539063e-08
    """
    if eps == 0.0 or not math.isfinite(eps):
        return eps
    if dtype == torch.bfloat16:
        # bfloat16 is the upper half of a float32: round the float32 bits up to a multiple of 2**16
        bits = int(np.array(_round_up(np.float32, eps)).view(np.uint32))
        bits = (bits + 0xFFFF) & ~0xFFFF
        return float(np.array(bits, dtype=np.uint32).view(np.float32))
    np_type = _NUMPY_FLOATS.get(dtype)
    return eps if np_type is None else float(_round_up(np_type, eps))


def _round_up(np_type: type, value: float) -> np.floating:
    rounded = np_type(value)
    if float(rounded) < value:  # rounded down: step up to the next representable value
        rounded = np.nextafter(rounded, np_type(np.inf))
    return rounded


def _count_small(x: torch.Tensor, eps: float) -> torch.Tensor:
    threshold = zero_threshold(eps, x.dtype)
    if threshold == 0.0:
        return numel_minus(x, torch.count_nonzero(x))
    return torch.count_nonzero(x.abs() < threshold).to(_F32)


def numel_minus(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x.numel() - count).to(_F32)


def empty_partial(device: torch.device) -> torch.Tensor:
    """Partial statistics of a shard that holds no element (neutral in a combination)."""
    return torch.zeros(PARTIAL_SLOTS, dtype=_F32, device=device)


def combine_partials_torch(gathered: torch.Tensor) -> torch.Tensor:
    """Combine ``[shards, N, 8]`` partial statistics on the device (mirror of records.combine_partials).

    Used by integrations after their one all-gather of a step, so that combining costs no
    extra host transfer.
    """
    has = gathered[..., 7] > 0
    out = gathered.sum(dim=0)
    out[:, 0] = gathered[..., 0].square().sum(dim=0).sqrt()
    inf = torch.full_like(gathered[..., 2], float("inf"))
    lo = torch.where(has, gathered[..., 2], inf)
    hi = torch.where(has, gathered[..., 3], -inf)
    out[:, 2] = lo.amin(dim=0)
    out[:, 3] = hi.amax(dim=0)
    # amin/amax propagate NaN, so a NaN on any shard survives.
    return out
