"""One registry for every removable hook handle the monitor installs (:class:`HookRegistry`); the base of
every collector's arm/disarm/close (:class:`HookedCollector`); torch's output-only backward-hook warning kept
away from trainmon's own hooks (:class:`QuietOutputOnlyBackward`)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from trainmon.collect.context import StepContext


H = TypeVar("H", bound=Callable[..., Any])


class _Handle(Protocol):
    def remove(self) -> None: ...


# The hooks trainmon puts on modules (a torch module, or a MindSpore cell: ``Any``) and on tensors.
ForwardPreHook: TypeAlias = "Callable[[Any, tuple[Any, ...], dict[str, Any]], None]"
"""A forward pre-hook registered ``with_kwargs=True``: ``hook(module, args, kwargs)``."""
ForwardHook: TypeAlias = "Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]"
"""A forward hook registered ``with_kwargs=True``: ``hook(module, args, kwargs, output)``."""
BackwardHook: TypeAlias = "Callable[[Any, tuple[Any, ...], tuple[Any, ...]], None]"
"""A full backward hook: ``hook(module, grad_input, grad_output)`` (``None`` where no gradient flowed)."""
TensorHook: TypeAlias = "Callable[[torch.Tensor], None]"
"""A tensor (gradient) hook: ``hook(grad)``."""


_Filter: TypeAlias = "tuple[str, re.Pattern[str] | None, type[Warning], re.Pattern[str] | None, int]"
"""An entry of ``warnings.filters`` (action, message, category, module, line)."""


def post_accumulate_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """``param.register_post_accumulate_grad_hook(hook)``, typed (torch leaves that method unannotated)."""
    register: Callable[[Callable[[torch.Tensor], None]], RemovableHandle] = param.register_post_accumulate_grad_hook
    return register(hook)


class HookRegistry:
    """Keeps removable handles grouped by owner so they can be removed per group or all at once.

    Example:
        >>> registry = HookRegistry()
        >>> # registry.add("activations", module.register_forward_hook(fn))
        >>> registry.remove_all()
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[_Handle]] = {}

    def add(self, group: str, handle: _Handle) -> None:
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


