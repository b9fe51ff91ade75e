"""Statistics of MindSpore CPU tensors, measured on the host after the step's one synchronisation.

MindSpore's CPU kernels for reductions, comparisons and ``isnan``/``isinf`` are slow (on the CI-class
CPU, 0.3-1.7 ms for 256 K float32 elements each, against 0.1 ms for a sum), so device statistics of
every gradient and optimizer state would cost several times a small model's step. On the CPU a
MindSpore tensor is host memory and ``asnumpy()`` is a view of it: these rows keep a reference to the
tensor in the hook (no kernel, no read) and are measured by trainmon's numpy kernels
(:mod:`trainmon.collect.kernels`, the torch CPU path: one pass a tensor, chunked) when
:meth:`MindSporeStepBuffer.transfer` has made the step's one synchronisation, after which no read waits.

Tensors whose values cannot change between the hook and the end of the step are only referenced:
gradients handed to the optimizer, optimizer states after the step and the Adam update/ratio derived
from them, and (in one process) the gradients autograd hands to parameter hooks. Every other tensor
measured through ``StepContext.record`` (activations, their gradients, multi-process gradients, which an
in-place all-reduce may change after the hook) is copied in its hook, one kernel, and the copy measured
on the host (:class:`MindSporeStats`): MindSpore's ``_version`` does not count in-place writes, so a later
change could not be detected. Copies kept in a step are bounded by ``activations.group_mb``; above it a
tensor is measured in its hook on the device. Parameters before the step are measured on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mindspore as ms
import numpy as np
import numpy.typing as npt
import torch
from mindspore import Tensor, mint

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.precursors import PRECURSORS, PRECURSORS_TAIL
from trainmon.base.records import RowKey
from trainmon.collect.kernels import adam_partial_into, partial_into
from trainmon.integrations.mindspore.stats import constants, partial_stats, tensor_meta

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.collect.stats_base import StatsSpec

_ADAM_FAMILIES = ("exp_avg", "exp_avg_sq", "update", "ratio", PRECURSORS, PRECURSORS_TAIL)
HOST_DTYPES = (ms.float16, ms.float32, ms.float64)
"""Dtypes measured on the host (numpy has them); others take the device path."""


def on_cpu() -> bool:
    """Whether MindSpore runs on the CPU, where tensors are host memory (checked once, at attach)."""
    return str(ms.get_context("device_target")).upper() == "CPU"


def host_view(tensor: Tensor) -> torch.Tensor:
    """A CPU torch tensor over the MindSpore CPU tensor's memory; call only after the step's synchronisation."""
    return torch.from_numpy(tensor.asnumpy())  # a view of host memory; the queue is drained: no wait


def host_scalar(tensor: Tensor) -> float:
    """A one-element MindSpore CPU tensor's value; call only after the step's synchronisation."""
    return float(tensor.asnumpy().reshape(-1)[0])  # host memory, the queue is drained: no wait


class HostEntry:
    """Rows (and scalars) measured on the host at the end of the step. Subclasses fill :meth:`measure`."""

    keys: list[RowKey]

    def measure(self) -> tuple[npt.NDArray[np.float64], dict[str, float]]:
        """``([len(keys), 8] partials, scalars)``; only called after the step's synchronisation."""
        raise NotImplementedError


@dataclass
class HostRows(HostEntry):
    """``keys[i]`` is the row of ``tensors[i]`` (float16/32/64 CPU tensors)."""

    keys: list[RowKey]
    tensors: list[Tensor]
    spec: StatsSpec

    def measure(self) -> tuple[npt.NDArray[np.float64], dict[str, float]]:
        out = np.zeros((len(self.tensors), PARTIAL_SLOTS))
        for tensor, row in zip(self.tensors, out):
            partial_into(host_view(tensor), self.spec, row)
        return out, {}


