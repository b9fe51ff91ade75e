"""Rows written once per data-parallel group (``write_replicated_once``): who writes them, what this rank's sinks
get, and the layout ``run.json`` records (its format: :mod:`trainmon.sinks.store_replicas`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainmon.base import process_groups
from trainmon.base.records import StepRecord
from trainmon.sinks.store_replicas import ReplicaLayout

if TYPE_CHECKING:
    from trainmon.config import MonitorConfig
    from trainmon.integrations.base import Attachment


@dataclass(frozen=True)
class ReplicaPlan:
    """This rank's part in the layout.

    Attributes:
        layout: the run's layout from this attach on (every rank's writer), for ``run.json``.
        dropped: the families whose rows this rank computes (its anomaly detectors see them) but its sinks do not
            get: the group's writer writes them. Empty on a writer, and where the collectors themselves add the
            rows on the writer only (FSDP2, DeepSpeed).
    """

    layout: ReplicaLayout
    dropped: frozenset[str] = field(default_factory=frozenset)

    def stored(self, record: StepRecord) -> StepRecord:
        """``record`` as this rank's sinks get it: without the rows of :attr:`dropped` (one pass over the rows on a
        rank that drops some, none elsewhere).

        Example:
            >>> from trainmon.base.records import Row, RowKey
            >>> plan = ReplicaPlan(ReplicaLayout(), frozenset({"param"}))
            >>> rows = [Row(RowKey(f, "w", 0, 0, i), 3, {"norm": 1.0}, False) for i, f in enumerate(("param", "actv"))]
            >>> [row.family for row in plan.stored(StepRecord(3, 1, rows)).rows]
            ['actv']
        """
        if not self.dropped or not record.rows:
            return record
        dropped = self.dropped
        rows = [row for row in record.rows if row.key.family not in dropped]
        if len(rows) == len(record.rows):
            return record
        return StepRecord(record.step, record.rank, rows, record.scalars, record.pp_stage, record.collected)


def plan_replicas(attachment: Attachment, config: MonitorConfig, ranks: Sequence[int] | None, writes: bool,
                  first_step: int) -> ReplicaPlan:
    """Who writes the rows that are the same on every rank of a data-parallel group (at ``attach``).

    The group's lowest rank that ``ranks`` selects writes them (:func:`~trainmon.base.process_groups.lowest_selected`,
    the rule FSDP2 and DeepSpeed follow for their combined rows). Every rank's writer is gathered with one
    collective over the world group, at attach only and only where some family is written once (the integration
    decides that alike on every rank): so the rank that writes ``run.json`` knows every group.

    Args:
        attachment: the integration's attachment (its ``replicated`` families and group).
        config: the monitor config (``write_replicated_once``).
        ranks: the selected ranks that exist (None: every rank).
        writes: whether this rank writes at all (``ranks`` selects it).
        first_step: the first step of this attach.
    """
    replicated = attachment.replicated
    if not config.write_replicated_once or replicated is None or attachment.world_size == 1 \
            or not process_groups.initialized():
        return ReplicaPlan(ReplicaLayout(first_step))
    writer = process_groups.lowest_selected(replicated.group, ranks)
    writers = process_groups.each_rank(writer if writes and writer is not None else -1)  # collective (at attach)
    layout = ReplicaLayout.of_writers(first_step, replicated.families, writers)
    rank = attachment.rank
    writes_own = layout.writer.get(rank, rank) == rank
    return ReplicaPlan(layout, frozenset() if writes_own or replicated.combined else frozenset(layout.families))


__all__ = ["ReplicaPlan", "plan_replicas"]
