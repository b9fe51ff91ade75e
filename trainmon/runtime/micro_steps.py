"""The training micro-steps in flight, the base of the step model (:class:`~trainmon.runtime.lifecycle.StepLifecycle`):
one :class:`Frame` per root forward, its end (a forward that raised leaves no rows), hooks on its output
that tell when its backward begins, the end of the backward pass (two hops of autograd's queued callbacks, then
the :attr:`~trainmon.collect.context.StepContext.backward_end` subscribers), and the rows of the micro-steps whose
backward raised or never began (rolled back, the later micro-steps moved down by one); :func:`part_of`, the
fail-safe guard's part of a collector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.activations import named_tensors

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.collect.hooks import H, HookRegistry

BACKWARD_HOOKS = "step_backward"
"""The registry group of the hooks on the forwards' outputs (removed when the step ends)."""


@dataclass
class Frame:
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


class MicroSteps:
    """The frames of the training micro-steps in flight and the passes they go through (a base of
    :class:`~trainmon.runtime.lifecycle.StepLifecycle`, whose ``reset`` sets the per-step state declared below, and
    whose root forward pre-hook opens the frames).
    """

    ctx: StepContext
    registry: HookRegistry
    forwards: dict[int, int]
    """Training forwards of each root (by ``id``) counted in this step."""
    _pending: Frame | None
    _frames: list[Frame]
    """The root forwards running (an evaluation forward's with ``root == -1``), innermost last."""
    _done: list[Frame]
    _suspended: list[bool]
    """``ctx.collecting`` as it was before each suspension (an evaluation forward, a trainer's evaluation loop)."""
    _backward_task: int | None
    """The autograd graph task whose end is scheduled (:meth:`backward_started`)."""

    def guarded(self, fn: H) -> H:
        """``fn`` (a hook of the step model) under the fail-safe guard as part ``step``: when it fails, the
        monitor cannot tell steps apart any more and switches itself off (:mod:`trainmon.base.guard`). While
        dynamo traces it (a root inside ``torch.compile``) it is called as it is, as without the guard."""
        return self.ctx.guard.wrap("step", fn, bypass=torch.compiler.is_compiling)

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

    def _watch_backward(self, frame: Frame, output: Any) -> None:
        """Hooks on the forward's output tensors: mark when its backward begins (kept until the step ends, so
        that a pipeline's forwards, whose backwards come later, are each seen)."""
        self._pending = frame
        for _, tensor in named_tensors(output, ""):
            if tensor.requires_grad and tensor.grad_fn is not None:  # a hook on a leaf would outlive the step
                frame.watched = True
                self.registry.add(BACKWARD_HOOKS, tensor.register_hook(self.guarded(
                    lambda grad, frame=frame: self._backward_begins(frame))))
        if frame.watched:
            self._done.append(frame)

    def _backward_begins(self, frame: Frame) -> None:
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


def part_of(owner: Any) -> str:
    """The fail-safe guard's part of a collector, or of a collector's bound method (its ``PART``); else ``step``."""
    part = getattr(owner, "PART", None)
    if part is None:
        part = getattr(getattr(owner, "__self__", None), "PART", None)
    return part if isinstance(part, str) else "step"