class HookedCollector:
    """The base of every collector: the arm/disarm/close lifecycle of
    :class:`trainmon.collect.context.Collector`, with its hooks in a :class:`HookRegistry`.

    - Hooks that run on collected steps only go in the registry groups named by ``HOOK_GROUPS``:
      :meth:`arm` calls :meth:`install_hooks` when none of those groups holds a handle (so arming
      twice installs nothing twice), :meth:`disarm` removes them and calls :meth:`reset`.
    - Hooks that must run on every step (phase markers, a wrapper's step hooks) are handed to
      :meth:`keep`; they stay until :meth:`close`.
    - :meth:`close` disarms, then runs :meth:`release` and removes the kept hooks, once: a second
      ``close`` only disarms again.

    Args:
        ctx: the monitor's step context (:class:`trainmon.collect.context.StepContext`).
        registry: the monitor's registry (shared with other collectors), or None for one of its own.

    Example:
        >>> from types import SimpleNamespace
        >>> class Counter(HookedCollector):
        ...     HOOK_GROUPS = ("counter",)
        ...     def install_hooks(self) -> None:
        ...         self.registry.add("counter", SimpleNamespace(remove=lambda: None))
        >>> counter = Counter(ctx=None)
        >>> counter.arm(); counter.arm(); counter.registry.count()
        1
        >>> counter.close(); counter.close(); counter.registry.count()
        0
    """

    HOOK_GROUPS: tuple[str, ...] = ()
    """The registry groups of the hooks installed by :meth:`install_hooks` (removed by :meth:`disarm`)."""
    PART: str = "weights"
    """What this collector is called by the fail-safe guard (:mod:`trainmon.base.guard`): a failure in one of its
    hooks switches off every collector of this part for the rest of the run."""

    def __init__(self, ctx: StepContext, registry: HookRegistry | None = None) -> None:
        self.ctx = ctx
        self.registry = registry if registry is not None else HookRegistry()
        self._closed = False
        self._kept = f"{type(self).__name__}@{id(self):x}"  # this instance's own group of kept hooks

    def guarded(self, fn: H) -> H:
        """``fn`` (a hook this collector registers) with its body under the monitor's fail-safe guard, as
        :attr:`PART`. While dynamo traces it (a hook inside a compiled region) it is called as it is."""
        guard = getattr(self.ctx, "guard", None)
        if guard is None:
            return fn
        import torch

        wrapped: H = guard.wrap(self.PART, fn, bypass=torch.compiler.is_compiling)
        return wrapped

    @property
    def armed(self) -> bool:
        """Whether the step hooks are installed."""
        return any(self.registry.count(group) for group in self.HOOK_GROUPS)

    def arm(self) -> None:
        """Before a collected step: install the step hooks (once; a no-op while armed)."""
        if not self.armed:
            self.install_hooks()

    def install_hooks(self) -> None:
        """Register the step hooks, each in one of the ``HOOK_GROUPS`` (none by default)."""

    def disarm(self) -> None:
        """Before an uncollected step, and in :meth:`close`: remove the step hooks, then :meth:`reset`."""
        for group in self.HOOK_GROUPS:
            self.registry.remove(group)
        self.reset()

    def reset(self) -> None:
        """Forget what the hooks noted in a step (nothing by default)."""

    def before_transfer(self) -> None:
        """End of a collected step, before the host transfer (nothing by default)."""

    def keep(self, handle: _Handle) -> None:
        """Hold a hook that runs on every step, collected or not, until :meth:`close`."""
        self.registry.add(self._kept, handle)

    def close(self) -> None:
        """Leave no hook behind; idempotent and safe after an exception."""
        self.disarm()
        if self._closed:
            return
        self._closed = True
        try:
            self.release()
        finally:
            self.registry.remove(self._kept)

    def release(self) -> None:
        """Run once by :meth:`close`: undo what the constructor set up (nothing by default)."""


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
        self._filters: list[_Filter] = []

    def hooks(self, module: torch.nn.Module, own: RemovableHandle,
              wrap: Callable[[Any], Any] = lambda fn: fn) -> list[RemovableHandle]:
        """Registers the two hooks on ``module`` whose own full backward hook has handle ``own``;
        returns their handles (for the caller's :class:`HookRegistry`). ``wrap`` puts them under the
        caller's fail-safe guard."""
        import torch

        key = id(module)

        def note_inputs(module: torch.nn.Module, args: tuple[object, ...]) -> None:
            if torch.is_grad_enabled():
                none = not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                self._inputs[key] = self._inputs.get(key, True) and none

        pre_handle: RemovableHandle | None = None

        def before_backward(module: torch.nn.Module, grad_output: tuple[torch.Tensor | None, ...]) -> None:
            if self._inputs.get(key) and _only_hooks(module, own, pre_handle):
                entry: _Filter = ("ignore", re.compile(re.escape(OUTPUT_ONLY_WARNING)), UserWarning, None, 0)
                _filters().insert(0, entry)
                self._filters.append(entry)

        forward_handle = module.register_forward_pre_hook(wrap(note_inputs))
        pre_handle = module.register_full_backward_pre_hook(wrap(before_backward))
        return [forward_handle, pre_handle]

    def lift(self) -> None:
        """Takes out the filters this object put in (a no-op when there are none)."""
        while self._filters:
            entry = self._filters.pop()
            filters = _filters()
            for i, item in enumerate(filters):
                if item is entry:
                    del filters[i]
                    break

    def reset(self) -> None:
        """End of a step: forget what the forward passes saw, and take out any filter left in."""
        self._inputs.clear()
        self.lift()


def _filters() -> list[_Filter]:
    """``warnings.filters``, the list itself (typeshed declares it a read-only Sequence)."""
    return cast("list[_Filter]", warnings.filters)


def _only_hooks(module: torch.nn.Module, own: RemovableHandle, pre: RemovableHandle | None) -> bool:
    """Whether ``module``'s only backward hooks are the two with handles ``own`` and ``pre`` (reads
    torch's hook dicts; anything unexpected counts as a foreign hook, so the warning stays)."""
    from torch.nn.modules import module as torch_module

    try:
        return (pre is not None and set(module._backward_hooks) == {own.id}
                and set(module._backward_pre_hooks) == {pre.id}
                and not torch_module._global_backward_hooks and not torch_module._global_backward_pre_hooks)
    except (AttributeError, TypeError):
        return False
