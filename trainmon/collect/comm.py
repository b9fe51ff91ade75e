"""Statistics of the tensors that pass through ``torch.distributed`` collectives (family ``comm``).

While a :class:`CommCollector` is attached, the supported functions of ``torch.distributed``
(and the same names in ``torch.distributed.distributed_c10d``, which its own helpers call) are
replaced by thin wrappers (installed and removed by :mod:`trainmon.collect.comm_wraps`);
:meth:`CommCollector.close` puts the originals back. On a step that is
not collected a wrapper calls straight through. On a collected step it measures the inputs
before the call and the outputs after it (for async calls: after ``wait()`` on the returned
handle), on the device and without a host synchronisation, and adds the host-known payload size
and call count. Calls of a step with the same row name are combined exactly on the device at the
end of the step (norm = sqrt(sum of norm^2), min of mins, max of maxes, counts and sums added).

Row names are ``{op}.{site}.{pre|post}.{i}``: ``site`` is the process group named by its global
ranks (``g0-7``) followed by the call's index among the calls of that op on that group in the
micro-step (``g0-7.call2``), or by ``@{file}:{function}:{line}`` with ``call_sites: true`` (then the
calls made from one call site are combined into one row); ``i`` is the tensor's index in the call
(the source rank's slot for ``all_gather`` outputs).

Each row carries the phase it really ran in (``RowKey.run_phase``): ``backward`` inside autograd's
backward pass, ``forward`` inside the forward of a root module, ``optimizer`` inside the optimizer's
step, else ``communication``. So a NaN entering at a collective in the forward pass is ordered
among the forward rows, where it happened.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainmon.base import guard, process_groups
from trainmon.base.records import RowKey
from trainmon.collect.comm_ops import (
    PLANNERS,
    ArgumentBinder,
    CallPlan,
    MeasuredWork,
    group_label,
    in_coalescing,
    payload_bytes,
)
from trainmon.collect.comm_wraps import Wrap, install, restore
from trainmon.collect.context import in_backward
from trainmon.collect.hooks import HookedCollector
from trainmon.collect.stats import combine_partials_torch, partial_stats
from trainmon.config import COMM_OPS

if TYPE_CHECKING:
    from trainmon.base.types import Optimizer, ProcessGroup
    from trainmon.collect.buffer import Buffer
    from trainmon.collect.context import StepContext
    from trainmon.config import CommunicationConfig

log = logging.getLogger(__name__)

FAMILY = "comm"


def _plumbing_dirs() -> tuple[str, ...]:
    """Where communication plumbing lives (not the call site a user wants to see): torch.distributed,
    deepspeed.comm when it is loaded, this module and the fail-safe guard that runs its measurement; real,
    resolved paths of the installed packages (a user's folder that happens to be called ``deepspeed`` is not
    plumbing)."""
    places = [os.path.dirname(dist.__file__) + os.sep, os.path.realpath(__file__), os.path.realpath(guard.__file__)]
    deepspeed_comm_file: str | None = getattr(sys.modules.get("deepspeed.comm"), "__file__", None)
    if deepspeed_comm_file:
        places.append(os.path.dirname(os.path.realpath(deepspeed_comm_file)) + os.sep)
    places[0] = os.path.realpath(places[0]) + os.sep
    return tuple(places)


@dataclass
class _Row:
    order: int
    micro_step: int
    phase: str
    partials: list[torch.Tensor] = field(default_factory=list)


class CommCollector(HookedCollector):
    """Wraps the ``torch.distributed`` collectives while attached and measures their tensors.

    Args:
        ctx: the monitor's step context; rows are measured with ``ctx.specs["comm"]`` and only
            while ``ctx.wants("comm")``.
        config: the ``communication`` section.
        roots: root modules; a forward pre-hook and a forward hook on each tell collectives inside
            the forward pass (phase ``forward``) from the others. Removed by :meth:`close`.
        optimizer: the optimizer whose step marks phase ``optimizer`` (step pre/post hooks), or None.

    Example:
        >>> collector = CommCollector(ctx, config.communication)   # wrappers installed  # doctest: +SKIP
        >>> dist.all_reduce(tensor)                                  # measured on collected steps  # doctest: +SKIP
        >>> collector.before_transfer(); collector.close()          # originals restored  # doctest: +SKIP
    """

    PART = "communication"

    def __init__(self, ctx: StepContext, config: CommunicationConfig, roots: Sequence[torch.nn.Module] = (),
                 optimizer: Optimizer | None = None) -> None:
        super().__init__(ctx)
        self.config = config
        self._site_filter = re.compile(config.call_site_filter) if config.call_site_filter is not None else None
        self._rank = process_groups.global_rank()
        self._local = threading.local()  # depth of our wrappers on this thread (nested calls pass through)
        self._rows: dict[tuple[str, int], _Row] = {}
        self._traffic: dict[str, list[int]] = {}  # "{op}.{site}" -> [calls, bytes]
        self._calls: dict[tuple[str, int], int] = {}  # ("{op}.{group}", micro_step) -> calls so far
        self._forward_depth = 0  # root forwards running (nested calls of a root count too)
        self._in_optimizer = False
        self._step_buffer: Buffer | None = None
        self._flushed: Buffer | None = None
        self._groups: dict[ProcessGroup, str] = {}
        self._sites: dict[tuple[CodeType, int], str | None] = {}
        self._plumbing: dict[CodeType, bool] = {}
        self._places = _plumbing_dirs()
        self._binders: dict[str, ArgumentBinder] = {}
        self._wraps: list[Wrap] = []
        self._active = True
        self._hook_phases(roots, optimizer)
        install(config.ops or list(COMM_OPS), self._wrap, self._wraps)

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self._reset(None)

    def before_transfer(self) -> None:
        """Combine each row's calls on the device and add rows and traffic scalars to the buffer."""
        buffer = self.ctx.buffer
        if self._step_buffer is buffer:
            self._flush(buffer)
        # Collectives run by the monitor itself after this point (e.g. a cross-rank reduction of
        # statistics) belong to no user step: ignore them until the buffer is replaced.
        self._flushed = buffer
        self._reset(None)

    def release(self) -> None:
        """Restore the original functions (once, by ``close``, which also removes the phase hooks).

        Where another trainmon collector wrapped ours (a config reload attaches the new collectors
        before closing the old ones), ours is spliced out of the chain. Where foreign code wrapped
        ours, its wrapper is left in place (not clobbered) and ours underneath only calls through.
        """
        self._active = False
        for module, name in restore(self._wraps):
            log.info("%s.%s was wrapped again after trainmon; trainmon's wrapper stays under it and "
                     "only calls through", module.__name__, name)
        self._wraps.clear()
        self._groups.clear()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Calls made inside this block on this thread are not measured (the monitor's own collectives)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    # ------------------------------------------------------------------ phases
    def _hook_phases(self, roots: Sequence[torch.nn.Module], optimizer: Optimizer | None) -> None:
        """One-line hooks that track whether a root forward or the optimizer step is running."""
        for root in roots:
            self.keep(root.register_forward_pre_hook(self.guarded(self._enter_forward)))
            self.keep(root.register_forward_hook(self.guarded(self._leave_forward), always_call=True))
        if (optimizer is not None and hasattr(optimizer, "register_step_pre_hook")
                and hasattr(optimizer, "register_step_post_hook")):
            self.keep(optimizer.register_step_pre_hook(self.guarded(self._enter_optimizer)))
            self.keep(optimizer.register_step_post_hook(self.guarded(self._leave_optimizer)))

    def _enter_forward(self, *args: Any) -> None:
        self._forward_depth += 1

    def _leave_forward(self, *args: Any) -> None:
        self._forward_depth = max(self._forward_depth - 1, 0)

    def _enter_optimizer(self, *args: Any) -> None:
        self._in_optimizer = True

    def _leave_optimizer(self, *args: Any) -> None:
        self._in_optimizer = False

    def _phase(self) -> str:
        """The phase a collective runs in now (checked in this order: a forward recomputed inside the
        backward pass, as activation checkpointing does, is backward)."""
        if in_backward():
            return "backward"
        if self._forward_depth:
            return "forward"
        return "optimizer" if self._in_optimizer else "communication"

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, name: str, original: Callable[..., Any]) -> Wrap:
        """The wrapper of one function (installed by :func:`~trainmon.collect.comm_wraps.install`)."""
        wrap = Wrap(name, original, [])

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = self.ctx
            if (not self._active or not ctx.collecting or FAMILY not in ctx.specs
                    or ctx.buffer is self._flushed or getattr(self._local, "depth", 0) != 0):
                return wrap.original(*args, **kwargs)
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                return self._call(name, wrap.original, args, kwargs)
            finally:
                self._local.depth -= 1

        wrapper._trainmon_wrap = wrap  # type: ignore[attr-defined]
        wrap.wrapper = wrapper
        return wrap

    def _call(self, name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The collective, measured: trainmon's work before and after it runs under the fail-safe guard, the
        collective itself outside it (its own errors reach the caller unchanged, and it always runs once)."""
        guard = self.ctx.guard
        started = guard.run(self.PART, self._before, name, original, args, kwargs)
        if started is None:
            return original(*args, **kwargs)
        prefix, plan, buffer = started
        result = original(*args, **kwargs)
        after = guard.run(self.PART, self._after, result, prefix, plan, buffer)
        return result if after is None else after

    def _before(self, name: str, original: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[str, CallPlan, Buffer] | None:
        """Plan a call and measure its inputs: ``(row prefix, plan, buffer)``, or None when not measured."""
        plan = self._plan(name, original, args, kwargs)
        site = None if plan is None else self._site(plan)
        if plan is None or site is None:
            return None
        prefix = f"{name}.{site}"
        buffer = self._start(self.ctx.buffer)
        traffic = self._traffic.setdefault(prefix, [0, 0])
        traffic[0] += 1
        traffic[1] += payload_bytes(plan)
        if not self.config.call_sites:  # one row per call: its index among the op's calls on the group
            counter = (prefix, self.ctx.micro_step)
            index = self._calls.get(counter, 0)
            self._calls[counter] = index + 1
            prefix = f"{prefix}.call{index}"
        self._measure(prefix, "pre", plan.pre)
        return prefix, plan, buffer

    def _after(self, result: Any, prefix: str, plan: CallPlan, buffer: Buffer) -> Any:
        """Measure a call's outputs (an async one's when its work completes); returns what the caller gets."""
        if not plan.post or in_coalescing(plan.group):
            return result  # inside _coalescing_manager the call only runs at the manager's exit
        if not plan.async_op:
            self._measure(prefix, "post", plan.post)
            return result
        return self._measure_on_completion(result, prefix, plan, buffer)

    def _plan(self, name: str, original: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> CallPlan | None:
        binder = self._binders.get(name)
        if binder is None:
            binder = self._binders[name] = ArgumentBinder(original)
        try:
            plan = PLANNERS[name](binder(args, kwargs), self._rank)
        except (TypeError, KeyError, ValueError, RuntimeError):
            return None  # a malformed call: let torch.distributed raise its own error
        if c10d._rank_not_in_group(plan.group):
            return None
        return plan

    def _site(self, plan: CallPlan) -> str | None:
        """``g{ranks}`` plus ``@file:function:line`` with call sites; None when filtered out."""
        group = plan.group if plan.group is not None else c10d._get_default_group()
        label = self._groups.get(group)
        if label is None:
            label = self._groups[group] = group_label(process_groups.members(group))
        if not self.config.call_sites and self._site_filter is None:
            return label
        frame = self._caller()
        if frame is None:
            return label
        key = (frame.f_code, frame.f_lineno)
        if key not in self._sites:  # formatted and filtered once per distinct call site
            self._sites[key] = self._describe(frame)
        site = self._sites[key]
        if site is None:
            return None
        return f"{label}@{site}" if self.config.call_sites else label

    def _caller(self) -> FrameType | None:
        """The first frame outside torch.distributed, deepspeed.comm and this module (a few hops)."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            plumbing = self._plumbing.get(code)
            if plumbing is None:
                path = os.path.realpath(code.co_filename)
                plumbing = self._plumbing[code] = any(path.startswith(p) or path == p for p in self._places)
            if not plumbing:
                return frame
            frame = frame.f_back
        return None

    def _describe(self, frame: FrameType) -> str | None:
        code = frame.f_code
        text = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        if self._site_filter is not None and not self._site_filter.search(text):
            return None
        stem = os.path.splitext(os.path.basename(code.co_filename))[0]
        return re.sub(r"[^A-Za-z0-9_:-]", "_", f"{stem}:{code.co_name}:{frame.f_lineno}")

    # ------------------------------------------------------------------ measuring
    def _start(self, buffer: Buffer) -> Buffer:
        if self._step_buffer is not buffer:  # first measured call of a step
            self._reset(buffer)
        return buffer

    def _reset(self, buffer: Buffer | None) -> None:
        self._rows.clear()
        self._traffic.clear()
        self._calls.clear()
        self._step_buffer = buffer

    def _measure(self, prefix: str, when: str, tensors: list[tuple[int, torch.Tensor]]) -> None:
        spec = self.ctx.specs[FAMILY]
        micro_step = self.ctx.micro_step
        phase = self._phase() if tensors else ""
        for i, tensor in tensors:
            key = (f"{prefix}.{when}.{i}", micro_step)
            row = self._rows.get(key)
            if row is None:  # a row combining several calls keeps the phase and order of its first
                row = self._rows[key] = _Row(self.ctx.buffer.next_order(), micro_step, phase)
            row.partials.append(partial_stats(tensor, spec))

    def _measure_on_completion(self, result: Any, prefix: str, plan: CallPlan, buffer: Buffer) -> Any:
        works = result if isinstance(result, list) else [result]
        if not works or not all(isinstance(w, dist.Work) for w in works):
            return result  # not a member of the group, or a backend without work handles
        pending = [len(works)]

        def done() -> None:
            pending[0] -= 1
            # Measured only if the step is still the one that issued the call.
            if pending[0] == 0 and self._active and self.ctx.collecting and self._step_buffer is buffer:
                self._measure(prefix, "post", plan.post)

        # done() runs from the user's work.wait(): under the guard, like the hooks
        wrapped = [MeasuredWork(w, self.ctx.guard.wrap(self.PART, done)) for w in works]
        return wrapped if isinstance(result, list) else wrapped[0]

    def _flush(self, buffer: Buffer) -> None:
        """Combine the calls of each row on the device (one combination per distinct call count)."""
        items = list(self._rows.items())
        by_shape: dict[tuple[int, torch.device], list[int]] = {}
        for index, (_, row) in enumerate(items):
            by_shape.setdefault((len(row.partials), row.partials[0].device), []).append(index)
        combined: dict[int, torch.Tensor] = {}
        for (calls, _), indices in by_shape.items():
            if calls == 1:
                combined.update((i, items[i][1].partials[0]) for i in indices)
                continue
            # [calls, rows, 8] -> [rows, 8]
            stacked = torch.stack([torch.stack(items[i][1].partials) for i in indices], dim=1)
            out = combine_partials_torch(stacked)
            combined.update((i, out[k]) for k, i in enumerate(indices))
        for index, ((name, micro_step), row) in enumerate(items):
            run_phase = "" if row.phase == "communication" else row.phase
            buffer.add(RowKey(FAMILY, name, micro_step, 0, row.order, run_phase), combined[index])
        for prefix, (calls, nbytes) in self._traffic.items():
            buffer.add_scalar(f"comm/{prefix}/calls", calls)
            buffer.add_scalar(f"comm/{prefix}/bytes", nbytes)

