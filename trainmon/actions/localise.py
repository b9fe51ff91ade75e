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
- ``input``: its input was already non-finite, made by the enclosing module's own code (or the model's
  input when there is no enclosing module): the enclosing module is reported;
- ``parameters``: its own parameters were non-finite (an earlier step wrote them);
- ``output_grad``: the gradient arriving at its output was non-finite (made by the loss or by code
  that is no module);
- ``input_grad``: its backward made the gradient w.r.t. its input non-finite from finite gradients.

A step where nothing is non-finite is tried again on the next one, at most ``max_steps`` times.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainmon.collect.activations import named_tensors
from trainmon.collect.hooks import HookRegistry

if TYPE_CHECKING:
    from trainmon.actions.modules import Key, ModuleTable

logger = logging.getLogger("trainmon")
_GROUP = "localise"
MAX_STEPS = 3
"""Steps checked before the localiser gives up on an anomaly (the non-finite value did not come back)."""
_WORDS = {"output": "its forward made a non-finite output from finite inputs and parameters",
          "input": "the input of {child} was already non-finite (made by its own code, outside its submodules)",
          "model_input": "its input (the model's input) was already non-finite",
          "parameters": "its parameters were already non-finite (written by an earlier step)",
          "output_grad": "the gradient w.r.t. its output arrived non-finite (from the loss or from code outside "
                         "any module)",
          "input_grad": "its backward made the gradient w.r.t. its input non-finite from finite gradients"}


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
        kind: ``output``, ``input``, ``model_input``, ``parameters``, ``output_grad`` or ``input_grad``.
        seen_at: the module whose hook saw it first (``kind`` ``input``: a submodule of ``module``).
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


