"""Fused single-pass statistics kernels: one operator per group of tensors of one device and dtype.

Two torch operators, registered with ``torch.library`` so that they dispatch like any aten op
(one launch per group on a GPU, one entry in a profile or a ``TorchDispatchMode``):

- ``trainmon::partials(tensors, flags, eps)``: the ``[8 N]`` partial statistics of ``N`` tensors,
  every slot from one read of each tensor (NaN/Inf counts come free with min/max: no second pass,
  no temporary).
- ``trainmon::adam_partials(exp_avg, exp_avg_sq, params, grads, coefficients, update_flags, ratio_flags,
  state_flags, eps)``: the partials of the Adam update ``m_hat / (sqrt(v_hat) + eps)`` and of
  ``update / param`` of ``N`` parameters, those of ``m`` and ``v`` themselves, and with ``grads`` the
  precursor rows (:mod:`trainmon.base.precursors`), from one read of ``m``, ``v`` (``p``, ``g``), without
  the full-size update.

Kernels: CPU (numpy over cache-sized chunks; bfloat16 is widened chunk by chunk from its bits) and
CUDA (Triton, :mod:`trainmon.collect.triton_kernels`, where Triton is installed). Devices without
a kernel use the plain torch ops of :func:`trainmon.collect.fallback.partials_torch`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from trainmon.base.partials import MAX, MIN, NORM, NUMEL, PARTIAL_SLOTS, combine_partials
from trainmon.collect.fallback import partials_torch
from trainmon.collect.kernel_ops import ADAM_PARTS, PRECURSOR_PARTS, adam_partials_op, adam_parts, partials_op
from trainmon.collect.stats_base import StatsSpec, bounds, partial_numpy

logger = logging.getLogger("trainmon")
CHUNK = 65536
"""Elements per chunk of the CPU kernels: a few float32 chunks stay in L2."""
_F32 = torch.float32
Array: TypeAlias = npt.NDArray[Any]
"""A numpy view of a tensor's memory, or a buffer: float16/32/64, int16 (bfloat16 bits) or int/bool."""
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def spec_flags(spec: StatsSpec | None) -> list[int]:
    """``[norm, sum, zeros, nans, infs]`` as ints (an operator argument); empty for None (not wanted)."""
    if spec is None:
        return []
    return [int(spec.norm), int(spec.sum), int(spec.zeros), int(spec.nans), int(spec.infs)]


def _spec(flags: Sequence[int], eps: float) -> StatsSpec:
    norm, total, zeros, nans, infs = (bool(f) for f in flags)
    return StatsSpec(norm=norm, sum=total, zeros=zeros, nans=nans, infs=infs, eps=eps)


# ---------------------------------------------------------------------------------------------- CPU


