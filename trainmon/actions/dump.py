"""Targeted msprobe-style dump of the modules implicated by an anomaly (torch, Megatron-Core, MindSpore).

Only the requested modules are hooked, and only during the requested step; every other step
runs with no hook of ours. The layout and the ``dump.json`` schema follow msprobe's L0 dump::

    rank{R}/dump/step{S}/dump.json  stack.json  construct.json  dump_tensor_data/*.pt (*.npy for MindSpore)

Statistics are computed on the device in the hooks and copied to the host once at the end of
the dump step; files are written by a background thread. ``tensor`` and ``md5`` modes copy
tensors to the host in the hooks (that is the point of a dump; it only happens on dump steps).
torch backward gradients are recorded with tensor hooks, which only observe (a module backward hook
breaks training when a dumped output is later modified in place); MindSpore's come from cell backward
hooks. Recompute re-runs of checkpointed forwards (Megatron, ``torch.utils.checkpoint``) are not dumped
again; the gradients of a checkpointed region are read from the re-run's tensors. No hook body can
raise into training: a failure is logged once and the dump goes on without that entry.

When the first-origin event of an anomaly names no module (the loss, with activations off), the
dump first localises the module that makes the non-finite value (:mod:`trainmon.actions.localise`).
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.actions.capture import Capture
from trainmon.actions.dump_writer import is_plumbing, write_dump
from trainmon.actions.framework_choice import framework_for
from trainmon.actions.frameworks import megatron_layout
from trainmon.actions.localise import Localisation, NonfiniteLocaliser
from trainmon.actions.modules import Key, ModuleTable
from trainmon.actions.naming import describe_event, is_nonfinite_event, names_activation
from trainmon.actions.requests import StepRequests
from trainmon.collect.hooks import HookRegistry
from trainmon.safe_io import make_dirs, open_output
from trainmon.sinks.base import OutputThread

if TYPE_CHECKING:
    from trainmon.actions.frameworks import CellBackwardHook, ForwardHook, ForwardPreHook, GradHook
    from trainmon.config import DumpConfig

logger = logging.getLogger("trainmon")
_GROUP = "dump"
_MAX_PENDING = 4  # dumps queued for the writer (each holds its host copies) before one is dropped


class TargetedDump:
    """Dump the inputs, outputs, parameters and gradients of a few modules during one step.

    The owner calls :meth:`begin_step` before each step's first forward and :meth:`end_step`
    after its optimizer step (on every step, collected or not: both return at once when no
    dump is due). Requests come from :meth:`request` (``monitor.dump``) or :meth:`on_anomaly`
    (the ``dump`` anomaly action) and apply to a step that has not begun yet.

    Args:
        model: the root module (inside any DDP wrapper), the list of Megatron-Core model chunks, or a
            MindSpore cell.
        rank_dir: ``{output_dir}/{run_name}/rank{R}``; dumps go to ``rank_dir/dump/step{S}``.
        config: the ``dump`` section.

    Example:
        >>> dump = TargetedDump(model, Path("out/run/rank0"), DumpConfig(enabled=True))  # doctest: +SKIP
        >>> dump.request(["layers.2"], steps=[6])  # doctest: +SKIP
    """

    def __init__(self, model: Any, rank_dir: Path, config: DumpConfig) -> None:
        self.model = model
        self.rank_dir = Path(rank_dir)
        self.config = config
        self.framework = framework_for(model)
        self.table = ModuleTable(model, self.framework)
        self.parents = self.table.parents[0]
        self.layout = megatron_layout() if getattr(self.framework, "megatron", False) else None
        self._plumbing = ("torch",) if self.framework.name == "pytorch" else ("torch", "mindspore")
        self._registry = HookRegistry()
        self._requests: StepRequests[Key] = StepRequests("dump")
        self._localiser = NonfiniteLocaliser(self.table)
        self._quiet_until = -1
        self._step: int | None = None
        self._capture: Capture | None = None
        self._dumps = 0
        self._refused = False
        self._output: OutputThread | None = None
        self.written: list[Path] = []
        """Dump directories written so far (complete once :meth:`flush` returns)."""
        self.localisations: list[Localisation] = []
        """What the localiser found for anomalies whose first origin named no module."""
        self._calls: dict[Key, int] = {}
        self._reruns: dict[Key, int] = {}
        self._backwards: dict[Key, int] = {}
        self._open: list[tuple[Key, str, bool]] = []
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ requests
    def request(self, modules: Iterable[str], steps: Iterable[int] | None = None) -> list[str]:
        """Dump ``modules`` (exact names, globs or ``re:`` regexes; in every model chunk) on ``steps``
        (default: the next step).

        Returns:
            The module names that will be dumped (none when ``dump.enabled`` is false).

        Raises:
            TargetError: a pattern matches no module.
        """
        keys = self.table.select(list(modules), "dump.modules")
        names = list(dict.fromkeys(name for _, name in keys))
        if not self.config.enabled:
            logger.warning("trainmon dump: dump.enabled is false; the request for %s is ignored", names)
            return []
        self._requests.add(keys, steps, self._step)
        return names

    def on_anomaly(self, events: Iterable[Any]) -> list[str]:
        """The ``dump`` action: dump the first-origin event's module and its neighbours next step.

        When the first origin is a non-finite value that does not say which module made it (the loss,
        a collective, or a weight gradient: with activations off every gradient is non-finite once the
        loss is), the modules are first checked on the next step(s) to find where the value is made,
        and that module's neighbourhood is dumped on the step after (:mod:`trainmon.actions.localise`);
        if the checks find nothing, the module the first origin names (if any) is dumped instead.

        Args:
            events: the step's anomaly events, first-origin first (objects with ``name``/``family``,
                and ``vpp_stage``, ``step``, ``phase``, ``detector``, ``value`` when they are ``AnomalyEvent``).

        Returns:
            The module names the events implicate (what is dumped unless the localiser finds another).
        """
        events = list(events)
        keys = self.table.for_events(events, self.config.depth)
        names = list(dict.fromkeys(name for _, name in keys))
        if not self.config.enabled or not events:
            return names
        first = events[0]
        if is_nonfinite_event(first) and not names_activation(first) and self.table.entries:
            step = int(getattr(first, "step", self._step or 0))
            # One localisation at a time, none for the anomalies of the steps it checks and dumps, and
            # none once no dump is left.
            if step > self._quiet_until and self._dumps < self.config.max_dumps:
                self._localiser.request(step, describe_event(first), fallback=keys)
        elif keys:
            self._requests.add(keys)
        return names

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self, step: int) -> None:
        """Arm hooks on the modules requested for ``step``; costs a dict lookup otherwise."""
        if self._capture is not None or self._localiser.armed:
            self.end_step()
        self._step = step
        self._localiser.begin_step(step)
        keys = self._requests.pop(step)
        if not keys or not self.config.enabled:
            return
        if self._dumps >= self.config.max_dumps:
            if not self._refused:
                logger.warning("trainmon dump: dump.max_dumps=%d reached; no more dumps in this run",
                               self.config.max_dumps)
            self._refused = True
            return
        self._capture = Capture(step, self.config.mode, self.config.max_bytes, self.framework)
        self._calls, self._reruns, self._backwards, self._open = {}, {}, {}, []
        framework = self.framework
        wanted = set(keys)
        for key in (k for k in self.table.entries if k in wanted):
            module = self.table.entries[key].module
            self._registry.add(_GROUP, framework.forward_pre_hook(module, self._pre_hook(key)))
            self._registry.add(_GROUP, framework.forward_hook(module, self._forward_hook(key)))
            if not framework.tensor_gradients:
                self._registry.add(_GROUP, framework.backward_hook(module, self._module_backward_hook(key)))
            for param_name, param in framework.own_parameters(module):
                if param.requires_grad:
                    hook = self._grad_hook(key, param_name, param)
                    self._registry.add(_GROUP, framework.param_grad_hook(param, hook))

    def end_step(self) -> Path | None:
        """Remove the hooks and hand the step's dump to its writer thread (never waits for the disk).

        Returns:
            The dump directory being written (``step{S}``; ``step{S}-{n}`` if a resumed run already
            dumped that step), or None when this step was not dumped.
        """
        self._registry.remove(_GROUP)
        self._localised(self._localiser.end_step())
        capture, self._capture = self._capture, None
        if capture is None:
            return None
        self._dumps += 1
        values = self.framework.to_host(capture.stats)
        directory = self.rank_dir / "dump" / f"step{capture.step}"
        self._submit(("dump", capture, values, directory))
        return directory

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every dump handed to the writer is on disk (at most ``timeout`` seconds).

        Returns:
            False when the writer did not finish in time (a stuck disk); it goes on by itself.
        """
        if self._output is None or self._output.wait(timeout):
            return True
        logger.warning("trainmon dump: the dumps are still being written after %.0f s", timeout)
        return False

    def close(self) -> None:
        """Finish a dump in progress, remove every hook and let the writer finish within a bounded
        time (idempotent, never raises for an output failure)."""
        if self._capture is not None:
            self.end_step()
        self._registry.remove_all()
        self._localiser.close()
        if self._output is not None:
            self._output.close()
            self._output.report()

    def _localised(self, found: Localisation | None) -> None:
        """Log what the localiser found and dump that module's neighbourhood on the next step."""
        if found is None:
            return
        self._quiet_until = max(self._quiet_until, self._step or 0)
        keys = self.table.neighbourhood(found.key, self.config.depth) if found.found else list(found.fallback)
        if keys:
            found.dump_step = (self._step or 0) + 1
            self._requests.add(keys)
            found.message += (f"; dumping it and its neighbours at step {found.dump_step}" if found.found else
                              f"; dumping the module the first origin names at step {found.dump_step}")
            self._quiet_until = found.dump_step
        else:
            found.message += "; nothing is dumped"
        logger.warning("%s", found.message)
        self.localisations.append(found)
        record = {k: v for k, v in vars(found).items() if k not in ("key", "fallback")}
        self._submit(("localisation", record, None, None))

    def _submit(self, item: tuple[str, Any, Any, Any]) -> None:
        if self._output is None:
            self._output = OutputThread("dump", self._write_job, max_pending=_MAX_PENDING, disable_on_error=False)
        self._output.submit(item)

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, key: Key) -> ForwardPreHook:
        framework = self.framework
        prefix = self.table.prefix(key)

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            capture = self._capture
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
                if self.config.stack:
                    frames = traceback.extract_stack()[:-1]
                    capture.stack[node] = [f"File {f.filename}, line {f.lineno}, in {f.name}, \n {f.line}"
                                           for f in frames if not is_plumbing(f.filename, self._plumbing)]
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
            capture = self._capture
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
                self._registry.add(_GROUP, handle)

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
            if self._capture is not capture:  # a backward after the dump step ended
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
            capture = self._capture
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
            capture = self._capture
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

    # ------------------------------------------------------------------ writer thread
    def _write_job(self, item: tuple[str, Any, Any, Any]) -> None:
        kind, payload, values, directory = item
        root = self.rank_dir.parent  # the run directory: nothing below it is followed if it is a symlink
        if kind == "localisation":
            make_dirs(self.rank_dir / "dump", root)
            with open_output(self.rank_dir / "dump" / "localisation.jsonl", "a", root) as handle:
                handle.write(json.dumps(payload) + "\n")
            return
        extra = {"parallel": self.layout} if self.layout else None
        self.written.append(write_dump(payload, values, directory, root, extra))


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

