"""Step hooks for framework objects: :class:`StepWrapper` (pre/post hooks on one instance's ``step``:
a ``DeepSpeedEngine``, a Megatron optimizer), :class:`ScalerHooks` (a torch ``GradScaler``'s
``update()``), and the two helpers the collectors share (:func:`unwrap_optimizer`, :func:`scale_of`).
The step model that uses them is :mod:`trainmon.runtime.lifecycle`.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from trainmon.base.types import GradScaler, Optimizer

logger = logging.getLogger("trainmon")

StepHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""A step pre/post hook: ``hook(owner, args, kwargs)``, as torch's optimizer step hooks."""


_DCP_STATE_DICT = os.path.join("distributed", "checkpoint", "state_dict.py")


def state_dict_init_step() -> bool:
    """Whether the optimizer step now running is ``torch.distributed.checkpoint``'s state initialisation rather
    than a training step.

    ``set_optimizer_state_dict`` and ``get_optimizer_state_dict`` (how FSDP2 and torchtitan-style loops load and
    save an optimizer) call ``_init_optim_state`` on an optimizer that holds no state yet: ``optimizer.step()`` with
    zero gradients and the learning rate set to 0, so that the states exist to load into. Counted as a step, it
    would shift every later step by one against the loop's own count and write rows of a step that never trained.
    Found from the call stack (a few frames, once per optimizer step).
    """
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(24):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_init_optim_state" and code.co_filename.endswith(_DCP_STATE_DICT):
            return True
        frame = frame.f_back
    return False


