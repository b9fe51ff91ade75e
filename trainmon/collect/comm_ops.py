"""What each wrapped ``torch.distributed`` function communicates: its input and output tensors.

For every supported function, a *planner* reads the call's bound arguments and says which
tensors hold meaningful data before the call (``pre``: what this rank sends or contributes)
and after it (``post``: what this rank received), with their index ``i`` in the row name.
Buffers that only receive (a ``recv`` tensor, a ``broadcast`` tensor on a non-source rank) are
not measured before the call: they hold whatever the allocator left there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

if TYPE_CHECKING:
    from trainmon.base.types import ProcessGroup

Indexed = list[tuple[int, torch.Tensor]]


@dataclass
class CallPlan:
    """The tensors of one collective call.

    Attributes:
        group: the process group argument (None: the default group).
        pre: ``(i, tensor)`` measured before the call.
        post: ``(i, tensor)`` measured after the call (after ``wait()`` for async calls).
        async_op: the call returns work handle(s) whose completion ends the call.
    """

    group: ProcessGroup | None
    pre: Indexed
    post: Indexed
    async_op: bool


def _one(tensor: torch.Tensor | None) -> Indexed:
    return [] if tensor is None else [(0, tensor)]


def _many(tensors: Sequence[torch.Tensor] | None) -> Indexed:
    return list(enumerate(tensors or ()))


def _peer(args: Mapping[str, Any], key: str) -> int | None:
    """Global rank of ``src``/``dst``, given either as a global rank or as ``group_src``/``group_dst``."""
    if args.get(key) is not None:
        return int(args[key])
    group_peer = args.get(f"group_{key}")
    if group_peer is None:
        return None
    return dist.get_global_rank(args.get("group") or c10d._get_default_group(), group_peer)


def _in_out(pre_key: str, post_key: str, many_pre: bool = False, many_post: bool = False
            ) -> Callable[[Mapping[str, Any], int], CallPlan]:
    def plan(args: Mapping[str, Any], rank: int) -> CallPlan:
        pre = _many(args[pre_key]) if many_pre else _one(args[pre_key])
        post = _many(args[post_key]) if many_post else _one(args[post_key])
        return CallPlan(args.get("group"), pre, post, bool(args.get("async_op")))

    return plan


def _reduce(args: Mapping[str, Any], rank: int) -> CallPlan:
    mine = _peer(args, "dst") == rank
    return CallPlan(args.get("group"), _one(args["tensor"]), _one(args["tensor"]) if mine else [],
                    bool(args.get("async_op")))


def _broadcast(args: Mapping[str, Any], rank: int) -> CallPlan:
    mine = _peer(args, "src") == rank
    return CallPlan(args.get("group"), _one(args["tensor"]) if mine else [], _one(args["tensor"]),
                    bool(args.get("async_op")))


def _gather(args: Mapping[str, Any], rank: int) -> CallPlan:
    mine = _peer(args, "dst") == rank
    return CallPlan(args.get("group"), _one(args["tensor"]), _many(args.get("gather_list")) if mine else [],
                    bool(args.get("async_op")))


def _scatter(args: Mapping[str, Any], rank: int) -> CallPlan:
    mine = _peer(args, "src") == rank
    return CallPlan(args.get("group"), _many(args.get("scatter_list")) if mine else [], _one(args["tensor"]),
                    bool(args.get("async_op")))


def _send(asynchronous: bool) -> Callable[[Mapping[str, Any], int], CallPlan]:
    return lambda args, rank: CallPlan(args.get("group"), _one(args["tensor"]), [], asynchronous)


def _recv(asynchronous: bool) -> Callable[[Mapping[str, Any], int], CallPlan]:
    return lambda args, rank: CallPlan(args.get("group"), [], _one(args["tensor"]), asynchronous)


def _batch_p2p(args: Mapping[str, Any], rank: int) -> CallPlan:
    ops = list(args["p2p_op_list"])
    # P2POp.op is isend/irecv (ours or the original: both carry the name).
    sends = [(i, op.tensor) for i, op in enumerate(ops) if getattr(op.op, "__name__", "") == "isend"]
    recvs = [(i, op.tensor) for i, op in enumerate(ops) if getattr(op.op, "__name__", "") == "irecv"]
    return CallPlan(ops[0].group if ops else None, sends, recvs, True)


PLANNERS: dict[str, Callable[[Mapping[str, Any], int], CallPlan]] = {
    "all_reduce": _in_out("tensor", "tensor"),
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _in_out("tensor", "tensor_list", many_post=True),
    "all_gather_single": _in_out("input_tensor", "output_tensor"),
    "all_gather_into_tensor": _in_out("input_tensor", "output_tensor"),
    "_all_gather_base": _in_out("input_tensor", "output_tensor"),
    "reduce_scatter": _in_out("input_list", "output", many_pre=True),
    "reduce_scatter_single": _in_out("input", "output"),
    "reduce_scatter_tensor": _in_out("input", "output"),
    "_reduce_scatter_base": _in_out("input", "output"),
    "all_to_all": _in_out("input_tensor_list", "output_tensor_list", many_pre=True, many_post=True),
    "all_to_all_single": _in_out("input", "output"),
    "gather": _gather,
    "scatter": _scatter,
    "send": _send(False),
    "recv": _recv(False),
    "isend": _send(True),
    "irecv": _recv(True),
    "batch_isend_irecv": _batch_p2p,
}
"""Planner of every supported function (the names of :data:`trainmon.config.COMM_OPS`)."""


class ArgumentBinder:
    """Binds a call's arguments to a function's parameter names, defaults included (host only)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.signature = inspect.signature(function)
        self.defaults = {name: p.default for name, p in self.signature.parameters.items()
                         if p.default is not inspect.Parameter.empty}

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs).arguments
        return {**self.defaults, **bound}


