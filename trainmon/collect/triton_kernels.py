"""CUDA kernels of ``trainmon::partials`` in Triton, and the pieces :mod:`trainmon.collect.triton_adam` shares
(imported only where Triton is installed, on the first CUDA tensor measured).

A group of tensors (one dtype: float16, bfloat16 or float32, each contiguous) is measured by two
launches whatever its size: the first reads every element once, each program a span of
``BLOCK * ITERS`` elements of one tensor, and writes the partial sums/extremes of its span; the
second combines the spans of each tensor. The tensors' addresses, sizes and spans are one small
int64 table copied to the device without waiting for it (no host sync).

The first kernel does little per element, so that it is bound by memory, not by instructions: a
whole span (every span of a tensor but its last) loads unmasked and does square-add, add, min and max
(and the zero test when ``zeros`` is asked for). NaN and Inf are not tested per element: either makes
a span's sum of squares or sum non-finite, and only then does its program read the span again to
count them. For a bf16 span on sm_90 that is 5 instructions per element and 56 registers a thread,
against about 40 and 108 when every element was also tested for NaN, Inf and the mask (ptxas figures of
Triton 3.6's output).

Tested on a real GPU against float64 references by tests/gpu/test_cuda.py (``bash
scripts/gpu_check.sh``). Without one, Triton's interpreter runs these launchers and kernels on CPU
tensors: tests/unit/test_triton_kernels.py against float64 numpy (NaN, Inf, zeros, unaligned views,
more spans than ``SPAN_ROWS``), and scripts/test.sh's Triton lane under the monitored loops; the unit test
also compiles every kernel for sm_80 and sm_90.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.collect.kernel_ops import partials_op
from trainmon.collect.stats_base import zero_threshold

logger = logging.getLogger("trainmon")
DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
BLOCK = 1024
WARPS = 4
SPAN_ROWS = 128
_LIST_SPANS = 256
_Column: TypeAlias = "list[int] | npt.NDArray[np.int64]"  # a span table: a list when short


def available() -> bool:
    """Whether the kernels can run: CUDA present."""
    return torch.cuda.is_available()


def supported(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether these tensors can go through the kernels (else: the plain torch ops)."""
    return all(t.dtype in DTYPES and t.is_contiguous() for t in tensors)


@triton.jit
def _small(x, threshold):
    """``|x| < threshold``, or ``x == 0`` when the threshold is 0 (the ``zeros`` metric)."""
    return tl.where(threshold == 0.0, x == 0.0, tl.abs(x) < threshold)


@triton.jit
def non_finite(total_sq, total):
    """A NaN or Inf among the values that gave these sums (or a square past float32's range)."""
    return (total_sq != total_sq) | (total_sq == float("inf")) | (total != total) | (tl.abs(total) == float("inf"))


@triton.jit
def fresh_block(BLOCK: tl.constexpr):
    """Empty running accumulators of one block's lanes: sum of squares, sum, min, max, zeros."""
    return (tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32), tl.full([BLOCK], float("inf"), tl.float32),
            tl.full([BLOCK], -float("inf"), tl.float32), tl.zeros([BLOCK], tl.float32))


@triton.jit
def add_to(x, sq, sm, lo, hi, zeros, threshold, ZEROS: tl.constexpr):
    """Accumulate a whole block: square-add, add, min, max (and the zero test when ``ZEROS``)."""
    sq += x * x
    sm += x
    lo = tl.minimum(lo, x)
    hi = tl.maximum(hi, x)
    if ZEROS:
        zeros += _small(x, threshold).to(tl.float32)
    return sq, sm, lo, hi, zeros


@triton.jit
def add_masked(x, mask, sq, sm, lo, hi, zeros, threshold, ZEROS: tl.constexpr):
    """Accumulate a block whose masked lanes hold 0 (neutral for the sums; kept out of min, max and zeros)."""
    sq += x * x
    sm += x
    lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
    hi = tl.maximum(hi, tl.where(mask, x, -float("inf")))
    if ZEROS:
        zeros += (mask & _small(x, threshold)).to(tl.float32)
    return sq, sm, lo, hi, zeros


