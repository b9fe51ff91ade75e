"""The one home of rank and size-of-group questions (torch.distributed, and MindSpore's communication).

Every function answers for a run without a process group too (one process: rank 0 of 1), so callers
never test ``dist.is_initialized()`` themselves. The frameworks are imported inside the functions:
importing this module imports neither.

- :func:`layout` is ``(rank in the group, group size)``; ``group`` None is torch's default group, or
  with ``none_is_world=False`` no group at all (Megatron's tensor- or pipeline-parallel group when model
  parallelism is not set up: ``(0, 1)``).
- :func:`global_rank`, :func:`world_size`, :func:`members` (the global ranks of a group).
- :func:`lowest_selected` / :func:`is_lowest_selected`: the one rule for which rank of a group writes
  rows combined over the group (the lowest global rank that ``config.ranks`` selects).
- :func:`all_gather_stacked`: every rank's table of a group, stacked (the collective that combines
  shard statistics, in DeepSpeed, FSDP2 and Megatron-Core alike).
- :func:`each_rank`: one integer of every process (at ``attach``: who writes the rows of each data-parallel group).
- :func:`mindspore_layout`: ``(rank, world size)`` from ``mindspore.communication``.

Example:
    >>> layout()        # no process group in this process
    (0, 1)
    >>> lowest_selected(None, [1, 2]) is None, is_lowest_selected(None, None)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from trainmon.base.types import ProcessGroup


def initialized() -> bool:
    """Whether a torch.distributed process group is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def layout(group: ProcessGroup | None = None, *, none_is_world: bool = True) -> tuple[int, int]:
    """``(rank in group, size of group)``; ``(0, 1)`` without a process group.

    Args:
        group: a torch process group; None is the default (world) group, or no group at all with
            ``none_is_world=False``.
        none_is_world: whether ``group`` None means the world group (torch's convention).
    """
    if not initialized() or (group is None and not none_is_world):
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def group_rank(group: ProcessGroup | None = None, *, none_is_world: bool = True) -> int:
    """This process's rank in ``group``; 0 without a process group (see :func:`layout`)."""
    return layout(group, none_is_world=none_is_world)[0]


def group_size(group: ProcessGroup | None = None, *, none_is_world: bool = True) -> int:
    """The number of ranks in ``group``; 1 without a process group (see :func:`layout`)."""
    return layout(group, none_is_world=none_is_world)[1]


def global_rank() -> int:
    """This process's global rank; 0 without a process group."""
    return layout()[0]


def world_size() -> int:
    """The number of processes of the job; 1 without a process group."""
    return layout()[1]


def members(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group`` (None: the world group), in group-rank order; ``[0]`` without a
    process group."""
    if not initialized():
        return [0]
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def lowest_selected(group: ProcessGroup | None, ranks: Sequence[int] | None) -> int | None:
    """The lowest global rank of ``group`` that ``ranks`` selects (None: no member is selected).

    ``ranks`` None selects every rank. Without an initialised process group: 0 when rank 0 is selected.
    """
    selected = [member for member in members(group) if ranks is None or member in ranks]
    return min(selected) if selected else None


def is_lowest_selected(group: ProcessGroup | None, ranks: Sequence[int] | None) -> bool:
    """Whether this process is the lowest global rank of ``group`` that ``ranks`` selects: the rank that
    writes rows combined over the group (when ``ranks`` selects no member of the group, none does)."""
    return lowest_selected(group, ranks) == global_rank()


def each_rank(value: int) -> list[int]:
    """Every process's ``value``, by global rank: one ``all_gather_object`` over the world group (at ``attach``,
    never in a step; every rank must call it). ``[value]`` without a process group."""
    if not initialized():
        return [value]
    import torch.distributed as dist

    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, int(value))
    return [int(v) for v in values]  # type: ignore[call-overload]


def all_gather_stacked(table: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    """``[size, *table.shape]``: ``table`` of every rank of ``group`` (of ``size`` ranks), in group-rank
    order, by one all-gather into one tensor (the caller's collective of the step; no host sync)."""
    import torch.distributed as dist

    out = table.new_empty((size * table.shape[0], *table.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name since torch 2.13
    gather(out, table.contiguous(), group=group)
    return out.view(size, *table.shape)


def mindspore_layout() -> tuple[int, int]:
    """``(rank, world_size)`` from ``mindspore.communication`` once ``init()`` ran, else ``(0, 1)``."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if GlobalComm.INITED:
        return get_rank(), get_group_size()
    return 0, 1
