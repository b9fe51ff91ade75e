"""Actions on anomalies: a targeted msprobe-style dump and free-benchmark perturbation checks.

Import the submodules directly (``trainmon.actions.dump``, ``trainmon.actions.free_benchmark``):
they need torch, while :mod:`trainmon.actions.naming` is framework-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trainmon.anomaly.events import AnomalyEvent


class HandOffAction(Protocol):
    """An anomaly action that acts on the model over the next steps: the dump and the free benchmark.

    The session calls :meth:`begin_step` when a step starts, :meth:`end_step` when it ends and
    :meth:`close` once; the anomaly engine hands it a step's events (first origin first) through
    :meth:`on_anomaly`; ``monitor.dump()`` and ``monitor.free_benchmark()`` call :meth:`request`.
    """

    def request(self, modules: Iterable[str], steps: Iterable[int] | None = None) -> list[str]:
        """Act on ``modules`` (names, globs, ``re:``) on ``steps`` (default: the next step); the module names."""
        ...

    def on_anomaly(self, events: Iterable[AnomalyEvent]) -> object: ...

    def begin_step(self, step: int) -> None: ...

    def end_step(self) -> object: ...

    def close(self) -> None: ...


if TYPE_CHECKING:  # read by mypy only: each hand-off action satisfies the protocol (never imported at run time)
    from trainmon.actions.dump import TargetedDump
    from trainmon.actions.free_benchmark import FreeBenchmark

    _HAND_OFF_ACTIONS: tuple[type[HandOffAction], ...] = (TargetedDump, FreeBenchmark)