@triton.jit
def store_sums(row, total_sq, total, lo, hi, zeros):
    """Slots 0-4 of a span's row: norm (the square root of the sum of squares), sum, min, max, zeros."""
    tl.store(row + 0, tl.sqrt(total_sq))
    _store_rest(row, total, lo, hi, zeros)


@triton.jit
def _store_rest(row, total, lo, hi, zeros):
    """Slots 1-4 of a span's row: sum, min, max, zeros."""
    tl.store(row + 1, total)
    tl.store(row + 2, tl.min(lo, 0))
    tl.store(row + 3, tl.max(hi, 0))
    tl.store(row + 4, tl.sum(zeros, 0))


@triton.jit
def _span_partials(table, n_tensors, n_spans, spans, threshold, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                   ITERS: tl.constexpr, ALIGNED: tl.constexpr, ZEROS: tl.constexpr):
    """One program per span; table = [addresses N, numels N, span tensor S, span start S, first N+1].

    Addresses come from a table, so Triton cannot see their alignment: ``ALIGNED`` (every tensor
    16-byte aligned, checked on the host) says it. A span that is whole (every span of a tensor but its
    last) loads unmasked and does 5 operations per element: widen, square-add, add, min, max (plus the
    zero test when ``ZEROS``). NaN and Inf are not tested per element: either makes the span's sum of
    squares or sum non-finite, and only then does the program read its span again to count them (a
    finite span, the common case, is read once). Where a NaN is present its min and max are NaN anyway
    (``combine_spans``), so how ``minimum`` treats NaN does not matter.
    """
    pid = tl.program_id(0)
    t = tl.load(table + 2 * n_tensors + pid)
    start = tl.multiple_of(tl.load(table + 2 * n_tensors + n_spans + pid), BLOCK)  # spans start at k * BLOCK
    n = tl.load(table + n_tensors + t)
    base = tl.load(table + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    sq, sm, lo, hi, zeros = fresh_block(BLOCK)
    if start + ITERS * BLOCK <= n:  # a whole span: no mask
        for i in range(ITERS):
            x = tl.load(base + (start + i * BLOCK + tl.arange(0, BLOCK))).to(tl.float32)
            sq, sm, lo, hi, zeros = add_to(x, sq, sm, lo, hi, zeros, threshold, ZEROS)
    else:  # a tensor's last span: masked lanes read 0 (neutral for the sums) and are kept out of min/max/zeros
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            x = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
            sq, sm, lo, hi, zeros = add_masked(x, mask, sq, sm, lo, hi, zeros, threshold, ZEROS)
    total_sq, total = tl.sum(sq, 0), tl.sum(sm, 0)
    row = spans + pid * 8
    _store_rest(row, total, lo, hi, zeros)
    norm = tl.sqrt(total_sq)
    n_nans = tl.full([], 0.0, tl.float32)
    n_infs = tl.full([], 0.0, tl.float32)
    if non_finite(total_sq, total):  # a NaN or an Inf in the span: count them, reading the span again
        # finite values whose squares passed float32's range: the norm of x / max|x| again, times max|x|
        biggest = tl.maximum(-tl.min(lo, 0), tl.max(hi, 0))
        inverse = tl.where((biggest > 0.0) & (biggest < float("inf")), 1.0 / biggest, 1.0)
        nans = tl.zeros([BLOCK], tl.float32)
        infs = tl.zeros([BLOCK], tl.float32)
        scaled = tl.zeros([BLOCK], tl.float32)
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + offsets, mask=offsets < n, other=0.0).to(tl.float32)
            nans += (x != x).to(tl.float32)
            infs += (tl.abs(x) == float("inf")).to(tl.float32)
            scaled += (x * inverse) * (x * inverse)
        n_nans = tl.sum(nans, 0)
        n_infs = tl.sum(infs, 0)
        norm = tl.where((n_nans + n_infs == 0.0) & (inverse != 1.0), biggest * tl.sqrt(tl.sum(scaled, 0)), norm)
    tl.store(row + 0, norm)  # each slot stored once: two stores to one address from one program have no order
    tl.store(row + 5, n_nans)
    tl.store(row + 6, n_infs)


