"""The precursor rows (:mod:`trainmon.base.precursors`) of one parameter, or piece of one, with plain torch ops: what
devices without a fused Adam kernel run (the fused kernels: :func:`trainmon.collect.kernels.precursor_chunk` on
the CPU, :mod:`trainmon.collect.triton_adam` on CUDA), from the float32 update the fallback computed anyway.

About 15 ops per piece and three float32 temporaries of its size (pieces are bounded: ``adam._TEMPORARY_ELEMENTS``);
never a host synchronisation.
"""

from __future__ import annotations

from typing import TypeAlias

import torch

_F32 = torch.float32
Coefficient: TypeAlias = "float | torch.Tensor"
"""A host float, or a 0-d tensor on the device (capturable Adam's step counter)."""


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D float32 tensor (a view for a contiguous float32 tensor, else a copy)."""
    return x.reshape(-1).to(_F32)


def precursor_rows_torch(update: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
                         g: torch.Tensor, eps: Coefficient, lr: Coefficient, bias2: Coefficient, sign: float = 1.0,
                         decay: float = 0.0) -> torch.Tensor:
    """Flat ``[16]``: the precursor head and tail of one piece (``eps`` is ``eps'`` of the update,
    ``eps * sqrt(1 - beta2^t)``; ``bias2`` is ``1 - beta2^t``), on the piece's device. The gradient is the one the
    moments took: ``sign * g + decay * (p + lr * update)`` (the weights before the step, under coupled decay).

    Example:
        >>> m, v, g = torch.tensor([0.1, 0.0]), torch.tensor([0.01, 0.0]), torch.tensor([1.0, 0.0])
        >>> u = m / (v.sqrt() + 1e-8)
        >>> rows = precursor_rows_torch(u, m, v, torch.ones(2), g, 1e-8, 0.5, 1.0)
        >>> [round(float(x), 4) for x in rows[:8]]  # |u|, u.g, 0, max r, m.g, sum r, #(v < eps^2), n
        [1.0, 1.0, 0.0, 100.0, 0.1, 100.0, 1.0, 2.0]
    """
    u, mf, vf, pf, gf = _flat(update), _flat(m), _flat(v), _flat(p), _flat(g)
    if sign != 1.0:
        gf = gf * sign
    if decay:
        gf = gf + decay * (pf + u * lr)
    n = float(u.numel())
    eps2 = eps * eps
    squares = gf * gf
    floor = torch.clamp(vf, min=eps2) if isinstance(eps2, float) else torch.maximum(vf, eps2.to(_F32))
    ratio = torch.where(squares != 0, squares / floor, 0.0)
    zero = torch.zeros((), dtype=_F32, device=u.device)
    count = torch.full((), n, dtype=_F32, device=u.device)
    bias = torch.as_tensor(bias2, dtype=_F32, device=u.device)
    rate = torch.as_tensor(lr, dtype=_F32, device=u.device)
    underflow = (vf < eps2).sum().to(_F32) if isinstance(eps2, float) else (vf < eps2.to(_F32)).sum().to(_F32)
    head = torch.stack([torch.linalg.vector_norm(u), torch.dot(u, gf), zero, ratio.max() * bias, torch.dot(mf, gf),
                        ratio.sum() * bias, underflow, count])
    tail = torch.stack([torch.linalg.vector_norm(pf), rate * count, zero, zero, torch.dot(gf, gf), torch.dot(mf, mf),
                        zero, count])
    return torch.cat([head, tail])


__all__ = ["precursor_rows_torch"]
