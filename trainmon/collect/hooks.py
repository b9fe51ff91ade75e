"""One registry for every removable hook handle the monitor installs."""

from __future__ import annotations

from typing import Any, Protocol


class _Handle(Protocol):
    def remove(self) -> None: ...


class HookRegistry:
    """Keeps removable handles grouped by owner so they can be removed per group or all at once.

    Example:
        >>> registry = HookRegistry()
        >>> # registry.add("activations", module.register_forward_hook(fn))
        >>> registry.remove_all()
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[_Handle]] = {}

    def add(self, group: str, handle: Any) -> None:
        self._groups.setdefault(group, []).append(handle)

    def remove(self, group: str) -> None:
        for handle in self._groups.pop(group, []):
            handle.remove()

    def remove_all(self) -> None:
        for group in list(self._groups):
            self.remove(group)

    def count(self, group: str | None = None) -> int:
        if group is not None:
            return len(self._groups.get(group, []))
        return sum(len(handles) for handles in self._groups.values())
