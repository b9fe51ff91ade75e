"""The two torch operators of the fused statistics kernels, ``trainmon::partials`` and
``trainmon::adam_partials``: their schemas and fake (meta) implementations.

Defined here, apart from any kernel, so that the CPU kernels (:mod:`trainmon.collect.kernels`) and the CUDA
ones (:mod:`trainmon.collect.triton_kernels`, loaded by ``kernels`` on the first CUDA tensor) each register
on them without importing each other.
"""

from __future__ import annotations

import torch

from trainmon.base.partials import PARTIAL_SLOTS

_F32 = torch.float32
ADAM_PARTS = 4
"""Parts of ``trainmon::adam_partials``'s result: update, ratio, exp_avg, exp_avg_sq."""
PRECURSOR_PARTS = 2
"""Parts added with gradients: the precursor rows' heads and tails (:mod:`trainmon.base.precursors`)."""
COEFFICIENTS = 6
"""Columns of ``trainmon::adam_partials``'s coefficients: ``(scale, eps', lr, 1 - beta2^t, sign, decay)``."""


def adam_parts(grads: list[torch.Tensor]) -> int:
    """Parts of ``trainmon::adam_partials``'s result: 4, and 2 more (the precursors) with gradients."""
    return ADAM_PARTS + (PRECURSOR_PARTS if grads else 0)


@torch.library.custom_op("trainmon::partials", mutates_args=())
def partials_op(tensors: list[torch.Tensor], flags: list[int], eps: float) -> torch.Tensor:
    """Flat ``[8 N]`` float32 partial statistics of ``tensors`` (one device, one dtype)."""
    raise NotImplementedError(f"trainmon::partials has no kernel for {tensors[0].device.type}")


@partials_op.register_fake
def _(tensors: list[torch.Tensor], flags: list[int], eps: float) -> torch.Tensor:
    return tensors[0].new_empty(PARTIAL_SLOTS * len(tensors), dtype=_F32)


@torch.library.custom_op("trainmon::adam_partials", mutates_args=())
def adam_partials_op(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
                     grads: list[torch.Tensor], coefficients: torch.Tensor, update_flags: list[int],
                     ratio_flags: list[int], state_flags: list[int], eps: float) -> torch.Tensor:
    """Flat ``[4, N, 8]`` partials of ``N`` parameters: their Adam updates, their ratios to the parameters, and
    the statistics of ``exp_avg`` and ``exp_avg_sq`` themselves (read for the update anyway); ``[6, N, 8]`` with
    ``grads``: also each parameter's precursor head and tail (:mod:`trainmon.base.precursors`), from the same
    read of ``m``, ``v``, ``p`` and the gradient.

    ``coefficients`` is ``[N, 6]`` float64 ``(scale, eps', lr, 1 - beta2^t, sign, decay)`` with update = m *
    scale / (sqrt(v) + eps'), and ``sign * grad + decay * param_before`` the gradient the moments took (the
    precursors'; :func:`trainmon.collect.adam.decay_is_coupled`). Empty flags: that part is not computed (left 0);
    ``params`` is read only for the ratio and the precursors, ``grads`` (empty, or one per parameter) only for the
    precursors.
    """
    raise NotImplementedError(f"trainmon::adam_partials has no kernel for {exp_avg[0].device.type}")


@adam_partials_op.register_fake
def _(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], params: list[torch.Tensor],
      grads: list[torch.Tensor], coefficients: torch.Tensor, update_flags: list[int], ratio_flags: list[int],
      state_flags: list[int], eps: float) -> torch.Tensor:
    return exp_avg[0].new_empty(adam_parts(grads) * PARTIAL_SLOTS * len(exp_avg), dtype=_F32)
