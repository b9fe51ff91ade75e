"""The built-in anomaly actions: ``log`` (rank-prefixed, rate-limited) and ``jsonl``.

``callback``, ``raise`` and the hand-offs (``dump``, ``free_benchmark``) are run by the
:class:`~trainmon.anomaly.engine.AnomalyEngine` itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import IO

from trainmon.anomaly.events import AnomalyEvent

logger = logging.getLogger("trainmon")


class LogAction:
    """Logs the events of a step on the ``trainmon`` logger, prefixed with the rank.

    Rate limits: at most ``limit`` lines per step (the first-origin event first, the rest
    counted in one summary line), and during a run of consecutive anomalous steps only the
    1st, 2nd, 4th, 8th, ... such step is logged. ``anomalies.jsonl`` keeps every event.

    Args:
        rank: global rank, the prefix of every line.
        limit: lines per step (``anomaly.log_limit``).
    """

    def __init__(self, rank: int, limit: int) -> None:
        self.rank = rank
        self.limit = max(1, limit)
        self.streak = 0

    def quiet(self) -> None:
        """A collected step without events: ends the current streak."""
        self.streak = 0

    def __call__(self, events: list[AnomalyEvent]) -> None:
        self.streak += 1
        if self.streak & (self.streak - 1):  # not a power of two: suppressed
            return
        prefix = f"[rank {self.rank}]"
        shown = events[: self.limit if len(events) <= self.limit else self.limit - 1]
        for i, event in enumerate(shown):
            text = event.message
            if i == 0 and self.streak > 1:
                text += f" (anomalies in {self.streak} consecutive collected steps; logging at powers of two)"
            logger.warning("%s %s", prefix, text)
        hidden = len(events) - len(shown)
        if hidden:
            logger.warning("%s ... and %d more anomalies at step %d (see anomalies.jsonl)",
                           prefix, hidden, events[0].step)


class JsonlAction:
    """Appends events to ``anomalies.jsonl``: one open handle, append mode, one flush per step.

    The file is opened on the first event (a run without anomalies leaves no file) and never
    truncated, so a resumed run keeps the earlier events.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def __call__(self, events: list[AnomalyEvent]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._file.write("".join(event.to_json() + "\n" for event in events))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
