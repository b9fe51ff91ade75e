"""Progress bars of the offline tools: tqdm on stderr, drawn only when stderr is a terminal (framework-free).

Every long CLI job (``csv2tb``, ``analyse``, ``grad-compare``, ``report``) advances one bar per file
(or per step pair) it has finished, with tqdm's rate and ETA: ``csv2tb: 40%|####  | 4/10 [00:02<00:03, 1.9 file/s]``.
Nothing is drawn when stderr is redirected (a log file, CI), so outputs stay clean.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class Bar:
    """A tqdm bar that several threads may advance (``csv2tb --workers``); a no-op when not drawn.

    Args:
        total: how many units the job has.
        label: the command's name, shown first.
        unit: what a unit is (``file``, ``step``).
        enabled: draw it (None: only when stderr is a terminal).

    Example:
        >>> with Bar(3, "demo", enabled=False) as bar:
        ...     for _ in range(3):
        ...         bar.advance()
    """

    def __init__(self, total: int, label: str, unit: str = "file", enabled: bool | None = None) -> None:
        stream = sys.stderr
        show = stream.isatty() if enabled is None else enabled
        self._lock = threading.Lock()
        # A terminal that reports no size (a fresh pseudo-terminal) would get no bar at all: 100x20 then.
        sized = _width(stream) > 0 if show else True
        self._bar = tqdm(total=total, desc=label, unit=unit, file=stream, disable=not show, dynamic_ncols=sized,
                         ncols=None if sized else 100, nrows=None if sized else 20, mininterval=0.1)

    def advance(self, count: int = 1, **postfix: Any) -> None:
        """Count ``count`` more units done; ``postfix`` (e.g. ``events=12``) is shown after the rate."""
        with self._lock:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(count)

    def close(self) -> None:
        with self._lock:
            self._bar.close()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def progress(items: Iterable[T], total: int, label: str, enabled: bool | None = None,
             unit: str = "file") -> Iterator[T]:
    """Yield ``items``, advancing a :class:`Bar` of ``total`` units after each one."""
    with Bar(total, label, unit, enabled) as bar:
        for item in items:
            yield item
            bar.advance()
