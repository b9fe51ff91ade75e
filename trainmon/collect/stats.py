"""On-device partial statistics of torch tensors.

A tensor's statistics are an 8-slot float32 vector on the tensor's device,
``[norm, sum, min, max, zeros, nans, infs, numel]`` (slot indices in :mod:`trainmon.base.records`),
computed without any host synchronisation and without copying the tensor. Slots that the
configured metrics do not need hold 0 and cost nothing; ``min``/``max`` are always computed
(one fused pass) because they double as the exact non-finite flag of the tensor.
Low-precision tensors accumulate in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.collect import fallback
from trainmon.collect.stats_base import (
    StatsSpec,
    norm_of_norms,
    numel_minus,
    partial_numpy,
    zero_threshold,
)

_F32 = torch.float32
_NUMPY_VIEWABLE = (torch.float32, torch.float64, torch.float16)


def partial_stats(tensor: torch.Tensor, spec: StatsSpec) -> torch.Tensor:
    """Partial statistics of one tensor, as a ``[8]`` float32 tensor on its device.

    Never synchronises with the host. The device path is :func:`partial_stats_many`'s for one
    tensor (a fused kernel where the device has one, else plain torch ops).
    """
    if tensor.layout != torch.strided:
        raise TypeError(f"{tensor.layout} tensors are not measured")
    if tensor.numel() == 0:
        return empty_partial(tensor.device)
    if numpy_viewable(tensor):
        return _partial_cpu(tensor.detach(), spec)
    return device_partials([tensor], spec)  # under no_grad: no detach (a view op per tensor) needed


def partial_stats_many(tensors: Sequence[torch.Tensor], spec: StatsSpec
                       ) -> list[tuple[list[int], torch.Tensor]]:
    """Partial statistics of many tensors, computed together: ``[(indices, block), ...]``.

    Tensors are grouped by device and dtype; each group's partials are one flat float32 ``block``
    of ``8 * len(indices)`` values on the group's device (row ``j`` is ``tensors[indices[j]]``).
    A group costs O(1) kernels where the device has a fused kernel (one read of each tensor),
    else ``_foreach`` norms and a few plain torch ops per tensor (:func:`partials_torch`);
    numpy-viewable CPU tensors take the numpy path into one CPU block. Empty tensors get
    empty partials. Never synchronises with the host.

    Raises:
        TypeError: a tensor that is not strided (sparse, nested).
    """
    groups: dict[tuple[str, torch.device, torch.dtype | None], list[int]] = {}
    xs = list(tensors)  # not detached one by one (a view op each): the device path runs under no_grad
    key: tuple[str, torch.device, torch.dtype | None]
    for i, x in enumerate(xs):
        if x.layout != torch.strided:
            raise TypeError(f"{x.layout} tensors are not measured")
        if x.numel() == 0:
            key = ("empty", x.device, None)
        elif numpy_viewable(x):
            key = ("numpy", x.device, None)
        else:
            key = ("device", x.device, x.dtype)
        groups.setdefault(key, []).append(i)
    out = []
    for (path, device, _), indices in groups.items():
        if path == "empty":
            block = torch.zeros(PARTIAL_SLOTS * len(indices), dtype=_F32, device=device)
        elif path == "numpy":
            block = torch.zeros(PARTIAL_SLOTS * len(indices), dtype=_F32)
            rows = block.numpy().reshape(-1, PARTIAL_SLOTS)  # CPU view: no sync
            for row, i in zip(rows, indices):
                partial_numpy(xs[i].detach().numpy(), spec, row)  # CPU view, no sync
        else:
            block = device_partials([xs[i] for i in indices], spec)
        out.append((indices, block))
    return out


def device_partials(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
    """Flat ``[8 N]`` float32 partials of non-empty tensors of one device and dtype (the device path)."""
    kernel = fused_kernel(tensors[0].device)
    with torch.no_grad():
        return kernel(tensors, spec) if kernel is not None else partials_torch(tensors, spec)


fused_enabled = True
"""Whether fused kernels are used (tests and benchmarks switch them off to measure the plain torch path)."""


def fused_kernel(device: torch.device) -> Callable[[Sequence[torch.Tensor], StatsSpec], torch.Tensor] | None:
    """The fused single-pass group kernel for ``device`` (:mod:`trainmon.collect.kernels`), or None."""
    if not fused_enabled:
        return None
    # imported lazily: registers the torch operators on first use
    from trainmon.collect import kernels

    return kernels.partials_kernel(device.type)


def partials_torch(tensors: Sequence[torch.Tensor], spec: StatsSpec) -> torch.Tensor:
    """The plain torch fallback of the device path: :func:`trainmon.collect.fallback.partials_torch`."""
    return fallback.partials_torch(tensors, spec)


def numpy_viewable(x: torch.Tensor) -> bool:
    """Whether ``x.numpy()`` is a zero-copy view numpy can compute on: the CPU fast paths."""
    return x.device.type == "cpu" and x.dtype in _NUMPY_VIEWABLE


def _partial_cpu(x: torch.Tensor, spec: StatsSpec) -> torch.Tensor:
    """CPU tensors: statistics on a zero-copy numpy view of the tensor.

    torch's CPU kernels for isnan/isinf/comparisons are unvectorised (10-16x slower than
    numpy's SIMD loops on this kind of machine); no data is copied or moved.
    """
    out = torch.zeros(PARTIAL_SLOTS, dtype=_F32)
    partial_numpy(x.numpy(), spec, out.numpy())  # CPU views of `x` and `out`: no transfer, no sync
    return out


def _count_small(x: torch.Tensor, eps: float) -> torch.Tensor:
    threshold = zero_threshold(eps, x.dtype)
    if threshold == 0.0:
        return numel_minus(x, torch.count_nonzero(x))
    return torch.count_nonzero(x.abs() < threshold).to(_F32)


def empty_partial(device: torch.device) -> torch.Tensor:
    """Partial statistics of a shard that holds no element (neutral in a combination)."""
    return torch.zeros(PARTIAL_SLOTS, dtype=_F32, device=device)


def combine_partials_torch(gathered: torch.Tensor) -> torch.Tensor:
    """Combine ``[shards, N, 8]`` partial statistics on the device (mirror of partials.combine_partials).

    Used by integrations after their one all-gather of a step, so that combining costs no
    extra host transfer.
    """
    has = gathered[..., 7] > 0
    out = gathered.sum(dim=0)
    out[:, 0] = norm_of_norms(gathered[..., 0], dim=0)  # scaled: shards' norms up to float32's max
    inf = torch.full_like(gathered[..., 2], float("inf"))
    lo = torch.where(has, gathered[..., 2], inf)
    hi = torch.where(has, gathered[..., 3], -inf)
    out[:, 2] = lo.amin(dim=0)
    out[:, 3] = hi.amax(dim=0)
    # amin/amax propagate NaN, so a NaN on any shard survives.
    return out


__all__ = ["combine_partials_torch", "device_partials", "empty_partial", "fused_enabled", "fused_kernel",
           "numpy_viewable", "partial_stats", "partial_stats_many", "partials_torch"]
