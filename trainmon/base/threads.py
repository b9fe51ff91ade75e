"""The output thread every writer uses: a bounded queue and a daemon thread per output.

Each output (a sink, ``anomalies.jsonl``, the free-benchmark CSV, a queue of one-off write jobs)
gets its own :class:`OutputThread`: a bounded queue and a daemon thread. The training thread only
ever calls :meth:`OutputThread.submit`, which is O(1) and never blocks: a full queue (a disk slower
than training) drops the item and counts it. A slow output cannot hold up another one, a failing
output warns once and is disabled (or, for jobs, skips that job), and :meth:`OutputThread.close`
waits at most a bounded time. What was dropped is reported per output when it closes.

Flush policy (crash loss): the thread flushes as soon as its queue is empty, and at least every
``flush_seconds`` while it is not. A ``kill -9`` therefore loses at most the item being written and
those still queued: one collected step when the disk keeps up, else at most ``flush_seconds`` of them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("trainmon")

CLOSE_TIMEOUT = 5.0
"""Seconds a close waits for an output to finish writing what is queued (a stuck disk is abandoned)."""


_STOP = object()


class _Marker:
    """Queued by :meth:`OutputThread.wait`: set once everything queued before it is written."""

    def __init__(self) -> None:
        self.done = threading.Event()


@dataclass
class OutputStats:
    """What happened to the items given to one output.

    Attributes:
        submitted: items offered by :meth:`OutputThread.submit`.
        written: items written.
        dropped_slow: dropped because the queue was full (the output was slower than training).
        dropped_failed: not written because the output had failed (or the item's job failed).
        dropped_at_close: still queued when a stuck output was abandoned at close.
        error: the first error, as ``Type: message``.
    """

    submitted: int = 0
    written: int = 0
    dropped_slow: int = 0
    dropped_failed: int = 0
    dropped_at_close: int = 0
    error: str | None = None
    _lost_in_queue: int = field(default=0, repr=False)  # counted by the output's thread

    @property
    def dropped(self) -> int:
        """Every item that was given to the output and is not on disk."""
        return self.dropped_slow + self.dropped_failed + self._lost_in_queue + self.dropped_at_close

    def as_dict(self) -> dict[str, Any]:
        return {"submitted": self.submitted, "written": self.written, "dropped": self.dropped,
                "dropped_slow": self.dropped_slow, "dropped_failed": self.dropped_failed + self._lost_in_queue,
                "dropped_at_close": self.dropped_at_close, "error": self.error}


class OutputThread:
    """One output written by its own daemon thread from a bounded queue.

    Args:
        name: the output's name in warnings (``csv``, ``anomalies.jsonl``, ...); the thread is
            ``trainmon-{name}``.
        write: called on the thread with each item.
        flush: called on the thread when the queue runs empty and at least every ``flush_seconds``.
        close: called once on the thread when it ends (also after a failure).
        flush_seconds: the longest time written items stay unflushed while the queue is busy.
        max_pending: queued items beyond which :meth:`submit` drops new ones.
        disable_on_error: a failing ``write``/``flush`` disables the output (a sink); when false
            only that item is lost (independent write jobs).
        close_timeout: the longest :meth:`close` waits.
        idle: called on the thread each time the queue stayed empty for ``flush_seconds`` (an output that keeps
            written items in memory for a while, the Parquet sink, writes them out then).

    Example:
        >>> out = OutputThread("demo", write=print)
        >>> out.submit("hello")
        >>> out.close().written
        hello
        1
    """

    def __init__(self, name: str, write: Callable[[Any], None], flush: Callable[[], None] | None = None,
                 close: Callable[[], None] | None = None, *, flush_seconds: float = 2.0, max_pending: int = 64,
                 disable_on_error: bool = True, close_timeout: float = CLOSE_TIMEOUT,
                 idle: Callable[[], None] | None = None) -> None:
        self.name = name
        self.stats = OutputStats()
        self._write, self._flush, self._close, self._idle = write, flush, close, idle
        self._flush_seconds = max(flush_seconds, 0.0)
        self._max_pending = max(1, max_pending)
        self._disable_on_error = disable_on_error
        self._close_timeout = close_timeout
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failed = False
        self._closed = False
        self._abandoned = False
        self._warned_slow = False
        self._unflushed = 0  # written since the last successful flush (output thread only)
        self._thread = threading.Thread(target=self._run, name=f"trainmon-{name}", daemon=True)
        self._thread.start()

    def bound(self, max_pending: int) -> None:
        """Set how many queued items :meth:`submit` keeps before it drops (an output whose items vary in size
        bounds them by bytes this way)."""
        self._max_pending = max(1, max_pending)

    # ------------------------------------------------------------------ training thread
    def submit(self, item: Any) -> None:
        """Queue an item; O(1), never blocks, never raises (a full queue or a failed output drops it)."""
        if self._closed:
            return
        stats = self.stats
        stats.submitted += 1
        if self._failed:
            stats.dropped_failed += 1
        elif self._queue.qsize() >= self._max_pending:  # only the training thread puts: the bound holds
            stats.dropped_slow += 1
            if not self._warned_slow:
                self._warned_slow = True
                logger.warning("trainmon: output %s is slower than training; dropping what it cannot keep up "
                               "with (counted, reported at close)", self.name)
        else:
            self._queue.put(item)

    def wait(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait until everything submitted so far is written and flushed; False after ``timeout`` seconds."""
        if self._closed or not self._thread.is_alive():
            return not self._thread.is_alive()
        marker = _Marker()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def close(self, deadline: float | None = None) -> OutputStats:
        """Write what is queued, flush, close; wait until ``deadline`` (``time.monotonic()``) at most.

        Idempotent; never raises. A thread still busy at the deadline (a stuck disk) is abandoned:
        what it still holds is counted as dropped, and it closes its files if it ever wakes up.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        if deadline is None:
            deadline = time.monotonic() + self._close_timeout
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._abandoned:
            return self.stats
        # A thread that finished consumed everything up to the stop marker; what is still queued
        # belongs to a stuck thread (a hung disk) or a dead one (killed by a BaseException).
        if self._thread.is_alive():
            self._abandoned = True  # first: from now on the thread skips what it still finds queued
            logger.warning("trainmon: output %s did not finish writing within %.1f s (a stuck disk?); giving up "
                           "on it, training goes on", self.name, self._close_timeout)
        self.stats.dropped_at_close = max(0, self._queue.qsize() - 1)  # minus the stop marker
        return self.stats

    def report(self) -> None:
        """One warning naming the output and how many of its items were not written (if any)."""
        stats = self.stats
        if stats.dropped:
            logger.warning("trainmon: output %s did not write %d of %d records (%d dropped while it lagged behind "
                           "training, %d lost to its failure, %d abandoned at close)%s", self.name, stats.dropped,
                           stats.submitted, stats.dropped_slow, stats.dropped_failed + stats._lost_in_queue,
                           stats.dropped_at_close, f"; first error: {stats.error}" if stats.error else "")

    # ------------------------------------------------------------------ output thread
    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            if self._idle is None:
                item = self._queue.get()
            else:
                try:
                    item = self._queue.get(timeout=max(self._flush_seconds, 0.05))
                except queue.Empty:
                    self._call(self._idle)
                    continue
            if item is _STOP:
                break
            if isinstance(item, _Marker):
                self._flush_now()
                item.done.set()
                continue
            if self._abandoned:  # counted as dropped at close already
                continue
            if self._failed:
                self.stats._lost_in_queue += 1
                continue
            if self._call(self._write, item):
                self.stats.written += 1
                self._unflushed += 1
            else:
                self.stats._lost_in_queue += 1
            now = time.monotonic()
            if self._queue.empty() or now - last_flush >= self._flush_seconds:
                self._flush_now()
                last_flush = now
        if not self._abandoned:
            self._flush_now()
        if self._close is not None:
            try:
                self._close()
            except Exception as exc:  # closing must end the thread, whatever the disk says
                self._fail(exc)

    def _flush_now(self) -> None:
        """Flush; items written since the last good flush count as written only once it succeeds."""
        if self._unflushed and not self._call(self._flush):
            self.stats.written -= self._unflushed
            self.stats._lost_in_queue += self._unflushed
        self._unflushed = 0

    def _call(self, fn: Callable[..., None] | None, *args: object) -> bool:
        if fn is None or self._failed:
            return fn is None
        try:
            fn(*args)
        except Exception as exc:  # full disk, unwritable dir, a bad job: warn once, train on
            self._fail(exc)
            return False
        return True

    def _fail(self, exc: Exception) -> None:
        first = self.stats.error is None
        if first:
            self.stats.error = f"{type(exc).__name__}: {exc}"
        if self._disable_on_error and not self._failed:
            self._failed = True
            logger.warning("trainmon: output %s failed and is disabled (%s: %s); %d records were written before "
                           "it failed; training goes on", self.name, type(exc).__name__, exc, self.stats.written)
        elif first:
            logger.warning("trainmon: output %s: a write failed (%s: %s); it goes on with the next one "
                           "(failures are counted, reported at close)", self.name, type(exc).__name__, exc)
