"""Lead-time arithmetic of ``benchmarks/precursors.py``: the loss event of a run, each detector's lead time and false
alarms, and the threshold that keeps a detector under a false-alarm budget. Plain Python over step numbers (no
torch), unit-tested in ``tests/unit/test_leadtime.py``.

**Event** (:func:`loss_event`): the first step whose loss is not finite, or else the first step ``t`` (from step
104 on) where the median of the last 5 losses (``t-4..t``) exceeds 1.5x the median of the 100 losses before them
(``t-104..t-5``); the event is then the first of those 5 steps whose loss exceeds that 1.5x. The median of 5
ignores one odd batch; moving back to the first high loss dates the event when the loss moved, not when the
median noticed.

**Lead time**: a fault run's alarms from ``max(onset, event - window)`` to ``event`` are warnings; the lead is
``event - first warning`` (0: the alarm came with the event). An alarm after the onset but before that window is
*early* (it does not count as a detection); an alarm before the onset is a false alarm, as is any alarm of a
healthy run. **False alarms per 10,000 healthy steps**: alarm steps over the steps of the healthy runs plus the
steps of the fault runs before their onset (the same training, not yet faulty). A fault run without an event is
not scored; its first alarm within ``window`` steps after the onset is reported (``after_onset``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

FAULTS: tuple[str, ...] = ("lr_ramp", "logit_growth", "repeated_batch", "eps_underflow")
"""The faults of ``benchmarks/precursor_runs.py``, in table order."""
EVENT_FACTOR = 1.5
EVENT_LEVEL_WINDOW = 100
EVENT_SMOOTH = 5
LEAD_WINDOW = 100
"""Default: alarms at most this many steps before the event are warnings."""
FA_BUDGET = 1.0
"""False alarms per 10,000 healthy steps allowed in the same-false-alarm comparison."""


def loss_event(losses: Sequence[float], *, factor: float = EVENT_FACTOR, level_window: int = EVENT_LEVEL_WINDOW,
               smooth: int = EVENT_SMOOTH, last_only: bool = False) -> int | None:
    """The step of a run's loss event (see the module), or None.

    Args:
        losses: the loss of each step, from step 0.
        last_only: only check whether the last step makes the event (for a training loop that calls this after
            every step: each step is then checked once, with the same result as a full scan).

    Example:
        >>> loss_event([1.0] * 120 + [1.2, 1.5, 1.6, 1.7, 1.8])
        122
        >>> loss_event([2.0, float("nan")]), loss_event([1.0] * 200)
        (1, None)
    """
    first = level_window + smooth - 1
    steps: Iterable[int] = [len(losses) - 1] if last_only else range(len(losses))
    for t in steps:
        if t < 0:
            continue
        if not math.isfinite(losses[t]):
            return t
        if t < first:
            continue
        level = statistics.median(losses[t - first:t - smooth + 1])
        recent = losses[t - smooth + 1:t + 1]
        if statistics.median(recent) > factor * level:
            return next(t - smooth + 1 + i for i, value in enumerate(recent) if value > factor * level)
    return None


@dataclass
class RunAlarms:
    """One detector at one threshold on one run: what the lead-time arithmetic needs.

    ``healthy_alarms`` counts the alarm steps among the run's healthy steps (every step of a healthy run, the steps
    before the onset of a fault run); ``alarms`` lists the alarm steps at or after a fault run's onset.
    """

    kind: str
    steps: int
    onset: int | None = None
    event: int | None = None
    healthy_alarms: int = 0
    alarms: list[int] = field(default_factory=list)

    @property
    def healthy_steps(self) -> int:
        if self.kind == "healthy" or self.onset is None:
            return self.steps
        return min(self.onset, self.steps)


@dataclass
class Outcome:
    """A fault run's outcome: ``lead`` (None: no warning in the window), whether an alarm came early."""

    lead: int | None
    early: bool


def outcome(run: RunAlarms, window: int = LEAD_WINDOW) -> Outcome | None:
    """The lead time of a fault run with an event (None for a healthy run or a run without one).

    Example:
        >>> outcome(RunAlarms("lr_ramp", 500, onset=300, event=450, alarms=[320, 440, 449]), window=100)
        Outcome(lead=10, early=True)
    """
    if run.kind == "healthy" or run.event is None:
        return None
    onset = run.onset if run.onset is not None else 0
    start = max(onset, run.event - window)
    warnings = [a for a in run.alarms if start <= a <= run.event]
    return Outcome(run.event - min(warnings) if warnings else None, any(onset <= a < start for a in run.alarms))


