"""The process groups of a Megatron-Core job as trainmon uses them: the tensor- and pipeline-parallel groups, the
data-parallel group a distributed optimizer's shards are combined over, the rows written once per data-parallel
group, and the group whose ranks hold the pieces of a parameter."""

from __future__ import annotations

import logging
from typing import Any

from trainmon.base import process_groups
from trainmon.integrations.base import REPLICATED_FAMILIES, AttachOptions, Replicated
from trainmon.integrations.megatron.collect import GroupLayout, MainParam

__all__ = ["check_dp_group", "model_parallel_groups", "probe_group", "replicated_families"]

logger = logging.getLogger("trainmon")


def model_parallel_groups(options: AttachOptions) -> tuple[Any, Any]:
    """``(tp_group, pp_group)``: explicit ones first, else ``parallel_state``'s, else None.

    No data-parallel group is returned: nothing is combined over a DP group except the shards of
    the distributed optimizer, and those over the optimizer's own group (see :func:`check_dp_group`).
    """
    from megatron.core import parallel_state as ps

    tp, pp = options.tp_group, options.pp_group
    if ps.model_parallel_is_initialized():
        tp = tp if tp is not None else ps.get_tensor_model_parallel_group()
        pp = pp if pp is not None else ps.get_pipeline_model_parallel_group()
    return tp, pp


def check_dp_group(dp_group: Any, mains: dict[int, MainParam]) -> bool:
    """Warn once when an explicit ``dp_group`` holds other ranks than the distributed optimizer's group.

    The shards of a ``DistributedOptimizer`` live on the ranks of its ``data_parallel_group``, so
    that is the group their statistics are combined over, whatever ``dp_group`` says. Without a
    distributed optimizer nothing is combined over a data-parallel group (reduced gradients and
    optimizer states are replicated; ``grad_unreduced`` is this rank's own): ``dp_group`` only names the ranks
    whose rows are written once when ``parallel_state`` is not initialised (:func:`replicated_families`).

    Returns:
        True when the warning was logged.
    """
    if dp_group is None or not process_groups.initialized():
        return False
    wanted = process_groups.members(dp_group)
    groups = {id(main.dp_group): main.dp_group for main in mains.values() if main.sharded}
    for group in groups.values():
        used = process_groups.members(group)
        if used != wanted:
            logger.warning("trainmon: dp_group passed to attach (ranks %s) differs from the distributed "
                           "optimizer's data_parallel_group (ranks %s); its shards are combined over the "
                           "optimizer's group", wanted, used)
            return True
    return False


def replicated_families(mains: dict[int, MainParam], options: AttachOptions) -> Replicated | None:
    """The rows that are the same on every rank of the data-parallel group, or None.

    The gradients are averaged over the data-parallel ranks (with context parallelism: over those of
    ``parallel_state``'s data-parallel group with context parallelism), which hold the same parameters: what the
    optimizer steps with, its parameters and states are the same on each (after the tensor-parallel combination,
    a distributed optimizer's shards after their combination over its ``data_parallel_group``). Not so under
    expert parallelism (expert parameters are averaged over the expert data-parallel ranks only, and hold other
    experts on each data-parallel rank), nor when the distributed optimizers use several groups: then every rank
    writes its own rows.
    """
    from megatron.core import parallel_state as ps

    # decided alike on every rank (the caller's collective at attach depends on it): from the job's layout, not
    # from the parameters of this pipeline stage
    initialized = ps.model_parallel_is_initialized()
    if not mains or (initialized and ps.get_expert_model_parallel_world_size() > 1):
        return None
    groups = {id(m.dp_group): m.dp_group for m in mains.values() if m.sharded}
    if len(groups) > 1:
        return None
    if groups:
        group = next(iter(groups.values()))
    else:
        group = ps.get_data_parallel_group(with_context_parallel=True) if initialized else options.dp_group
        if group is None:
            return None  # no data-parallel group known: nothing is assumed
    if process_groups.group_size(group, none_is_world=False) == 1:
        return None
    return Replicated(tuple(f for f in REPLICATED_FAMILIES if f != "momentum"), group)


def probe_group(mains: dict[int, MainParam], layout: GroupLayout, user: str = "grad_probe") -> tuple[bool, Any]:
    """``(sharded, group)``: the ranks whose pieces make up a parameter (TP partitions, distributed-optimizer
    ranges); ``(False, None)`` when every rank holds whole parameters (replicated: each rank writes its own).
    ``user`` names the feature in the errors."""
    dp_groups = {id(m.dp_group): m.dp_group for m in mains.values()
                 if m.sharded and process_groups.group_size(m.dp_group, none_is_world=False) > 1}
    if len(dp_groups) > 1:
        raise ValueError(f"{user}: the distributed optimizers use different data-parallel groups")
    dp_group = next(iter(dp_groups.values()), None)
    if dp_group is None:
        return layout.tp_size > 1, layout.tp_group
    if layout.tp_size == 1:
        return True, dp_group
    from megatron.core import parallel_state as ps

    # TP partitions cut by distributed-optimizer ranges: the group of both (one gather over it)
    wanted = sorted({r for g in (layout.tp_group, dp_group) for r in process_groups.members(g)})
    for with_cp in (False, True):
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=with_cp) if \
            ps.model_parallel_is_initialized() else None
        if group is not None and sorted(process_groups.members(group)) == wanted:
            return True, group
    raise ValueError(f"{user}: no process group holds exactly the tensor- and data-parallel ranks of the "
                     "distributed optimizer (parallel_state's tensor_and_data_parallel group differs)")
