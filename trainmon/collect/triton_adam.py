"""The CUDA kernel of ``trainmon::adam_partials`` in Triton: the statistics of the Adam update
m / (sqrt(v) + eps) and of the update/param ratio without making either tensor (imported with
:mod:`trainmon.collect.triton_kernels`, on the first CUDA tensor measured, where Triton is installed).

Three launches per group whatever its size: the span kernel reads ``m``, ``v`` (and the parameter, for the
ratio) once, as :func:`trainmon.collect.triton_kernels._span_partials` reads a tensor (whole spans unmasked,
NaN/Inf counted only in spans whose sums are not finite, zeros only when asked for); then
``combine_spans`` once per half (update, ratio). Its block is 512: two values per element at 1024 would
need about 140 registers a thread (56 at 512, sm_90).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainmon.base.records import PARTIAL_SLOTS
from trainmon.collect.kernel_ops import ADAM_PARTS, adam_partials_op
from trainmon.collect.stats_base import zero_threshold
from trainmon.collect.triton_kernels import (
    DTYPES,
    SPAN_ROWS,
    WARPS,
    add_masked,
    add_to,
    aligned_addresses,
    combine_spans,
    flag_kwargs,
    fresh_block,
    non_finite,
    on_device,
    span_table,
    split_spans,
    store_sums,
)

ADAM_BLOCK = 512


@triton.jit
def _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO: tl.constexpr, MASKED: tl.constexpr, n):
    """``m``, ``v``, the update m / (sqrt(v) + eps) * scale and the update/param ratio (0 where the param is 0)
    at ``offsets``. Masked lanes read m = v = p = 0: update 0 / (0 + eps) = 0 and ratio 0, neutral for the sums.
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
    return m, v, update, ratio


