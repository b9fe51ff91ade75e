"""Combining per-shard grad-probe partials into the statistics and directions of the whole parameter.

A sharded framework (DeepSpeed ZeRO 1-3, Megatron tensor parallelism and its distributed
optimizer, FSDP2) keeps a parameter's gradient in pieces, one per rank. The grad probe measures
each piece where it lives and combines *partials*, never the gradient:

- :class:`ShardSpec` says which elements of the whole parameter a rank's flat piece holds: a
  contiguous range ``[start, start + numel)`` of the row-major flattening of a *block*, the block
  being the whole parameter cut along ``dim`` to ``[offset, offset + length)`` (a tensor-parallel
  partition; the whole parameter when not cut). ZeRO's flat partitions are ``ShardSpec.flat``;
  Megatron's TP partition with a distributed-optimizer range inside it is a block with a range.
- :data:`COLUMNS`: the float64 partial vector of one piece (element count, max, min, sum of
  squares, differing sign bits and dot products for the similarities, interval and zero
  counts). Every column combines by a sum except max and min (:func:`combine_partials`), so the
  combination does not depend on how the parameter is cut: the result equals the unsharded one.
- :func:`words_checksum` gives a piece's share of the L0 hash's position-weighted sign
  checksum at the elements' *global* positions; shares add (modulo 2**64) to the whole
  parameter's :func:`trainmon.probe.device.words_checksum`, so the L0 hash is shard-invariant.
- :func:`stored_positions` and :func:`assemble_bits` place each piece's packed sign bits at the
  positions of the whole parameter (or of its fixed sample) on the host, so one direction file
  holds the whole parameter's direction, as an unsharded run writes it.

- :func:`whole_stats` turns combined partials into the probe's rows (written by the rank that
  :func:`trainmon.base.process_groups.lowest_selected` names).

Device functions never synchronise with the host; host functions (numpy) run on the probe's
writer thread or once at set-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

Positions: TypeAlias = "npt.NDArray[np.int64] | slice"
"""Where a piece's elements go in the stored vector: a slice (one contiguous range) or int64 indices."""

COLUMNS: tuple[str, ...] = (
    "numel", "max", "min", "sumsq",
    "prev_differing", "prev_count",                       # sign_agree_prev
    "prev_dot", "prev_sumsq_now", "prev_sumsq_before", "prev_values",  # cos_prev (sampled values)
    "exp_avg_differing", "exp_avg_count", "exp_avg_dot", "exp_avg_sumsq", "exp_avg_grad_sumsq",
    "mg_agree", "mg_count",                               # msprobe's mg_direction
    "zero_count",
)
"""Columns of a piece's partial vector, followed by one count per L2 interval."""
(NUMEL, MAX, MIN, SUMSQ, PREV_DIFF, PREV_COUNT, PREV_DOT, PREV_SQ_NOW, PREV_SQ_BEFORE, PREV_VALUES,
 EXP_DIFF, EXP_COUNT, EXP_DOT, EXP_SQ, EXP_GRAD_SQ, MG_AGREE, MG_COUNT, ZERO_COUNT) = range(len(COLUMNS))
_F64 = torch.float64


def partial_width(bounds: Sequence[float]) -> int:
    """Length of a piece's partial vector: :data:`COLUMNS` plus one count per interval of ``bounds``."""
    return len(COLUMNS) + len(bounds) + 1


