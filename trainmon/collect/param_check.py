"""The parameters' health as training begins: which hold a NaN or an Inf when the first training forward starts.

A parameter that is not finite before any step ran is the true first origin of everything non-finite that follows:
memory left uninitialised (a model built on the meta device, ``to_empty()``, and a ``reset_parameters()`` that does not
reach every module), or a checkpoint saved after a non-finite step. The rows made here go to the ``nonfinite``
detector with the first step's record, placed before every row of its forward (phase ``forward``, negative
``order``), so its first-origin answer names the parameter rather than the first module whose output shows it.

It runs once per attach, at the first training forward, and adds no host synchronisation: on an accelerator each
parameter's NaN and Inf counts are computed there and copied to the host without waiting (pinned memory and an event,
as ``async_results`` copies a step), read when the step's record is checked; on the CPU one squared-norm kernel per
dtype screens them (a NaN or an Inf makes a norm non-finite) and only the tensors it flags are counted (a finite value
so large that its square overflows is flagged, then cleared by the count). Each rank checks what it holds: the local
shard of a DTensor (FSDP2), the partition of a ZeRO-3 parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from trainmon.base.records import Row, RowKey
from trainmon.base.targets import plain_name
from trainmon.collect.buffer import copy_to_host

__all__ = ["ParameterCheck", "held_parameters"]

COUNTED_AT_ONCE: tuple[str, ...] = ("cpu",)
"""Device types whose tensors are screened and counted at once (nothing to wait for); the others are counted on the
device and copied without waiting. Tests empty it to run the accelerators' path on CPU tensors."""
_WRAPPERS = ("DistributedDataParallel", "Float16Module")
"""Wrappers whose ``module`` holds the model (torch's and Megatron-Core's DDP, Megatron's fp16 module)."""


def _inner(root: torch.nn.Module) -> torch.nn.Module:
    """The model inside data-parallel, fp16 and ``torch.compile`` wrappers: rows are named after its names."""
    while True:
        inner = getattr(root, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, torch.nn.Module) and type(root).__name__ in _WRAPPERS:
            inner = getattr(root, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return root
        root = inner


def _local(param: torch.Tensor) -> torch.Tensor | None:
    """What this rank holds of ``param`` (None: nothing to check here)."""
    tensor = getattr(param, "_local_tensor", None)  # a DTensor's local shard (FSDP2, tensor parallelism)
    if tensor is None:
        tensor = param.detach()
        if tensor.numel() == 0:  # a ZeRO-3 parameter outside its forward: the partition this rank keeps
            tensor = getattr(param, "ds_tensor", None)
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.numel() == 0:
        return None
    return tensor if tensor.is_floating_point() or tensor.is_complex() else None


def held_parameters(roots: Iterable[tuple[Any, int]]) -> list[tuple[str, int, torch.Tensor]]:
    """``(name, vpp_stage, tensor)`` of each parameter of the torch ``(root, vpp_stage)`` this rank holds (a tied one
    once), named as rows are; other roots (MindSpore cells) are left out."""
    held: list[tuple[str, int, torch.Tensor]] = []
    seen: set[int] = set()
    for root, vpp_stage in roots:
        if not isinstance(root, torch.nn.Module):
            continue
        for name, param in _inner(root).named_parameters():
            tensor = _local(param)
            if tensor is not None and id(param) not in seen:
                seen.add(id(param))
                held.append((plain_name(name), vpp_stage, tensor))
    return held


class ParameterCheck:
    """The NaN and Inf counts of the ``held`` parameters as step ``step``'s first forward begins (started here,
    no host sync); :meth:`rows` gives a ``param`` row for each tensor that holds one."""

    def __init__(self, held: Sequence[tuple[str, int, torch.Tensor]], step: int) -> None:
        self.step = step
        self._names = [(name, vpp_stage) for name, vpp_stage, _ in held]
        self._counted: list[tuple[int, int, int]] = []  # (index, NaN count, Inf count) of the non-finite ones
        self._copies: list[tuple[list[int], torch.Tensor, Any]] = []  # (indices, host counts [k, 2], event or None)
        by_device: dict[torch.device, list[int]] = {}
        for index, (*_, tensor) in enumerate(held):
            by_device.setdefault(tensor.device, []).append(index)
        with torch.no_grad():
            for device, indices in by_device.items():
                if device.type in COUNTED_AT_ONCE:  # screened, then the flagged ones counted: nothing to wait for
                    for index in _screen([(index, held[index][2]) for index in indices]):
                        nans, infs = _counts(held[index][2]).numpy()  # a CPU tensor: no sync
                        if nans or infs:
                            self._counted.append((index, int(nans), int(infs)))
                else:  # counted on the device, copied without waiting
                    counts = torch.stack([_counts(held[index][2]) for index in indices])
                    self._copies.append((indices, *copy_to_host(counts, wait=False)))

    def rows(self) -> list[Row]:
        """A ``param`` row (``nans``, ``infs``) for each non-finite tensor, in the parameters' order, at orders
        before the forward's first row (0); waits for the counts' copies only."""
        for indices, host, event in self._copies:
            if event is not None:
                event.synchronize()  # this copy only, not the device
            counts = host.numpy()  # host memory, its copy ended with the event: no sync
            self._counted += [(index, int(nans), int(infs)) for index, (nans, infs) in zip(indices, counts)
                              if nans or infs]
        self._copies = []
        found = sorted(self._counted)
        return [Row(RowKey("param", self._names[index][0], vpp_stage=self._names[index][1], order=order,
                           run_phase="forward"), self.step, {"nans": float(nans), "infs": float(infs)}, True)
                for order, (index, nans, infs) in enumerate(found, start=-len(found))]


def _counts(tensor: torch.Tensor) -> torch.Tensor:
    """``[NaN count, Inf count]`` of ``tensor``, on its device."""
    return torch.stack([tensor.isnan().sum(), tensor.isinf().sum()])


def _screen(indexed: Sequence[tuple[int, torch.Tensor]]) -> list[int]:
    """The indices of the CPU tensors whose squared norm is not finite (one ``_foreach_norm`` per dtype)."""
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for index, tensor in indexed:
        by_dtype.setdefault(tensor.dtype, []).append((index, tensor))
    flagged: list[int] = []
    for group in by_dtype.values():
        finite = torch.stack(torch._foreach_norm([t for _, t in group], 2)).isfinite().numpy()  # CPU: no sync
        flagged += [index for (index, _), ok in zip(group, finite) if not ok]
    return flagged
