"""The anomaly engine: detectors on each collected step's host record, then the actions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainmon.anomaly.detectors import ADDED_DEFAULTS, build_detectors, effective_specs
from trainmon.anomaly.events import AnomalyEvent, utc_now
from trainmon.anomaly.ordering import order_events
from trainmon.anomaly.responses import JsonlAction, LogAction, logger
from trainmon.errors import AnomalyError

if TYPE_CHECKING:
    from trainmon.base.records import StepRecord

AnomalyCallback = Callable[[AnomalyEvent], object]
"""A user callback: receives each event of a step, first origin first."""
StepAction = Callable[[list[AnomalyEvent]], object]
"""A hand-off action (dump, free benchmark): receives the step's events, first origin first."""



class AnomalySettings(Protocol):
    """What the engine reads of its config section (:class:`trainmon.config.AnomalyConfig`, a room above
    this one: the config imports the detectors' specs, never the reverse)."""

    @property
    def detectors(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def default_detectors(self) -> bool: ...
    @property
    def actions(self) -> Sequence[str]: ...
    @property
    def log_limit(self) -> int: ...


HANDOFF_ACTIONS: tuple[str, ...] = ("dump", "free_benchmark")
_STATE_VERSION = 1


class AnomalyEngine:
    """Runs the configured detectors on each collected step and applies the actions.

    Action order within a step: ``log``, ``jsonl``, user callbacks, hand-offs (``dump``,
    ``free_benchmark``), then ``raise``. An action that fails is logged once and disabled;
    only ``raise`` stops training, on purpose, after every other action ran. ``rollback`` is not applied
    here: the session's rollback keeper (:mod:`trainmon.actions.rollback`) reads :attr:`last_events` with the
    step's record after the engine, and stops the run at the end of the step.

    Callbacks registered with :meth:`on_anomaly` run when ``callback`` is in ``anomaly.actions``
    (registering one without it logs a warning once).

    Args:
        config: the ``anomaly`` config section.
        rank: global rank (log prefix and event field).
        rank_dir: ``{run}/rank{R}`` for ``anomalies.jsonl``; None disables ``jsonl`` (a rank that
            does not write).

    Example:
        >>> from trainmon.config import AnomalyConfig
        >>> from trainmon.base.records import StepRecord
        >>> engine = AnomalyEngine(AnomalyConfig(actions=[]), rank=0, rank_dir=None)
        >>> [e.name for e in engine.process(StepRecord(step=3, rank=0, scalars={"loss": float("nan")}))]
        ['loss']
    """

    def __init__(self, config: AnomalySettings, rank: int, rank_dir: Path | None) -> None:
        self.config = config
        self.rank = rank
        self.specs = effective_specs(config.detectors, config.default_detectors)
        self.detectors = build_detectors(self.specs, "anomaly.detectors")
        # The console throttles each detector on its own (LogAction), named as the user sees it.
        self._labels = [_label(spec, self.specs) for spec in self.specs]
        self.actions = list(config.actions)
        # made whatever the actions: act() may be asked for them (the jsonl thread starts at its first event)
        self._log = LogAction(rank, config.log_limit)
        self._jsonl = JsonlAction(Path(rank_dir) / "anomalies.jsonl") if rank_dir is not None else None
        self._callbacks: list[AnomalyCallback] = []
        self._handoffs: dict[str, StepAction] = {}
        self._disabled: set[str] = set()
        self._warned: set[str] = set()
        self._closed = False
        self.last_events: list[AnomalyEvent] = []
        """The events of the last step :meth:`process` saw (also when an action raised): what the rollback keeper
        reads after it."""

    @property
    def jsonl_path(self) -> Path | None:
        """Where events are appended, or None without the ``jsonl`` action."""
        return self._jsonl.path if self._jsonl and "jsonl" in self.actions else None

    def on_anomaly(self, fn: AnomalyCallback) -> AnomalyCallback:
        """Register a callback called with each event (usable as a decorator)."""
        if not callable(fn):
            raise TypeError(f"on_anomaly needs a callable, got {type(fn).__name__}")
        self._callbacks.append(fn)
        if "callback" not in self.actions:
            self._warn_once("callback", "on_anomaly(): 'callback' is not in anomaly.actions, so registered "
                                        "callbacks are not called; add it to anomaly.actions")
        return fn

    def register_action(self, name: str, fn: StepAction) -> None:
        """Provide a hand-off action; it runs only when ``name`` is in ``anomaly.actions``."""
        if name not in HANDOFF_ACTIONS:
            raise ValueError(f"unknown hand-off action {name!r}; allowed: {list(HANDOFF_ACTIONS)}")
        self._handoffs[name] = fn

    # ------------------------------------------------------------------ per step
    def process(self, record: StepRecord, found: Sequence[AnomalyEvent] = ()) -> list[AnomalyEvent]:
        """Detect on one collected step's record and apply the actions.

        Args:
            record: the step's record.
            found: events of the step made outside the detectors (the step guard's), handled with theirs.

        Returns:
            The step's events, earliest first (the first is the first origin).

        Raises:
            AnomalyError: with the ``raise`` action, when the step has an event.
        """
        self.last_events = []
        if self._closed:
            return []
        time = utc_now()
        events: list[AnomalyEvent] = list(found)
        source: dict[int, str] = {id(event): event.detector for event in found}  # id(event) -> detector's label
        for event in found:  # made on every step, collected or not
            self._log.every_step(event.detector)
        for index, detector in enumerate(self.detectors):
            name = f"detector {index} ({detector.type_name})"
            if name in self._disabled:
                continue
            try:
                found = detector.update(record, time)
            except Exception:  # a detector bug must not kill training
                self._fail(name)
                continue
            events.extend(found)
            source.update((id(event), self._labels[index]) for event in found)
        if not events:
            if "log" in self.actions:
                self._log.quiet(record.collected)
            return []
        if record.batch is not None:  # the step's data, where the loop gave it
            for event in events:
                if event.batch is None and event.step == record.step:
                    event.batch = record.batch
        events = order_events(events)
        self.last_events = events
        self._apply(events, self.actions, [source[id(e)] for e in events], record.collected)
        return events

    def act(self, events: list[AnomalyEvent], actions: Sequence[str]) -> None:
        """Apply ``actions`` (names of ``anomaly.actions``) to events made outside the detectors, in the order
        of :meth:`process` (the step guard's escalation of a run of skipped steps).

        Raises:
            AnomalyError: with ``raise`` among ``actions``.
        """
        if not self._closed and events:
            self._apply(events, actions, [f"{event.detector} {event.metric}" for event in events], collected=True)

    def _apply(self, events: list[AnomalyEvent], actions: Sequence[str], sources: list[str], collected: bool) -> None:
        if "log" in actions:
            self._run("log", functools.partial(self._log, sources=sources, collected=collected), events)
        if "jsonl" in actions and self._jsonl is not None:
            self._run("jsonl", self._jsonl, events)
        for i, callback in enumerate(self._callbacks if "callback" in actions else []):
            self._run(f"callback {i} ({getattr(callback, '__qualname__', callback)!r})",
                      functools.partial(_call_each, callback), events)
        for action in HANDOFF_ACTIONS:
            if action in actions:
                handoff = self._handoffs.get(action)
                if handoff is None:
                    self._warn_once(action, f"anomaly action {action!r} is configured but not available "
                                            f"(its {action} section is not attached); skipping it")
                else:
                    self._run(action, handoff, events)
        if "raise" in actions:
            raise AnomalyError(events[0].message)

    def _run(self, name: str, action: StepAction, events: list[AnomalyEvent]) -> None:
        if name in self._disabled:
            return
        try:
            action(events)
        except Exception:  # an action must never kill training (only `raise` does)
            self._fail(name)

    def _fail(self, name: str) -> None:
        self._disabled.add(name)
        logger.exception("[rank %d] anomaly %s failed and is disabled for the rest of the run", self.rank, name)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("[rank %d] %s", self.rank, message)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Every detector's state, for checkpoints (JSON-compatible)."""
        return {"version": _STATE_VERSION,
                "detectors": [{"type": d.type_name, "state": d.state_dict()} for d in self.detectors]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        A state saved with an earlier set of defaults (:data:`~trainmon.anomaly.detectors.ADDED_DEFAULTS`: the
        three defaults before the global grad-norm watch, the four before the growth and level watches, the seven
        before the zero-gradient level) loads into the detectors it has; the defaults added since start fresh.

        Raises:
            ValueError: the state does not match the detectors that run (count or types).
        """
        saved = state.get("detectors") if isinstance(state, Mapping) else None
        if state.get("version") != _STATE_VERSION or not isinstance(saved, list):
            raise ValueError("not an anomaly engine state (missing version/detectors)")
        saved_types = [item.get("type") if isinstance(item, Mapping) else None for item in saved]
        # Candidates: every detector, then without the defaults added since (the latest additions first). Each is
        # tried on fresh detectors: one whose saved state does not fit (a user's spike sliding into a default's
        # place) is refused, and the engine keeps its state.
        candidates = [list(range(len(self.detectors)))]
        for cut in range(len(ADDED_DEFAULTS) - 1, -1, -1):
            later = [spec for added in ADDED_DEFAULTS[cut:] for spec in added]
            candidates.append([i for i, spec in enumerate(self.specs) if spec not in later])
        for indices in candidates:
            if saved_types != [self.detectors[i].type_name for i in indices]:
                continue
            loaded = build_detectors([self.specs[i] for i in indices], "anomaly.detectors")
            try:
                for detector, item in zip(loaded, saved):
                    detector.load_state_dict(item["state"])
            except (KeyError, TypeError, ValueError):
                continue
            for i, detector in zip(indices, loaded):
                self.detectors[i] = detector  # the defaults left out start fresh
            return
        types = [d.type_name for d in self.detectors]
        raise ValueError(f"anomaly state holds detectors {saved_types}, the config has {types} (with "
                         f"anomaly.default_detectors: {str(self.config.default_detectors).lower()}); configure "
                         f"the detectors the checkpoint was saved with")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the events of the steps processed so far are in ``anomalies.jsonl``.

        ``process`` only queues them (the file is written on its own thread, so a slow disk never
        slows training); this is for readers in the same process, e.g. tests.

        Returns:
            False when they are still not written after ``timeout`` seconds.
        """
        return self._jsonl.flush(timeout) if self._jsonl is not None else True

    def close(self) -> None:
        """Write and close ``anomalies.jsonl`` within a bounded time; idempotent, never raises.
        Later steps are not processed."""
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()


def _label(spec: Mapping[str, Any], specs: Sequence[Mapping[str, Any]]) -> str:
    """A detector's name on the console: its type, with its series when two detectors share the type.

    Example:
        >>> _label({"type": "spike", "series": ["grad_norm"]}, [{"type": "spike"}, {"type": "spike"}])
        'spike (grad_norm)'
    """
    kind = str(spec["type"])
    if sum(other["type"] == kind for other in specs) == 1:
        return kind
    series = spec.get("series")
    return f"{kind} ({', '.join(map(str, series))})" if series else f"{kind} #{list(specs).index(spec)}"


def _call_each(callback: AnomalyCallback, events: list[AnomalyEvent]) -> None:
    """A user callback, called once per event of the step."""
    for event in events:
        callback(event)
