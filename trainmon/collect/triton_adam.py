"""The CUDA kernel of ``trainmon::adam_partials`` in Triton: the statistics of the Adam update
m / (sqrt(v) + eps) and of the update/param ratio without making either tensor (imported with
:mod:`trainmon.collect.triton_kernels`, on the first CUDA tensor measured, where Triton is installed).

Three launches per group whatever its size: the span kernel reads ``m``, ``v`` (and the parameter, for the
ratio) once, as :func:`trainmon.collect.triton_kernels._span_partials` reads a tensor (whole spans unmasked,
NaN/Inf counted only in spans whose sums are not finite, zeros only when asked for); then
``combine_spans`` once per half (update, ratio). Its block is 512: two values per element at 1024 would
need about 140 registers a thread (56 at 512, sm_90). With gradients it also reads them (and the parameter)
in the same pass for the precursor rows (:mod:`trainmon.base.precursors`), at half the block, and one more
launch (``_combine_precursors``) makes both precursor parts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.collect.kernel_ops import ADAM_PARTS, adam_partials_op, adam_parts
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
_ROW = 32
"""Slots of a span's row: update, ratio, m, v (8 each); 16 more with the precursors (head, tail)."""
_PRECURSOR_ROW = 48


@triton.jit
def _load(base, offsets, MASKED: tl.constexpr, n):
    """Values at ``offsets`` in float32; masked lanes (past ``n``) read 0."""
    if MASKED:
        return tl.load(base + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    return tl.load(base + offsets).to(tl.float32)


@triton.jit
def _adam_values(m_base, v_base, p_base, offsets, scale, eps, RATIO: tl.constexpr, MASKED: tl.constexpr, n):
    """``m``, ``v``, the update m / (sqrt(v) + eps) * scale and the update/param ratio (0 where the param is 0)
    at ``offsets``. Masked lanes read m = v = p = 0: update 0 / (0 + eps) = 0 and ratio 0, neutral for the sums.
    """
    m = _load(m_base, offsets, MASKED, n)
    v = _load(v_base, offsets, MASKED, n)
    update = m / (tl.sqrt(v) + eps) * scale
    ratio = update
    if RATIO:
        p = _load(p_base, offsets, MASKED, n)
        ratio = tl.where(p != 0.0, update / tl.where(p != 0.0, p, 1.0), 0.0)
    return m, v, update, ratio


@triton.jit
def _taken(g, p, update, lr, sign, decay):
    """The gradient the moments took: ``sign * g + decay * (p + lr * update)`` (``p + lr * update``: the weights
    before the step, under Adam's coupled decay; ``lr`` is not read without decay: it may be NaN, unknown)."""
    return tl.where(decay != 0.0, sign * g + decay * (p + lr * update), sign * g)


@triton.jit
def _stale(g, v, eps2):
    """``g^2 / max(v, eps'^2)``, 0 where ``g`` is 0 (an element without a gradient, a masked lane)."""
    squares = g * g
    return tl.where(squares != 0.0, squares / tl.maximum(v, eps2), 0.0)


@triton.jit
def _adam_span_partials(table, coefficients, n_tensors, n_spans, spans, threshold, state_threshold,
                        M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, RATIO: tl.constexpr,
                        STATES: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr,
                        ZEROS: tl.constexpr, PRECURSORS: tl.constexpr, G_DTYPE: tl.constexpr, STRIDE: tl.constexpr):
    """Update and ratio spans (and, with ``STATES``, those of ``m`` and ``v``: rows of 32 slots, update, ratio,
    m, v; with ``PRECURSORS``, 48: the precursor head and tail follow, their sums before the span's
    combination); table = [m N, v N, p N, g N, numels N, span tensor S, span start S, first N+1].

    As :func:`_span_partials`: whole spans load unmasked, NaN/Inf are counted only when a span's sums
    are not finite (reading its m, v and p again), zeros only when ``ZEROS``. The precursors' sums need no
    count: a NaN or an Inf shows in them as it is.
    """
    pid = tl.program_id(0)
    t = tl.load(table + 5 * n_tensors + pid)
    start = tl.multiple_of(tl.load(table + 5 * n_tensors + n_spans + pid), BLOCK)
    n = tl.load(table + 4 * n_tensors + t)
    m_base = tl.load(table + t).to(tl.pointer_type(M_DTYPE))
    v_base = tl.load(table + n_tensors + t).to(tl.pointer_type(V_DTYPE))
    p_base = tl.load(table + 2 * n_tensors + t).to(tl.pointer_type(P_DTYPE))
    g_base = tl.load(table + 3 * n_tensors + t).to(tl.pointer_type(G_DTYPE))
    if ALIGNED:
        m_base = tl.multiple_of(m_base, 16)
        v_base = tl.multiple_of(v_base, 16)
        p_base = tl.multiple_of(p_base, 16)
        g_base = tl.multiple_of(g_base, 16)
    scale = tl.load(coefficients + 6 * t).to(tl.float32)
    eps = tl.load(coefficients + 6 * t + 1).to(tl.float32)
    lr = tl.load(coefficients + 6 * t + 2).to(tl.float32)
    sign = tl.load(coefficients + 6 * t + 4).to(tl.float32)
    decay = tl.load(coefficients + 6 * t + 5).to(tl.float32)
    eps2 = eps * eps
    sq, sm, lo, hi, zeros = fresh_block(BLOCK)
    r_sq, r_sm, r_lo, r_hi, r_zeros = fresh_block(BLOCK)
    m_sq, m_sm, m_lo, m_hi, m_zeros = fresh_block(BLOCK)
    v_sq, v_sm, v_lo, v_hi, v_zeros = fresh_block(BLOCK)
    # precursors: u.g, m.g, |g|^2, |m|^2, |p|^2, sum and max of g^2 / max(v, eps'^2), elements with v < eps'^2
    ug, mg, gg, mm, pp, stale_sum, stale_max, under = (tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32),
                                                       tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32),
                                                       tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32),
                                                       tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32))
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
            if PRECURSORS:
                p = _load(p_base, offsets, False, n)
                g = _taken(_load(g_base, offsets, False, n), p, update, lr, sign, decay)
                stale = _stale(g, v, eps2)
                ug += update * g
                mg += m * g
                gg += g * g
                mm += m * m
                pp += p * p
                stale_sum += stale
                stale_max = tl.maximum(stale_max, stale)  # a NaN shows in the sum (below)
                under += (v < eps2).to(tl.float32)
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
            if PRECURSORS:  # masked lanes read g = m = p = v = 0: neutral for every sum, kept out of the count
                p = _load(p_base, offsets, True, n)
                g = _taken(_load(g_base, offsets, True, n), p, update, lr, sign, decay)
                stale = _stale(g, v, eps2)
                ug += update * g
                mg += m * g
                gg += g * g
                mm += m * m
                pp += p * p
                stale_sum += stale
                stale_max = tl.maximum(stale_max, stale)  # a NaN shows in the sum (below)
                under += (mask & (v < eps2)).to(tl.float32)
    row = spans + pid * STRIDE
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
    if PRECURSORS:  # head [|u|, u.g, 0, max r, m.g, sum r, #(v < eps'^2), n], tail [|p|, -, 0, 0, |g|^2, |m|^2, 0, n]
        valid = tl.minimum(n - start, ITERS * BLOCK).to(tl.float32)
        values = tl.zeros([16], tl.float32)
        lanes16 = tl.arange(0, 16)
        values += tl.where(lanes16 == 0, tl.sqrt(total_sq), 0.0)
        values += tl.where(lanes16 == 1, tl.sum(ug, 0), 0.0)
        stale_total = tl.sum(stale_sum, 0)
        values += tl.where(lanes16 == 3, tl.where(stale_total != stale_total, float("nan"), tl.max(stale_max, 0)), 0.0)
        values += tl.where(lanes16 == 4, tl.sum(mg, 0), 0.0)
        values += tl.where(lanes16 == 5, stale_total, 0.0)
        values += tl.where(lanes16 == 6, tl.sum(under, 0), 0.0)
        values += tl.where((lanes16 == 7) | (lanes16 == 15), valid, 0.0)
        values += tl.where(lanes16 == 8, tl.sqrt(tl.sum(pp, 0)), 0.0)
        values += tl.where(lanes16 == 12, tl.sum(gg, 0), 0.0)
        values += tl.where(lanes16 == 13, tl.sum(mm, 0), 0.0)
        tl.store(row + 32 + lanes16, values)


