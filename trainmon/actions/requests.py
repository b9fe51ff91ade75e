"""When the anomaly actions run: module names requested for the next step or for given steps."""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("trainmon")


class StepRequests:
    """Module names due on coming steps, in request order, without repeats.

    Args:
        label: the action's name in warnings (``dump``, ``free_benchmark``).

    Example:
        >>> requests = StepRequests("dump")
        >>> requests.add(["layers.2"]); requests.add(["head"], steps=[7], current=3)
        >>> requests.pop(4), requests.pop(7)
        (['layers.2'], ['head'])
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._next: list[str] = []
        self._by_step: dict[int, list[str]] = {}

    def add(self, names: Iterable[str], steps: Iterable[int] | None = None, current: int | None = None) -> None:
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

    def pop(self, step: int) -> list[str]:
        """The names due on ``step`` (those asked for the next step first); forgets them."""
        names, self._next = self._next, []
        return _extend(names, self._by_step.pop(step, []))


def _extend(names: list[str], more: Iterable[str]) -> list[str]:
    names.extend(name for name in more if name not in names)
    return names
