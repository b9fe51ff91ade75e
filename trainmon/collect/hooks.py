"""One registry for every removable hook handle the monitor installs; torch's output-only backward-hook
warning kept away from trainmon's own hooks (:class:`QuietOutputOnlyBackward`)."""

from __future__ import annotations

import re
import warnings
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


OUTPUT_ONLY_WARNING = ("Full backward hook is firing when gradients are computed with respect to module outputs "
                       "since no inputs require gradients")
"""The start of torch's UserWarning for a full backward hook on a module none of whose inputs requires grad."""


class QuietOutputOnlyBackward:
    """Keeps torch's "Full backward hook is firing ... no inputs require gradients" warning away from
    trainmon's own full backward hooks, and only from them.

    torch warns whenever a module with full backward hooks gets no input that requires grad (the
    first target of almost every model: it receives the data). For trainmon's hook that case is
    expected (``input_grad`` rows are simply absent), so the warning is noise. It cannot be filtered
    by module: torch raises it from inside ``loss.backward()``, attributed to the caller's line.
    So, per target module:

    - a forward pre-hook notes whether every grad-enabled call of the module in this step got no
      positional tensor that requires grad (the case in which torch warns);
    - a full backward *pre*-hook, which torch runs immediately before it warns, puts one "ignore"
      filter for exactly this message in front of ``warnings.filters``, but only when that case
      holds and the module carries no backward hook but trainmon's (no user hook on it, no global
      module hook): a user's own hook still gets the warning;
    - trainmon's full backward hook, which torch runs immediately after the warning, takes the
      filter out again (:meth:`lift`; :meth:`reset` at the end of the step, as a safety net).

    The filter list is changed in place, without bumping the warnings version, so no other
    warning's "already shown" record is cleared.
    """

    def __init__(self) -> None:
        self._inputs: dict[int, bool] = {}  # id(module) -> every grad-enabled call had no grad input
        self._filters: list[tuple[Any, ...]] = []

    def hooks(self, module: Any, own: Any) -> list[Any]:
        """Registers the two hooks on ``module`` whose own full backward hook has handle ``own``;
        returns their handles (for the caller's :class:`HookRegistry`)."""
        import torch

        key = id(module)

        def note_inputs(module: Any, args: tuple) -> None:
            if torch.is_grad_enabled():
                none = not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                self._inputs[key] = self._inputs.get(key, True) and none

        pre_handle: Any = None

        def before_backward(module: Any, grad_output: tuple) -> None:
            if self._inputs.get(key) and _only_hooks(module, own, pre_handle):
                entry = ("ignore", re.compile(re.escape(OUTPUT_ONLY_WARNING)), UserWarning, None, 0)
                warnings.filters.insert(0, entry)
                self._filters.append(entry)

        forward_handle = module.register_forward_pre_hook(note_inputs)
        pre_handle = module.register_full_backward_pre_hook(before_backward)
        return [forward_handle, pre_handle]

    def lift(self) -> None:
        """Takes out the filters this object put in (a no-op when there are none)."""
        while self._filters:
            entry = self._filters.pop()
            for i, item in enumerate(warnings.filters):
                if item is entry:
                    del warnings.filters[i]
                    break

    def reset(self) -> None:
        """End of a step: forget what the forward passes saw, and take out any filter left in."""
        self._inputs.clear()
        self.lift()


def _only_hooks(module: Any, own: Any, pre: Any) -> bool:
    """Whether ``module``'s only backward hooks are the two with handles ``own`` and ``pre`` (reads
    torch's hook dicts; anything unexpected counts as a foreign hook, so the warning stays)."""
    from torch.nn.modules import module as torch_module

    try:
        return (set(module._backward_hooks) == {own.id} and set(module._backward_pre_hooks) == {pre.id}
                and not torch_module._global_backward_hooks and not torch_module._global_backward_pre_hooks)
    except (AttributeError, TypeError):
        return False