@triton.jit
def _combine_precursors(first, numels, spans, coefficients, heads, tails, STRIDE: tl.constexpr,
                        ROWS: tl.constexpr):
    """One program per tensor: its spans' precursor sums -> its head and tail (:mod:`trainmon.base.precursors`):
    norms as the square root of their squares' sum, the max of maxes, sums added, ``r``'s sum and max times
    ``1 - beta2^t``, and the tail's ``lr * n``. ``spans`` points at the first span's head."""
    t = tl.program_id(0)
    begin = tl.load(first + t)
    end = tl.load(first + t + 1)
    u_sq = tl.zeros([ROWS], tl.float32)
    p_sq = tl.zeros([ROWS], tl.float32)
    ug = tl.zeros([ROWS], tl.float32)
    mg = tl.zeros([ROWS], tl.float32)
    stale_sum = tl.zeros([ROWS], tl.float32)
    stale_max = tl.zeros([ROWS], tl.float32)
    under = tl.zeros([ROWS], tl.float32)
    gg = tl.zeros([ROWS], tl.float32)
    mm = tl.zeros([ROWS], tl.float32)
    for row_start in range(begin, end, ROWS):
        rows = row_start + tl.arange(0, ROWS)
        mask = rows < end
        row = spans + rows * STRIDE
        u_norm = tl.load(row + 0, mask=mask, other=0.0)
        p_norm = tl.load(row + 8, mask=mask, other=0.0)
        u_sq += u_norm * u_norm
        p_sq += p_norm * p_norm
        ug += tl.load(row + 1, mask=mask, other=0.0)
        stale_max = tl.maximum(stale_max, tl.load(row + 3, mask=mask, other=0.0))  # a NaN shows in the sum
        mg += tl.load(row + 4, mask=mask, other=0.0)
        stale_sum += tl.load(row + 5, mask=mask, other=0.0)
        under += tl.load(row + 6, mask=mask, other=0.0)
        gg += tl.load(row + 12, mask=mask, other=0.0)
        mm += tl.load(row + 13, mask=mask, other=0.0)
    count = tl.load(numels + t).to(tl.float32)
    lr = tl.load(coefficients + 6 * t + 2).to(tl.float32)
    bias2 = tl.load(coefficients + 6 * t + 3).to(tl.float32)
    lanes = tl.arange(0, 8)
    head = tl.where(lanes == 0, tl.sqrt(tl.sum(u_sq, 0)), 0.0)
    head += tl.where(lanes == 1, tl.sum(ug, 0), 0.0)
    stale_total = tl.sum(stale_sum, 0)
    stale_top = tl.where(stale_total != stale_total, float("nan"), tl.max(stale_max, 0))
    head += tl.where(lanes == 3, stale_top * bias2, 0.0)
    head += tl.where(lanes == 4, tl.sum(mg, 0), 0.0)
    head += tl.where(lanes == 5, stale_total * bias2, 0.0)
    head += tl.where(lanes == 6, tl.sum(under, 0), 0.0)
    head += tl.where(lanes == 7, count, 0.0)
    tail = tl.where(lanes == 0, tl.sqrt(tl.sum(p_sq, 0)), 0.0)
    tail += tl.where(lanes == 1, lr * count, 0.0)
    tail += tl.where(lanes == 4, tl.sum(gg, 0), 0.0)
    tail += tl.where(lanes == 5, tl.sum(mm, 0), 0.0)
    tail += tl.where(lanes == 7, count, 0.0)
    tl.store(heads + t * 8 + lanes, head)
    tl.store(tails + t * 8 + lanes, tail)


