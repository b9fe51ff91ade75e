"""The built-in responses to anomaly events: the ``anomaly.actions`` ``log`` (rank-prefixed,
rate-limited) and ``jsonl``.

``callback``, ``raise`` and the hand-offs (``dump``, ``free_benchmark``) are run by the
:class:`~trainmon.anomaly.engine.AnomalyEngine` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from trainmon.anomaly.events import AnomalyEvent, reports_nonfinite
from trainmon.base.safe_io import open_output
from trainmon.base.threads import CLOSE_TIMEOUT, OutputThread

logger = logging.getLogger("trainmon")


class LogAction:
    """Logs the events of a step on the ``trainmon`` logger, prefixed with the rank.

    Rate limits, kept per detector (one entry of ``anomaly.detectors``) so that a rule firing every
    step never hides another's lines: during a run of consecutive steps in which a detector
    fires, only its events of the 1st, 2nd, 4th, 8th, ... such step are logged. A non-finite event
    (the ``nonfinite`` detector, or a NaN/Inf value) is always logged at its step when it names a
    tensor or scalar not logged as non-finite before; its repeats follow the detector's powers of
    two. At most ``limit`` lines per step: non-finite events first, then the others earliest first,
    the rest counted in one summary line. ``anomalies.jsonl`` keeps every event.

    Args:
        rank: global rank, the prefix of every line.
        limit: lines per step (``anomaly.log_limit``).
    """

    def __init__(self, rank: int, limit: int) -> None:
        self.rank = rank
        self.limit = max(1, limit)
        self.streaks: dict[str, int] = {}
        """Consecutive collected steps in which each detector (by its label) fired."""
        self._logged_nonfinite: set[tuple[str, str]] = set()  # (family, name); bounded by the monitored tensors
        self._scalar_labels: set[str] = set()  # detectors that fired on an uncollected step's scalars

    def every_step(self, label: str) -> None:
        """``label`` judges every step, collected or not (the step guard): a step without its events ends its
        streak."""
        self._scalar_labels.add(label)

    def quiet(self, collected: bool = True) -> None:
        """A step without events: ends every detector's streak (a step that was not collected, whose
        record holds only the scalars given to ``step()``, ends the streaks of the detectors that have
        fired on such a step: those that watch these scalars)."""
        self.streaks = {} if collected else {label: n for label, n in self.streaks.items()
                                             if label not in self._scalar_labels}

    def __call__(self, events: list[AnomalyEvent], sources: Sequence[str] | None = None,
                 collected: bool = True) -> None:
        """Log one step's events (earliest first).

        Args:
            events: the step's events, earliest first.
            sources: the label of the detector that made each event (its throttle key); default
                each event's ``detector`` type.
            collected: False for a step that was not collected: a detector of rows saw nothing
                there, so its streak goes on.
        """
        labels = list(sources) if sources is not None else [event.detector for event in events]
        if not collected:
            self._scalar_labels.update(labels)
        # A detector absent from this step's events has ended its streak (if it could have fired).
        kept = {} if collected else {label: n for label, n in self.streaks.items()
                                     if label not in self._scalar_labels}
        self.streaks = {**kept, **{label: self.streaks.get(label, 0) + 1 for label in labels}}
        nonfinite: list[tuple[AnomalyEvent, str]] = []
        others: list[tuple[AnomalyEvent, str]] = []
        for event, label in zip(events, labels):
            streak = self.streaks[label]
            if reports_nonfinite(event.detector, event.value):
                if not streak & (streak - 1) or (event.family, event.name) not in self._logged_nonfinite:
                    nonfinite.append((event, label))
            elif not streak & (streak - 1):  # a power of two
                others.append((event, label))
        due = nonfinite + others
        shown = due[: self.limit if len(due) <= self.limit else self.limit - 1]
        prefix = f"[rank {self.rank}]"
        noted: set[str] = set()
        for event, label in shown:
            text = event.message
            if label not in noted and self.streaks[label] > 1:
                text += (f" ({label}: anomalies in {self.streaks[label]} consecutive steps; "
                         f"logging at powers of two)")
            noted.add(label)
            if reports_nonfinite(event.detector, event.value):
                self._logged_nonfinite.add((event.family, event.name))
            logger.warning("%s %s", prefix, text)
        hidden = len(due) - len(shown)
        if hidden:
            logger.warning("%s ... and %d more anomalies at step %d (see anomalies.jsonl)",
                           prefix, hidden, events[0].step)


class JsonlAction:
    """Appends events to ``anomalies.jsonl`` on its own writer thread; never blocks training.

    The training thread only queues the step's lines (O(1)); the thread opens the file on the
    first event (a run without anomalies leaves no file and starts no thread), appends, and
    flushes as soon as nothing else is queued, so an event is on disk a moment after its step
    (:meth:`flush` waits for it). The file is never truncated: a resumed run keeps the earlier events
    (a line cut short by a crash is ended first). It is opened without following symlinks below
    ``root``. A failing disk is reported once and the lines it could not take are counted at close.

    Args:
        path: ``{run}/rank{R}/anomalies.jsonl``.
        root: the directory below which no symlink is followed (default: the run directory).
        flush_seconds: written lines stay unflushed at most this long while more are queued.
    """

    def __init__(self, path: Path, root: Path | None = None, flush_seconds: float = 2.0) -> None:
        self.path = Path(path)
        self.root = Path(root) if root is not None else self.path.parent.parent
        self._flush_seconds = flush_seconds
        self._file: IO[str] | None = None
        self._output: OutputThread | None = None

    def __call__(self, events: list[AnomalyEvent]) -> None:
        if self._output is None:
            self._output = OutputThread("anomalies.jsonl", self._write, self._flush, self._close,
                                        flush_seconds=self._flush_seconds)
        # Serialised here: events are not touched again once queued, and the thread only writes text.
        self._output.submit("".join(event.to_json() + "\n" for event in events))

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait until every queued event is in the file; False after ``timeout`` seconds."""
        return self._output.wait(timeout) if self._output is not None else True

    def close(self) -> None:
        """Write what is queued and close the file, within a bounded time; idempotent, never raises."""
        if self._output is not None:
            self._output.close()
            self._output.report()

    # ------------------------------------------------------------------ writer thread
    def _write(self, text: str) -> None:
        if self._file is None:
            self._file = _open_append(self.path, self.root)
        self._file.write(text)

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _close(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()


def _open_append(path: Path, root: Path) -> IO[str]:
    """Open a line file for appending; a last line cut short by a crash is ended first."""
    try:
        with open_output(path, "rb", root) as existing:
            cut = existing.seek(0, 2) > 0 and existing.seek(-1, 2) >= 0 and existing.read(1) != b"\n"
    except FileNotFoundError:
        cut = False
    handle = open_output(path, "a", root, newline=None)
    if cut:
        handle.write("\n")
    return handle
