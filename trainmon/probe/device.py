"""On-device building blocks of the grad probe: packed sign bits, bit agreement, samples, checksums.

Everything here runs on the gradient's device and returns device tensors: no host
synchronisation, no copy of a whole gradient. The packed layout matches
``numpy.packbits(x > 0, bitorder="little")``: element ``i`` is bit ``i % 8`` of byte ``i // 8``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from trainmon.collect.stats import numpy_viewable

_F32 = torch.float32
# Multiplying eight 0/1 bytes (one little-endian int64) by this constant gathers byte j's bit
# into bit 56 + j: every partial product lands on a distinct bit, so nothing carries.
_GATHER_BITS = 0x0102040810204080
_M1, _M2, _M4 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F
SAMPLE_SEED = 0
"""Seed of the stratified element sample; stored in each direction file's header."""


def packed_words(count: int) -> int:
    """Number of int64 words that hold ``count`` packed bits (the device buffer is word-padded)."""
    return (count + 63) // 64


def pack_positive(x: torch.Tensor) -> torch.Tensor:
    """``pack_signs(x > 0)``; on CPU through numpy (torch's CPU comparison and the packing kernels
    are about 10x slower than numpy's SIMD ``>`` and ``packbits`` on a zero-copy view)."""
    if numpy_viewable(x):
        return _pack_numpy(x.detach().reshape(-1).numpy() > 0)  # CPU view: no copy, no sync
    return pack_signs(x > 0)


def _pack_numpy(positive: npt.NDArray[np.bool_]) -> torch.Tensor:
    n = positive.size
    out = torch.zeros(8 * packed_words(n), dtype=torch.uint8)
    bits = np.packbits(positive, bitorder="little")
    out.numpy()[: bits.size] = bits  # CPU view: no sync
    return out


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor (``x > 0``) into bytes, 8 elements per byte, on its device.

    Returns:
        A uint8 tensor of ``8 * packed_words(n)`` bytes: the first ``ceil(n / 8)`` bytes are
        the packed bits, the rest (up to 7 bytes) are zero padding, so that two packed
        tensors can be compared as int64 words (:func:`differing_bits`).
    """
    if positive.device.type == "cpu":
        return _pack_numpy(positive.reshape(-1).numpy())  # CPU view: no sync
    return _pack_torch(positive)


def _pack_torch(positive: torch.Tensor) -> torch.Tensor:
    """The device kernels of :func:`pack_signs` (any device; used off CPU)."""
    n = positive.numel()
    flat = positive.reshape(-1)
    n8 = n - n % 8
    parts = []
    if n8:
        # A fresh bool tensor is 8-byte aligned, so its uint8 bytes reinterpret as int64 words.
        words = flat[:n8].view(torch.uint8).view(torch.int64)
        parts.append((((words * _GATHER_BITS) >> 56) & 255).to(torch.uint8))
    if n % 8:
        tail = flat[n8:].to(torch.uint8)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128][: n % 8], dtype=torch.uint8, device=flat.device)
        parts.append((tail * weights).sum(dtype=torch.uint8).reshape(1))
    pad = 8 * packed_words(n) - (n + 7) // 8
    if pad:
        parts.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def differing_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of differing bits of two word-padded packed tensors, as a 0-d int64 device tensor.

    XOR of the int64 words, then a branch-free popcount (SWAR: 2-, 4-, 8-bit partial sums)
    and a byte sum. Arithmetic right shifts of negative words only bring sign bits into
    positions the masks clear.
    """
    if a.device.type == "cpu":  # numpy's unpackbits + count_nonzero: 2x the SWAR kernels on CPU
        # CPU views, CPU result: no sync
        return torch.tensor(np.count_nonzero(np.unpackbits(np.bitwise_xor(a.numpy(), b.numpy()))))  # CPU view, no sync
    return _differing_torch(a, b)


def _differing_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The device kernels of :func:`differing_bits` (any device; used off CPU)."""
    x = a.view(torch.int64) ^ b.view(torch.int64)
    x = x - ((x >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    return x.view(torch.uint8).sum(dtype=torch.int64)


def sample_indices(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """A fixed, sorted, stratified sample of ``count`` element indices out of ``numel``.

    Stratum ``i`` covers ``[i * numel // count, (i + 1) * numel // count)``; one index is drawn
    uniformly in each with a CPU generator seeded with :data:`SAMPLE_SEED`. The sample depends
    only on ``(numel, count)``, so two runs sample the same elements of equally shaped parameters.
    """
    if count >= numel:
        return torch.arange(numel, device=device)
    edges = torch.arange(count + 1, dtype=torch.int64) * numel // count
    width = edges[1:] - edges[:-1]
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    offsets = (torch.rand(count, generator=generator, dtype=torch.float64) * width).to(torch.int64)
    return (edges[:-1] + torch.minimum(offsets, width - 1)).to(device)


def raw_checksum(flat: torch.Tensor) -> torch.Tensor:
    """Wrapping int32 sum of the raw bit patterns of ``flat`` (0-d int32 device tensor).

    Integer addition modulo 2**32 is associative, so the result does not depend on the
    reduction order: it is deterministic on every device.
    """
    size = flat.element_size()
    if size == 4:
        bits = flat.view(torch.int32)
    elif size == 2:
        bits = flat.view(torch.int16)
    elif size == 8:
        bits = flat.view(torch.int32)  # two halves of each element
    else:
        bits = flat.view(torch.uint8)
    return bits.sum(dtype=torch.int32)


def words_checksum(packed: torch.Tensor) -> torch.Tensor:
    """Position-weighted wrapping int64 sum of the packed sign words (0-d int64 device tensor)."""
    words = packed.view(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
    return (words * (weights * 2 + 1)).sum()


def interval_counts(flat: torch.Tensor, bounds: Sequence[float]) -> list[torch.Tensor]:
    """Element counts of the right-closed intervals ``(-inf, b0], (b0, b1], ..., (bk, inf)``.

    NaN falls in no interval. Returns ``len(bounds) + 1`` float32 0-d tensors.
    """
    if not bounds:
        return [torch.count_nonzero(~torch.isnan(flat)).to(_F32)]
    at_most = [torch.count_nonzero(flat <= b).to(_F32) for b in bounds]
    counts = [at_most[0]]
    counts += [at_most[i] - at_most[i - 1] for i in range(1, len(at_most))]
    counts.append(torch.count_nonzero(flat > bounds[-1]).to(_F32))
    return counts
