"""What every statistics path shares: :class:`StatsSpec` (which slots to compute), the exact zero
threshold of a dtype (:func:`zero_threshold`), cached zeros, and the numpy path (:func:`partial_numpy`).

Imported by :mod:`trainmon.collect.stats` (which re-exports these names), the fused kernels
(:mod:`trainmon.collect.kernels`, :mod:`trainmon.collect.triton_kernels`) and the plain torch fallback
(:mod:`trainmon.collect.fallback`); it imports none of them, so the statistics modules import in one
direction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

_F32 = torch.float32
LOW_PRECISION = (torch.float16, torch.bfloat16)
"""Dtypes whose statistics accumulate in float32."""
FloatArray: TypeAlias = "npt.NDArray[np.floating[Any]]"
"""A numpy array of float16, float32 or float64 values."""
_NUMPY_FLOATS: dict[torch.dtype, type[np.floating[Any]]] = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_TORCH_FLOATS = {numpy_type: torch_type for torch_type, numpy_type in _NUMPY_FLOATS.items()}
_minimum, _maximum = np.minimum.reduce, np.maximum.reduce
vector_norm: Callable[..., torch.Tensor] = torch.linalg.vector_norm
"""``torch.linalg.vector_norm``, typed (torch leaves it unannotated)."""


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


zero = _Zeros()
"""``zero(device)``: a cached 0-d float32 zero on ``device``."""


def partial_numpy(values: FloatArray, spec: StatsSpec, out: FloatArray,
                  known_bounds: tuple[Any, Any] | None = None) -> FloatArray:
    """Fill the 8-slot partial ``out`` from a float16/32/64 numpy array (no copy of ``values``).

    The norm of a contiguous float32/float64 array is a BLAS dot (2x ``vector_norm`` on
    cache-sized arrays); the NaN and Inf counts are only computed when min or max is not finite
    (they are exactly 0 otherwise). Also the building block of chunked statistics
    (:func:`trainmon.collect.adam.adam_partials_cpu`). ``known_bounds``: ``(values.min(), values.max())`` where
    the caller has them already.
    """
    if spec.norm:
        if values.dtype != np.float16 and values.flags.c_contiguous:
            flat = values.reshape(-1)  # contiguous: a view
            out[0] = np.sqrt(np.dot(flat, flat))
        else:
            out[0] = _norm(torch.from_numpy(values)).numpy()  # CPU views, no sync
    # min and max between the norm's pass and the sum's: bounds() reads backwards from the end, which the norm's
    # pass left in the cache
    lo, hi = bounds(values) if known_bounds is None else known_bounds
    out[2], out[3] = lo, hi
    if spec.sum:
        out[1] = torch.from_numpy(values).sum(dtype=_F32).numpy()  # torch's CPU sum (4x numpy's); CPU view: no sync
    finite = math.isfinite(lo) and math.isfinite(hi)  # math: 10x np.isfinite on a scalar
    if spec.norm and finite and math.isinf(out[0]):
        out[0] = _wide_norm(values)  # finite values whose float32 squares overflowed (rare: |x| > ~1.8e19)
    if spec.zeros:
        threshold = zero_threshold(spec.eps, _TORCH_FLOATS[values.dtype.type])
        out[4] = np.count_nonzero(values == 0) if threshold == 0 else np.count_nonzero(
            (values > -threshold) & (values < threshold))
    if not finite:  # finite min and max: no NaN or Inf anywhere
        if spec.nans:
            out[5] = np.count_nonzero(np.isnan(values))
        if spec.infs:
            out[6] = np.count_nonzero(np.isinf(values))
    out[7] = values.size
    return out


BOUNDS_CHUNK = 131072
"""Elements per chunk of :func:`bounds` (512 KB of float32: min and max of a chunk in one read of memory)."""


def bounds(values: FloatArray) -> tuple[Any, Any]:
    """``(values.min(), values.max())``, the same values.

    An array larger than the CPU's L2 cache would be read from memory twice; chunk by chunk, the max reads
    what the min just brought into the cache, and the chunks go backwards, so that the first ones are still
    in the cache from the pass before (a 3-4 MB activation: 10-20% of its statistics' time). Min and max
    take no rounding, so the chunks' combine to the same values, except that which zero's sign a zero
    extreme has, or which NaN a NaN one is, depends on the order of reading: those (rare) are read again
    whole, as before.

    Example:
        >>> [float(bound) for bound in bounds(np.array([3.0, -1.0, 2.0]))]
        [-1.0, 3.0]
    """
    if values.size > 3 * BOUNDS_CHUNK and values.flags.c_contiguous:
        flat = values.reshape(-1)  # contiguous: a view
        lows, highs = [], []
        for start in range(BOUNDS_CHUNK * ((flat.size - 1) // BOUNDS_CHUNK), -1, -BOUNDS_CHUNK):
            piece = flat[start:start + BOUNDS_CHUNK]
            lows.append(_minimum(piece))
            highs.append(_maximum(piece))
        lo, hi = _minimum(lows), _maximum(highs)
        if lo != 0 and hi != 0 and not (math.isnan(lo) or math.isnan(hi)):
            return lo, hi
    return _minimum(values, axis=None), _maximum(values, axis=None)  # values.min(), .max() without their wrapper


def _wide_norm(values: FloatArray, chunk: int = 65536) -> float:
    """The L2 norm with squares summed in float64, chunk by chunk (no full-size float64 copy)."""
    flat = values.reshape(-1)  # a copy only for a strided array, on this rare path
    total = 0.0
    for start in range(0, flat.size, chunk):
        piece = flat[start:start + chunk].astype(np.float64)
        total += float(np.dot(piece, piece))
    return math.sqrt(total)


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_foreach_norm`` of tensors of one device and dtype (float32 accumulation for fp16/bf16, float64 in
    float64), where finite float32/bf16 values above ~1.8e19, whose float32 squares overflow, still give
    their norm on the CPU: an Inf norm there is computed again in float64 (CPU values: reading them is no
    sync). Other devices keep ``_foreach_norm``'s Inf (their statistics come from the fused kernels).
    """
    dtype = tensors[0].dtype
    norms = list(torch._foreach_norm(tensors, 2, dtype=_F32 if dtype in LOW_PRECISION else None))
    if tensors[0].device.type == "cpu" and dtype in (_F32, torch.bfloat16):
        overflowed = np.flatnonzero(np.isinf(torch.stack(norms).numpy()))  # CPU values: a view, no sync
        for i in overflowed:  # rare: only where a norm overflowed (or the tensor holds an Inf: Inf again)
            norms[i] = vector_norm(tensors[i], dtype=torch.float64).to(norms[i].dtype)
    return norms


def norm_of_norms(norms: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``sqrt(sum(norms ** 2))`` along ``dim``, scaled by the largest so that float32 squares of norms above
    ~1.8e19 do not overflow (exact combination of shards' norms; NaN and Inf propagate). On the device, no sync.

    Example:
        >>> float(norm_of_norms(torch.tensor([3e30, 4e30])))
        4.9999999241216036e+30
    """
    largest = norms.amax(dim=dim, keepdim=True)
    scale = torch.where((largest > 0) & torch.isfinite(largest), largest, torch.ones_like(largest))
    return vector_norm(norms / scale, dim=dim) * scale.squeeze(dim)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """L2 norm as a float32 0-d tensor; fp16/bf16 accumulate in float32, float64 in float64.

    ``vector_norm(dtype=float32)`` rejects float64 input (a narrowing cast), so only
    low-precision tensors get the accumulation dtype.
    """
    if x.dtype in LOW_PRECISION:
        return vector_norm(x, dtype=_F32)
    return vector_norm(x).to(_F32)


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


def _round_up(np_type: type[np.floating[Any]], value: float) -> np.floating[Any]:
    rounded = np_type(value)
    if float(rounded) < value:  # rounded down: step up to the next representable value
        rounded = np.nextafter(rounded, np_type(np.inf))
    return rounded


def numel_minus(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x.numel() - count).to(_F32)
