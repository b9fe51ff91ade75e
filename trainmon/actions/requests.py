"""When the anomaly actions run: module names requested for the next step or for given steps."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

logger = logging.getLogger("trainmon")

K = TypeVar("K", bound=Hashable)
"""What is requested: a module name, or a ``(vpp stage, name)`` key of a module table."""


class StepRequests(Generic[K]):
    """Module names (or module keys) due on coming steps, in request order, without repeats.

    Args:
        label: the action's name in warnings (``dump``, ``free_benchmark``).

    Example:
        >>> requests: StepRequests[str] = StepRequests("dump")
        >>> requests.add(["layers.2"]); requests.add(["head"], steps=[7], current=3)
        >>> requests.pop(4), requests.pop(7)
        (['layers.2'], ['head'])
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._next: list[K] = []
        self._by_step: dict[int, list[K]] = {}

    def add(self, names: Iterable[K], steps: Iterable[int] | None = None, current: int | None = None) -> None:
        """Request ``names`` on ``steps`` (default: the next step to begin); a step that has already
        begun (``<= current``) is refused with a warning."""
        if steps is None:
            _extend(self._next, names)
            return
        for step in steps:
            if current is not None and step <= current:
                logger.warning("trainmon %s: step %d has already begun; not run for it", self.label, step)
                continue
            _extend(self._by_step.setdefault(int(step), []), names)

    def pop(self, step: int) -> list[K]:
        """The names due on ``step`` (those asked for the next step first); forgets them."""
        names, self._next = self._next, []
        return _extend(names, self._by_step.pop(step, []))


def _extend(names: list[K], more: Iterable[K]) -> list[K]:
    names.extend(name for name in more if name not in names)
    return names