@triton.jit
def _adam_span_partials(table, coefficients, n_tensors, n_spans, spans, threshold, state_threshold,
                        M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, RATIO: tl.constexpr,
                        STATES: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr,
                        ZEROS: tl.constexpr):
    """Update and ratio spans (and, with ``STATES``, those of ``m`` and ``v``: rows of 32 slots, update, ratio,
    m, v); table = [m N, v N, p N, numels N, span tensor S, span start S, first N+1].

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
    sq, sm, lo, hi, zeros = fresh_block(BLOCK)
    r_sq, r_sm, r_lo, r_hi, r_zeros = fresh_block(BLOCK)
    m_sq, m_sm, m_lo, m_hi, m_zeros = fresh_block(BLOCK)
    v_sq, v_sm, v_lo, v_hi, v_zeros = fresh_block(BLOCK)
    if start + ITERS * BLOCK <= n:  # a whole span: no mask
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            m, v, update, ratio = _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO, False, n)
            sq, sm, lo, hi, zeros = add_to(update, sq, sm, lo, hi, zeros, threshold, ZEROS)
            if RATIO:
                r_sq, r_sm, r_lo, r_hi, r_zeros = add_to(ratio, r_sq, r_sm, r_lo, r_hi, r_zeros, threshold, ZEROS)
            if STATES:
                m_sq, m_sm, m_lo, m_hi, m_zeros = add_to(m, m_sq, m_sm, m_lo, m_hi, m_zeros, state_threshold, ZEROS)
                v_sq, v_sm, v_lo, v_hi, v_zeros = add_to(v, v_sq, v_sm, v_lo, v_hi, v_zeros, state_threshold, ZEROS)
    else:
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            m, v, update, ratio = _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO, True, n)
            sq, sm, lo, hi, zeros = add_masked(update, mask, sq, sm, lo, hi, zeros, threshold, ZEROS)
            if RATIO:
                r_sq, r_sm, r_lo, r_hi, r_zeros = add_masked(ratio, mask, r_sq, r_sm, r_lo, r_hi, r_zeros, threshold,
                                                              ZEROS)
            if STATES:
                m_sq, m_sm, m_lo, m_hi, m_zeros = add_masked(m, mask, m_sq, m_sm, m_lo, m_hi, m_zeros,
                                                              state_threshold, ZEROS)
                v_sq, v_sm, v_lo, v_hi, v_zeros = add_masked(v, mask, v_sq, v_sm, v_lo, v_hi, v_zeros,
                                                              state_threshold, ZEROS)
    row = spans + pid * 32
    total_sq, total = tl.sum(sq, 0), tl.sum(sm, 0)
    r_total_sq, r_total = tl.sum(r_sq, 0), tl.sum(r_sm, 0)
    m_total_sq, m_total = tl.sum(m_sq, 0), tl.sum(m_sm, 0)
    v_total_sq, v_total = tl.sum(v_sq, 0), tl.sum(v_sm, 0)
    store_sums(row, total_sq, total, lo, hi, zeros)
    counts = tl.zeros([8], tl.float32)  # NaN and Inf counts: update, ratio, m, v
    # a NaN or an Inf in a span of m or v makes the update's sums non-finite too (unless m is 0 where v is Inf)
    if non_finite(total_sq, total) | non_finite(r_total_sq, r_total) | non_finite(m_total_sq, m_total) \
            | non_finite(v_total_sq, v_total):  # count them, reading the span again
        lanes = tl.arange(0, 8)
        for i in range(ITERS):
            offsets = start + i * BLOCK + tl.arange(0, BLOCK)
            m, v, update, ratio = _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO, True, n)
            counts += tl.where(lanes == 0, tl.sum((update != update).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 1, tl.sum((tl.abs(update) == float("inf")).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 2, tl.sum((ratio != ratio).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 3, tl.sum((tl.abs(ratio) == float("inf")).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 4, tl.sum((m != m).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 5, tl.sum((tl.abs(m) == float("inf")).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 6, tl.sum((v != v).to(tl.float32), 0), 0.0)
            counts += tl.where(lanes == 7, tl.sum((tl.abs(v) == float("inf")).to(tl.float32), 0), 0.0)
    slots = tl.arange(0, 8)
    tl.store(row + 5 + (slots // 2) * 8 + slots % 2, counts)  # slots 5 and 6 of each part
    if RATIO:
        store_sums(row + 8, r_total_sq, r_total, r_lo, r_hi, r_zeros)
    if STATES:
        store_sums(row + 16, m_total_sq, m_total, m_lo, m_hi, m_zeros)
        store_sums(row + 24, v_total_sq, v_total, v_lo, v_hi, v_zeros)


def adam_triton(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                coefficients: torch.Tensor, update_flags: list[int], ratio_flags: list[int],
                state_flags: list[int], eps: float) -> torch.Tensor:
    """Flat ``[4, N, 8]`` update, ratio, exp_avg and exp_avg_sq partials: ``m``, ``v`` (and ``p``) read once,
    a launch for the spans and one per part wanted."""
    device = exp_avg[0].device
    ratio, states = bool(ratio_flags), bool(state_flags)
    numels = [t.numel() for t in exp_avg]
    per, owner, start, first = split_spans(numels)
    n, spans = len(exp_avg), len(owner)
    p_list = params if ratio else exp_avg
    columns = [[t.data_ptr() for t in group] for group in (exp_avg, exp_avg_sq, p_list)]
    table = span_table([*columns, numels, owner, start, first], device)
    partial = torch.zeros(spans * 32, dtype=torch.float32, device=device)
    threshold = zero_threshold(eps, torch.float32)
    state_threshold = zero_threshold(eps, exp_avg[0].dtype)  # exp_avg_sq is of the same dtype (adam.py)
    zeros = any(bool(flags[2]) for flags in (update_flags, ratio_flags, state_flags) if flags)
    block = ADAM_BLOCK // 2 if states else ADAM_BLOCK  # four sets of accumulators: the registers of two
    out = torch.zeros(ADAM_PARTS * PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    first_spans, numel_column = table[4 * n + 2 * spans:], table[3 * n:4 * n]
    with on_device(device):
        _adam_span_partials[(spans,)](table, coefficients, n, spans, partial, threshold, state_threshold,
                                      M_DTYPE=DTYPES[exp_avg[0].dtype], V_DTYPE=DTYPES[exp_avg_sq[0].dtype],
                                      P_DTYPE=DTYPES[p_list[0].dtype], RATIO=ratio, STATES=states, BLOCK=block,
                                      ITERS=per // block, ALIGNED=all(aligned_addresses(column) for column in columns),
                                      ZEROS=zeros, num_warps=WARPS)
        for part, flags in enumerate((update_flags, ratio_flags, state_flags, state_flags)):
            if flags:
                combine_spans[(n,)](first_spans, numel_column, partial[8 * part:], out[PARTIAL_SLOTS * n * part:],
                                     STRIDE=32, ROWS=SPAN_ROWS, **flag_kwargs(flags))
    return out


@adam_partials_op.register_kernel("cuda")
def _adam_partials_cuda(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                        coefficients: torch.Tensor, update_flags: list[int], ratio_flags: list[int],
                        state_flags: list[int], eps: float) -> torch.Tensor:
    return adam_triton(exp_avg, exp_avg_sq, params, coefficients, update_flags, ratio_flags, state_flags, eps)
