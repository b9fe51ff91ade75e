"""Finding the module where a non-finite value first appears, when the first-origin event names none.

With activations off (the default) a NaN produced inside a layer is first seen in the loss, which
names no module, so there is nothing to dump. :class:`NonfiniteLocaliser` then checks every module
of the model on the next step: a forward pre-hook and a forward hook take ``[min, max]`` of each
module's inputs, outputs and (on its first call) its own parameters, and gradient hooks take those of
the gradients w.r.t. its outputs and inputs. Each is one reduction on the device (NaN propagates
through min/max, so ``[min, max]`` is non-finite exactly when the tensor is); the step's flags reach
the host with one transfer at its end. The first module call in execution order whose output is
non-finite (forward), else the first non-finite gradient (backward), is the answer:

- ``output``: the module produced it from finite inputs and parameters (the usual answer);
- ``input``: its input was already non-finite, made by the enclosing module's own code (outside its
  submodules): the enclosing module is reported;
- ``model_input``: the model's input was already non-finite; ``model_code``: the model's own forward
  code made it outside any submodule (the first module that received it is reported);
- ``parameters``: its own parameters were non-finite (an earlier step wrote them);
- ``output_grad``: the gradient w.r.t. the output of a submodule arrived non-finite: made by the reported
  module's own backward code (or, for a module no other module encloses, by the loss or the model's code);
- ``input_grad``: its backward made the gradient w.r.t. its input non-finite from finite gradients.

A step where nothing is non-finite is tried again on the next one, at most ``max_steps`` times.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainmon.base.records import ACTIVATION_KINDS
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.tensor_names import named_tensors

if TYPE_CHECKING:
    from trainmon.actions.modules import Key, ModuleTable

logger = logging.getLogger("trainmon")
_GROUP = "localise"
_INPUT_GRAD, _OUTPUT_GRAD = ACTIVATION_KINDS["actv_grad"]
"""The two sides of a module's gradients, named as the ``actv_grad`` rows of the same tensors."""
MAX_STEPS = 3
"""Steps checked before the localiser gives up on an anomaly (the non-finite value did not come back)."""
_WORDS = {"output": "its forward made a non-finite output from finite inputs and parameters",
          "input": "its own code (outside its submodules) made the non-finite input of {child}",
          "model_input": "its input (the model's input) was already non-finite",
          "model_code": "its input was made non-finite by the model's own code, outside any submodule",
          "parameters": "its parameters were already non-finite (written by an earlier step)",
          _OUTPUT_GRAD: "its own backward code (outside its submodules) made the gradient w.r.t. the output of "
                         "{child} non-finite",
          "loss_grad": "the gradient w.r.t. its output arrived non-finite (from the loss or from code outside "
                       "any module)",
          _INPUT_GRAD: "its backward made the gradient w.r.t. its input non-finite from finite gradients"}


@dataclass
class Localisation:
    """Where a non-finite value first appeared on a checked step (a line of ``dump/localisation.jsonl``).

    Attributes:
        anomaly_step: the step of the anomaly whose first origin named no module.
        origin: that first origin's name (``loss``, a collective ...).
        step: the step the modules were checked on.
        found: whether a non-finite value was seen on that step.
        phase: ``forward`` or ``backward``.
        module: the module's name; ``vpp_stage``: its model chunk.
        kind: ``output``, ``input``, ``model_input``, ``model_code``, ``parameters``, ``output_grad`` or
            ``input_grad``.
        seen_at: the module whose hook saw it first (for ``input`` and ``output_grad`` a submodule of
            ``module``).
        message: one line for people.
        dump_step: the step its neighbourhood is dumped on (None when nothing is dumped).
    """

    anomaly_step: int
    origin: str
    step: int
    found: bool = False
    phase: str = ""
    module: str = ""
    vpp_stage: int = 0
    kind: str = ""
    seen_at: str = ""
    message: str = ""
    dump_step: int | None = None
    key: Any = field(default=None, repr=False)
    fallback: list[Any] = field(default_factory=list, repr=False)
    """The modules the first origin names (dumped when nothing is found)."""


@dataclass
class _Call:
    key: Key
    parent: int | None
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    params: list[int] = field(default_factory=list)
    root_inputs: list[int] = field(default_factory=list)