@dataclass
class _Call:
    key: Key
    parent: int | None
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    params: list[int] = field(default_factory=list)
    done: bool = False


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
        self._stack: list[int] = []
        self._backward: list[tuple[Key, str, int, int]] = []  # (module, side, extreme index, gradient id)
        self._params_seen: set[Key] = set()

    @property
    def pending(self) -> bool:
        """A localisation is requested or under way."""
        return self._pending is not None

    @property
    def armed(self) -> bool:
        """The checks are on the modules (the current step is checked)."""
        return self._armed_step is not None

    def request(self, anomaly_step: int, origin: str) -> None:
        """Check the next step(s) for the anomaly of ``anomaly_step`` (ignored while one is pending)."""
        if self._pending is None:
            self._pending = Localisation(anomaly_step, origin, step=-1)
            self._tries = 0

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self, step: int) -> None:
        """Arm the checks on every module when a localisation is pending; nothing otherwise."""
        if self._pending is None or self._armed_step is not None:
            return
        self._armed_step = step
        framework = self.framework
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
        calls, backward = self._calls, self._backward
        self._extremes, self._calls, self._stack, self._backward = [], [], [], []
        self._params_seen = set()
        del calls, backward
        pending = self._pending
        pending.step = step
        self._tries += 1
        if result is None:
            if self._tries < self.max_steps:
                return None
            self._pending = None
            pending.message = (f"trainmon dump: no module produced a non-finite value in {self._tries} step(s) after "
                               f"step {pending.anomaly_step} (first origin: {pending.origin}); nothing is dumped")
            return pending
        self._pending = None
        phase, kind, key, seen_at = result
        pending.found, pending.phase, pending.kind = True, phase, kind
        pending.key, pending.module, pending.vpp_stage = key, key[1], key[0]
        pending.seen_at = seen_at[1]
        words = _WORDS[kind].format(child=self.table.label(seen_at))
        pending.message = (f"trainmon dump: step {pending.anomaly_step}'s non-finite value (first origin: "
                           f"{pending.origin}) localised at step {step} to the {phase} of {self.table.label(key)}: "
                           f"{words}")
        return pending

    def close(self) -> None:
        self._registry.remove_all()
        self._extremes, self._calls, self._stack, self._backward = [], [], [], []

    # ------------------------------------------------------------------ hooks (training thread, no sync)
    def _measure(self, value: Any) -> list[int]:
        indices = []
        for _, tensor in named_tensors(value, "", self.framework.tensor_type):
            pair = self.framework.extremes(tensor)
            if pair is not None:
                indices.append(len(self._extremes))
                self._extremes.append(pair)
        return indices

    def _pre_hook(self, key: Key) -> Callable[..., None]:
        framework = self.framework

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if framework.is_rerun():
                self._stack.append(-1)  # a recompute re-run: only its gradients are watched
            else:
                call = _Call(key, self._stack[-1] if self._stack and self._stack[-1] >= 0 else None)
                call.inputs = self._measure((args, kwargs))
                if key not in self._params_seen:
                    self._params_seen.add(key)
                    call.params = self._measure([p for _, p in framework.own_parameters(module)])
                self._calls.append(call)
                self._stack.append(len(self._calls) - 1)
            if framework.tensor_gradients and framework.grad_enabled():
                self._watch(key, "input_grad", (args, kwargs))

        return hook

    def _forward_hook(self, key: Key) -> Callable[..., None]:
        framework = self.framework

        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._stack:
                return
            index = self._stack.pop()
            if index >= 0:
                call = self._calls[index]
                call.outputs = self._measure(output)
                call.done = True
            if framework.tensor_gradients and framework.grad_enabled():
                self._watch(key, "output_grad", output)

        return hook

    def _watch(self, key: Key, side: str, value: Any) -> None:
        framework = self.framework
        for _, tensor in named_tensors(value, "", framework.tensor_type):
            handle = framework.tensor_hook(tensor, self._gradient_hook(key, side))
            if handle is not None:
                self._registry.add(_GROUP, handle)

    def _gradient_hook(self, key: Key, side: str) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            if self._armed_step is None:
                return
            pair = self.framework.extremes(grad)
            if pair is not None:
                self._backward.append((key, side, len(self._extremes), id(grad)))
                self._extremes.append(pair)

        return hook

    def _module_backward_hook(self, key: Key) -> Callable[..., None]:
        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            if self._armed_step is None:
                return
            for side, grads in (("output_grad", grad_output), ("input_grad", grad_input)):
                for _, grad in named_tensors(grads, "", self.framework.tensor_type):
                    pair = self.framework.extremes(grad)
                    if pair is not None:
                        self._backward.append((key, side, len(self._extremes), id(grad)))
                        self._extremes.append(pair)

        return hook

    # ------------------------------------------------------------------ analysis (host)
    def _analyse(self, flags: list[bool]) -> tuple[str, str, Key, Key] | None:
        """``(phase, kind, module to dump, module whose hook saw it)`` of the first non-finite value."""
        bad = lambda indices: any(flags[i] for i in indices)  # noqa: E731
        for call in (c for c in self._calls if c.done):  # completion order: a submodule before its parent
            if not bad(call.outputs):
                continue
            if bad(call.params):
                return "forward", "parameters", call.key, call.key
            if bad(call.inputs):
                if call.parent is None:
                    return "forward", "model_input", call.key, call.key
                return "forward", "input", self._calls[call.parent].key, call.key
            return "forward", "output", call.key, call.key
        first: list[tuple[Key, str, int, int]] = []
        for record in self._backward:  # firing order
            if first and record[3] != first[0][3]:
                break
            if flags[record[2]] or first:
                first.append(record)
        if not first:
            return None
        # Hooks on one tensor fire together (a block's input is its first submodule's input): the
        # deepest module is the most precise answer.
        key, side, _, _ = max(first, key=lambda record: self._depth(record[0]))
        return "backward", side, key, key

    def _depth(self, key: Key) -> int:
        depth, parent = 0, self.table.parent(key)
        while parent is not None:
            depth, parent = depth + 1, self.table.parent(parent)
        return depth
