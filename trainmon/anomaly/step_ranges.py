"""The steps a reader keeps (framework-free): :class:`StepRanges`, sorted and merged inclusive ranges, and
:func:`parse_steps` of the ``--steps`` text (``"1,3,5-9"``). Used by :mod:`trainmon.anomaly.merge` and the
offline tools (``trainmon analyse``, ``report``, the store's SQL).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np
import numpy.typing as npt

from trainmon.base.inputs import INT64_MAX


class StepRanges:
    """A set of steps kept as sorted, merged, inclusive ranges: ``0-99999999999999`` costs two integers.

    Steps beyond int64 cannot occur in a run, so ranges are clipped to ``0..2**63-1``.

    Example:
        >>> steps = parse_steps("9,1,3,5-8")
        >>> str(steps), 7 in steps, 4 in steps, list(steps)
        ('1,3,5-9', True, False, [1, 3, 5, 6, 7, 8, 9])
    """

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for low, high in sorted((max(low, 0), min(high, INT64_MAX)) for low, high in ranges):
            if low > high:
                continue
            if merged and low <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        self.ranges: tuple[tuple[int, int], ...] = tuple((low, high) for low, high in merged)

    @classmethod
    def of(cls, steps: Iterable[int]) -> StepRanges:
        """From individual steps (a set or list of ints)."""
        return cls((step, step) for step in steps)

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(low <= step <= high for low, high in self.ranges)

    def __iter__(self) -> Iterator[int]:
        for low, high in self.ranges:
            yield from range(low, high + 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepRanges) and self.ranges == other.ranges

    def __hash__(self) -> int:
        return hash(self.ranges)

    def __str__(self) -> str:
        return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in self.ranges)

    def __repr__(self) -> str:
        return f"StepRanges({str(self)!r})"

    def mask(self, steps: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Which entries of an int64 array are in the set (vectorised: one binary search per entry)."""
        if not self.ranges:
            return np.zeros(steps.shape, dtype=bool)
        lows = np.array([low for low, _ in self.ranges], dtype=np.int64)
        highs = np.array([high for _, high in self.ranges], dtype=np.int64)
        index = np.searchsorted(lows, steps, side="right") - 1
        return (index >= 0) & (steps <= highs[np.clip(index, 0, None)])


def parse_steps(text: str) -> StepRanges:
    """``"1,3,5-9"`` -> the steps 1, 3 and 5 to 9, as lazy ranges (``0-99999999999999`` is cheap).

    Raises:
        ValueError: malformed text or a descending range.
    """
    ranges = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"bad step list {text[:50]!r}: expected e.g. 1,3,5-9")
        low = bounded_int(match.group(1))
        high = bounded_int(match.group(2)) if match.group(2) else low
        if high < low:
            raise ValueError(f"bad step range {part[:50]!r}: end before start")
        ranges.append((low, high))
    return StepRanges(ranges)


def bounded_int(digits: str) -> int:
    """The integer of a digit string, or INT64_MAX + 1 for anything larger (no 4,300-digit int limit)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 19 else INT64_MAX + 1


__all__ = ["StepRanges", "bounded_int", "parse_steps"]