def group_label(ranks: Sequence[int]) -> str:
    """Name a process group by its global ranks, compactly.

    Example:
        >>> group_label([0, 1, 2, 3]), group_label([1, 5, 9]), group_label([0, 3, 4]), group_label([2])
        ('g0-3', 'g1-9step4', 'g0_3_4', 'g2')
    """
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"g{ranks[0]}"
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(steps) == 1 and (step := steps.pop()) > 0 and (step == 1 or len(ranks) > 2):
        return f"g{ranks[0]}-{ranks[-1]}" + (f"step{step}" if step > 1 else "")
    return "g" + "_".join(str(r) for r in ranks)


def in_coalescing(group: ProcessGroup | None) -> bool:
    """Whether calls on ``group`` are being recorded by ``_coalescing_manager`` (they run at its exit)."""
    state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if not state:
        return False
    return (group if group is not None else c10d._get_default_group()) in state


def payload_bytes(plan: CallPlan) -> int:
    """Bytes the call moves on this rank: the larger of its measured inputs and outputs
    (the message size as nccl-tests counts it: the output of all_gather, the input of reduce_scatter)."""
    size_in = sum(t.numel() * t.element_size() for _, t in plan.pre)
    size_out = sum(t.numel() * t.element_size() for _, t in plan.post)
    return max(size_in, size_out)


class MeasuredWork(dist.Work):
    """A work handle that runs ``on_complete`` once, right after the call has completed.

    ``torch.distributed.Work`` does not allow replacing ``wait`` on an instance, so async calls
    return this subclass; every method delegates to the real handle. Completion is seen through
    ``wait()``, ``synchronize()`` and ``block_current_stream()`` (each makes the current stream, or
    the host, wait for the collective, so statistics computed afterwards read the result).
    Completion observed only through ``get_future()`` is not measured.
    """

    def __init__(self, work: dist.Work, on_complete: Callable[[], None]) -> None:
        super().__init__()
        self._work = work
        self._on_complete: Callable[[], None] | None = on_complete

    def _completed(self) -> None:
        callback, self._on_complete = self._on_complete, None
        if callback is not None:
            callback()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._work.wait(*args, **kwargs)
        self._completed()
        return result

    def synchronize(self) -> None:
        self._work.synchronize()
        self._completed()

    def block_current_stream(self) -> None:
        self._work.block_current_stream()
        self._completed()

    def get_future(self) -> Any:
        return self._work.get_future()

    def get_future_result(self) -> Any:
        return self._untyped().get_future_result()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def _source_rank(self) -> int:
        return self._work._source_rank()

    def boxed(self) -> Any:
        return self._work.boxed()

    def _get_duration(self) -> float:
        duration: float = self._untyped()._get_duration()
        return duration

    def _get_op_type(self) -> Any:
        return self._untyped()._get_op_type()

    def _untyped(self) -> Any:
        """The real handle, for the methods that torch's stubs leave out (they exist on the C++ class)."""
        return self._work
