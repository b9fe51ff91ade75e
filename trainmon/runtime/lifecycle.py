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
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from trainmon.collect.activations import named_tensors
from trainmon.collect.hooks import H, HookRegistry
from trainmon.collect.step_hooks import ScalerHooks

if TYPE_CHECKING:
    from trainmon.base.types import GradScaler, Optimizer
    from trainmon.collect.context import StepContext

logger = logging.getLogger("trainmon")

_ROOTS = "step_roots"
_BACKWARD = "step_backward"


@dataclass
class _Frame:
    """One training micro-step in flight: where its rows begin, whether its backward began/ended."""

    root: int
    mark: int
    returned: bool = False
    backward_started: bool = False
    backward_done: bool = False
    end: int = -1
    """Buffer length when the forward's rows were all recorded (its rows are ``mark:end``)."""
    micro: int = 0
    watched: bool = False
    """Its output has a tensor whose gradient hook tells when its backward begins."""


class StepLifecycle:
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
        self._pending: _Frame | None = None
        self._frames: list[_Frame] = []
        self._done: list[_Frame] = []
        """The step's training forwards that returned (in order), until their backward began or they were dropped."""
        self.registry.remove(_BACKWARD)
        self._suspended: list[bool] = []
        self._backward_task: int | None = None

    # ------------------------------------------------------------------ set-up
    def guarded(self, fn: H) -> H:
        """``fn`` (a hook of the step model) under the fail-safe guard as part ``step``: when it fails, the
        monitor cannot tell steps apart any more and switches itself off (:mod:`trainmon.base.guard`). While
        dynamo traces it (a root inside ``torch.compile``) it is called as it is, as without the guard."""
        return self.ctx.guard.wrap("step", fn, bypass=torch.compiler.is_compiling)

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
            self._frames.append(_Frame(root=-1, mark=-1))
            return
        ctx.forwards += 1
        ctx.micro_step = self.forwards.get(id(module), 0)
        self._frames.append(_Frame(root=id(module), mark=len(ctx.buffer.keys), micro=ctx.micro_step))
        ctx.training_forward_open = True

    def _forward_ok(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._frames:
            self._frames[-1].returned = True  # hooks registered without always_call run only on success

    def _forward_done(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._frames:
            return
        frame = self._frames.pop()
        self.ctx.training_forward_open = any(open_frame.root != -1 for open_frame in self._frames)
        if frame.root == -1:
            if self._suspended:
                self.ctx.collecting = self._suspended.pop()
            return
        if not frame.returned:  # the forward raised: its rows go, the micro-step is not counted
            self._rollback(frame.mark)
            return
        self.forwards[frame.root] = self.forwards.get(frame.root, 0) + 1
        if self.ctx.collecting:
            self.ctx.grouped.flush()  # the forward's activations, measured together
            frame.end = len(self.ctx.buffer.keys)
            if torch.is_grad_enabled():
                self._watch_backward(frame, output)

    def _watch_backward(self, frame: _Frame, output: Any) -> None:
        """Hooks on the forward's output tensors: mark when its backward begins (kept until the step ends, so
        that a pipeline's forwards, whose backwards come later, are each seen)."""
        self._pending = frame
        for _, tensor in named_tensors(output, ""):
            if tensor.requires_grad and tensor.grad_fn is not None:  # a hook on a leaf would outlive the step
                frame.watched = True
                self.registry.add(_BACKWARD, tensor.register_hook(self.guarded(
                    lambda grad, frame=frame: self._backward_begins(frame))))
        if frame.watched:
            self._done.append(frame)

    def _backward_begins(self, frame: _Frame) -> None:
        frame.backward_started = True
        self.backward_started()

    def backward_started(self) -> None:
        """Called from inside a backward pass on a collected step: schedule the end-of-backward work once.

        Two hops: a callback queued during the backward runs when the pass ends, but before
        callbacks queued later (torch DDP queues its gradient reduction when the first gradient
        is ready); a callback queued from that callback runs after all of them, when the
        gradients are reduced and final.
        """
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._backward_task:
            return
        self._backward_task = task
        engine = torch.autograd.Variable._execution_engine
        backward_ends = self.guarded(self._backward_ends)  # it runs inside the user's backward()
        engine.queue_callback(lambda: engine.queue_callback(backward_ends))

    def _backward_ends(self) -> None:
        self._backward_task = None
        if self._pending is not None and self._pending.backward_started:
            self._pending.backward_done = True
        if not self.ctx.collecting:
            self._drop_abandoned()
            return
        self.ctx.grouped.flush()  # the pass's activation gradients, measured together
        self._drop_abandoned()  # after the flush: its rows are renumbered with the pass's others
        guard = self.ctx.guard
        for hook in list(self.ctx.backward_end):  # each under its collector's part: one failing stops only that
            guard.run(part_of(hook), hook)

    def _drop_failed_backward(self) -> None:
        """A backward that began and never ended raised: drop its micro-step's rows."""
        frame = self._pending
        if frame is not None and frame.backward_started and not frame.backward_done:
            self._rollback(frame.mark)
            for subscriber in self.ctx.backward_failed:
                subscriber()
            self.forwards[frame.root] = max(0, self.forwards.get(frame.root, 1) - 1)
            self._backward_task = None
            if frame in self._done:
                self._done.remove(frame)
        self._pending = None

    def _drop_abandoned(self) -> None:
        """Drop the micro-steps whose backward never began although a later one of their root finished its
        backward: a backward that raised before it reached the model's output (pipeline schedules run their
        backwards in the order of their forwards, and forwards that share one backward all begin in it).

        Their forward rows go, the later micro-steps of the step move down by one (rows, counters, and the
        subscribers of :attr:`StepContext.micro_step_dropped`)."""
        done = self._done
        started_roots = {frame.root: i for i, frame in enumerate(done) if frame.backward_started}
        abandoned = [frame for i, frame in enumerate(done)
                     if not frame.backward_started and started_roots.get(frame.root, -1) > i]
        if not abandoned:
            self._done = [frame for frame in done if not frame.backward_started]  # begun: settled
            return
        ctx = self.ctx
        drop = getattr(ctx.buffer, "drop_rows", None)  # a StepBuffer (torch roots only make frames)
        for frame in reversed(abandoned):  # latest first: earlier frames' row ranges stay valid
            if drop is not None and frame.end >= frame.mark >= 0:
                drop(frame.mark, frame.end, frame.micro)
                removed = frame.end - frame.mark
                for later in [*done, *self._frames]:  # rows recorded after the dropped ones moved up
                    if later is not frame and later.mark >= frame.end:
                        later.mark -= removed
                        later.end = later.end - removed if later.end >= 0 else later.end
            self.forwards[frame.root] = max(0, self.forwards.get(frame.root, 1) - 1)
            if ctx.micro_step > frame.micro:
                ctx.micro_step -= 1
            for later in [*done, *self._frames]:
                if later.root == frame.root and later.micro > frame.micro:
                    later.micro -= 1
            for subscriber in ctx.micro_step_dropped:  # each under its collector's part, as backward_end
                ctx.guard.run(part_of(subscriber), subscriber, frame.micro)
        self._done = [frame for frame in done if not frame.backward_started and frame not in abandoned]

    def _rollback(self, mark: int) -> None:
        self.ctx.grouped.discard()  # kept since the pass began: they belong to it
        if mark >= 0:
            self.ctx.buffer.truncate(mark)

    def _optimizer_post(self, *args: Any) -> None:
        self.optimizer_stepped = True

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Every torch optimizer's step ends here, after its own post-hooks (the collectors' states are read)."""
        if optimizer is self.optimizer and self.scaler is None:  # under a scaler, its update() reads the step's verdict
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


def part_of(owner: Any) -> str:
    """The fail-safe guard's part of a collector, or of a collector's bound method (its ``PART``); else ``step``."""
    part = getattr(owner, "PART", None)
    if part is None:
        part = getattr(getattr(owner, "__self__", None), "PART", None)
    return part if isinstance(part, str) else "step"
