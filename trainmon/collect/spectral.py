"""Spectral norm and stable rank of weight matrices (family ``weight_features``), by power iteration on the device.

At the end of each collected step (:meth:`WeightFeatures.before_transfer`, after the optimizer step), for every matrix
``W``: ``iterations`` steps of ``v <- W^T W v / ||W^T W v||`` from the previous collected step's ``v`` (a random unit
vector, seeded by the matrix's name, the first time), then ``spectral_norm = sqrt(||W^T W v||)`` for the last unit
``v`` (a lower bound of ``sigma_1`` that converges to it, tighter than ``||W v||``) and ``stable_rank =
||W||_F^2 / spectral_norm^2`` (0 for a zero matrix). Everything stays on the device: no host sync.

A matrix split over ranks (Megatron-Core's tensor-parallel partitions, FSDP2's ``Shard(d)``) is measured exactly:
oriented so that its rows are split (``A = W`` for a split of dim 0, ``W^T`` for dim 1), ``A^T A v`` is the sum over
ranks of ``A_i^T (A_i v)`` with ``v`` the same on every rank, so each iteration adds the local products of every split
matrix into one flat buffer and all-reduces it over the group (also the squared Frobenius norms, in the first): one
collective per iteration, every rank of the group in it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.records import RowKey
from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.collect.stats_base import vector_norm

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext

FAMILY = "weight_features"
CHUNK_BYTES = 64 << 20
"""A low-precision matrix is read in float32 in row blocks of at most this many bytes (its float32 copy, a block at a
time)."""


@dataclass(frozen=True)
class Matrix:
    """One weight matrix and where its elements live.

    Attributes:
        name: the parameter's row name.
        param: the parameter (an FSDP2 ``DTensor``: its local shard is read).
        vpp_stage: its virtual-pipeline chunk.
        split_dim: the dimension split over ``group``'s ranks (None: this rank holds it whole).
        group: the process group of the split (None with ``split_dim`` None).
    """

    name: str
    param: torch.Tensor
    vpp_stage: int = 0
    split_dim: int | None = None
    group: Any = None


def oriented(weight: torch.Tensor, split_dim: int | None) -> torch.Tensor:
    """``weight`` as a 2-D matrix whose rows are split over ranks (``W``, or ``W^T`` when dim 1 is split)."""
    local: torch.Tensor = weight.to_local() if hasattr(weight, "to_local") else weight
    local = local.detach()
    if local.dim() != 2:
        local = local.reshape(local.shape[0], -1)
    return local.t() if split_dim == 1 else local


def gram_product(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``matrix^T (matrix vector)`` in float32 (a low-precision matrix converted a block of rows at a time)."""
    if matrix.dtype in (torch.float32, torch.float64):
        return matrix.t().float() @ (matrix @ vector.to(matrix.dtype)).float()
    rows = max(1, CHUNK_BYTES // max(1, 4 * matrix.shape[1]))
    out = torch.zeros_like(vector)
    for start in range(0, matrix.shape[0], rows):
        block = matrix[start:start + rows].float()
        out += block.t() @ (block @ vector)
    return out


def squared_norm(matrix: torch.Tensor) -> torch.Tensor:
    """``||matrix||_F^2`` in float32 (a 0-d device tensor)."""
    return vector_norm(matrix, dtype=torch.float32).square()


class WeightFeatures(HookedCollector):
    """Family ``weight_features`` for ``matrices`` (see the module docstring); no hook, only the end of the step.

    Args:
        ctx: the monitor's step context.
        matrices: the matrices; those split over ranks are all-reduced together, per group.
        iterations: power iterations per collected step.
        registry: the attachment's hook registry (none is added).
        all_reduce: ``all_reduce(tensor, group)`` (sum, in place); None: ``torch.distributed.all_reduce``.
    """

    PART = "weight_features"

    def __init__(self, ctx: StepContext, matrices: list[Matrix], iterations: int, registry: HookRegistry,
                 all_reduce: Callable[[torch.Tensor, Any], None] | None = None) -> None:
        super().__init__(ctx, registry)
        self.matrices = matrices
        self.iterations = iterations
        self._all_reduce = all_reduce
        self._vectors: dict[str, torch.Tensor] = {}

    @property
    def collective(self) -> bool:
        """Whether a matrix is split over ranks (then every rank of its group must collect the same steps)."""
        return any(m.split_dim is not None for m in self.matrices)

    def before_transfer(self) -> None:
        if FAMILY not in self.ctx.specs or not self.ctx.collecting or not self.matrices:
            return
        with torch.no_grad():
            sigma, stable = self.measure()
        block = F.pad(torch.stack([sigma, stable], dim=1), (0, PARTIAL_SLOTS - 2))
        buffer = self.ctx.buffer
        first = buffer.reserve_orders(len(self.matrices)) if hasattr(buffer, "reserve_orders") else 0
        keys = [RowKey(FAMILY, m.name, 0, m.vpp_stage, first + i) for i, m in enumerate(self.matrices)]
        add_block = getattr(buffer, "add_block", None)
        if add_block is not None:
            add_block(keys, block.reshape(-1))
        else:
            for i, key in enumerate(keys):
                buffer.add(key, block[i])

    def measure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(spectral norms, stable ranks)`` of every matrix, in order (float32 device tensors, no sync)."""
        mats = [oriented(m.param, m.split_dim) for m in self.matrices]
        vectors = [self._vector(m, a) for m, a in zip(self.matrices, mats)]
        frobenius = [squared_norm(a) for a in mats]
        split: dict[int, list[int]] = {}
        for i, m in enumerate(self.matrices):
            if m.split_dim is not None:
                split.setdefault(id(m.group), []).append(i)
        products: list[torch.Tensor] = []
        for iteration in range(self.iterations):
            products = [gram_product(a, v) for a, v in zip(mats, vectors)]
            for indices in split.values():
                extra = [frobenius[i].reshape(1) for i in indices] if iteration == 0 else []
                flat = torch.cat([products[i] for i in indices] + extra)
                self._reduce(flat, self.matrices[indices[0]].group)  # one collective per group and iteration
                parts = torch.split_with_sizes(flat, [len(products[i]) for i in indices] + [1] * len(extra))
                for j, i in enumerate(indices):
                    products[i] = parts[j]
                    if extra:
                        frobenius[i] = parts[len(indices) + j].reshape(())
            for i, product in enumerate(products):
                size = vector_norm(product)
                vectors[i] = torch.where(size > 0, product / size.clamp_min(torch.finfo(torch.float32).tiny),
                                         vectors[i])
        for m, v in zip(self.matrices, vectors):
            self._vectors[m.name] = v
        squares = torch.stack([vector_norm(p) for p in products])  # ||A^T A v|| ~ sigma_1^2
        sigma = squares.sqrt()
        frob = torch.stack(frobenius)
        stable = torch.where(squares > 0, frob / squares.clamp_min(torch.finfo(torch.float32).tiny),
                             torch.zeros_like(frob))
        return sigma, stable

    def _vector(self, matrix: Matrix, local: torch.Tensor) -> torch.Tensor:
        """The matrix's unit vector from the previous collected step, or a new one (seeded by its name, made on the
        device: the same on every rank of a split)."""
        vector = self._vectors.get(matrix.name)
        size = local.shape[1]
        if vector is not None and vector.shape[0] == size and vector.device == local.device:
            return vector
        generator = torch.Generator(device=local.device)
        generator.manual_seed(zlib.crc32(matrix.name.encode()))
        fresh: torch.Tensor = torch.randn(size, generator=generator, device=local.device, dtype=torch.float32)
        return fresh / vector_norm(fresh)

    def _reduce(self, tensor: torch.Tensor, group: Any) -> None:
        if self._all_reduce is not None:
            self._all_reduce(tensor, group)
            return
        import torch.distributed as dist

        dist.all_reduce(tensor, group=group)  # sum; queued on the device, no host sync
