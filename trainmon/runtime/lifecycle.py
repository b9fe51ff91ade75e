"""The step model: one component that owns the lifecycle of a monitor step for every integration.

A *monitor step* is one optimizer step. Within it:

- a **training micro-step** is a forward of a root module with grad enabled and the module in
  training mode; other forwards (evaluation, ``torch.no_grad()``, ``inference_mode``) are not
  counted and record no rows (collection is suspended while they run);
- a forward that raises, or a backward that raises (both caught by the user), leaves no rows:
  the rows recorded since that micro-step's forward began are rolled back and the micro-step is
  not counted. A backward that raised before it reached the model (in the loss, in a hook on the
  loss or a root-level backward hook) is seen later: a micro-step whose output never received a
  gradient when a later micro-step of the same root finished its backward is abandoned: its forward's
  rows go and the later micro-steps move down by one (a training forward without a backward at the end
  of a step keeps its rows: nothing tells it from a forward whose output was only looked at);
- the gradients are final at the **end of the backward pass** (after data-parallel reduction;
  :class:`StepContext.backward_end` subscribers run then) and the optimizer steps with them at
  its step pre-hook (after a closure's backward, after ``GradScaler.unscale_``, after clipping);
- the step **ends** when the user calls ``monitor.step()``, or, for users who do not (and in the first step,
  before it is known), at the first training root forward after the optimizer stepped or a
  ``GradScaler.update()`` ran (so a step the scaler skipped still ends, and step numbers stay aligned) that is
  called from where the step's first training forward was: the next iteration's. A forward from elsewhere is
  still this iteration's (a GAN's discriminator called again for the generator's loss), and an evaluation
  forward (no grad, eval mode) ends nothing. A step in which no training forward of the attached module ran (its
  forward called as ``model.forward(x)``, which runs no module hook, as pytorch/examples' forward-forward layers do)
  has nothing later to mark the next iteration: it ends at the optimizer's step (at ``GradScaler.update()`` under a
  scaler), and a ``monitor.step()`` right after that closes the same step. Without an optimizer (an update
  written by hand) and without ``monitor.step()``, a step is ``grad_acc_steps`` training forwards of the root;
- whether the step was **applied**: with a ``GradScaler`` from its ``found_inf`` (scalar
  ``step_skipped``, with ``loss_scale``), otherwise from whether the optimizer's step ran.

Framework specifics come in through two small pieces in :mod:`trainmon.collect.step_hooks`:
:class:`~trainmon.collect.step_hooks.StepWrapper` gives pre/post step hooks to an object that has none (a
``DeepSpeedEngine``, a Megatron optimizer), and :class:`~trainmon.collect.step_hooks.ScalerHooks` reads a
torch ``GradScaler`` at its ``update()``.

Here: where steps end and whether they were applied (:class:`StepLifecycle`'s hooks on the roots' forward pre-hooks,
the optimizer and the scaler). The frames of the micro-steps in flight (a forward's end, its backward's beginning
and end, the rows of failed and abandoned micro-steps) are its base,
:class:`~trainmon.runtime.micro_steps.MicroSteps`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from trainmon.collect.hooks import HookRegistry
from trainmon.collect.step_hooks import ScalerHooks, state_dict_init_step
from trainmon.runtime.micro_steps import BACKWARD_HOOKS, Frame, MicroSteps, part_of

if TYPE_CHECKING:
    from trainmon.base.types import GradScaler, Optimizer
    from trainmon.collect.context import StepContext

logger = logging.getLogger("trainmon")

_ROOTS = "step_roots"
_STATE_INIT = "state_init_steps"


class StepLifecycle(MicroSteps):
    """Owns when micro-steps and steps begin and end, for every integration.

    Args:
        ctx: the monitor's step context (its ``collecting`` flag is suspended during
            evaluation forwards; its buffer is rolled back after a failed pass).
        end_step: ends the current step (the session's ``end_step(None, {}, by_user=False)``).
    """

    def __init__(self, ctx: StepContext, end_step: Callable[[], Any]) -> None:
        self.ctx = ctx
        ctx.schedule_backward_end = self.backward_started
        self._end_step = end_step
        self.registry = HookRegistry()
        self.optimizer: Optimizer | None = None
        self.scaler: ScalerHooks | None = None
        self.user_steps = False
        self.closing = False
        """The monitor is closing: a step it ends now never reached its optimizer step (not a skipped step)."""
        self.drive_by_trainer = False
        """A trainer's callbacks say where micro-steps begin and steps end (:meth:`drive_by_callbacks`)."""
        self.ended_without_forward = False
        """The step model just ended a step at its optimizer step because no training forward of the root ran in it
        (:meth:`_end_without_forward`); a ``monitor.step()`` before anything else closes that same step."""
        self._warned: set[str] = set()
        self.on_first_forward: Callable[[], None] | None = None
        """Called once, as the first training micro-step begins (before its forward runs), then forgotten."""
        self.reset()

    def reset(self) -> None:
        """The state of a new step."""
        self.forwards: dict[int, int] = {}
        self.ended_without_forward = False
        self.optimizer_stepped = False
        self.scaler_updated = False
        self.first_site: tuple[tuple[str, int], ...] | None = None
        """Where the user's code called this step's first training forward (kept while steps end by themselves)."""
        self.skip_flags: list[torch.Tensor | float] = []
        """This step's verdicts on whether the update was skipped: a GradScaler's, the step guard's."""
        self._pending: Frame | None = None
        self._frames: list[Frame] = []
        self._done: list[Frame] = []
        """The step's training forwards that returned (in order), until their backward began or they were dropped."""
        self.registry.remove(BACKWARD_HOOKS)
        self._suspended: list[bool] = []
        self._backward_task: int | None = None

    # ------------------------------------------------------------------ set-up
    def hook_roots(self, roots: list[Any]) -> None:
        guarded = self.guarded
        for root in roots:
            if isinstance(root, torch.nn.Module):
                self.ctx.training_forward_open = False  # until a training forward of the root begins
                self.registry.add(_ROOTS, root.register_forward_pre_hook(guarded(self._forward_pre)))
                self.registry.add(_ROOTS, root.register_forward_hook(guarded(self._forward_ok)))
                self.registry.add(_ROOTS, root.register_forward_hook(guarded(self._forward_done), always_call=True))
            else:  # MindSpore cells: every forward is a training micro-step
                self.registry.add(_ROOTS, root.register_forward_pre_hook(guarded(self._forward_pre_plain)))

    # ------------------------------------------------------------------ driven by a trainer's callbacks
    def drive_by_callbacks(self) -> None:
        """A trainer (Lightning) tells where micro-steps begin: root forwards no longer count.

        Lightning calls ``training_step``/``validation_step``, not the module's ``forward``, so the
        root's forward hooks may never fire; its callback calls :meth:`micro_step_begins`,
        :meth:`backward_ended`, :meth:`suspend` and :meth:`resume`.
        """
        self.registry.remove(_ROOTS)
        self.drive_by_trainer = True
        self.ctx.training_forward_open = True  # the root's forwards are not followed
        if self.optimizer is not None:
            self.hook_optimizer(self.optimizer)

    def micro_step_begins(self) -> None:
        """A training micro-step (one batch, forward and backward) begins."""
        self._forward_pre_plain(self, None)

    def suspend(self) -> None:
        """An evaluation loop begins: nothing is recorded until :meth:`resume`."""
        self._suspended.append(self.ctx.collecting)
        self.ctx.collecting = False

    def resume(self) -> None:
        if self._suspended:
            self.ctx.collecting = self._suspended.pop()

    def backward_ended(self) -> None:
        """A backward pass ended and the gradients are final (the trainer says so, e.g. ``on_after_backward``)."""
        self._backward_ends()

    def hook_optimizer(self, optimizer: Optimizer | None) -> None:
        self.optimizer = optimizer
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self.registry.add(_ROOTS, optimizer.register_step_post_hook(self.guarded(self._optimizer_post)))
        if isinstance(optimizer, torch.optim.Optimizer) and not self.drive_by_trainer:
            # torch runs the global post-hooks after every instance's: a step ended there changes the optimizer's
            # own hooks (collectors arm and disarm) after torch iterated over them, never while it does
            self.registry.add(_ROOTS, register_optimizer_step_post_hook(
                self.guarded(self._after_optimizer_step)))
        if not self.registry.count(_STATE_INIT):  # torch runs global pre-hooks first and global post-hooks last
            self.registry.add(_STATE_INIT, register_optimizer_step_pre_hook(self.guarded(self._state_init_begins)))
            self.registry.add(_STATE_INIT, register_optimizer_step_post_hook(self.guarded(self._state_init_ends)))

    def hook_scaler(self, scaler: GradScaler | None) -> None:
        if scaler is not None and self.scaler is None:
            self.scaler = ScalerHooks(scaler, self._scaler_update, wrap=self.guarded)
            self.ctx.scaler = scaler

    def close(self) -> None:
        self.registry.remove_all()
        if self.scaler is not None:
            self.scaler.close()
            self.scaler = None
        self.ctx.scaler = None
        while self._suspended:
            self.ctx.collecting = self._suspended.pop()

    # ------------------------------------------------------------------ queries
    @property
    def active(self) -> bool:
        """Whether anything of a training step happened since the last step ended."""
        return bool(self.forwards) or self.optimizer_stepped or self.scaler_updated

    @property
    def finished(self) -> bool:
        """The optimizer stepped (or the scaler decided to skip): the next forward starts a new step."""
        return self.optimizer_stepped or self.scaler_updated

    # ------------------------------------------------------------------ hooks
    def _maybe_end(self) -> None:
        if self.finished and not self.user_steps:
            self._end_step()  # the user does not call monitor.step()

    def _maybe_end_training(self) -> None:
        """Before a training root forward, when the user does not call ``monitor.step()`` (or has not yet): the
        step ends here when the optimizer stepped and this forward is the next iteration's, i.e. called from where
        the step's first training forward was. A forward from elsewhere is still this iteration's (a GAN's
        discriminator, called again for the generator's loss after its own optimizer stepped)."""
        if self.user_steps:
            return
        if self.finished or self._counted_step_done():
            site = _call_site()
            if self.first_site is not None and site != self.first_site:
                return
            self._end_step()
            self.first_site = site
        elif self.first_site is None:
            self.first_site = _call_site()

    def _counted_step_done(self) -> bool:
        """Without an optimizer (an update written by hand, pytorch/examples' word_language_model) nothing marks the
        end of a step but ``monitor.step()``: until the user calls it, a step is ``grad_acc_steps`` training forwards
        of a root (else every batch of the run would be a micro-step of step 0)."""
        if self.optimizer is not None or self.drive_by_trainer or not self.forwards:
            return False
        if max(self.forwards.values()) < self.ctx.grad_acc_steps:
            return False
        self._warn_once("counted", "trainmon: attach() got no optimizer and monitor.step() has not been called: each "
                        "step is taken to be %d training forward(s) of the model (attach(grad_acc_steps=...)); call "
                        "monitor.step() after your update if that is not so", self.ctx.grad_acc_steps)
        return True

    def _forward_pre_plain(self, module: Any, args: Any) -> None:
        self._maybe_end()
        count = self.forwards.get(id(module), 0)
        self.forwards[id(module)] = count + 1
        self.ctx.micro_step = count
        self.ctx.forwards += 1
        self._first_forward()

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        training = torch.is_grad_enabled() and module.training
        if training:  # an evaluation between the optimizer's step and monitor.step() does not end the step
            self._maybe_end_training()
        self._drop_failed_backward()
        ctx = self.ctx
        if not training:
            # evaluation / no_grad / inference_mode: not a micro-step, no rows
            self._suspended.append(ctx.collecting)
            ctx.collecting = False
            self._frames.append(Frame(root=-1, mark=-1))
            return
        ctx.forwards += 1
        ctx.micro_step = self.forwards.get(id(module), 0)
        self._frames.append(Frame(root=id(module), mark=len(ctx.buffer.keys), micro=ctx.micro_step))
        ctx.training_forward_open = True
        self._first_forward()

    def _first_forward(self) -> None:
        if self.on_first_forward is not None:
            call, self.on_first_forward = self.on_first_forward, None
            call()

    def _state_init_begins(self, *args: Any) -> None:
        """Before any hook of a torch optimizer's step: is it ``torch.distributed.checkpoint``'s state
        initialisation (not a training step: nothing of trainmon's acts on it)?"""
        self.ctx.state_init_step = state_dict_init_step()

    def _state_init_ends(self, *args: Any) -> None:
        self.ctx.state_init_step = False

    def _optimizer_post(self, *args: Any) -> None:
        if not self.ctx.state_init_step:
            self.optimizer_stepped = True

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Every torch optimizer's step ends here, after its own post-hooks (the collectors' states are read)."""
        # under a scaler, its update() reads the step's verdict; a state initialisation is not a step
        if optimizer is self.optimizer and self.scaler is None and not self.ctx.state_init_step:
            self._end_without_forward()

    def _scaler_update(self, scale: torch.Tensor | None, skipped: torch.Tensor | None) -> None:
        self.scaler_updated = True
        ctx = self.ctx
        if ctx.collecting:
            if scale is not None:
                ctx.buffer.add_scalar("loss_scale", scale)
            if skipped is not None:
                self.skip_flags.append(skipped)
        self._end_without_forward()

    def _end_without_forward(self) -> None:
        """The optimizer stepped (or the scaler decided) in a step where no training forward of the root ran: the
        root's forward was called as ``model.forward(x)`` (no module hook runs), or ran in eval mode. No later forward
        will mark the next iteration, so, unless the user calls ``monitor.step()``, the step ends now (else every
        later iteration would fall into this step)."""
        if self.user_steps or self.forwards or self.drive_by_trainer:
            return
        self._end_step()
        self.ended_without_forward = True

    def step_guarded(self, skipped: torch.Tensor | float) -> None:
        """The step guard decided this step (1: the update is skipped): the step is over, as after the optimizer's
        step, even when the guard did not call it."""
        self.optimizer_stepped = True
        self.skip_flags.append(skipped)
        if not isinstance(skipped, torch.Tensor) and skipped > 0:  # decided on the host: step() was not called
            for subscriber in list(self.ctx.step_not_taken):  # each under its collector's part
                self.ctx.guard.run(part_of(subscriber), subscriber)

    # ------------------------------------------------------------------ step end
    def before_end(self, by_user: bool, has_scalars: bool) -> dict[str, torch.Tensor | float]:
        """At the end of a step, before its transfer: settle failed passes and whether the step was applied.

        Returns:
            ``{"step_skipped": ...}`` when the step guard or a GradScaler decided it (the step guard decides every
            step, collected or not), or, on a collected step, when nothing else (an engine) said it; else ``{}``.
        """
        self._drop_failed_backward()
        if by_user and not self.active and not has_scalars:
            self._warn_once("empty", "trainmon: monitor.step() was called with no training forward, optimizer step "
                            "or scalar since the previous step; the step is counted but empty (called twice?)")
        if self.skip_flags:
            return {"step_skipped": _any_skipped(self.skip_flags)}
        ctx, buffer = self.ctx, self.ctx.buffer
        known = "step_skipped" in buffer.scalar_names or "step_skipped" in buffer.host_scalars
        if (ctx.collecting and not known and self.optimizer is not None and self.forwards
                and (not self.closing or self.optimizer_stepped)
                and hasattr(self.optimizer, "register_step_post_hook")):
            # (a step ended by close() before its optimizer step - forwards after the last one, a crash - was not
            # skipped: it never came to its update; one ended by close() after it, the loop's last, was applied)
            # nothing (scaler, engine) told us: the step was skipped when the optimizer's step did not run
            return {"step_skipped": 0.0 if self.optimizer_stepped else 1.0}
        return {}

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


_LIBRARIES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
"""torch's and trainmon's folders: frames there are not the user's code."""


def _call_site(depth: int = 3) -> tuple[tuple[str, int], ...]:
    """The first ``depth`` frames of the caller's stack outside torch and trainmon (file, line): where the user's
    code called a forward. Read only at the first training forward of a step, while steps end by themselves."""
    site: list[tuple[str, int]] = []
    frame = sys._getframe(1)
    while frame is not None and len(site) < depth:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARIES):
            site.append((name, frame.f_lineno))
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(site)


def _any_skipped(flags: list[torch.Tensor | float]) -> torch.Tensor | float:
    """1 when any flag is (device tensors stay on the device: no sync)."""
    tensors = [flag for flag in flags if isinstance(flag, torch.Tensor)]
    numbers = [float(flag) for flag in flags if not isinstance(flag, torch.Tensor)]
    if any(number > 0 for number in numbers) or not tensors:
        return float(any(number > 0 for number in numbers))
    combined = (tensors[0] > 0).to(torch.float32)
    for flag in tensors[1:]:
        combined = torch.maximum(combined, (flag > 0).to(combined.device, torch.float32))
    return combined
