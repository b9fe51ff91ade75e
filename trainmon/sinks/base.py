"""The sink protocol and :class:`SinkWriter`, which runs each sink on its own output thread.

Each sink (and a queue of one-off write jobs) gets its own :class:`~trainmon.base.threads.OutputThread`
(its queue, flush policy and crash loss are described there): a slow sink cannot hold up another one, a
failing sink warns once and is disabled, and :meth:`SinkWriter.close` waits at most a bounded time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from trainmon.base.records import StepRecord
from trainmon.base.safe_io import write_json
from trainmon.base.threads import CLOSE_TIMEOUT, OutputThread

if TYPE_CHECKING:
    from pathlib import Path

logger = logging.getLogger("trainmon")


class Sink(Protocol):
    """Writes step records somewhere. Sinks never run anomaly logic."""

    name: str

    def write(self, record: StepRecord) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _run_job(job: Callable[[], None]) -> None:
    job()


class SinkWriter:
    """Runs each sink on its own :class:`OutputThread`, plus one for one-off write jobs.

    A slow sink cannot make another drop rows, a sink that raises is disabled with one warning, and
    :meth:`close` is bounded. Per-sink drop counts are reported at close (a warning per output that
    lost records) and written to ``stats_path`` when given.

    Args:
        sinks: the sinks of this rank.
        flush_seconds: written rows stay unflushed at most this long (flushed at once when idle).
        max_pending: records queued per sink before new ones are dropped (with one warning)
            instead of waiting for a slow disk.
        close_timeout: the longest :meth:`close` waits, over all outputs together.
        stats_path: where to write ``writer_stats.json`` at close (None: nowhere).
        root: the directory under which ``stats_path`` is written without following symlinks.
    """

    def __init__(self, sinks: Sequence[Sink], flush_seconds: float = 2.0, max_pending: int = 64, *,
                 close_timeout: float = CLOSE_TIMEOUT, stats_path: Path | None = None,
                 root: Path | None = None) -> None:
        self.sinks = list(sinks)
        self.flush_seconds = flush_seconds
        self._max_pending = max_pending
        self._close_timeout = close_timeout
        self._stats_path, self._root = stats_path, root
        self._outputs = [self._start(sink) for sink in self.sinks]
        self._jobs: OutputThread | None = None
        self._closed = False

    def _start(self, sink: Sink) -> OutputThread:
        # Looked up at each call, not bound once: a sink may replace its methods (tests do, to play a full disk).
        # ``idle``: a sink that keeps rows in memory between files (Parquet) writes them once training pauses.
        idle = (lambda: sink.idle()) if callable(getattr(sink, "idle", None)) else None  # type: ignore[attr-defined]
        return OutputThread(sink.name, lambda record: sink.write(record), lambda: sink.flush(), lambda: sink.close(),
                            flush_seconds=self.flush_seconds, max_pending=self._max_pending,
                            close_timeout=self._close_timeout, idle=idle)

    def submit(self, item: StepRecord | Callable[[], None]) -> None:
        """Queue a record for every sink (or a one-off write job). Never blocks, never raises."""
        if self._closed:
            return
        if isinstance(item, StepRecord):
            for output in self._outputs:
                output.submit(item)
            return
        if self._jobs is None:  # started on the first job: most runs never have one
            self._jobs = OutputThread("jobs", _run_job, flush_seconds=self.flush_seconds,
                                      max_pending=self._max_pending, disable_on_error=False,
                                      close_timeout=self._close_timeout)
        self._jobs.submit(item)

    def wait(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait until everything submitted so far is written and flushed; False after ``timeout``."""
        deadline = time.monotonic() + timeout
        outputs = self._outputs + ([self._jobs] if self._jobs else [])
        return all([output.wait(max(0.0, deadline - time.monotonic())) for output in outputs])

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-output counts (``submitted``, ``written``, ``dropped``, ...)."""
        outputs = self._outputs + ([self._jobs] if self._jobs else [])
        return {output.name: output.stats.as_dict() for output in outputs}

    def close(self) -> None:
        """Write what is queued, flush and close the sinks within ``close_timeout``; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            deadline = time.monotonic() + self._close_timeout
            for output in self._outputs:
                output.close(deadline)
            if self._stats_path is not None:
                self.submit_stats()
            if self._jobs is not None:
                self._jobs.close(deadline)
            for output in self._outputs + ([self._jobs] if self._jobs else []):
                output.report()
        except Exception:  # closing the outputs must never raise into the user's code
            logger.exception("trainmon: closing the outputs failed")

    def submit_stats(self) -> None:
        """Queue ``writer_stats.json`` (the per-output counts) as the last write job."""
        counts, path, root = self.stats(), self._stats_path, self._root
        assert path is not None, "submit_stats() needs the stats_path given at construction"
        if self._jobs is None:
            self._jobs = OutputThread("jobs", _run_job, flush_seconds=self.flush_seconds, disable_on_error=False,
                                      close_timeout=self._close_timeout)
        self._jobs.submit(lambda: write_json(path, counts, root=root))
