"""The plain torch fallback of the device path: partial statistics without a fused kernel.

What devices without a ``trainmon::partials`` kernel run (Ascend, CUDA without Triton, float64 or
non-contiguous tensors on CUDA): multi-tensor ``_foreach`` ops where torch has them, so that a
group of tensors costs a constant number of ops, and temporaries of at most ``_SCRATCH_ELEMENTS``
elements whatever the tensors' sizes (no float32 copy of a bf16 tensor, no full-size mask).
Figures: docs/performance.md, "Device work per collected step".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias, TypeVar

import torch

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.collect.stats_base import LOW_PRECISION as _LOW_PRECISION
from trainmon.collect.stats_base import StatsSpec, foreach_norms, numel_minus, zero_threshold
from trainmon.collect.stats_base import zero as _zero

_F32 = torch.float32
_Item = TypeVar("_Item")
_Tensors: TypeAlias = "list[torch.Tensor] | tuple[torch.Tensor, ...]"  # what the _foreach ops take and return
_FOREACH_MAX = hasattr(torch, "_foreach_max")  # torch >= 2.4 (a multi-tensor max)
_FOREACH_POWSUM = hasattr(torch, "_foreach_powsum")  # newer torch: sums of bool masks, one op per list
_SCRATCH_ELEMENTS = 1 << 24
"""The most elements a temporary holds: a batch's ``_foreach`` result list (64 MiB in float32), a mask
(16 MiB). At most 2**24, so counts accumulated in float32 stay exact."""
_SMALL_ELEMENTS = 1 << 22
"""Tensors up to this size take the multi-tensor path, which reads the data ~13 times in ~15 ops per
batch; larger ones take ~6 ops and ~6 reads each. About where 7 reads of a bf16 tensor (8 MiB at 2 TB/s:
~30 us) cost as much as 6 kernel launches."""
_FLOAT64_DEVICES = ("cpu", "cuda")
"""Device types whose reductions accumulate in float64 (the multi-tensor sum's two halves)."""
_FOREACH_MIN_TENSORS = 3
"""Fewest tensors for which the multi-tensor path (about 15 ops per batch) beats ~6 ops per tensor."""


class _Numels:
    """Cached 0-d float32 constants per ``(device, value)``: the ``numel`` slot without an op per step."""

    def __init__(self, size: int = 4096) -> None:
        self._values: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._size = size

    def __call__(self, device: torch.device, value: int) -> torch.Tensor:
        key = (device, value)
        constant = self._values.get(key)
        if constant is None:
            if len(self._values) >= self._size:  # bounded: the oldest entry goes
                del self._values[next(iter(self._values))]
            constant = self._values[key] = torch.full((), float(value), dtype=_F32, device=device)
        return constant


_numel = _Numels()


def partials_torch(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
    """The plain torch fallback (devices without a fused kernel): flat ``[8 N]`` float32 partials.

    Ops are spent per group, not per tensor, wherever a multi-tensor (``_foreach``) op exists,
    and no temporary is ever larger than ``_SCRATCH_ELEMENTS`` (no float32 copy of a bf16 tensor):

    - norm: one ``_foreach_norm`` for the group (float32 accumulation for fp16/bf16; on the CPU an Inf norm
      of finite values above ~1.8e19 is computed again in float64: ``foreach_norms``);
    - sum, min, max, counts of tensors of at most ``_SMALL_ELEMENTS`` elements, 3 or more of
      them: :func:`_foreach_slots`, about 15 ops per batch whatever the number of tensors
      (more passes over the data than per-tensor ops, fewer launches: small tensors are bound
      by launches, large ones by memory);
    - other tensors (one alone, large ones): ``sum`` and ``aminmax`` each, and counts from
      boolean masks of bounded pieces (:func:`_tensor_slots`);
    - numel: cached device constants; one ``stack`` makes the block.

    NaN/Inf counts: skipping them when min and max are finite needs the host, so they are always
    computed, as reductions of NaN-propagating temporaries (``x * 0`` is NaN exactly where ``x``
    is not finite, ``tanh(x) * 0`` exactly where it is NaN) or of bounded masks. Never
    synchronises with the host.
    """
    xs = list(tensors)
    device = xs[0].device
    if xs[0].is_complex():
        xs = [torch.view_as_real(x) for x in xs]
    elif xs[0].dtype == torch.bool or not xs[0].is_floating_point():
        xs = [x.to(_F32) for x in xs]  # integer tensors are rare (indices); measure them in float32
    accumulate = _F32 if xs[0].dtype in _LOW_PRECISION else None
    zero = _zero(device)
    rows: list[list[torch.Tensor]] = [[zero] * PARTIAL_SLOTS for _ in xs]
    present = [i for i, x in enumerate(xs) if x.numel() > 0]  # an empty tensor keeps a row of zeros
    if spec.norm and present:
        norms = foreach_norms([xs[i] for i in present])
        for i, norm in zip(present, norms):
            rows[i][0] = norm
    small = [i for i in present if xs[i].numel() <= _SMALL_ELEMENTS]
    together = small if _FOREACH_MAX and len(small) >= _FOREACH_MIN_TENSORS else []
    for batch in bounded_batches(together, [xs[i].numel() for i in together], _SCRATCH_ELEMENTS):
        for i, slots in zip(batch, _foreach_slots([xs[i] for i in batch], spec, accumulate)):
            rows[i][1:7] = slots
    alone = sorted(set(present) - set(together))
    for i in alone:
        rows[i][1:7] = [xs[i].sum(dtype=accumulate) if spec.sum else zero, *_tensor_slots(xs[i], spec, zero)]
    for i in present:
        rows[i][7] = _numel(device, xs[i].numel())
    block = torch.stack([slot for row in rows for slot in row])  # one op; promotes (to float64: float64 sums)
    return block if block.dtype == _F32 else block.to(_F32)


def bounded_batches(items: Sequence[_Item], sizes: Sequence[int], bound: int) -> list[list[_Item]]:
    """Consecutive runs of ``items`` whose ``sizes`` add up to at most ``bound`` (a larger item alone)."""
    batches: list[list[_Item]] = []
    total = bound + 1
    for item, size in zip(items, sizes):
        if total + size > bound:
            batches.append([])
            total = 0
        batches[-1].append(item)
        total += size
    return batches


def _foreach_slots(xs: list[torch.Tensor], spec: StatsSpec, accumulate: torch.dtype | None
                   ) -> list[list[torch.Tensor]]:
    """``[sum, min, max, zeros, nans, infs]`` of non-empty tensors (at most ``_SCRATCH_ELEMENTS``
    elements together) from multi-tensor ops: a constant number of ops, one temporary list the size
    of ``xs`` alive at a time.

    The sum is ``sum max(x, 0) - sum max(-x, 0)``, each accumulated in float64 (so the difference
    loses nothing to cancellation; +-inf and NaN come out as in a plain sum), where the device has
    float64; else, and for float64 tensors, ``x.sum()`` per tensor. ``_foreach_norm(t, 0)`` counts
    the non-zero elements of ``t`` (NaN included) in float32: exact, as no tensor here has 2**24.
    """
    zero = _zero(xs[0].device)
    n = len(xs)
    sums: _Tensors = [zero] * n
    split_sum = spec.sum and xs[0].dtype != torch.float64 and xs[0].device.type in _FLOAT64_DEVICES
    if split_sum:
        scratch = torch._foreach_clamp_min(xs, 0.0)
        positive = torch._foreach_norm(scratch, 1, dtype=torch.float64)
        del scratch
    elif spec.sum:
        sums = [x.sum(dtype=accumulate) for x in xs]
    maxes = torch._foreach_max(xs)
    scratch = torch._foreach_neg(xs)
    mins = torch._foreach_neg(torch._foreach_max(scratch))  # min(x) = -max(-x), exact
    if split_sum:
        torch._foreach_clamp_min_(scratch, 0.0)  # max(-x, 0): NaN stays NaN
        sums = torch._foreach_sub(positive, torch._foreach_norm(scratch, 1, dtype=torch.float64))
    zeros: _Tensors = [zero] * n
    nans: _Tensors = zeros
    infs: _Tensors = zeros
    threshold = zero_threshold(spec.eps, xs[0].dtype) if spec.zeros else 0.0
    if spec.zeros and threshold == 0.0:  # |x| < 0 never holds: count the exact zeros
        zeros = torch._foreach_neg(torch._foreach_sub(torch._foreach_norm(xs, 0, dtype=accumulate),
                                                      [float(x.numel()) for x in xs]))
    if spec.zeros and threshold != 0.0:
        del scratch
        # min(|x|, t) - t: non-zero exactly where |x| < t or x is NaN
        scratch = torch._foreach_abs(xs)
        torch._foreach_clamp_max_(scratch, threshold)
        torch._foreach_sub_(scratch, threshold)
        small_or_nan = torch._foreach_norm(scratch, 0, dtype=accumulate)
    if spec.nans or spec.infs or (spec.zeros and threshold != 0.0):
        torch._foreach_tanh_(scratch)  # finite everywhere but at NaN (tanh(+-inf) = +-1)
        torch._foreach_mul_(scratch, 0.0)  # NaN exactly where x is NaN, else 0
        nans = torch._foreach_norm(scratch, 0, dtype=accumulate)
        if spec.zeros and threshold != 0.0:
            zeros = torch._foreach_sub(small_or_nan, nans)
    del scratch
    if spec.infs:
        not_finite = torch._foreach_mul(xs, 0.0)  # NaN exactly where x is NaN or +-inf, else 0
        infs = torch._foreach_sub(torch._foreach_norm(not_finite, 0, dtype=accumulate), nans)
    if not spec.nans:
        nans = [zero] * n
    return [list(slots) for slots in zip(sums, mins, maxes, zeros, nans, infs)]


def _tensor_slots(x: torch.Tensor, spec: StatsSpec, zero: torch.Tensor) -> list[torch.Tensor]:
    """``[min, max, zeros, nans, infs]`` of one non-empty tensor: ``aminmax`` and counts from
    boolean masks of pieces of at most ``_SCRATCH_ELEMENTS`` elements (one piece for most tensors)."""
    lo, hi = torch.aminmax(x)
    zeros = nans = infs = zero
    if spec.zeros and zero_threshold(spec.eps, x.dtype) == 0.0:
        zeros = numel_minus(x, torch.count_nonzero(x))  # no temporary
    kinds = [kind for kind, wanted in (("zeros", spec.zeros and zeros is zero), ("nans", spec.nans),
                                        ("infs", spec.infs)) if wanted]
    if kinds:
        counts = _mask_counts(x, kinds, spec.eps)
        zeros = counts.get("zeros", zeros)
        nans = counts.get("nans", zero)
        infs = counts.get("infs", zero)
    return [lo, hi, zeros, nans, infs]


def _mask_counts(x: torch.Tensor, kinds: list[str], eps: float) -> dict[str, torch.Tensor]:
    """Counts of ``|x| < eps``, NaN and Inf elements, one bounded mask per kind and piece."""
    threshold = zero_threshold(eps, x.dtype)
    per_piece: list[list[torch.Tensor]] = []
    for piece in _pieces(x):
        masks = [(piece.abs() < threshold) if kind == "zeros" else torch.isnan(piece) if kind == "nans"
                 else torch.isinf(piece) for kind in kinds]
        if _FOREACH_POWSUM:
            per_piece.append(list(torch._foreach_powsum(masks, 1, dtype=_F32)))
        else:
            per_piece.append([mask.sum() for mask in masks])
    if len(per_piece) == 1:
        return dict(zip(kinds, per_piece[0]))
    return dict(zip(kinds, torch.stack([torch.stack(counts) for counts in per_piece]).sum(dim=0).unbind()))


def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``x`` of at most ``_SCRATCH_ELEMENTS`` elements each, covering it once (``x`` itself if small).

    Contiguous tensors are cut flat; others along their first dimension (a single slice larger
    than the bound stays whole).
    """
    if x.numel() <= _SCRATCH_ELEMENTS or x.dim() == 0:
        return [x]
    if x.is_contiguous():
        return list(torch.split(x.view(-1), _SCRATCH_ELEMENTS))
    rows = max(1, _SCRATCH_ELEMENTS // max(1, x[0].numel()))
    return list(torch.split(x, rows, dim=0))