class NonfiniteLocaliser:
    """Cheap non-finite checks on every module of the model for the steps after an anomaly.

    Args:
        table: the model's modules.
        max_steps: steps checked per anomaly before giving up.
    """

    def __init__(self, table: ModuleTable, max_steps: int = MAX_STEPS) -> None:
        self.table = table
        self.framework = table.framework
        self.max_steps = max_steps
        self._registry = HookRegistry()
        self._pending: Localisation | None = None
        self._tries = 0
        self._armed_step: int | None = None
        self._extremes: list[Any] = []
        self._calls: list[_Call] = []
        self._completed: list[int] = []  # indices into _calls, in the order the calls returned
        self._stack: list[int] = []
        self._backward: list[tuple[Key, str, int, int]] = []  # (module, side, extreme index, tensor number)
        self._numbers = itertools.count()
        self._tensors: dict[int, tuple[weakref.ref[Any], int]] = {}  # id -> (tensor, number): hooks on one tensor
        self._params_seen: set[Key] = set()
        self._root_inputs: list[int] = []

    @property
    def pending(self) -> bool:
        """A localisation is requested or under way."""
        return self._pending is not None

    @property
    def armed(self) -> bool:
        """The checks are on the modules (the current step is checked)."""
        return self._armed_step is not None

    def request(self, anomaly_step: int, origin: str, fallback: list[Any] | None = None) -> None:
        """Check the next step(s) for the anomaly of ``anomaly_step`` (ignored while one is pending).

        Args:
            anomaly_step: the step of the anomaly.
            origin: its first origin, in words (for messages).
            fallback: the modules to dump when no non-finite value is found.
        """
        if self._pending is None:
            self._pending = Localisation(anomaly_step, origin, step=-1, fallback=list(fallback or []))
            self._tries = 0

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self, step: int) -> None:
        """Arm the checks on every module when a localisation is pending; nothing otherwise."""
        if self._pending is None or self._armed_step is not None:
            return
        self._armed_step = step
        framework = self.framework
        for root in self.table.roots:  # the model's input: told apart from the model's own code
            self._registry.add(_GROUP, framework.forward_pre_hook(root, self._root_hook))
        for key, entry in self.table.entries.items():
            module = entry.module
            self._registry.add(_GROUP, framework.forward_pre_hook(module, self._pre_hook(key)))
            self._registry.add(_GROUP, framework.forward_hook(module, self._forward_hook(key)))
            if not framework.tensor_gradients:
                self._registry.add(_GROUP, framework.backward_hook(module, self._module_backward_hook(key)))

    def end_step(self) -> Localisation | None:
        """Remove the checks and read the step's flags (one transfer).

        Returns:
            The localisation of this step (``found`` false when nothing was non-finite and the
            localiser gives up), or None when no step was checked or it tries again next step.
        """
        self._registry.remove(_GROUP)
        step, self._armed_step = self._armed_step, None
        if step is None or self._pending is None:
            return None
        flags = self.framework.nonfinite_rows(self._extremes)  # sync: one transfer on a checked step
        result = self._analyse(flags)
        self._extremes, self._calls, self._completed, self._stack, self._backward = [], [], [], [], []
        self._params_seen, self._root_inputs, self._tensors = set(), [], {}
        pending = self._pending
        pending.step = step
        self._tries += 1
        if result is None:
            if self._tries < self.max_steps:
                return None
            self._pending = None
            pending.message = (f"trainmon dump: no module produced a non-finite value in {self._tries} step(s) after "
                               f"step {pending.anomaly_step} (first origin: {pending.origin})")
            return pending
        self._pending = None
        phase, kind, key, seen_at = result
        pending.found, pending.phase, pending.kind = True, phase, kind
        pending.key, pending.module, pending.vpp_stage = key, key[1], key[0]
        pending.seen_at = seen_at[1]
        words = _WORDS[kind].format(child=self.table.label(seen_at))
        if kind == _OUTPUT_GRAD and seen_at == key:
            pending.kind, words = _OUTPUT_GRAD, _WORDS["loss_grad"]
        pending.message = (f"trainmon dump: step {pending.anomaly_step}'s non-finite value (first origin: "
                           f"{pending.origin}) localised at step {step} to the {phase} of {self.table.label(key)}: "
                           f"{words}")
        return pending

    def close(self) -> None:
        self._registry.remove_all()
        self._extremes, self._calls, self._completed, self._stack, self._backward = [], [], [], [], []
        self._tensors = {}

    # ------------------------------------------------------------------ hooks (training thread, no sync)
    def _measure(self, value: Any) -> list[int]:
        indices = []
        for _, tensor in named_tensors(value, "", self.framework.tensor_type):
            pair = self.framework.extremes(tensor)
            if pair is not None:
                indices.append(len(self._extremes))
                self._extremes.append(pair)
        return indices

    def _root_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.framework.is_rerun():
            self._root_inputs = self._measure((args, kwargs))

    def _pre_hook(self, key: Key) -> Callable[..., None]:
        framework = self.framework

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if framework.is_rerun():
                self._stack.append(-1)  # a recompute re-run: only its gradients are watched
            else:
                call = _Call(key, self._stack[-1] if self._stack and self._stack[-1] >= 0 else None)
                call.inputs = self._measure((args, kwargs))
                call.root_inputs = self._root_inputs
                if key not in self._params_seen:
                    self._params_seen.add(key)
                    call.params = self._measure([p for _, p in framework.own_parameters(module)])
                self._calls.append(call)
                self._stack.append(len(self._calls) - 1)
            if framework.tensor_gradients and framework.grad_enabled():
                self._watch(key, _INPUT_GRAD, (args, kwargs))

        return hook

    def _forward_hook(self, key: Key) -> Callable[..., None]:
        framework = self.framework

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self._stack:
                return
            index = self._stack.pop()
            if index >= 0:
                self._calls[index].outputs = self._measure(output)
                self._completed.append(index)
            if framework.tensor_gradients and framework.grad_enabled():
                self._watch(key, _OUTPUT_GRAD, output)

        return hook

    def _watch(self, key: Key, side: str, value: Any) -> None:
        framework = self.framework
        for _, tensor in named_tensors(value, "", framework.tensor_type):
            if tensor.grad_fn is None:
                continue
            seen = self._tensors.get(id(tensor))
            if seen is None or seen[0]() is not tensor:
                seen = self._tensors[id(tensor)] = (weakref.ref(tensor), next(self._numbers))
            handle = framework.tensor_hook(tensor, self._gradient_hook(key, side, seen[1]))
            if handle is not None:
                self._registry.add(_GROUP, handle)

    def _gradient_hook(self, key: Key, side: str, number: int) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            if self._armed_step is None:
                return
            pair = self.framework.extremes(grad)
            if pair is not None:
                self._backward.append((key, side, len(self._extremes), number))
                self._extremes.append(pair)

        return hook

    def _module_backward_hook(self, key: Key) -> Callable[..., None]:
        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            if self._armed_step is None:
                return
            for side, grads in ((_OUTPUT_GRAD, grad_output), (_INPUT_GRAD, grad_input)):
                for _, grad in named_tensors(grads, "", self.framework.tensor_type):
                    pair = self.framework.extremes(grad)
                    if pair is not None:
                        self._backward.append((key, side, len(self._extremes), next(self._numbers)))
                        self._extremes.append(pair)

        return hook

    # ------------------------------------------------------------------ analysis (host)
    def _analyse(self, flags: list[bool]) -> tuple[str, str, Key, Key] | None:
        """``(phase, kind, module to dump, module whose hook saw it)`` of the first non-finite value."""

        def bad(indices: list[int]) -> bool:
            return any(flags[i] for i in indices)

        calls = self._calls
        for call in (calls[i] for i in self._completed):  # a submodule returns before its parent
            if not bad(call.outputs):
                continue
            if bad(call.params):
                return "forward", "parameters", call.key, call.key
            if not bad(call.inputs):
                return "forward", "output", call.key, call.key
            # Its input was non-finite already: climb to the outermost call that received it.
            top = call
            while top.parent is not None and bad(calls[top.parent].inputs):
                top = calls[top.parent]
            if top.parent is not None:
                return "forward", "input", calls[top.parent].key, top.key
            return "forward", "model_input" if bad(top.root_inputs) else "model_code", top.key, top.key
        first: list[tuple[Key, str, int, int]] = []
        for record in self._backward:  # firing order
            if first and record[3] != first[0][3]:
                break
            if flags[record[2]] or first:
                first.append(record)
        if not first:
            return None
        # Hooks on one tensor fire together (a block's input is also its first submodule's input, a
        # submodule's output may be its parent's output): a consumer's input gradient is the most precise
        # answer (the deepest such module made it); gradients w.r.t. outputs only say that it arrived
        # there, made by the code of the module enclosing the outermost of them.
        inputs = [record[0] for record in first if record[1] == _INPUT_GRAD]
        if inputs:
            key = max(inputs, key=self._depth)
            return "backward", _INPUT_GRAD, key, key
        outer = min((record[0] for record in first), key=self._depth)
        # A module whose output gradient is non-finite too received it from further out (MindSpore's cell
        # hooks fire when a cell's backward ends, so an enclosing cell's come after its submodules').
        arrived = {record[0] for record in self._backward if record[1] == _OUTPUT_GRAD and flags[record[2]]}
        while (parent := self.table.parent(outer)) is not None and parent in arrived:
            outer = parent
        return "backward", _OUTPUT_GRAD, parent or outer, outer

    def _depth(self, key: Key) -> int:
        depth, parent = 0, self.table.parent(key)
        while parent is not None:
            depth, parent = depth + 1, self.table.parent(parent)
        return depth
