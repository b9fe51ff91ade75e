"""What each of MindSpore's collective APIs sends and receives (the call plans the comm collector measures by).

A planner takes a call's bound arguments (and the caller's rank) and returns its :class:`Plan`: the process
group, the tensors sent (``pre``) and received (``post``), whether the call is asynchronous and whether the
returned value is what was received. The tables name the planners of ``mindspore.mint.distributed``
(:data:`MINT_PLANS`), ``mindspore.communication.comm_func`` (:data:`COMM_FUNC_PLANS`) and the
``mindspore.ops`` collectives (:data:`OPS_NAMES`), and the collective primitives' row names
(:data:`PRIMITIVES`). :class:`MeasuredHandle` measures an async call's received tensors on ``wait()``.
:class:`trainmon.integrations.mindspore.comm.MindSporeCommCollector` wraps the APIs with them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor


@dataclass
class Plan:
    """One call of a collective: its group, the ``(index, tensor)`` pairs it sends (``pre``) and receives
    (``post``)."""

    group: Any
    pre: list[tuple[int, Tensor]]
    post: list[tuple[int, Tensor]]
    async_op: bool = False
    result_is_post: bool = False
    """Functional collectives (``comm_func``, primitives): the returned value is what was received."""
    result_may_be_post: bool = False
    """``mindspore.ops``' collectives work in place or return the result, by MindSpore's own setting."""


def one_tensor(tensor: Any) -> list[tuple[int, Tensor]]:
    """``[(0, tensor)]``, or nothing when ``tensor`` is not a MindSpore tensor."""
    return [(0, tensor)] if isinstance(tensor, Tensor) else []


def tensors_of(tensors: Any) -> list[tuple[int, Tensor]]:
    """The ``(index, tensor)`` pairs of a list of tensors (None: none), other items skipped."""
    return [(i, t) for i, t in enumerate(tensors or ()) if isinstance(t, Tensor)]


def in_place(pre: str, post: str, many_pre: bool = False, many_post: bool = False) -> Callable[..., Plan]:
    """A collective that sends argument ``pre`` and receives into argument ``post`` (``many_*``: a list)."""
    def plan(args: dict[str, Any], rank: int, ranks: Callable[[Any], list[int]]) -> Plan:
        return Plan(args.get("group"), tensors_of(args[pre]) if many_pre else one_tensor(args[pre]),
                    tensors_of(args[post]) if many_post else one_tensor(args[post]), bool(args.get("async_op")))

    return plan


def rooted(key: str, sends: bool, many: str | None = None) -> Callable[..., Plan]:
    """broadcast/scatter (``sends``: the root contributes) and reduce/gather (the root receives)."""
    def plan(args: dict[str, Any], rank: int, ranks: Callable[[Any], list[int]]) -> Plan:
        group = args.get("group")
        root = args.get(key, 0)
        mine = root == rank
        tensor = one_tensor(args["tensor"])
        listed = tensors_of(args.get(many)) if many else tensor
        if sends:
            return Plan(group, listed if mine else [], tensor, bool(args.get("async_op")))
        return Plan(group, tensor, listed if mine else [], bool(args.get("async_op")))

    return plan


def p2p(sends: bool, asynchronous: bool) -> Callable[..., Plan]:
    """send/isend (``sends``) and recv/irecv of argument ``tensor``."""
    def plan(args: dict[str, Any], rank: int, ranks: Callable[[Any], list[int]]) -> Plan:
        tensor = one_tensor(args["tensor"])
        return Plan(args.get("group"), tensor if sends else [], [] if sends else tensor, asynchronous)

    return plan


def either(planner: Callable[..., Plan]) -> Callable[..., Plan]:
    """``planner``'s plan, whose received tensors are the returned ones when a value is returned."""
    def plan(args: dict[str, Any], rank: int, ranks: Callable[[Any], list[int]]) -> Plan:
        result = planner(args, rank, ranks)
        result.result_may_be_post = True
        return result

    return plan


def functional(args: dict[str, Any], rank: int, ranks: Callable[[Any], list[int]]) -> Plan:
    """A functional collective: sends argument ``tensor`` and returns what it received."""
    return Plan(args.get("group"), one_tensor(args["tensor"]), [], bool(args.get("async_op")), result_is_post=True)


MINT_PLANS: dict[str, Callable[..., Plan]] = {
    "all_reduce": in_place("tensor", "tensor"),
    "broadcast": rooted("src", sends=True),
    "all_gather": in_place("tensor", "tensor_list", many_post=True),
    "all_gather_into_tensor": in_place("input_tensor", "output_tensor"),
    "reduce_scatter_tensor": in_place("input", "output"),
    "reduce_scatter": in_place("input_list", "output", many_pre=True),
    "reduce": rooted("dst", sends=False),
    "all_to_all": in_place("input_tensor_list", "output_tensor_list", many_pre=True, many_post=True),
    "all_to_all_single": in_place("input", "output"),
    "gather": rooted("dst", sends=False, many="gather_list"),
    "scatter": rooted("src", sends=True, many="scatter_list"),
    "send": p2p(True, False), "recv": p2p(False, False), "isend": p2p(True, True), "irecv": p2p(False, True),
}
"""``mindspore.mint.distributed`` functions (torch's signatures and in-place semantics)."""
COMM_FUNC_PLANS: dict[str, Callable[..., Plan]] = {
    "all_reduce": functional, "all_gather_into_tensor": functional, "reduce_scatter_tensor": functional,
}
"""``mindspore.communication.comm_func`` functions that return what they received."""
OPS_NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "reduce_scatter", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")
"""``mindspore.ops`` (``mindspore.ops.function.comm_func``) collectives: torch's signatures, as
``mint.distributed``'s, but in place or returning the result depending on MindSpore's mode."""
PRIMITIVES: dict[str, str] = {"AllReduce": "all_reduce", "AllGather": "all_gather_into_tensor",
                               "ReduceScatter": "reduce_scatter_tensor", "Broadcast": "broadcast"}
"""Collective primitives and their names in rows (torch's vocabulary)."""


class MeasuredHandle:
    """An async handle whose ``wait()`` measures the received tensors once the call completed."""

    def __init__(self, handle: Any, on_complete: Callable[[], None]) -> None:
        self._handle = handle
        self._on_complete: Callable[[], None] | None = on_complete

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._handle.wait(*args, **kwargs)
        callback, self._on_complete = self._on_complete, None
        if callback is not None:
            callback()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)