def flat_chunks(values: Array, size: int = CHUNK) -> Iterator[Array]:
    """Consecutive pieces of at most ``size`` elements covering ``values`` in C order.

    Views for a C-contiguous array; for a strided one, slices of its outer dimensions (a copy of
    at most ``size`` elements each when reshaped), never a copy of the whole array.
    """
    if values.flags.c_contiguous or values.ndim <= 1:
        flat = values.reshape(-1) if values.flags.c_contiguous else values
        for start in range(0, flat.size, size):
            yield flat[start:start + size]
        return
    inner = values[0].size
    if inner >= size:
        for row in values:
            yield from flat_chunks(row, size)
        return
    rows = max(1, size // max(inner, 1))
    for start in range(0, values.shape[0], rows):
        yield values[start:start + rows].reshape(-1)


def _widen(piece: Array, out: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """float32 values of a chunk: bfloat16 bits (int16) shifted into the high half, else a cast."""
    wide = out[: piece.size]
    if piece.dtype == np.int16:
        as_int = wide.view(np.int32)
        np.copyto(as_int, piece, casting="unsafe")
        np.left_shift(as_int, 16, out=as_int)
    else:
        np.copyto(wide, piece, casting="unsafe")
    return wide


def _numpy_source(tensor: torch.Tensor) -> tuple[Array, bool]:
    """A zero-copy numpy view of ``tensor`` and whether it must be widened to float32 chunk by chunk."""
    x = tensor.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype in _NUMPY_DTYPES:
        return x.numpy(), False  # CPU view, no sync
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy(), True  # CPU view, no sync: the same bits, widened per chunk
    return x.to(_F32).numpy(), False  # CPU, no sync; integer/bool tensors are rare (indices)


def partial_into(tensor: torch.Tensor, spec: StatsSpec, out: Array) -> None:
    """The 8-slot partial of one CPU tensor into ``out``, from one pass over its memory."""
    if tensor.numel() == 0:
        return
    values, widen = _numpy_source(tensor)
    if not widen:
        partial_numpy(values, spec, out)
        return
    chunks = list(flat_chunks(values))
    if len(chunks) == 1:
        partial_numpy(_widen(chunks[0], np.empty(chunks[0].size, np.float32)), spec, out)
        return
    parts = np.zeros((len(chunks), PARTIAL_SLOTS))
    buffer = np.empty(CHUNK, np.float32)
    for part, piece in zip(parts, chunks):
        partial_numpy(_widen(piece, buffer), spec, part)
    out[:] = combine_partials(parts[:, None, :])[0]


@partials_op.register_kernel("cpu")
def _partials_cpu(tensors: list[torch.Tensor], flags: list[int], eps: float) -> torch.Tensor:
    spec = _spec(flags, eps)
    out = torch.zeros(PARTIAL_SLOTS * len(tensors), dtype=_F32)
    rows = out.numpy().reshape(-1, PARTIAL_SLOTS)  # CPU view: no sync
    for tensor, row in zip(tensors, rows):
        partial_into(tensor, spec, row)
    return out


def update_into(m: Array, v: Array, out: Array, scale: float, eps: float) -> None:
    """The Adam update ``m * scale / (sqrt(v) + eps)`` in four passes over ``out``."""
    np.sqrt(v, out=out)
    out += eps
    np.divide(m, out, out=out)
    out *= scale


def ratio_into(update: Array, param: Array, out: Array) -> tuple[Any, Any]:
    """``update / param``, 0 where the parameter is exactly 0; returns the result's ``(min, max)``.

    A zero parameter makes ``update / param`` infinite or NaN there, so finite bounds mean there is none: the
    fix-up (a mask of the parameter and a masked copy) is then skipped.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(update, param, out=out)
    lo, hi = bounds(out)
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    np.copyto(out, 0.0, where=param == 0)
    return bounds(out)


def adam_partial_into(m: torch.Tensor, v: torch.Tensor, p: torch.Tensor | None, scale: float, eps: float,
                      update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                      update_out: Array, ratio_out: Array, state_spec: StatsSpec | None = None,
                      m_out: Array | None = None, v_out: Array | None = None, *, grad: torch.Tensor | None = None,
                      lr: float = math.nan, bias2: float = 1.0, sign: float = 1.0, decay: float = 0.0,
                      precursor_out: Array | None = None) -> None:
    """Update and ratio partials of one CPU parameter, chunk by chunk (no full-size update or ratio); with
    ``state_spec``, the partials of ``m`` and ``v`` too, from the same chunks; with ``grad`` (and ``p``), the
    ``[2, 8]`` precursor head and tail into ``precursor_out`` (:mod:`trainmon.base.precursors`; ``lr``,
    ``bias2 = 1 - beta2^t``, and the gradient the moments took, ``sign * grad + decay * param_before``)."""
    n = m.numel()
    if n == 0:
        return
    precursors = grad is not None and p is not None and precursor_out is not None
    sources = [_numpy_source(t) for t in (m, v, p, grad if precursors else None) if t is not None]
    if len({values.flags.c_contiguous for values, _ in sources}) > 1:  # rare: align the chunk boundaries
        sources = [(np.ascontiguousarray(values), widen) for values, widen in sources]
    pieces = [list(flat_chunks(values)) for values, _ in sources]
    chunks = len(pieces[0])
    parts = np.zeros((ADAM_PARTS + PRECURSOR_PARTS, chunks, PARTIAL_SLOTS))  # update, ratio, m, v, head, tail
    size = min(n, CHUNK)
    # the precursors' dot products want float32 (or float64) chunks: float16 ones are widened too
    widened = [np.empty(size, np.float32) if widen or (precursors and values.dtype == np.float16) else None
               for values, widen in sources]
    buffer_u, buffer_r = np.empty(size, np.float32), np.empty(size, np.float32)
    scratch = np.empty(size, np.float32) if precursors else buffer_r
    taken = np.empty(size, np.float32) if precursors and (sign != 1.0 or decay) else None
    eps2 = eps * eps
    reuse_norm = update_spec is not None and update_spec.norm  # the update's |u| per chunk, computed anyway
    # g^2 / eps'^2 may overflow to Inf (a huge gradient): a value, not a warning for the user
    quiet: contextlib.AbstractContextManager[Any] = np.errstate(divide="ignore", invalid="ignore", over="ignore") \
        if precursors else contextlib.nullcontext()
    with quiet:
        for i in range(chunks):
            arrays = [_widen(piece[i], wide) if wide is not None else piece[i] for piece, wide in zip(pieces, widened)]
            k = arrays[0].size
            u, r = buffer_u[:k], buffer_r[:k]
            if state_spec is not None:
                partial_numpy(arrays[0], state_spec, parts[2, i])
                partial_numpy(arrays[1], state_spec, parts[3, i])
            update_into(arrays[0], arrays[1], u, scale, eps)
            if update_spec is not None:
                partial_numpy(u, update_spec, parts[0, i])
            if ratio_spec is not None:
                partial_numpy(r, ratio_spec, parts[1, i], ratio_into(u, arrays[2], r))
            if precursors:
                g = arrays[3]
                if taken is not None:  # sign * g + decay * (p + lr * u): p + lr * u are the weights before the step
                    g = taken[:k]
                    np.multiply(arrays[3], sign, out=g)
                    if decay:
                        before = scratch[:k]  # free until precursor_chunk
                        np.multiply(u, lr, out=before)
                        before += arrays[2]
                        before *= decay
                        g += before
                precursor_chunk(u, arrays[0], arrays[1], arrays[2], g, eps2, r, scratch[:k], parts[4, i], parts[5, i],
                                float(parts[0, i, 0]) if reuse_norm else None)
    for spec, out, part in ((update_spec, update_out, parts[0]), (ratio_spec, ratio_out, parts[1]),
                            (state_spec, m_out, parts[2]), (state_spec, v_out, parts[3])):
        if spec is not None and out is not None:
            combine_chunks(part, out)
    if precursors:
        assert precursor_out is not None
        precursor_out[:] = finish_precursors(combine_partials(parts[4:].transpose(1, 0, 2)), lr, bias2)


def combine_chunks(parts: Array, out: Array) -> None:
    """``out[:] = combine_partials(parts[:, None, :])[0]``: one tensor's ``[chunks, 8]`` float64 partials combined.
    One chunk (every tensor of up to 64 K elements) takes the same float64 operations on scalars instead of a
    dozen array operations (~20 us of numpy calls): the same values.

    Example:
        >>> out = np.zeros(8, np.float32)
        >>> combine_chunks(np.array([[3.0, 1.0, np.nan, 2.0, 0, 1, 0, 4]]), out)
        >>> out.tolist()
        [3.0, 1.0, nan, nan, 0.0, 1.0, 0.0, 4.0]
    """
    if len(parts) != 1:
        out[:] = combine_partials(parts[:, None, :])[0]
        return
    part = parts[0]
    row = part + 0.0  # a float64 copy, as the sum of one chunk (-0.0 becomes 0.0)
    row[NORM] = np.sqrt(np.square(part[NORM]))
    if not part[NUMEL] > 0:  # no element: min and max are neutral
        row[MIN], row[MAX] = np.inf, -np.inf
    elif math.isnan(part[MIN]) or math.isnan(part[MAX]):
        row[MIN] = row[MAX] = np.nan
    else:  # the chunk's own (a -0.0 stays)
        row[MIN], row[MAX] = part[MIN], part[MAX]
    out[:] = row


def precursor_chunk(u: Array, m: Array, v: Array, p: Array, g: Array, eps2: float, buffer: Array, other: Array,
                    head: Array, tail: Array, update_norm: float | None = None) -> None:
    """One chunk's precursor sums (:mod:`trainmon.base.precursors`) into ``head`` and ``tail``, before the
    ``1 - beta2^t`` factor and the learning rate (:func:`finish_precursors`): ``r = g^2 / max(v, eps'^2)``
    (0 where ``g`` is 0), ``eps' = eps * sqrt(1 - beta2^t)`` as in the update. ``buffer``, ``other``: two
    scratch arrays of the chunk's size (``buffer`` may be the ratio's, which is measured by then);
    ``update_norm``: the chunk's ``|u|`` where the update's statistics computed it. Call under
    ``np.errstate(divide="ignore", invalid="ignore", over="ignore")``."""
    np.multiply(g, g, out=buffer)
    np.maximum(v, eps2, out=other)
    if eps2 > 0:  # g = 0 gives 0 / max(v, eps'^2) = 0 by itself
        np.divide(buffer, other, out=buffer)
    else:
        np.divide(buffer, other, out=buffer, where=buffer != 0)  # 0 stays 0 (an element without a gradient)
    head[0] = np.sqrt(np.dot(u, u)) if update_norm is None else update_norm
    head[1] = np.dot(u, g)
    head[3] = buffer.max()
    head[4] = np.dot(m, g)
    head[5] = buffer.sum()
    head[6] = np.count_nonzero(v < eps2)
    head[7] = tail[7] = u.size
    tail[0] = np.sqrt(np.dot(p, p))
    tail[4] = np.dot(g, g)
    tail[5] = np.dot(m, m)


def finish_precursors(combined: Array, lr: float, bias2: float) -> Array:
    """The ``[2, 8]`` precursor head and tail of a parameter from its combined chunk sums: ``r``'s max and sum
    times ``1 - beta2^t`` (so that they are of ``g^2 / max(v_hat, eps^2)``), and ``lr * n``."""
    combined = np.array(combined, dtype=np.float64)
    combined[0, 3] *= bias2
    combined[0, 5] *= bias2
    combined[1, 1] = lr * combined[1, 7]
    return combined


@adam_partials_op.register_kernel("cpu")
def _adam_partials_cpu(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                       grads: list[torch.Tensor], coefficients: torch.Tensor, update_flags: list[int],
                       ratio_flags: list[int], state_flags: list[int], eps: float) -> torch.Tensor:
    update_spec = _spec(update_flags, eps) if update_flags else None
    ratio_spec = _spec(ratio_flags, eps) if ratio_flags else None
    state_spec = _spec(state_flags, eps) if state_flags else None
    n, parts = len(exp_avg), adam_parts(grads)
    out = torch.zeros(parts * PARTIAL_SLOTS * n, dtype=_F32)
    rows = out.numpy().reshape(parts, n, PARTIAL_SLOTS)  # CPU view: no sync
    constants = coefficients.numpy()  # a CPU tensor: a view, no sync
    read_params = ratio_spec is not None or bool(grads)
    for i in range(n):
        precursors = rows[ADAM_PARTS:, i] if grads else None
        adam_partial_into(exp_avg[i], exp_avg_sq[i], params[i] if read_params else None,
                          float(constants[i, 0]), float(constants[i, 1]), update_spec, ratio_spec,
                          rows[0, i], rows[1, i], state_spec, rows[2, i], rows[3, i],
                          grad=grads[i] if grads else None, lr=float(constants[i, 2]),
                          bias2=float(constants[i, 3]), sign=float(constants[i, 4]), decay=float(constants[i, 5]),
                          precursor_out=precursors)
    return out


def _fused_partials(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
    # no detach (a dispatched view op each): the operator has no autograd formula and runs under no_grad
    partials: torch.Tensor = partials_op(list(tensors), spec_flags(spec), spec.eps)
    return partials


PARTIALS: dict[str, Callable[[Sequence[torch.Tensor], StatsSpec], torch.Tensor]] = {"cpu": _fused_partials}
"""Device type -> ``(tensors, spec) -> flat [8 N] partials`` (``trainmon::partials`` or a kernel called directly)."""
ADAM: dict[str, Callable[[Sequence[torch.Tensor]], bool]] = {"cpu": lambda tensors: True}
"""Device type -> whether ``trainmon::adam_partials`` takes these tensors (``m``, ``v`` and ``p``)."""
ADAM_DIRECT: dict[str, Callable[..., torch.Tensor]] = {}
"""Device type -> the Adam kernel called directly, not through the dispatcher (the Triton one)."""
_loaded_cuda = False


def _load_cuda() -> None:
    """Registers the Triton kernels on the first CUDA tensor, where Triton is installed."""
    global _loaded_cuda
    _loaded_cuda = True
    try:
        from trainmon.collect import triton_kernels
    except ImportError:  # no Triton: CUDA uses the plain torch ops
        return
    if triton_kernels.available():
        use_triton("cuda")


def use_triton(device_type: str) -> None:
    """Measures ``device_type``'s tensors with the Triton kernels, called directly (no dispatcher: ~60 µs of
    Python per call saved; no autograd here). CUDA's, on its first tensor; the tests also put CPU tensors
    through them in Triton's interpreter (``TRITON_INTERPRET=1``), the CUDA code path without a GPU."""
    from trainmon.collect import triton_adam, triton_kernels

    def triton_partials(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
        if not triton_kernels.supported(tensors):  # float64, non-contiguous: the plain torch ops
            return partials_torch(tensors, spec)
        try:
            return triton_kernels.partials_triton(list(tensors), spec_flags(spec), spec.eps)
        except Exception as exc:  # a kernel that does not compile here must not cost the rows
            _give_up_triton(device_type, exc)
            return partials_torch(tensors, spec)

    PARTIALS[device_type] = triton_partials
    ADAM[device_type] = triton_kernels.supported
    ADAM_DIRECT[device_type] = triton_adam.adam_triton


def _give_up_triton(device_type: str, exc: Exception) -> None:
    logger.warning("trainmon: the Triton statistics kernels failed (%s: %s); using plain torch ops",
                   type(exc).__name__, exc)
    for table in (PARTIALS, ADAM, ADAM_DIRECT):
        table.pop(device_type, None)


def partials_kernel(device_type: str) -> Callable[[Sequence[torch.Tensor], StatsSpec], torch.Tensor] | None:
    """The fused partials kernel of ``device_type``, or None."""
    if device_type == "cuda" and not _loaded_cuda:
        _load_cuda()
    return PARTIALS.get(device_type)


def adam_kernel_takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``trainmon::adam_partials`` has a kernel for these tensors (one device)."""
    device_type = tensors[0].device.type
    if device_type == "cuda" and not _loaded_cuda:
        _load_cuda()
    takes = ADAM.get(device_type)
    return takes is not None and takes(tensors)


def adam_partials(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                  coefficients: torch.Tensor, update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                  state_spec: StatsSpec | None = None, grads: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
    """``trainmon::adam_partials``: flat ``[4, N, 8]`` (update, ratio, exp_avg, exp_avg_sq; a part whose spec
    is None is left 0), ``[6, N, 8]`` with ``grads`` (the precursor heads and tails); None when the kernel
    failed (then the plain torch ops are used)."""
    spec = update_spec or ratio_spec or state_spec
    device_type = exp_avg[0].device.type
    kernel = ADAM_DIRECT.get(device_type, adam_partials_op)
    try:
        partials: torch.Tensor = kernel(exp_avg, exp_avg_sq, params, list(grads), coefficients,
                                        spec_flags(update_spec), spec_flags(ratio_spec), spec_flags(state_spec),
                                        spec.eps if spec is not None else 0.0)
        return partials
    except Exception as exc:
        if kernel is adam_partials_op and device_type == "cpu":
            raise
        _give_up_triton(device_type, exc)
        return None
