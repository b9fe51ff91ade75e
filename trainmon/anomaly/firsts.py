"""The two answers of an anomaly analysis besides the ordered list: the **first non-finite** event and the
**first spike** (the earliest event of every other detector), the first origin a run names (:func:`headline`),
and the check of a detector filter (``trainmon analyse --detector``, ``trainmon report --detector``).

A run whose spike rule fires early and often (msprobe's ``AnomalyTurbulence`` on every row fires from step 1)
would otherwise name a step-1 spike as the origin of a NaN at step 60.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from trainmon.anomaly.detectors import DETECTORS
from trainmon.anomaly.events import NONFINITE_DETECTORS


class UnknownDetectorError(ValueError):
    """A detector filter names a detector that neither the run's events nor trainmon or msprobe know."""


def check_detectors(wanted: Collection[str] | None, present: Collection[str]) -> None:
    """Refuse a detector filter with a name that is no detector: not in the run's events (``present``),
    not a trainmon detector type, not msprobe's ``AnomalyNan``. A known detector without events is fine
    (its selection is empty).

    Raises:
        UnknownDetectorError: one line naming the unknown names and the detectors present.
    """
    unknown = sorted(set(wanted or ()) - set(present) - set(DETECTORS) - NONFINITE_DETECTORS)
    if unknown:
        names = sorted(present)
        shown = ", ".join(repr(name[:40])[1:-1] for name in names[:20]) + (", ..." if len(names) > 20 else "")
        raise UnknownDetectorError(f"unknown detector {', '.join(repr(n[:40]) for n in unknown[:5])}; "
                                   f"the run's events come from {shown or 'no detector'} "
                                   f"(trainmon's detectors: {', '.join(sorted(DETECTORS))})")


def headline(first_nonfinite: dict[str, Any] | None, ordered: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first origin a run names: its first non-finite event when it has one, else its earliest event.

    A NaN is what stops a run, and where it came from is the question; a spike rule that fires early
    and often (msprobe's turbulence rule on every row) must not take its place (``first_spike`` keeps it).
    """
    return first_nonfinite if first_nonfinite is not None else (ordered[0] if ordered else None)


__all__ = ["UnknownDetectorError", "check_detectors", "headline"]
