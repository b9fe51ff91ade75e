"""Re-reading the config file while training (framework-free)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from trainmon.config import ConfigError, MonitorConfig, load_config

logger = logging.getLogger("trainmon")


class ConfigWatcher:
    """Polls a config file's modification time at most every ``poll_seconds``.

    The file is only read, never written. A broken edit is reported once per edit and ignored.

    Example:
        >>> watcher = ConfigWatcher(Path("monitor.yaml"), poll_seconds=5)   # doctest: +SKIP
        >>> new_config = watcher.poll()   # None unless the file changed and is valid  # doctest: +SKIP
    """

    def __init__(self, path: Path, poll_seconds: float) -> None:
        self.path = path
        self.poll_seconds = poll_seconds
        self._stamp = self._read_stamp()
        self._next_check = time.monotonic() + poll_seconds

    def _read_stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def poll(self) -> MonitorConfig | None:
        """The new config if the file changed since the last poll and is valid, else None."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.poll_seconds
        stamp = self._read_stamp()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            return load_config(self.path)
        except ConfigError as exc:
            logger.warning("trainmon: ignoring the edited config (%s); the previous config stays in force", exc)
            return None
