"""The sink protocol and the writer thread that runs sinks off the training thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from trainmon.records import StepRecord

logger = logging.getLogger("trainmon")


class Sink(Protocol):
    """Writes step records somewhere. Sinks never run anomaly logic."""

    name: str

    def write(self, record: StepRecord) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


_STOP = object()


class SinkWriter:
    """Runs sinks on a daemon thread; a sink that raises is logged once and disabled.

    Args:
        sinks: the sinks of this rank.
        flush_seconds: flush at most this often; always flushed on close.
        max_pending: records queued before the training thread drops new ones (with one warning)
            instead of waiting for a slow disk.
    """

    def __init__(self, sinks: Sequence[Sink], flush_seconds: float = 2.0, max_pending: int = 64) -> None:
        self.sinks = list(sinks)
        self.flush_seconds = flush_seconds
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="trainmon-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, item: StepRecord | Callable[[], None]) -> None:
        """Queue a record (or a one-off write job). Never blocks training."""
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)  # a full queue means a slow disk: drop, never wait
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                logger.warning("trainmon: output is slower than training; dropping records until it catches up")

    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.flush_seconds or None)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, StepRecord):
                self._each(lambda sink: sink.write(item))
            elif callable(item):
                try:
                    item()
                except Exception as exc:  # a side job must not kill the writer
                    logger.warning("trainmon: output job failed: %s", exc)
            if time.monotonic() - last_flush >= self.flush_seconds:
                self._each(lambda sink: sink.flush())
                last_flush = time.monotonic()
        self._each(lambda sink: sink.flush())
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                logger.warning("trainmon: sink %s failed to close: %s", sink.name, exc)

    def _each(self, action: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                action(sink)
            except Exception as exc:  # full disk, unwritable dir, ...: warn once, disable, train on
                logger.warning("trainmon: sink %s failed and is disabled: %s: %s",
                               sink.name, type(exc).__name__, exc)
                self.sinks.remove(sink)
                try:
                    sink.close()
                except Exception:
                    pass

    def close(self) -> None:
        """Write everything queued, flush and close the sinks; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
