"""The hooks of a targeted dump step (torch, Megatron-Core, MindSpore): what fills msprobe's L0 layout.

:class:`DumpHooks` registers, on the modules requested for one step, a forward pre-hook and a forward hook
(``{prefix}.forward.{call}``: input args and kwargs, parameters, output; ``construct.json``'s parent and,
with ``dump.stack``, ``stack.json``'s frames), tensor hooks on the forward's inputs and outputs for torch's
backward gradients (``{prefix}.backward.{call}``) or a cell backward hook for MindSpore's, and a gradient hook
per parameter (``{prefix}.parameters_grad``). Recompute re-runs record only their gradients. Every hook writes
into the step's :class:`~trainmon.actions.capture.Capture` and never raises into training: a failure is
logged once. :class:`trainmon.actions.dump.TargetedDump` decides which steps and modules are dumped and writes
the capture out.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from trainmon.actions.capture import Capture
from trainmon.actions.dump_writer import is_plumbing
from trainmon.actions.modules import Key, ModuleTable
from trainmon.collect.hooks import HookRegistry

if TYPE_CHECKING:
    from trainmon.actions.frameworks import CellBackwardHook, ForwardHook, ForwardPreHook, Framework, GradHook

logger = logging.getLogger("trainmon")
_GROUP = "dump"


class DumpHooks:
    """The hooks of one dump step at a time, and the :class:`Capture` they fill.

    Args:
        table: the model's modules (names, prefixes, labels).
        framework: the model's framework adapter.
        stack: record each forward's call stack (``dump.stack``).

    Example:
        >>> hooks = DumpHooks(table, framework, stack=False)  # doctest: +SKIP
        >>> hooks.arm(Capture(6, "statistics", max_bytes, framework), keys)  # doctest: +SKIP
        >>> capture = hooks.disarm()  # doctest: +SKIP
    """

    def __init__(self, table: ModuleTable, framework: Framework, stack: bool) -> None:
        self.table = table
        self.framework = framework
        self.stack = stack
        self.plumbing = ("torch",) if framework.name == "pytorch" else ("torch", "mindspore")
        self.registry = HookRegistry()
        self.capture: Capture | None = None
        """The capture of the step being dumped; None between dump steps (every hook then returns at once)."""
        self._calls: dict[Key, int] = {}
        self._reruns: dict[Key, int] = {}
        self._backwards: dict[Key, int] = {}
        self._open: list[tuple[Key, str, bool]] = []
        self._warned: set[str] = set()

    def arm(self, capture: Capture, keys: Iterable[Key]) -> None:
        """Hook the modules ``keys`` (of the table) until :meth:`disarm`; they fill ``capture``."""
        self.capture = capture
        self._calls, self._reruns, self._backwards, self._open = {}, {}, {}, []
        framework = self.framework
        wanted = set(keys)
        for key in (k for k in self.table.entries if k in wanted):
            module = self.table.entries[key].module
            self.registry.add(_GROUP, framework.forward_pre_hook(module, self._pre_hook(key)))
            self.registry.add(_GROUP, framework.forward_hook(module, self._forward_hook(key)))
            if not framework.tensor_gradients:
                self.registry.add(_GROUP, framework.backward_hook(module, self._module_backward_hook(key)))
            for param_name, param in framework.own_parameters(module):
                if param.requires_grad:
                    hook = self._grad_hook(key, param_name, param)
                    self.registry.add(_GROUP, framework.param_grad_hook(param, hook))

    def disarm(self) -> Capture | None:
        """Remove the step's hooks.

        Returns:
            The capture they filled, or None when no dump step was armed.
        """
        self.registry.remove(_GROUP)
        capture, self.capture = self.capture, None
        return capture

    def close(self) -> None:
        """Remove every hook (idempotent)."""
        self.registry.remove_all()

    def _pre_hook(self, key: Key) -> ForwardPreHook:
        framework = self.framework
        prefix = self.table.prefix(key)

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            capture = self.capture
            if capture is None:
                return
            try:
                if framework.is_rerun():  # a recompute re-run: only its gradients are recorded
                    call = self._reruns.get(key, 0)
                    self._reruns[key] = call + 1
                    node = f"{prefix}.forward.{call}"
                    self._open.append((key, node, True))
                    if framework.tensor_gradients:
                        self._watch_gradients(capture, node, "output", _tensors(framework, args, kwargs))
                    return
                call = self._calls.get(key, 0)
                self._calls[key] = call + 1
                node = f"{prefix}.forward.{call}"
                capture.data[node] = {
                    "input_args": capture.describe(list(args), f"{node}.input"),
                    "input_kwargs": capture.describe(dict(kwargs), f"{node}.input"),
                    "parameters": {pn: capture.describe(p, f"{node}.parameters.{pn}")
                                   for pn, p in framework.own_parameters(module)},
                }
                parent = next((n for _, n, rerun in reversed(self._open) if not rerun), None)
                capture.construct[node] = parent
                if self.stack:
                    frames = traceback.extract_stack()[:-1]
                    capture.stack[node] = [f"File {f.filename}, line {f.lineno}, in {f.name}, \n {f.line}"
                                           for f in frames if not is_plumbing(f.filename, self.plumbing)]
                self._open.append((key, node, False))
                if framework.tensor_gradients:
                    # Registered now, before the forward runs: a module that modifies its input in
                    # place (ReLU(inplace=True)) leaves the hook on the old version, whose gradient it sees.
                    self._watch_gradients(capture, node, "output", _tensors(framework, args, kwargs))
            except Exception as exc:  # a dump must never stop training
                self._warn_once("hook", "trainmon dump: the forward pre-hook of %s failed (%r); the dump of step "
                                "%d may be incomplete", self.table.label(key), exc, capture.step)

        return hook

    def _forward_hook(self, key: Key) -> ForwardHook:
        framework = self.framework

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            capture = self.capture
            if capture is None or not self._open or self._open[-1][0] != key:
                return
            try:
                _, node, rerun = self._open.pop()
                outputs = list(output) if isinstance(output, (list, tuple)) else [output]
                if not rerun:
                    capture.data[node]["output"] = capture.describe(outputs, f"{node}.output")
                if framework.tensor_gradients:
                    # msprobe convention: a backward's input is the gradient w.r.t. the forward output.
                    self._watch_gradients(capture, node, "input", _tensors(framework, outputs, {}))
            except Exception as exc:  # a dump must never stop training
                self._warn_once("hook", "trainmon dump: the forward hook of %s failed (%r); the dump of step %d "
                                "may be incomplete", self.table.label(key), exc, capture.step)

        return hook

    def _watch_gradients(self, capture: Capture, forward_node: str, side: str, tensors: list[Any]) -> None:
        """Record the gradients of ``tensors`` under ``backward.{call}[side][i]`` with tensor hooks (torch).

        Tensor hooks only observe (unlike ``register_full_backward_hook``, whose view outputs break
        a later in-place modification). Only non-leaf tensors that are part of the graph get a hook:
        parameters and user inputs are leaves and keep no hook of ours.
        """
        if not self.framework.grad_enabled():
            return
        node = _as_backward(forward_node)
        for index, tensor in enumerate(tensors):
            if tensor is None:
                continue
            handle = self.framework.tensor_hook(tensor, self._gradient_hook(capture, node, forward_node, side,
                                                                              index, len(tensors)))
            if handle is not None:
                self.registry.add(_GROUP, handle)

    def _backward_entry(self, capture: Capture, node: str, forward_node: str) -> dict[str, Any]:
        entry = capture.data.get(node)
        if entry is None:
            entry = capture.data[node] = {"input": [], "output": []}
            parent = capture.construct.get(forward_node)
            capture.construct[node] = _as_backward(parent) if parent else None
        return entry

    def _gradient_hook(self, capture: Capture, node: str, forward_node: str, side: str, index: int,
                       count: int) -> GradHook:
        def hook(grad: Any) -> None:
            if self.capture is not capture:  # a backward after the dump step ended
                return
            try:
                slots = self._backward_entry(capture, node, forward_node)[side]
                slots.extend([None] * (count - len(slots)))
                slots[index] = capture.describe(grad, f"{node}.{side}.{index}")
            except Exception as exc:  # a dump must never stop training
                self._warn_once("hook", "trainmon dump: a gradient hook of %s failed (%r); the dump of step %d "
                                "may be incomplete", node, exc, capture.step)

        return hook

    def _module_backward_hook(self, key: Key) -> CellBackwardHook:
        """MindSpore: ``(cell, grad_input, grad_output)``; the k-th backward of a cell in the step is
        ``backward.{k}`` (msprobe's numbering)."""
        prefix = self.table.prefix(key)

        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            capture = self.capture
            if capture is None:
                return
            try:
                call = self._backwards.get(key, 0)
                self._backwards[key] = call + 1
                forward_node = f"{prefix}.forward.{call}"
                node = _as_backward(forward_node)
                entry = self._backward_entry(capture, node, forward_node)
                entry["input"] = capture.describe(list(grad_output), f"{node}.input")
                entry["output"] = capture.describe(list(grad_input), f"{node}.output")
            except Exception as exc:  # a dump must never stop training
                self._warn_once("hook", "trainmon dump: the backward hook of %s failed (%r); the dump of step %d "
                                "may be incomplete", self.table.label(key), exc, capture.step)

        return hook

    def _grad_hook(self, key: Key, param_name: str, param: Any) -> GradHook:
        partition_dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) \
            else None
        node = f"{self.table.prefix(key)}.parameters_grad"

        def hook(grad: Any) -> None:
            capture = self.capture
            if capture is None:
                return
            try:
                desc = capture.describe(grad, f"{node}.{param_name}")
                if partition_dim is not None:
                    desc["tp_partition_dim"] = int(partition_dim)
                # msprobe's layout: {param: [description]}; the last micro-step's call wins
                capture.data.setdefault(node, {})[param_name] = [desc]
            except Exception as exc:  # a dump must never stop training
                self._warn_once("hook", "trainmon dump: the gradient hook of %s.%s failed (%r); the dump of step "
                                "%d may be incomplete", self.table.label(key), param_name, exc, capture.step)

        return hook

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def _tensors(framework: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The top-level positional arguments (or outputs) and keyword arguments that are tensors, in order;
    None for every other positional argument so indices match ``input_args``."""
    tensor_type = framework.tensor_type
    out: list[Any] = [a if isinstance(a, tensor_type) else None for a in args]
    out += [v for v in kwargs.values() if isinstance(v, tensor_type)]
    return out


def _as_backward(node: str) -> str:
    head, kind, call = node.rsplit(".", 2)
    assert kind == "forward", node
    return f"{head}.backward.{call}"

