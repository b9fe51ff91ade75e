"""The grad probe on FSDP2 (``fully_shard``, also HSDP): the whole gradient's direction from the local shards.

Each parameter's gradient is a ``DTensor`` with ``Shard(d)`` on the shard mesh dimension: rank ``r`` of
the shard group holds the block ``[offset, offset + length)`` of dimension ``d`` (``torch.chunk``'s
split, as FSDP2 cuts it; empty on the ranks past the last chunk). That block is a
:class:`~trainmon.probe.shards.ShardSpec`, and :class:`~trainmon.probe.sharded.ShardedGradProbe`
does the rest: it measures this rank's block (``to_local()``, a view) in the optimizer's step
pre-hook, and at the end of a collected step ONE ``gather`` over the shard group brings every
rank's partials and packed sign bits (1/32 of the float32 gradient) to the group's writer, which
writes the whole parameters' rows and direction files, as an unsharded run would. No gradient is
gathered. Under HSDP the replicas hold identical reduced gradients: each replica's shard group
writes once, as for the other FSDP families.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from trainmon.base import process_groups
from trainmon.collect.optimizer_parts import optimizer_parts
from trainmon.integrations.fsdp.layout import FSDPLayoutError, ShardGroup, local_shard
from trainmon.probe.shards import ShardSpec

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Shard

    from trainmon.collect.context import StepContext
    from trainmon.collect.hooks import HookRegistry
    from trainmon.config import MonitorConfig
    from trainmon.probe.sharded import ShardedGradProbe


def shard_spec(param: torch.Tensor, shards: ShardGroup) -> ShardSpec:
    """Which block of the whole parameter this rank's shard is (its last placement is ``Shard(d)``,
    checked by :func:`trainmon.integrations.fsdp.layout.shard_group_of`).

    Raises:
        FSDPLayoutError: the local shard is not the block ``torch.chunk`` gives this rank (a layout
            FSDP2 does not make; the probe could not place its bits).
    """
    shape = tuple(param.shape)
    if not hasattr(param, "to_local"):  # unsharded (shard group of one): the whole parameter
        return ShardSpec.flat(shape, 0, param.numel())
    dim = cast("Shard", cast("DTensor", param).placements[-1]).dim  # a DTensor sharded by FSDP2 (checked at attach)
    extent = shape[dim] if shape else 1
    rank = process_groups.group_rank(shards.group, none_is_world=False)
    chunk = -(-extent // shards.size)  # torch.chunk's chunk size
    offset = min(rank * chunk, extent)
    length = min(chunk, extent - offset)
    local = param.to_local()
    if tuple(local.shape) != shape[:dim] + (length,) + shape[dim + 1:]:
        raise FSDPLayoutError(f"parameter shard of shape {tuple(local.shape)} on rank {rank} of its shard group "
                              f"is not rows [{offset}, {offset + length}) of dim {dim} of {shape}: grad_probe "
                              "cannot place its direction bits in the whole parameter")
    return ShardSpec.block(shape, dim, offset, length)


def fsdp_grad_probe(ctx: StepContext, config: MonitorConfig, params: Sequence[tuple[str, torch.nn.Parameter, int]],
                    optimizer: torch.optim.Optimizer | None, registry: HookRegistry,
                    shards: ShardGroup) -> ShardedGradProbe:
    """The grad probe of the sharded ``params`` (every rank of the shard group builds it alike).

    Raises:
        FSDPLayoutError: a shard is not the block FSDP2's ``torch.chunk`` split gives its rank.
    """
    from trainmon.probe.sharded import ShardedGradProbe

    specs = {id(param): shard_spec(param, shards) for _, param, _ in params}
    parts = optimizer_parts(optimizer) if optimizer is not None else []  # the inner optimizers of a container

    def grad_of(param: torch.Tensor) -> torch.Tensor | None:
        grad = param.grad
        return None if grad is None else local_shard(grad)

    def exp_avg_of(param: torch.Tensor) -> torch.Tensor | None:
        state = next((part.state[param] for part in parts if param in part.state), None)
        exp_avg = state.get("exp_avg") if state else None
        return None if exp_avg is None else local_shard(exp_avg)

    return ShardedGradProbe(ctx, params, config, registry, optimizer, grad_of=grad_of,
                            spec_of=lambda param: specs[id(param)], exp_avg_of=exp_avg_of, group=shards.group)

