"""The CUDA kernel of ``trainmon::adam_partials`` in Triton: the statistics of the Adam update
m / (sqrt(v) + eps) and of the update/param ratio without making either tensor (imported with
:mod:`trainmon.collect.triton_kernels`, on the first CUDA tensor measured, where Triton is installed).

Three launches per group whatever its size: the span kernel reads ``m``, ``v`` (and the parameter, for the
ratio) once, as :func:`trainmon.collect.triton_kernels._span_partials` reads a tensor (whole spans unmasked,
NaN/Inf counted only in spans whose sums are not finite, zeros only when asked for); then
``_combine_spans`` once per half (update, ratio). Its block is 512: two values per element at 1024 would
need about 140 registers a thread (56 at 512, sm_90).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainmon.collect.kernel_ops import adam_partials_op
from trainmon.collect.stats_base import zero_threshold
from trainmon.collect.triton_kernels import (
    _ROWS,
    DTYPES,
    WARPS,
    _add,
    _add_masked,
    _aligned,
    _combine_spans,
    _flag_kwargs,
    _fresh,
    _non_finite,
    _spans,
    _store_sums,
    _table,
    on_device,
)
from trainmon.records import PARTIAL_SLOTS

ADAM_BLOCK = 512


@triton.jit
def _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO: tl.constexpr, MASKED: tl.constexpr, n):
    """The update m / (sqrt(v) + eps) * scale and the update/param ratio (0 where the param is 0) at ``offsets``.

    Masked lanes read m = v = p = 0: update 0 / (0 + eps) = 0 and ratio 0, neutral for the sums.
    """
    if MASKED:
        mask = offsets < n
        m = tl.load(m_base + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_base + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        m = tl.load(m_base + offsets).to(tl.float32)
        v = tl.load(v_base + offsets).to(tl.float32)
    update = m / (tl.sqrt(v) + eps) * scale
    ratio = update
    if RATIO:
        if MASKED:
            p = tl.load(p_base + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        else:
            p = tl.load(p_base + offsets).to(tl.float32)
        ratio = tl.where(p != 0.0, update / tl.where(p != 0.0, p, 1.0), 0.0)
    return update, ratio



@triton.jit
def _adam_span_partials(table, coefficients, n_tensors, n_spans, spans, threshold,
                        M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, RATIO: tl.constexpr,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr, ZEROS: tl.constexpr):
    """Update and ratio spans; table = [m N, v N, p N, numels N, span tensor S, span start S, first N+1].

    As :func:`_span_partials`: whole spans load unmasked, NaN/Inf are counted only when a span's sums
    are not finite (reading its m, v and p again), zeros only when ``ZEROS``.
    """
    pid = tl.program_id(0)
    t = tl.load(table + 4 * n_tensors + pid)
    start = tl.multiple_of(tl.load(table + 4 * n_tensors + n_spans + pid), BLOCK)
    n = tl.load(table + 3 * n_tensors + t)
    m_base = tl.load(table + t).to(tl.pointer_type(M_DTYPE))
    v_base = tl.load(table + n_tensors + t).to(tl.pointer_type(V_DTYPE))
    p_base = tl.load(table + 2 * n_tensors + t).to(tl.pointer_type(P_DTYPE))
    if ALIGNED:
        m_base = tl.multiple_of(m_base, 16)
        v_base = tl.multiple_of(v_base, 16)
        p_base = tl.multiple_of(p_base, 16)
    scale = tl.load(coefficients + 2 * t).to(tl.float32)
    eps = tl.load(coefficients + 2 * t + 1).to(tl.float32)
    sq, sm, lo, hi, zeros = _fresh(BLOCK)
    r_sq, r_sm, r_lo, r_hi, r_zeros = _fresh(BLOCK)
    if start + ITERS * BLOCK <= n:  # a whole span: no mask
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            update, ratio = _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO, False, n)
            sq, sm, lo, hi, zeros = _add(update, sq, sm, lo, hi, zeros, threshold, ZEROS)
            if RATIO:
                r_sq, r_sm, r_lo, r_hi, r_zeros = _add(ratio, r_sq, r_sm, r_lo, r_hi, r_zeros, threshold, ZEROS)
    else:
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            update, ratio = _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO, True, n)
            sq, sm, lo, hi, zeros = _add_masked(update, mask, sq, sm, lo, hi, zeros, threshold, ZEROS)
            if RATIO:
                r_sq, r_sm, r_lo, r_hi, r_zeros = _add_masked(ratio, mask, r_sq, r_sm, r_lo, r_hi, r_zeros, threshold,
                                                              ZEROS)
    row = spans + pid * 16
    total_sq, total = tl.sum(sq, 0), tl.sum(sm, 0)
    r_total_sq, r_total = tl.sum(r_sq, 0), tl.sum(r_sm, 0)
    _store_sums(row, total_sq, total, lo, hi, zeros)
    n_nans = tl.full([], 0.0, tl.float32)
    n_infs = tl.full([], 0.0, tl.float32)
    r_nans = tl.full([], 0.0, tl.float32)
    r_infs = tl.full([], 0.0, tl.float32)
    if _non_finite(total_sq, total) | _non_finite(r_total_sq, r_total):  # count them, reading the span again
        nans = tl.zeros([BLOCK], tl.float32)
        infs = tl.zeros([BLOCK], tl.float32)
        r_nan_lanes = tl.zeros([BLOCK], tl.float32)
        r_inf_lanes = tl.zeros([BLOCK], tl.float32)
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            update, ratio = _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO, True, n)
            nans += (update != update).to(tl.float32)
            infs += (tl.abs(update) == float("inf")).to(tl.float32)
            r_nan_lanes += (ratio != ratio).to(tl.float32)
            r_inf_lanes += (tl.abs(ratio) == float("inf")).to(tl.float32)
        n_nans, n_infs = tl.sum(nans, 0), tl.sum(infs, 0)
        r_nans, r_infs = tl.sum(r_nan_lanes, 0), tl.sum(r_inf_lanes, 0)
    tl.store(row + 5, n_nans)
    tl.store(row + 6, n_infs)
    if RATIO:
        _store_sums(row + 8, r_total_sq, r_total, r_lo, r_hi, r_zeros)
        tl.store(row + 13, r_nans)
        tl.store(row + 14, r_infs)



def adam_triton(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                coefficients: torch.Tensor, update_flags: list[int], ratio_flags: list[int],
                eps: float) -> torch.Tensor:
    """Flat ``[2, N, 8]`` update and ratio partials: three launches, ``m``, ``v`` (and ``p``) read once."""
    device = exp_avg[0].device
    ratio = bool(ratio_flags)
    numels = [t.numel() for t in exp_avg]
    per, owner, start, first = _spans(numels)
    n, spans = len(exp_avg), len(owner)
    p_list = params if ratio else exp_avg
    columns = [[t.data_ptr() for t in group] for group in (exp_avg, exp_avg_sq, p_list)]
    table = _table([*columns, numels, owner, start, first], device)
    partial = torch.empty(spans * 16, dtype=torch.float32, device=device)
    threshold = zero_threshold(eps, torch.float32)
    zeros = any(bool(flags[2]) for flags in (update_flags, ratio_flags) if flags)
    out = torch.zeros(2 * PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    first_spans, numel_column = table[4 * n + 2 * spans:], table[3 * n:4 * n]
    with on_device(device):
        _adam_span_partials[(spans,)](table, coefficients, n, spans, partial, threshold,
                                      M_DTYPE=DTYPES[exp_avg[0].dtype], V_DTYPE=DTYPES[exp_avg_sq[0].dtype],
                                      P_DTYPE=DTYPES[p_list[0].dtype], RATIO=ratio, BLOCK=ADAM_BLOCK,
                                      ITERS=per // ADAM_BLOCK, ALIGNED=all(_aligned(column) for column in columns),
                                      ZEROS=zeros, num_warps=WARPS)
        for half, flags in enumerate((update_flags, ratio_flags)):
            if flags:
                _combine_spans[(n,)](first_spans, numel_column, partial[8 * half:], out[PARTIAL_SLOTS * n * half:],
                                     STRIDE=16, ROWS=_ROWS, **_flag_kwargs(flags))
    return out


@adam_partials_op.register_kernel("cuda")
def _adam_partials_cuda(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                        coefficients: torch.Tensor, update_flags: list[int], ratio_flags: list[int],
                        eps: float) -> torch.Tensor:
    return adam_triton(exp_avg, exp_avg_sq, params, coefficients, update_flags, ratio_flags, eps)
