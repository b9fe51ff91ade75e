"""Row families written once per data-parallel group, and where a reader finds each rank's rows (framework-free).

Under data parallelism some families are the same on every rank of a data-parallel group: ``grad_reduced``,
``param`` and the optimizer states of torch DDP and Megatron-Core, the combined shard rows of FSDP2, DeepSpeed and
Megatron's distributed optimizer. With ``write_replicated_once`` (the default) only the group's lowest selected
rank writes them, in every sink. ``run.json`` says so under ``"replicated"`` (a resumed run's
``run.resume{n}.json`` for the steps from its first one)::

    "replicated": {"from_step": 0, "families": ["grad_reduced", "param", "exp_avg", ...],
                   "groups": [[0, 1], [2, 3]], "writer": {"0": 0, "1": 0, "2": 2, "3": 2}}

``groups`` lists the groups of two or more writing ranks (their first rank writes for all of them) and ``writer``
maps each of their ranks to the rank whose rows it reads. A run without such groups has ``"families": []``.
:func:`replica_map` turns the run's files into ``(family, rank, writer, first_step, last_step)`` rows: the
``replicas`` table of :func:`trainmon.tools.store.open_run`, which joins it to the stored rows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.base.inputs import INT64_MAX, open_regular

REPLICATED = "replicated"
"""The key of ``run.json`` that describes the layout."""
_RUN_FILE = re.compile(r"^run(?:\.resume(\d+))?\.json$")
_MAX_RUN_JSON = 64 << 20
"""The largest ``run.json`` read (4,096 ranks make ~100 kB)."""


class ReplicaLayoutError(ValueError):
    """A ``run.json`` whose ``"replicated"`` entry cannot be read; the message names the file."""


@dataclass(frozen=True)
class ReplicaLayout:
    """Which rows are written once per data-parallel group, from one attach on.

    Attributes:
        from_step: the first step of the attach that wrote it (a resumed run's layout applies from its first step).
        families: the families written once per group (empty: every rank writes its own rows).
        writer: ``rank -> the rank whose rows it reads``, for the ranks of groups of two or more.

    Example:
        >>> layout = ReplicaLayout.of_writers(0, ["grad_reduced"], [0, 0, 2, 2])
        >>> layout.groups(), layout.as_json()["writer"]
        ([[0, 1], [2, 3]], {'0': 0, '1': 0, '2': 2, '3': 2})
    """

    from_step: int = 0
    families: tuple[str, ...] = ()
    writer: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def of_writers(cls, from_step: int, families: Sequence[str], writers: Sequence[int]) -> ReplicaLayout:
        """The layout from every rank's writer (``writers[rank]``; a negative value: the rank writes nothing).

        Groups of one rank are left out (the rank writes its own rows); without a group of two or more the
        layout has no families.
        """
        members: dict[int, list[int]] = {}
        for rank, writer in enumerate(writers):
            if writer >= 0:
                members.setdefault(writer, []).append(rank)
        writer_of = {rank: lead for lead, ranks in members.items() if len(ranks) > 1 for rank in ranks}
        return cls(from_step, tuple(families) if writer_of else (), dict(sorted(writer_of.items())) if families else {})

    def groups(self) -> list[list[int]]:
        """The groups, each sorted, in the order of their writers."""
        members: dict[int, list[int]] = {}
        for rank, writer in sorted(self.writer.items()):
            members.setdefault(writer, []).append(rank)
        return [members[lead] for lead in sorted(members)]

    def writes(self, rank: int, family: str) -> bool:
        """Whether ``rank`` writes its rows of ``family`` under this layout (itself, or as its group's writer)."""
        return family not in self.families or self.writer.get(rank, rank) == rank

    def as_json(self) -> dict[str, Any]:
        """The ``"replicated"`` entry of ``run.json``."""
        return {"from_step": self.from_step, "families": list(self.families), "groups": self.groups(),
                "writer": {str(rank): writer for rank, writer in self.writer.items()}}

    @classmethod
    def from_json(cls, entry: Any, where: str) -> ReplicaLayout:
        """Read :meth:`as_json`'s dict back.

        Raises:
            ReplicaLayoutError: ``entry`` is not such a dict (``where`` names the file in the message).
        """
        try:
            if not isinstance(entry, dict):
                raise TypeError("not an object")
            from_step = _count(entry.get("from_step", 0), "from_step")
            families = entry.get("families", [])
            if not (isinstance(families, list) and all(isinstance(f, str) for f in families)):
                raise TypeError("families is not a list of names")
            writers = entry.get("writer", {})
            if not isinstance(writers, dict):
                raise TypeError("writer is not an object")
            writer = {_count(rank, "a rank"): _count(lead, "a writer") for rank, lead in writers.items()}
        except (TypeError, ValueError) as exc:
            raise ReplicaLayoutError(f"{where}: {REPLICATED!r} cannot be read ({exc})") from None
        return cls(from_step, tuple(families) if writer else (), dict(sorted(writer.items())))


def _count(value: Any, what: str) -> int:
    """A non-negative integer from JSON (a rank may be a key: a string of digits)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def run_files(run_dir: Path) -> list[Path]:
    """``run.json`` and the ``run.resume{n}.json`` of resumed attaches, in the order they were written."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = [(int(m.group(1) or 0), name) for name in names if (m := _RUN_FILE.match(name))]
    return [Path(run_dir) / name for _, name in sorted(found)]


def replica_layouts(run_dir: str | os.PathLike[str]) -> list[ReplicaLayout]:
    """The layout of each attach of a run (one per ``run*.json`` that has one), in the order written.

    A ``run.json`` written before trainmon recorded layouts has none: every rank wrote its own rows.

    Raises:
        ReplicaLayoutError: a ``run*.json`` that is not JSON, or whose ``"replicated"`` cannot be read.
    """
    layouts = []
    for path in run_files(Path(run_dir)):
        try:
            with open_regular(path) as handle:
                info = json.loads(handle.read(_MAX_RUN_JSON + 1)[:_MAX_RUN_JSON])
        except (OSError, ValueError) as exc:
            raise ReplicaLayoutError(f"{path}: not a readable run.json ({exc})") from None
        if isinstance(info, dict) and REPLICATED in info:
            layouts.append(ReplicaLayout.from_json(info[REPLICATED], str(path)))
    return layouts


def replica_map(layouts: Iterable[ReplicaLayout]) -> list[tuple[str, int, int, int, int]]:
    """``(family, rank, writer, first_step, last_step)``: where each rank's rows of a family written once per group
    are, for the steps of each layout: from its first step to the step before the first step of any later one.

    Example:
        >>> replica_map([ReplicaLayout.of_writers(0, ["param"], [0, 0]), ReplicaLayout(100)])
        [('param', 0, 0, 0, 99), ('param', 1, 0, 0, 99)]
    """
    ordered = list(layouts)
    rows = []
    for i, layout in enumerate(ordered):
        # a later attach's layout holds from its first step on (one resumed from an earlier checkpoint too)
        last = min((later.from_step for later in ordered[i + 1:]), default=INT64_MAX + 1) - 1
        if last < layout.from_step:
            continue
        rows += [(family, rank, writer, layout.from_step, last)
                 for family in layout.families for rank, writer in layout.writer.items()]
    return rows


def replica_groups(layouts: Iterable[ReplicaLayout]) -> dict[tuple[str, int], list[int]]:
    """``(family, writer) -> the ranks of its group``: whose rows a writer's rows of ``family`` are (the latest
    layout that writes the family once per group), for tools that show each rank's files."""
    groups: dict[tuple[str, int], list[int]] = {}
    for layout in layouts:
        for group in layout.groups():
            for family in layout.families:
                groups[(family, group[0])] = group
    return groups


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``'0-3,6'``.

    Example:
        >>> ranks_text([0, 1, 2, 3, 6, 8, 9])
        '0-3,6,8-9'
    """
    parts: list[str] = []
    for rank in sorted(ranks):
        if parts and rank == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{rank}"
        else:
            parts.append(str(rank))
    return ",".join(parts)


__all__ = ["REPLICATED", "ReplicaLayout", "ReplicaLayoutError", "ranks_text", "replica_groups", "replica_layouts",
           "replica_map", "run_files"]