@dataclass
class HostNorm(HostEntry):
    """The scalar ``name``: the L2 norm over ``tensors`` (float32 accumulation as on the device)."""

    name: str
    tensors: list[Tensor]

    def __post_init__(self) -> None:
        self.keys = []

    def measure(self) -> tuple[npt.NDArray[np.float64], dict[str, float]]:
        total = 0.0
        for tensor in self.tensors:
            flat = host_view(tensor).reshape(-1)
            total += float(torch.dot(flat, flat)) if flat.dtype != torch.float16 else float(
                torch.dot(flat.float(), flat.float()))
        return np.empty((0, PARTIAL_SLOTS)), {self.name: float(np.sqrt(total))}


@dataclass
class HostPrecursors:
    """What :class:`HostAdam` needs for the ``precursors`` rows: the gradients the step took, the optimizer's fixed
    learning rate (None: unknown, NaN ratio) and ``nn.Adam``'s coupled weight decay with the parameters it applies
    to (``optimizer.Precursors``)."""

    grads: list[Tensor]
    lr: Tensor | None
    decay: Tensor | None
    decayed: list[bool]


@dataclass
class HostAdam(HostEntry):
    """``exp_avg``, ``exp_avg_sq``, ``update``, ``ratio`` and ``precursors`` rows of an Adam-like optimizer after its
    step.

    ``rows[family]`` holds the keys of that family, one per parameter (absent: not measured); the update is
    ``m * scale / (sqrt(v) + eps')`` computed chunk by chunk in float32 (no full-size temporary), with
    ``scale = sqrt(1 - beta2_power) / (1 - beta1_power)`` and ``eps' = eps * sqrt(1 - beta2_power)`` (the
    bias-corrected update ``m_hat / (sqrt(v_hat) + eps)`` of ``nn.Adam``) or 1 and ``eps`` without beta powers
    (``nn.AdamWeightDecay``).
    """

    rows: dict[str, list[RowKey]]
    specs: dict[str, StatsSpec]
    m: list[Tensor]
    v: list[Tensor]
    params: list[Tensor]
    eps: Tensor | float
    beta_powers: tuple[Tensor, Tensor] | None
    precursors: HostPrecursors | None = None

    def __post_init__(self) -> None:
        self.keys = [key for family in _ADAM_FAMILIES for key in self.rows.get(family, [])]

    def measure(self) -> tuple[npt.NDArray[np.float64], dict[str, float]]:
        scale, eps, bias2 = 1.0, host_scalar(self.eps) if isinstance(self.eps, Tensor) else float(self.eps), 1.0
        if self.beta_powers is not None:
            bias2 = 1.0 - host_scalar(self.beta_powers[1])
            root_bias2 = float(np.sqrt(bias2))
            scale, eps = root_bias2 / (1.0 - host_scalar(self.beta_powers[0])), eps * root_bias2
        extra = self.precursors
        lr = host_scalar(extra.lr) if extra is not None and extra.lr is not None else float("nan")
        decay = host_scalar(extra.decay) if extra is not None and extra.decay is not None else 0.0
        raw_eps = host_scalar(self.eps) if isinstance(self.eps, Tensor) else float(self.eps)
        count = len(self.m)
        parts = {family: np.zeros((count, PARTIAL_SLOTS)) for family in self.rows}
        scratch = np.zeros(PARTIAL_SLOTS)
        state_spec = self.specs.get("exp_avg") or self.specs.get("exp_avg_sq")
        together = state_spec is not None and all(self.specs.get(f, state_spec) == state_spec
                                                  for f in ("exp_avg", "exp_avg_sq"))
        derived = "update" in self.rows or "ratio" in self.rows or extra is not None
        precursor = np.zeros((2, PARTIAL_SLOTS))
        for i in range(count):
            m, v = host_view(self.m[i]), host_view(self.v[i])
            if derived:  # one chunked pass over m, v (the parameter, the gradient): update, ratio, moments, precursors
                p = host_view(self.params[i]) if "ratio" in self.rows or extra is not None else None
                adam_partial_into(m, v, p, scale, eps, self.specs.get("update"), self.specs.get("ratio"),
                                  parts["update"][i] if "update" in parts else scratch,
                                  parts["ratio"][i] if "ratio" in parts else scratch,
                                  state_spec if together else None,
                                  parts["exp_avg"][i] if "exp_avg" in parts else scratch.copy(),
                                  parts["exp_avg_sq"][i] if "exp_avg_sq" in parts else scratch.copy(),
                                  grad=self._taken(i, m, v, scale, raw_eps, lr, decay) if extra is not None else None,
                                  lr=lr, bias2=bias2, precursor_out=precursor if extra is not None else None)
                if extra is not None:
                    parts[PRECURSORS][i], parts[PRECURSORS_TAIL][i] = precursor
                    precursor[:] = 0.0
            if not (derived and together):
                for family, tensor in (("exp_avg", m), ("exp_avg_sq", v)):
                    if family in parts:
                        partial_into(tensor, self.specs[family], parts[family][i])
        ordered = [parts[family] for family in _ADAM_FAMILIES if family in parts]
        return np.concatenate(ordered) if ordered else np.empty((0, PARTIAL_SLOTS)), {}

    def _taken(self, i: int, m: torch.Tensor, v: torch.Tensor, scale: float, eps: float, lr: float,
               decay: float) -> torch.Tensor:
        """The gradient parameter ``i``'s moments took: the one handed to the optimizer, plus ``nn.Adam``'s coupled
        decay ``decay * p_before``, ``p_before = p + lr * scale * m / (sqrt(v) + eps)`` (``nn.Adam``'s own step,
        which adds ``eps`` before the bias correction; a float32 temporary of the parameter's size)."""
        assert self.precursors is not None
        grad = host_view(self.precursors.grads[i])
        if not (decay and self.precursors.decayed[i]):
            return grad
        step = m.float() / (v.float().sqrt() + eps) * (lr * scale)
        return grad.float() + decay * (host_view(self.params[i]).float() + step)