@triton.jit
def combine_spans(first, numels, spans, out, STRIDE: tl.constexpr, NORM: tl.constexpr, SUM: tl.constexpr,
                   ZEROS: tl.constexpr, NANS: tl.constexpr, INFS: tl.constexpr, ROWS: tl.constexpr):
    """One program per tensor: its spans (``first[t]`` to ``first[t + 1]``) -> its 8-slot partial.

    Span norms combine as ``M * sqrt(sum((norm / M)^2))``, ``M`` the largest: finite norms whose squares
    pass float32's range (values up to ~1e37) stay finite (a NaN or Inf norm gives NaN or Inf as before)."""
    t = tl.program_id(0)
    begin = tl.load(first + t)
    end = tl.load(first + t + 1)
    biggest = tl.zeros([ROWS], tl.float32)
    if NORM:  # the spans' rows are few (one per 64 Ki elements): a second read of their norms costs nothing
        for row_start in range(begin, end, ROWS):
            rows = row_start + tl.arange(0, ROWS)
            biggest = tl.maximum(biggest, tl.load(spans + rows * STRIDE, mask=rows < end, other=0.0))
    largest = tl.max(biggest, 0)
    inverse = tl.where((largest > 0.0) & (largest < float("inf")), 1.0 / largest, 1.0)
    sq = tl.zeros([ROWS], tl.float32)
    sm = tl.zeros([ROWS], tl.float32)
    zeros = tl.zeros([ROWS], tl.float32)
    nans = tl.zeros([ROWS], tl.float32)
    infs = tl.zeros([ROWS], tl.float32)
    lo = tl.full([ROWS], float("inf"), tl.float32)
    hi = tl.full([ROWS], -float("inf"), tl.float32)
    for row_start in range(begin, end, ROWS):
        rows = row_start + tl.arange(0, ROWS)
        mask = rows < end
        row = spans + rows * STRIDE
        norm = tl.load(row + 0, mask=mask, other=0.0) * inverse
        sq += norm * norm
        sm += tl.load(row + 1, mask=mask, other=0.0)
        lo = tl.minimum(lo, tl.load(row + 2, mask=mask, other=float("inf")))
        hi = tl.maximum(hi, tl.load(row + 3, mask=mask, other=-float("inf")))
        zeros += tl.load(row + 4, mask=mask, other=0.0)
        nans += tl.load(row + 5, mask=mask, other=0.0)
        infs += tl.load(row + 6, mask=mask, other=0.0)
    n_nans = tl.sum(nans, 0)
    low = tl.min(lo, 0)
    high = tl.max(hi, 0)
    low = tl.where(n_nans > 0, float("nan"), low)  # as torch.aminmax: a NaN anywhere is the min and the max
    high = tl.where(n_nans > 0, float("nan"), high)
    result = out + t * 8
    zero = 0.0
    if NORM:
        tl.store(result + 0, tl.where(inverse != 1.0, largest, 1.0) * tl.sqrt(tl.sum(sq, 0)))
    else:
        tl.store(result + 0, zero)
    if SUM:
        tl.store(result + 1, tl.sum(sm, 0))
    else:
        tl.store(result + 1, zero)
    tl.store(result + 2, low)
    tl.store(result + 3, high)
    if ZEROS:
        tl.store(result + 4, tl.sum(zeros, 0))
    else:
        tl.store(result + 4, zero)
    if NANS:
        tl.store(result + 5, n_nans)
    else:
        tl.store(result + 5, zero)
    if INFS:
        tl.store(result + 6, tl.sum(infs, 0))
    else:
        tl.store(result + 6, zero)
    tl.store(result + 7, tl.load(numels + t).to(tl.float32))