@dataclass
class Summary:
    """A detector at one threshold over every run."""

    healthy_steps: int
    false_alarms: int
    leads: dict[str, list[int]]  # fault -> leads of the detected events
    events: dict[str, int]  # fault -> runs with an event
    runs: dict[str, int]  # fault -> runs
    early: dict[str, int]  # fault -> runs with an early alarm
    after_onset: dict[str, list[int]] = field(default_factory=dict)  # fault -> first alarm - onset, runs without
    # an event that had an alarm within the window after the onset

    @property
    def fa_per_10k(self) -> float:
        return 1e4 * self.false_alarms / self.healthy_steps if self.healthy_steps else math.nan

    @property
    def fa_upper_95(self) -> float:
        """One-sided 95% upper confidence bound of the false alarms per 10,000 steps (Poisson)."""
        return 1e4 * poisson_upper(self.false_alarms) / self.healthy_steps if self.healthy_steps else math.nan

    def recall(self, fault: str) -> tuple[int, int]:
        return len(self.leads.get(fault, [])), self.events.get(fault, 0)

    def median_lead(self, fault: str) -> float | None:
        leads = self.leads.get(fault, [])
        return statistics.median(leads) if leads else None


def summarise(runs: Sequence[RunAlarms], window: int = LEAD_WINDOW) -> Summary:
    """False alarms over the healthy steps of every run, and leads by fault.

    Example:
        >>> s = summarise([RunAlarms("healthy", 10_000, healthy_alarms=2),
        ...                RunAlarms("lr_ramp", 600, onset=300, event=500, healthy_alarms=1, alarms=[480, 500])])
        >>> round(s.fa_per_10k, 3), s.leads, s.recall("lr_ramp")
        (2.913, {'lr_ramp': [20]}, (1, 1))
    """
    summary = Summary(0, 0, {}, {}, {}, {})
    for run in runs:
        summary.healthy_steps += run.healthy_steps
        summary.false_alarms += run.healthy_alarms
        if run.kind == "healthy":
            continue
        summary.runs[run.kind] = summary.runs.get(run.kind, 0) + 1
        result = outcome(run, window)
        if result is None:
            onset = run.onset if run.onset is not None else 0
            alarms = [a - onset for a in run.alarms if onset <= a <= onset + window]
            if alarms:
                summary.after_onset.setdefault(run.kind, []).append(min(alarms))
            continue
        summary.events[run.kind] = summary.events.get(run.kind, 0) + 1
        summary.early[run.kind] = summary.early.get(run.kind, 0) + result.early
        if result.lead is not None:
            summary.leads.setdefault(run.kind, []).append(result.lead)
    return summary


def tune(by_threshold: Mapping[str, Summary], budget: float = FA_BUDGET) -> str | None:
    """The most sensitive threshold (the first in ``by_threshold``'s order) whose false alarms per 10,000 healthy
    steps are at most ``budget``; None when none is.

    Example:
        >>> noisy = summarise([RunAlarms("healthy", 10_000, healthy_alarms=5)])
        >>> quiet = summarise([RunAlarms("healthy", 10_000)])
        >>> tune({"2": noisy, "6": quiet}), tune({"2": noisy}, budget=5.0), tune({"2": noisy})
        ('6', '2', None)
    """
    return next((theta for theta, summary in by_threshold.items() if summary.fa_per_10k <= budget), None)


def poisson_upper(count: int, confidence: float = 0.95) -> float:
    """The one-sided upper confidence bound of a Poisson mean after observing ``count`` events.

    Example:
        >>> round(poisson_upper(0), 3), round(poisson_upper(2), 3)
        (2.996, 6.296)
    """
    def cdf(mean: float) -> float:  # P(X <= count), summed in log space (no underflow at large means)
        if mean <= 0:
            return 1.0
        return sum(math.exp(k * math.log(mean) - mean - math.lgamma(k + 1)) for k in range(count + 1))

    low, high = 0.0, count + 10.0 * math.sqrt(count + 1) + 10.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) > 1 - confidence else (low, middle)
    return (low + high) / 2


def to_ranges(steps: Iterable[int]) -> list[list[int]]:
    """Sorted steps as ``[first, last]`` runs of consecutive steps (the JSON form of an alarm list).

    Example:
        >>> to_ranges([3, 4, 5, 9, 11, 12])
        [[3, 5], [9, 9], [11, 12]]
    """
    out: list[list[int]] = []
    for step in sorted(set(steps)):
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return out


def from_ranges(ranges: Iterable[Sequence[int]]) -> list[int]:
    """The inverse of :func:`to_ranges`.

    Example:
        >>> from_ranges([[3, 5], [9, 9]])
        [3, 4, 5, 9]
    """
    return [step for first, last in ranges for step in range(first, last + 1)]


__all__ = ["EVENT_FACTOR", "FAULTS", "FA_BUDGET", "LEAD_WINDOW", "Outcome", "RunAlarms", "Summary", "from_ranges",
           "loss_event", "outcome", "poisson_upper", "summarise", "to_ranges", "tune"]
