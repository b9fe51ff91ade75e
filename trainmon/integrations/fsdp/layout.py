"""FSDP2 layouts: which models are FSDP, and the one shard group the parameters are sharded over.

Used by the FSDP integration (:mod:`trainmon.integrations.fsdp`), its grad probe
(:mod:`trainmon.integrations.fsdp.probe`) and the anomaly actions' framework choice; imports nothing
of ``torch.distributed`` until a model is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from trainmon.base import process_groups


class FSDPLayoutError(ValueError):
    """The model's sharding is not one trainmon can measure exactly (raised at ``attach``)."""


def contains_fsdp(model: Any) -> bool:
    """Whether ``model`` is, or contains, an FSDP2 module (``fully_shard``) or an FSDP1 wrapper.

    Imports nothing: when ``torch.distributed.fsdp`` was never imported, no FSDP module exists.
    """
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(model, torch.nn.Module):
        return False
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if k)
    return any(isinstance(module, kinds) for module in model.modules())


@dataclass(frozen=True)
class ShardGroup:
    """The process group the parameters are sharded over (the shard mesh dimension).

    Attributes:
        group: the shard dimension's process group.
        size: its size; 1 means every rank holds whole tensors (an HSDP mesh ``N x 1``).
        description: the layout in words, for messages.
    """

    group: Any
    size: int
    description: str


def shard_group_of(named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> ShardGroup:
    """Check every parameter's layout and return the one shard group they share.

    Supported: a DTensor on a 1-D mesh with ``Shard(d)`` (FSDP), or on a 2-D mesh with
    ``(Replicate(), Shard(d))`` (HSDP: replicate dimension first, as FSDP2 builds it).

    Raises:
        FSDPLayoutError: a parameter is not a DTensor (FSDP does not manage it), or has another
            layout (tensor parallelism, ``_StridedShard``, ``Partial``, ...), or the parameters
            are sharded over different process groups.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    found: dict[tuple[int, ...], tuple[str, Any, str]] = {}
    for name, param in named_params:
        if not isinstance(param, DTensor):
            raise FSDPLayoutError(
                f"parameter {name!r} is a plain tensor in a model sharded with fully_shard: FSDP does not "
                "manage it (outside every fully_shard module, or in ignored_params), so its gradient is "
                "this rank's own and cannot be combined with the shards of the others. Call fully_shard on "
                "the root module too (it manages every remaining parameter); see docs/fsdp.md")
        mesh, placements = param.device_mesh, tuple(param.placements)
        kinds = [type(p) for p in placements]
        if mesh.ndim == 1 and kinds == [Shard]:
            dim, layout = 0, f"FSDP, Shard({cast(Shard, placements[0]).dim})"
        elif mesh.ndim == 2 and kinds == [Replicate, Shard]:
            dim, layout = 1, f"HSDP, (Replicate(), Shard({cast(Shard, placements[1]).dim}))"
        else:
            names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
            raise FSDPLayoutError(
                f"parameter {name!r} has placements {placements} on a {mesh.ndim}-D device mesh{names} of shape "
                f"{tuple(mesh.shape)}: trainmon measures FSDP2 parameters sharded on one mesh dimension "
                "(Shard(d)) or HSDP parameters (Replicate(), Shard(d)); tensor parallelism (a tensor-parallel "
                "mesh dimension), _StridedShard and Partial placements are not supported. Monitor this model "
                "without weight_grads, optimizer_states and params (activations only), or see docs/fsdp.md")
        group = mesh.get_group(dim)
        key = tuple(process_groups.members(group))
        found.setdefault(key, (name, group, layout))
    if not found:
        return ShardGroup(None, 1, "no parameters")
    if len(found) > 1:
        shown = "; ".join(f"{name!r} over ranks {list(ranks)}" for ranks, (name, _, _) in list(found.items())[:3])
        raise FSDPLayoutError(f"the parameters are sharded over different process groups ({shown}): trainmon "
                              "combines the shards of a step with one collective over one shard group")
    ranks, (_, group, layout) = next(iter(found.items()))
    return ShardGroup(group, len(ranks), f"{layout} over ranks {list(ranks)}")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view, no communication); a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()
