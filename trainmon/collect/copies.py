"""Copies of a monitored torch model leave trainmon's hooks behind.

Training scripts copy the model they train: ``copy.deepcopy(model)`` for an EMA or a reference model,
``torch.save(model)`` for a whole-module checkpoint (pytorch/examples' word_language_model saves one every epoch
and loads it back with ``weights_only`` and its own list of safe globals). torch copies and pickles a module's hook
dicts with it, so without this a deep copy would share trainmon's hooks (the EMA model's forward would feed the
monitor under the monitored model's names) and a pickle would need trainmon to load.

At attach, :func:`keep_hooks_out_of_copies` gives each module's empty hook dicts a subclass of ``OrderedDict``
(:class:`HookDict`) that behaves the same in the module and leaves trainmon's entries out of its deep copies and
pickles: a copy is a plain ``OrderedDict`` holding the user's hooks only (a pickle names no trainmon global, so it
loads where trainmon is not installed and under ``weights_only``). A trainmon entry is a
:class:`~trainmon.base.guard.GuardedHook` and, in the flag dicts (``with_kwargs``, ``always_call``), the key of
one. A dict that already holds hooks (a framework's: FSDP2, ZeRO-3) is left as it is, since the handles of those
hooks refer to it; trainmon's hooks in it copy and pickle as :func:`~trainmon.base.guard.inert_hook`.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from trainmon.base.guard import GuardedHook

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
"""A module's dicts of hooks (id -> hook)."""
_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
"""A module's dicts of flags of hooks (id -> True)."""


class HookDict(OrderedDict[int, Any]):
    """A module's hook (or hook-flag) dict whose copies and pickles leave trainmon's entries out.

    Example:
        >>> import pickle, torch
        >>> from trainmon.base.guard import Guard
        >>> module = torch.nn.Linear(2, 2)
        >>> keep_hooks_out_of_copies(module)
        1
        >>> ours = module.register_forward_hook(Guard().wrap("activations", lambda *args: None))
        >>> theirs = module.register_forward_hook(print)
        >>> list(pickle.loads(pickle.dumps(module))._forward_hooks.values()) == [print]
        True
        >>> type(module._forward_hooks)() == {}      # as code copying a module's dicts makes one: a plain dict
        True
    """

    def __init__(self, module: Any = None) -> None:
        super().__init__()
        # None (``type(hooks)()``, as code that copies a module's dicts writes it): keeps every entry, as a plain dict
        self._module = weakref.ref(module) if module is not None else lambda: None

    def copy(self) -> HookDict:
        """A copy in the module (``OrderedDict.copy`` would call the constructor with the items)."""
        new = HookDict.__new__(HookDict)
        OrderedDict.__init__(new, self)
        new._module = self._module
        return new

    def _theirs(self) -> Iterator[tuple[int, Any]]:
        module = self._module()
        ours: set[int] = set() if module is None else {key for name in _HOOKS for key, hook in
                                              getattr(module, name, {}).items() if isinstance(hook, GuardedHook)}
        return ((key, value) for key, value in self.items() if key not in ours)

    def __reduce__(self) -> tuple[Any, ...]:
        return OrderedDict, (), None, None, self._theirs()

    def __deepcopy__(self, memo: dict[int, Any]) -> OrderedDict[int, Any]:
        return OrderedDict((key, copy.deepcopy(value, memo)) for key, value in self._theirs())


def keep_hooks_out_of_copies(model: Any) -> int:
    """Give the empty hook dicts of every torch module in ``model`` (a module, or a list of modules) a
    :class:`HookDict`; returns how many modules got one. Anything else (a MindSpore cell) is left alone."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:  # no torch module exists in this process
        return 0
    roots: Iterable[Any] = model if isinstance(model, (list, tuple)) else (model,)
    seen = 0
    for root in roots:
        if not isinstance(root, torch.nn.Module):
            continue
        for module in root.modules():
            changed = False
            for name in _HOOKS + _FLAGS:
                hooks = module.__dict__.get(name)
                if type(hooks) is OrderedDict and not hooks:
                    module.__dict__[name] = HookDict(module)
                    changed = True
            seen += changed
    return seen