def split_spans(numels: list[int]) -> tuple[int, _Column, _Column, _Column]:
    """Elements per program (a power of two: few programs for big groups) and the span tables.

    Plain lists for a few hundred spans (a single tensor's 3 small tables cost more in numpy calls
    than in Python), numpy arrays beyond.
    """
    total = sum(numels)
    per = max(BLOCK * 16, min(1 << 20, 1 << max(0, math.ceil(math.log2(max(total, 1) / 4096)))))
    counts = [max(1, -(-n // per)) for n in numels]
    if sum(counts) <= _LIST_SPANS:
        owner: list[int] = []
        start: list[int] = []
        first = [0]
        for t, count in enumerate(counts):
            owner += [t] * count
            start += range(0, count * per, per)
            first.append(first[-1] + count)
        return per, owner, start, first
    array = np.array(counts, np.int64)
    first_array = np.concatenate([[0], np.cumsum(array)])
    owner_array = np.repeat(np.arange(len(numels), dtype=np.int64), array)
    start_array = (np.arange(int(first_array[-1]), dtype=np.int64) - first_array[owner_array]) * per
    return per, owner_array, start_array, first_array


def span_table(columns: list[_Column], device: torch.device) -> torch.Tensor:
    if all(isinstance(column, list) for column in columns):
        table = torch.tensor([value for column in columns for value in column], dtype=torch.int64)
    else:
        table = torch.from_numpy(np.concatenate([np.asarray(column, np.int64) for column in columns]))
    # pageable host memory, non-blocking: staged at once, the device is not waited for (no sync)
    return table.to(device, non_blocking=True)


def on_device(device: torch.device) -> Any:
    """A context in which kernels launch on ``device``: Triton launches on the current CUDA device and its
    stream, not the tensors'. A model on ``cuda:1`` in a process whose current device is ``cuda:0`` (no
    ``torch.cuda.set_device``) would otherwise be read by a kernel on the wrong device: an illegal address,
    which ends the process's CUDA context and the training with it."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def aligned_addresses(addresses: list[int]) -> bool:
    """Every address 16-byte aligned (fresh torch allocations are; a view at an odd offset is not)."""
    return all(address % 16 == 0 for address in addresses)


def flag_kwargs(flags: Sequence[int]) -> dict[str, bool]:
    norm, total, zeros, nans, infs = (bool(f) for f in flags)
    return {"NORM": norm, "SUM": total, "ZEROS": zeros, "NANS": nans, "INFS": infs}


def partials_triton(tensors: list[torch.Tensor], flags: list[int], eps: float) -> torch.Tensor:
    """Flat ``[8 N]`` partials of contiguous float16/bfloat16/float32 tensors of one dtype: two launches."""
    device, dtype = tensors[0].device, tensors[0].dtype
    numels = [t.numel() for t in tensors]
    per, owner, start, first = split_spans(numels)
    n, spans = len(tensors), len(owner)
    addresses = [t.data_ptr() for t in tensors]  # host metadata: no sync
    table = span_table([addresses, numels, owner, start, first], device)
    partial = torch.empty(spans * 8, dtype=torch.float32, device=device)
    threshold = zero_threshold(eps, dtype)
    out = torch.empty(PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    with on_device(device):
        _span_partials[(spans,)](table, n, spans, partial, threshold, DTYPE=DTYPES[dtype], BLOCK=BLOCK,
                                 ITERS=per // BLOCK, ALIGNED=aligned_addresses(addresses), ZEROS=bool(flags[2]),
                                 num_warps=WARPS)
        combine_spans[(n,)](table[2 * n + 2 * spans:], table[n:2 * n], partial, out, STRIDE=8, ROWS=SPAN_ROWS,
                             **flag_kwargs(flags))
    return out


@partials_op.register_kernel("cuda")
def _partials_cuda(tensors: list[torch.Tensor], flags: list[int], eps: float) -> torch.Tensor:
    return partials_triton(tensors, flags, eps)