@dataclass
class Deferred:
    """What :class:`MindSporeStats` returns for a tensor measured on the host: its copy and the slots to fill.
    ``MindSporeStepBuffer.add`` turns it into a :class:`HostRows` entry."""

    tensor: Tensor
    spec: StatsSpec


class MindSporeStats:
    """``StepContext.stats_fn`` of a MindSpore attachment: device partials (:func:`.stats.partial_stats`), or on
    the CPU a copy of the tensor to be measured on the host (:class:`Deferred`), while the step's copies stay
    under ``limit_bytes``.

    Args:
        ctx: the monitor's step context (its buffer counts the bytes of the step's copies).
        host: MindSpore runs on the CPU.
        limit_bytes: the most bytes of copies one step keeps.
    """

    def __init__(self, ctx: StepContext, host: bool, limit_bytes: int) -> None:
        self.ctx, self.host, self.limit_bytes = ctx, host, limit_bytes

    def __call__(self, tensor: Tensor, spec: StatsSpec) -> Tensor | Deferred:
        dtype, numel = tensor_meta(tensor)  # a tensor handed to a hook: already inferred, no wait
        if self.host and dtype in HOST_DTYPES and numel:
            buffer: Any = self.ctx.buffer  # a MindSporeStepBuffer (attach sets the factory)
            size = numel * _ITEM_BYTES[dtype]
            if getattr(buffer, "host_bytes", self.limit_bytes) + size <= self.limit_bytes:
                buffer.host_bytes += size
                # The value now: a later in-place write (which MindSpore does not count) cannot change the row.
                return Deferred(mint.mul(tensor, constants.scalar(1.0, dtype)), spec)
        return partial_stats(tensor, spec)


_ITEM_BYTES = {ms.float16: 2, ms.float32: 4, ms.float64: 8}


def host_measurable(metas: Sequence[tuple[Any, int]]) -> bool:
    """Whether every tensor of these ``(dtype, numel)`` can be measured on the host."""
    return all(dtype in HOST_DTYPES for dtype, _ in metas)