class StepWrapper:
    """Step pre/post hooks for ONE instance whose ``step`` has none (DeepSpeed engine, Megatron optimizer).

    Installing sets the instance attribute ``step`` (the class is never patched);
    :meth:`uninstall` removes it, or, when something wrapped it again on top of us, leaves an
    inert pass-through. Hooks run only when ``boundary()`` is true (DeepSpeed calls
    ``engine.step()`` after every micro-batch but updates on accumulation boundaries only).
    The result of the last wrapped call is kept in :attr:`last_result` for post-hooks.

    The wrapper is installed as a method bound to the instance, carrying the marks of what it wraps, so that a
    torch LR scheduler made later can wrap it in turn (it takes the ``__func__`` of ``optimizer.step``) and one
    made earlier still finds its ``_wrapped_by_lr_sched`` mark.

    Args:
        owner: the instance whose ``step`` is wrapped.
        boundary: whether this call of ``step`` is an optimizer step (default: always).
        method: the name of the method wrapped (default ``step``; a DeepSpeed ``PipelineEngine``, whose
            ``step`` raises, has its optimizer step wrapped in ``_take_model_step`` and its batch in
            ``train_batch``).
        around: makes the wrapped call, ``around(inner, args, kwargs)`` (default: ``inner(*args, **kwargs)``);
            the step guard's decides whether the step is applied at all.
    """

    def __init__(self, owner: Any, boundary: Callable[[], bool] | None = None, method: str = "step",
                 around: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None = None) -> None:
        self.owner = owner
        self.boundary = boundary
        self.method = method
        self.around = around
        self._pre: OrderedDict[int, StepHook] = OrderedDict()  # weak-referenceable, as RemovableHandle needs
        self._post: OrderedDict[int, StepHook] = OrderedDict()
        self.last_result: Any = None
        self.active = False
        self._previous: Any = None
        self._installed: Any = None

    def register_step_pre_hook(self, hook: StepHook) -> RemovableHandle:
        handle = RemovableHandle(self._pre)
        self._pre[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: StepHook) -> RemovableHandle:
        handle = RemovableHandle(self._post)
        self._post[handle.id] = hook
        return handle

    def install(self) -> StepWrapper:
        namespace = self.owner.__dict__
        self._previous = namespace.get(self.method)
        inner = getattr(self.owner, self.method)  # the bound method, or a wrapper installed earlier

        def step(owner: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.active or (self.boundary is not None and not self.boundary()):
                return inner(*args, **kwargs)
            for hook in list(self._pre.values()):
                hook(self.owner, args, kwargs)
            self.last_result = inner(*args, **kwargs) if self.around is None else self.around(inner, args, kwargs)
            for hook in list(self._post.values()):
                hook(self.owner, args, kwargs)
            return self.last_result

        step.__dict__.update(getattr(getattr(inner, "__func__", inner), "__dict__", {}))  # an LR scheduler's mark
        step.__trainmon_step_wrapper__ = self  # type: ignore[attr-defined]
        self._installed = namespace[self.method] = types.MethodType(step, self.owner)
        self.active = True
        return self

    def uninstall(self) -> None:
        self.active = False
        self._pre.clear()
        self._post.clear()
        namespace = self.owner.__dict__
        if _wrapper_of(namespace.get(self.method)) is not self:
            return  # wrapped again on top of us: stay as an inert pass-through
        previous = self._previous
        # Unwind earlier trainmon wrappers that are already inert (e.g. after a config reload).
        while (earlier := _wrapper_of(previous)) is not None and not earlier.active:
            previous = earlier._previous
        if previous is None:
            del namespace[self.method]
        else:
            namespace[self.method] = previous


def installed_wrapper(owner: Any, method: str = "step") -> StepWrapper | None:
    """The active :class:`StepWrapper` installed on ``owner.method`` (the outermost, when it is trainmon's), or None.

    Example:
        >>> class Engine:
        ...     def step(self):
        ...         return 1
        >>> engine = Engine()
        >>> wrapper = StepWrapper(engine).install()
        >>> installed_wrapper(engine) is wrapper, installed_wrapper(engine, "other")
        (True, None)
        >>> wrapper.uninstall(); installed_wrapper(engine) is None
        True
    """
    wrapper = _wrapper_of(getattr(owner, "__dict__", {}).get(method))
    return wrapper if wrapper is not None and wrapper.active else None


def _wrapper_of(method: Any) -> StepWrapper | None:
    """The :class:`StepWrapper` that installed ``method`` itself (a wrapper around it copies its marks: not it)."""
    wrapper = getattr(method, "__trainmon_step_wrapper__", None)
    return wrapper if isinstance(wrapper, StepWrapper) and wrapper._installed is method else None


def unwrap_optimizer(optimizer: Optimizer) -> tuple[Optimizer, GradScaler | None]:
    """``(torch optimizer, GradScaler or None)`` behind a trainer's optimizer wrapper.

    accelerate's ``AcceleratedOptimizer`` (what Hugging Face callbacks receive) and Lightning's
    ``LightningOptimizer`` keep the real optimizer in ``.optimizer`` (Lightning: ``._optimizer``);
    accelerate keeps its ``GradScaler`` in ``.scaler``.
    """
    scaler = None
    for _ in range(4):  # wrappers of wrappers
        module = type(optimizer).__module__.split(".")[0]
        if module not in ("accelerate", "lightning", "pytorch_lightning"):
            break
        scaler = scaler if scaler is not None else getattr(optimizer, "scaler", None)
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer, scaler


def scale_of(scaler: GradScaler | None) -> torch.Tensor | None:
    """The current loss scale of an enabled torch ``GradScaler`` as a device tensor (no sync), else None."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    return getattr(scaler, "_scale", None)


class ScalerHooks:
    """Reads a torch ``GradScaler`` at each ``update()``: ``loss_scale`` and ``step_skipped``.

    ``update()`` runs once per optimizer step whether or not the scaler skipped it, so it also
    marks the step as finished for users who never call ``monitor.step()``. The instance's
    ``update`` is wrapped (an instance attribute, removed on close); nothing is read on the host.
    """

    def __init__(self, scaler: GradScaler,
                 on_update: Callable[[torch.Tensor | None, torch.Tensor | None], None], *,
                 wrap: Callable[[Callable[[], None]], Callable[[], None]] = lambda fn: fn) -> None:
        self.scaler = scaler
        self._on_update = on_update
        self._inner = scaler.update
        self.active = True
        read = wrap(self._read)  # trainmon's part, under the fail-safe guard; the user's update() outside it

        def update(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                read()
            return self._inner(*args, **kwargs)

        self._wrapper = update
        scaler.__dict__["update"] = update

    def _read(self) -> None:
        scale = scale_of(self.scaler)
        found: torch.Tensor | None = None
        states = getattr(self.scaler, "_per_optimizer_states", {})
        for state in states.values():
            for value in state.get("found_inf_per_device", {}).values():
                found = value.float() if found is None else found + value.to(found.device).float()
        skipped = None if found is None else (found > 0).float()
        # update() rescales in place: read the scale this step used before it changes
        self._on_update(None if scale is None else scale.detach().clone(), skipped)

    def close(self) -> None:
        self.active = False
        if self.scaler.__dict__.get("update") is self._wrapper:
            del self.scaler.__dict__["update"]
