"""A dependency-free progress bar on stderr (framework-free)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, enabled: bool | None = None) -> Iterator[T]:
    """Yield ``items`` while drawing ``label [#####    ] i/total`` at most 10 times a second.

    Drawn only when stderr is a terminal unless ``enabled`` says otherwise.
    """
    show = sys.stderr.isatty() if enabled is None else enabled
    last = 0.0
    done = 0
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if show and (now - last > 0.1 or done == total):
            last = now
            filled = int(30 * done / max(total, 1))
            sys.stderr.write(f"\r{label} [{'#' * filled}{' ' * (30 - filled)}] {done}/{total}")
            sys.stderr.flush()
    if show and done:
        sys.stderr.write("\n")