def adam_triton(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                grads: list[torch.Tensor], coefficients: torch.Tensor, update_flags: list[int],
                ratio_flags: list[int], state_flags: list[int], eps: float) -> torch.Tensor:
    """Flat ``[4, N, 8]`` update, ratio, exp_avg and exp_avg_sq partials (``[6, N, 8]`` with ``grads``: the
    precursor heads and tails too): ``m``, ``v`` (``p``, ``g``) read once, a launch for the spans and one per
    part wanted (one for both precursor parts)."""
    device = exp_avg[0].device
    ratio, states, precursors = bool(ratio_flags), bool(state_flags), bool(grads)
    numels = [t.numel() for t in exp_avg]
    per, owner, start, first = split_spans(numels)
    n, spans = len(exp_avg), len(owner)
    p_list = params if ratio or precursors else exp_avg
    g_list = grads if precursors else exp_avg
    columns = [[t.data_ptr() for t in group] for group in (exp_avg, exp_avg_sq, p_list, g_list)]
    table = span_table([*columns, numels, owner, start, first], device)
    stride = _PRECURSOR_ROW if precursors else _ROW
    partial = torch.zeros(spans * stride, dtype=torch.float32, device=device)
    threshold = zero_threshold(eps, torch.float32)
    state_threshold = zero_threshold(eps, exp_avg[0].dtype)  # exp_avg_sq is of the same dtype (adam.py)
    zeros = any(bool(flags[2]) for flags in (update_flags, ratio_flags, state_flags) if flags)
    # four sets of accumulators (states) take the registers of two; the precursors' eight those of two more
    block = ADAM_BLOCK // (2 if states else 1) // (2 if precursors else 1)
    parts = adam_parts(grads)
    out = torch.zeros(parts * PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    first_spans, numel_column = table[5 * n + 2 * spans:], table[4 * n:5 * n]
    with on_device(device):
        _adam_span_partials[(spans,)](table, coefficients, n, spans, partial, threshold, state_threshold,
                                      M_DTYPE=DTYPES[exp_avg[0].dtype], V_DTYPE=DTYPES[exp_avg_sq[0].dtype],
                                      P_DTYPE=DTYPES[p_list[0].dtype], RATIO=ratio, STATES=states, BLOCK=block,
                                      ITERS=per // block, ALIGNED=all(aligned_addresses(column) for column in columns),
                                      ZEROS=zeros, PRECURSORS=precursors, G_DTYPE=DTYPES[g_list[0].dtype],
                                      STRIDE=stride, num_warps=WARPS)
        for part, flags in enumerate((update_flags, ratio_flags, state_flags, state_flags)):
            if flags:
                combine_spans[(n,)](first_spans, numel_column, partial[8 * part:], out[PARTIAL_SLOTS * n * part:],
                                     STRIDE=stride, ROWS=SPAN_ROWS, **flag_kwargs(flags))
        if precursors:
            heads = out[PARTIAL_SLOTS * n * ADAM_PARTS:]
            _combine_precursors[(n,)](first_spans, numel_column, partial[32:], coefficients, heads,
                                      heads[PARTIAL_SLOTS * n:], STRIDE=stride, ROWS=SPAN_ROWS)
    return out


@adam_partials_op.register_kernel("cuda")
def _adam_partials_cuda(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                        grads: list[torch.Tensor], coefficients: torch.Tensor, update_flags: list[int],
                        ratio_flags: list[int], state_flags: list[int], eps: float) -> torch.Tensor:
    return adam_triton(exp_avg, exp_avg_sq, params, grads, coefficients, update_flags, ratio_flags, state_flags, eps)
