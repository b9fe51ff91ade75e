"""The fail-safe guard: trainmon's own exceptions never reach the training loop.

Everything trainmon runs inside the user's training (module, tensor and gradient hooks, optimizer step
hooks, the step wrappers of engines, the end of a step, trainer callbacks) runs its body through one
:class:`Guard`. An exception raised there by trainmon:

- is caught where it happened, so the forward, backward or optimizer step of the user goes on as if
  trainmon were not there (a hook that fails returns ``None``: torch then keeps the tensors unchanged);
- switches off the *part* that raised (a collector, an action, the anomaly engine, ...) for the rest of
  the run: its hooks return at once from then on and are removed at the next step boundary;
- is reported by one warning naming the part, the error and what the user can do, and is counted in the
  run's records (the ``trainmon_failures`` scalar, ``rank{R}/failures.json``).

What is never caught: the user's own exceptions passing through a call trainmon wraps (the wrapper calls
the user's function outside the guard), :class:`~trainmon.errors.AnomalyError` (the ``raise`` action the user
configured) and ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``).

The module is framework-free: a predicate given at wrap time (``torch.compiler.is_compiling`` for torch
hooks) makes the wrapper call the hook directly while a compiler traces it, so what dynamo traces is the hook
itself, as without the guard.
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from trainmon.errors import AnomalyError

logger = logging.getLogger("trainmon")

F = TypeVar("F", bound=Callable[..., Any])

# What each part is called in the warning, and what the user can do about it. A part not listed here is
# named as given and gets the generic advice.
_ADVICE: dict[str, str] = {
    "activations": "set activations.enabled: false (or narrow targets.modules) to run without it",
    "weight_grads": "set weight_grads.enabled: false to run without it",
    "optimizer_states": "set optimizer_states.enabled: false to run without it",
    "params": "set params.enabled: false to run without it",
    "communication": "set communication.enabled: false to run without it",
    "grad_probe": "set grad_probe.enabled: false to run without it",
    "dump": "set dump.enabled: false to run without it",
    "free_benchmark": "set free_benchmark.enabled: false to run without it",
    "anomaly": "anomaly detection is off; check anomaly.detectors",
    "param_check": "the parameters were not checked for NaN/Inf as training began; nothing else is affected",
    "step_guard": "optimizer steps are applied unguarded from now on (anomaly.guard.enabled: false runs without it)",
    "step": "the monitor is off for the rest of the run",
}


@dataclass
class Failure:
    """What is known of one part's failures.

    Attributes:
        part: the part that raised (``activations``, ``weight_grads``, ``step``, ...).
        count: exceptions caught from it (the first switches it off; later ones come from calls already
            under way, e.g. other hooks of the same backward pass).
        error: ``"ExceptionType: message"`` of the first.
        where: the innermost frame of the first (``file:line in function``).
        time: when the first was caught (seconds since the epoch).
    """

    part: str
    count: int
    error: str
    where: str
    time: float

    def as_dict(self) -> dict[str, Any]:
        return {"part": self.part, "count": self.count, "error": self.error, "where": self.where,
                "time": self.time}


class Guard:
    """Catches trainmon's own exceptions per part; see the module docstring.

    Args:
        on_failure: called with the :class:`Failure` when a part first fails (the session notes it and
            removes the part's hooks at the next step boundary). Its own exceptions are logged, never raised.
        fatal: parts whose failure switches off every part (``step``: without the step model no row can be
            labelled, so the whole monitor stops).

    Example:
        >>> guard = Guard()
        >>> hook = guard.wrap("activations", lambda x: 1 / x)
        >>> hook(2)
        0.5
        >>> hook(0) is None          # trainmon's ZeroDivisionError: caught, the part switched off
        True
        >>> hook(2) is None, guard.off("activations"), guard.failures["activations"].count
        (True, True, 1)
    """

    def __init__(self, on_failure: Callable[[Failure], None] | None = None,
                 fatal: tuple[str, ...] = ("step",)) -> None:
        self.failures: dict[str, Failure] = {}
        self._off: set[str] = set()
        self._parts: set[str] = set(fatal)
        self.fatal = fatal
        self.on_failure = on_failure

    def off(self, part: str) -> bool:
        """Whether ``part`` failed and is switched off (one set lookup)."""
        return part in self._off

    @property
    def stopped(self) -> bool:
        """Whether a fatal part failed: every part is off."""
        return any(part in self._off for part in self.fatal)

    @property
    def total(self) -> int:
        """Exceptions caught so far, over all parts."""
        return sum(failure.count for failure in self.failures.values())

    def wrap(self, part: str, fn: F, *, bypass: Callable[[], bool] | None = None) -> F:
        """``fn`` with its body guarded as ``part``: returns None (does nothing) once ``part`` is off.

        Args:
            part: the name of what ``fn`` belongs to (switched off together).
            fn: the hook or callback.
            bypass: when it returns True, ``fn`` is called directly, unguarded (``torch.compiler.is_compiling``:
                while dynamo traces a hook it must see the hook itself, and an exception there is dynamo's).
        """
        self._note(part)
        return GuardedHook(self, part, fn, bypass)  # type: ignore[return-value]

    def run(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` now, guarded as ``part`` (None when it raised or ``part`` is off)."""
        self._note(part)
        return None if part in self._off else self._call(part, fn, args, kwargs)

    def _call(self, part: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``; trainmon's own exception is recorded against ``part`` (None returned)."""
        try:
            return fn(*args, **kwargs)
        except AnomalyError:
            raise
        except Exception as exc:
            self.fail(part, exc)
            return None

    def _note(self, part: str) -> None:
        self._parts.add(part)
        if part not in self._off and self.stopped:
            self._off.add(part)

    def fail(self, part: str, exc: BaseException) -> None:
        """Record ``exc`` against ``part`` and switch the part off; warns on the part's first failure."""
        failure = self.failures.get(part)
        if failure is not None:
            failure.count += 1
            return
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
        failure = self.failures[part] = Failure(part, 1, f"{type(exc).__name__}: {exc}", where, time.time())
        self._off.add(part)
        if part in self.fatal:
            self._off.update(self._parts)
        advice = _ADVICE.get(part, "the rest of the monitor goes on")
        logger.warning("trainmon: %s failed (%s, at %s) and is off for the rest of this run; training is not "
                       "affected (%s). Please report this with the traceback logged at debug level.",
                       part, failure.error, where, advice)
        logger.debug("trainmon: traceback of the %s failure", part, exc_info=exc)
        if self.on_failure is not None:
            try:
                self.on_failure(failure)
            except Exception:
                logger.exception("trainmon: handling the failure of %s failed", part)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: ``{"total": n, "parts": [Failure.as_dict(), ...]}``."""
        return {"total": self.total, "parts": [failure.as_dict() for failure in self.failures.values()]}


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a copy of one of trainmon's hooks is: a hook that does nothing.

    A deep copy of a monitored module (``copy.deepcopy(model)``: an EMA or reference model) gets this in place of
    each trainmon hook, so the copy never feeds the monitor; a module pickled whole (``torch.save(model)``) saves
    it, and loads with it where trainmon is importable (``state_dict`` saves no hook at all).
    """
    return None


def _inert() -> Callable[..., None]:
    """:func:`inert_hook` (what unpickling a :class:`GuardedHook` gives)."""
    return inert_hook


def _guarded(part: str, fn: Callable[..., Any], bypass: Callable[[], bool] | None, off: set[str],
             call: Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
             *args: Any, **kwargs: Any) -> Any:
    """The body of a :class:`GuardedHook` (its first five arguments bound by it)."""
    if bypass is not None and bypass():
        return fn(*args, **kwargs)
    return None if part in off else call(part, fn, args, kwargs)


class GuardedHook(functools.partial):  # type: ignore[type-arg]
    """A hook or callback under a :class:`Guard` (made by :meth:`Guard.wrap`): ``fn``'s body guarded as ``part``.

    Not a closure, so that copies of the objects holding it stay possible and harmless: a deep copy or a pickle
    of it is :func:`inert_hook` (a closure cannot be pickled, and ``copy.deepcopy`` shares it, so a deep-copied
    module would feed the monitor, and ``torch.save(model)`` would raise in the user's loop). A
    ``functools.partial`` of :func:`_guarded`, so that a call costs what the closure's did (partial's call is C).

    Example:
        >>> import copy, pickle
        >>> hook = Guard().wrap("activations", lambda *args: 1)
        >>> hook(), guarded_part(hook), copy.deepcopy(hook) is inert_hook, pickle.loads(pickle.dumps(hook))()
        (1, 'activations', True, None)
    """

    __trainmon_guard_part__: str

    def __new__(cls, guard: Guard, part: str, fn: Callable[..., Any],
                bypass: Callable[[], bool] | None) -> GuardedHook:
        self = super().__new__(cls, _guarded, part, fn, bypass, guard._off, guard._call)
        functools.update_wrapper(self, fn)
        self.__trainmon_guard_part__ = part
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert, ()


def guarded_part(fn: Callable[..., Any]) -> str | None:
    """The part a :meth:`Guard.wrap`-ped function belongs to (None for an unguarded function)."""
    return getattr(fn, "__trainmon_guard_part__", None)