@dataclass(frozen=True)
class ShardSpec:
    """Which elements of a whole parameter one rank's flat piece holds.

    The *block* is the whole parameter (shape ``shape``) cut along ``dim`` to
    ``[offset, offset + length)``; the piece is elements ``[start, start + numel)`` of the block's
    row-major flattening. ``numel == 0``: the rank holds nothing of the parameter (or holds a copy
    that another rank already counts, e.g. a tensor-parallel-replicated parameter on TP rank > 0).

    Example: ZeRO's flat partition of rank 1 of a ``[13, 8]`` weight split into 52-element parts is
    ``ShardSpec.flat((13, 8), 52, 52)``; Megatron's row-parallel ``[32, 64]`` weight on TP rank 1 of 2
    is ``ShardSpec.block((32, 64), dim=1, offset=32, length=32)``.
    """

    shape: tuple[int, ...]
    start: int
    numel: int
    dim: int = 0
    offset: int = 0
    length: int = -1  # -1: the whole extent of ``dim``

    @classmethod
    def flat(cls, shape: Sequence[int], start: int, numel: int) -> ShardSpec:
        """A contiguous range of the whole parameter's row-major flattening."""
        return cls(tuple(int(n) for n in shape), int(start), int(numel))

    @classmethod
    def block(cls, shape: Sequence[int], dim: int, offset: int, length: int, start: int = 0,
              numel: int | None = None) -> ShardSpec:
        """A range (default: all) of the block ``[offset, offset + length)`` along ``dim``."""
        shape = tuple(int(n) for n in shape)
        block_numel = math.prod(shape[:dim]) * length * math.prod(shape[dim + 1:])
        return cls(shape, int(start), block_numel - start if numel is None else int(numel), dim, offset, length)

    @property
    def total(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    def _geometry(self) -> tuple[int, int, int, int]:
        """``(outer, extent of dim, inner, block length)`` (a 0-d parameter is one element)."""
        shape = self.shape or (1,)
        extent = shape[self.dim]
        length = extent if self.length < 0 else self.length
        return math.prod(shape[:self.dim]), extent, math.prod(shape[self.dim + 1:]), length

    def contiguous_start(self) -> int | None:
        """The global flat index of the piece's first element when the piece is one contiguous
        range of the whole parameter's flattening, else None."""
        outer, extent, inner, length = self._geometry()
        if length == extent or outer == 1:
            return self.offset * inner + self.start
        return None

    def global_indices(self, local: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Global flat indices of the piece's elements at ``local`` positions (int64 numpy)."""
        outer, extent, inner, length = self._geometry()
        q = np.asarray(local, dtype=np.int64) + self.start
        o, rest = np.divmod(q, length * inner)
        d, i = np.divmod(rest, inner)
        indices: npt.NDArray[np.int64] = o * (extent * inner) + (self.offset + d) * inner + i
        return indices

    def local_positions(self, global_sorted: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Of sorted global flat indices (a sample), the ones this piece holds.

        Returns:
            ``(local, rank_in_sample)``: the positions in the piece and in ``global_sorted``.
        """
        outer, extent, inner, length = self._geometry()
        g = np.asarray(global_sorted, dtype=np.int64)
        o, rest = np.divmod(g, extent * inner)
        d, i = np.divmod(rest, inner)
        q = o * (length * inner) + (d - self.offset) * inner + i
        held = (d >= self.offset) & (d < self.offset + length) & (q >= self.start) & (q < self.start + self.numel)
        where = np.flatnonzero(held)
        return q[where] - self.start, where


def sample_global(total: int, count: int | None) -> npt.NDArray[np.int64] | None:
    """The fixed stratified sample of a whole parameter (None when stored whole), as the unsharded probe draws it."""
    from trainmon.probe.device import sample_indices

    if count is None or count >= total:
        return None
    return sample_indices(total, count, torch.device("cpu")).numpy()  # a CPU tensor: no sync


def stored_positions(spec: ShardSpec, sample: npt.NDArray[np.int64] | None
                     ) -> tuple[npt.NDArray[np.int64] | None, Positions]:
    """Where a piece's stored direction bits go: ``(local elements to pack or None for all, positions)``.

    ``positions`` index the stored vector (the whole parameter's flattening, or its sample): a
    slice when the piece is one contiguous range stored whole, else an int64 array. Host-side,
    computed once per parameter; a whole non-contiguous piece (a TP column block) returns an
    array as long as the piece.
    """
    if sample is not None:
        local, ranks = spec.local_positions(sample)
        return local, ranks
    start = spec.contiguous_start()
    if start is not None:
        return None, slice(start, start + spec.numel)
    return None, spec.global_indices(np.arange(spec.numel, dtype=np.int64))


def assemble_bits(count: int, pieces: Sequence[tuple[npt.NDArray[np.uint8], int, Positions]]) -> npt.NDArray[np.uint8]:
    """The packed bits (``numpy.packbits(x > 0, bitorder="little")``) of the whole stored vector.

    Args:
        count: stored elements of the whole parameter (its numel, or the sample size).
        pieces: per rank, ``(packed bytes, number of stored bits, positions)`` as
            :func:`stored_positions` gives them.
    """
    signs = np.zeros(count, dtype=bool)
    for packed, stored, positions in pieces:
        if stored:
            signs[positions] = np.unpackbits(packed, count=stored, bitorder="little").view(bool)
    return np.packbits(signs, bitorder="little")


def words_checksum(packed: torch.Tensor, flat: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """A piece's share of :func:`trainmon.probe.device.words_checksum` at its global positions (0-d int64).

    Element ``g`` of the whole parameter contributes ``(2 * (g // 64) + 3) << (g % 64)`` when it is
    ``> 0``; shares of all pieces add up (modulo 2**64) to the whole parameter's checksum.

    Args:
        packed: the piece's packed signs (``pack_positive(flat)``), used for a contiguous piece.
        flat: the piece's flat gradient.
        spec: where the piece lies.
    """
    start = spec.contiguous_start()
    n = flat.numel()
    if start is None:  # a column block: per element
        local = torch.arange(n, dtype=torch.int64, device=flat.device) + spec.start
        outer, extent, inner, length = spec._geometry()
        o, rest = local // (length * inner), local % (length * inner)
        g = o * (extent * inner) + (spec.offset + rest // inner) * inner + rest % inner
        return _element_terms(g, flat)
    head = min((-start) % 64, n)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    if head:
        g = torch.arange(start, start + head, dtype=torch.int64, device=flat.device)
        total = total + _element_terms(g, flat[:head])
    if n > head:
        from trainmon.probe.device import pack_positive

        body = packed if head == 0 else pack_positive(flat[head:])
        words = body.view(torch.int64)
        first = (start + head) // 64
        weights = (torch.arange(words.numel(), dtype=torch.int64, device=flat.device) + first) * 2 + 3
        total = total + (words * weights).sum()
    return total


def _element_terms(g: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    terms = torch.bitwise_left_shift((g >> 6) * 2 + 3, g & 63)
    return torch.where(values.reshape(-1) > 0, terms, torch.zeros_like(terms)).sum()


def combine_partials(gathered: torch.Tensor) -> torch.Tensor:
    """``[ranks, params, width]`` float64 partials -> ``[params, width]``: max of maxes, min of mins,
    every other column summed (on the device)."""
    combined = gathered.sum(dim=0)
    combined[:, MAX] = gathered[:, :, MAX].amax(dim=0)
    combined[:, MIN] = gathered[:, :, MIN].amin(dim=0)
    return combined


def combine_checksums(gathered: torch.Tensor) -> torch.Tensor:
    """``[ranks, params, 2]`` int64 ``(raw, words)`` shares -> ``[params, 2]``: the raw checksum wrapped
    to int32 (as :func:`trainmon.probe.device.raw_checksum`), the words checksum modulo 2**64."""
    summed = gathered.sum(dim=0)
    return torch.stack([summed[:, 0].to(torch.int32).to(torch.int64), summed[:, 1]], dim=1)


def interval_counts(flat: torch.Tensor, bounds: Sequence[float]) -> list[torch.Tensor]:
    """As :func:`trainmon.probe.device.interval_counts`, as exact int64 counts."""
    if not bounds:
        return [torch.count_nonzero(~torch.isnan(flat))]
    at_most = [torch.count_nonzero(flat <= b) for b in bounds]
    return [at_most[0], *(at_most[i] - at_most[i - 1] for i in range(1, len(at_most))),
            torch.count_nonzero(flat > bounds[-1])]


def whole_stats(combined: torch.Tensor, totals: Sequence[int], counts: Sequence[int], level: str,
                n_bounds: int) -> torch.Tensor:
    """``[params, W]`` float32 rows of the whole parameters from combined partials, in
    :class:`~trainmon.probe.collector.GradProbe`'s column order (max, min, norm, the four
    similarities, then at L2 the interval fractions and the zero fraction).

    ``totals``: each parameter's element count; ``counts``: its stored direction elements (numel or
    the sample size). A value whose pieces did not all contribute (a missing gradient or
    ``exp_avg`` piece, no previous step) is NaN, as unsharded."""
    c = combined
    totals_t = torch.tensor(list(totals), dtype=_F64, device=c.device)
    counts_t = torch.tensor(list(counts), dtype=_F64, device=c.device)
    nan = torch.full_like(totals_t, float("nan"))
    whole = c[:, NUMEL] == totals_t
    columns = [torch.where(whole, c[:, MAX], nan), torch.where(whole, c[:, MIN], nan),
               torch.where(whole, c[:, SUMSQ].sqrt(), nan),
               torch.where(c[:, PREV_COUNT] == counts_t, 1.0 - c[:, PREV_DIFF] / counts_t, nan),
               torch.where(c[:, PREV_VALUES] == counts_t,
                           c[:, PREV_DOT] / (c[:, PREV_SQ_NOW].sqrt() * c[:, PREV_SQ_BEFORE].sqrt()), nan),
               torch.where(c[:, EXP_COUNT] == totals_t, 1.0 - c[:, EXP_DIFF] / totals_t, nan),
               torch.where(c[:, EXP_COUNT] == totals_t,
                           c[:, EXP_DOT] / (c[:, SUMSQ].sqrt() * c[:, EXP_SQ].sqrt()), nan)]
    if level == "L2":
        columns += [torch.where(whole, c[:, len(COLUMNS) + k] / totals_t, nan) for k in range(n_bounds + 1)]
        columns.append(torch.where(whole, c[:, ZERO_COUNT] / totals_t, nan))
    return torch.stack(columns, dim=1).to(torch.float32)
