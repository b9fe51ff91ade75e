"""The process group of a DeepSpeed job that trainmon combines a parameter's pieces over."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmon.base.types import DeepSpeedParameter
    from trainmon.integrations.base import AttachOptions

__all__ = ["partition_group"]


def partition_group(engine: Any, params: list[tuple[str, DeepSpeedParameter, int]], options: AttachOptions) -> Any:
    """The group the ZeRO partitions are spread over: ZeRO-3's ``ds_process_group``, else the data-parallel group."""
    if options.dp_group is not None:
        return options.dp_group
    groups = {id(p.ds_process_group): p.ds_process_group for _, p, _ in params if hasattr(p, "ds_process_group")}
    if len(groups) == 1:
        return next(iter(groups.values()))
    return getattr(engine, "data_parallel_group", None)
