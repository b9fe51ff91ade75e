"""Targeted msprobe-style dump of the modules implicated by an anomaly.

Only the requested modules are hooked, and only during the requested step; every other step
runs with no hook of ours. The layout and the ``dump.json`` schema follow msprobe's L0 dump::

    rank{R}/dump/step{S}/dump.json  stack.json  construct.json  dump_tensor_data/*.pt

Statistics are computed on the device in the hooks and copied to the host once at the end of
the dump step; files are written by a background thread. ``tensor`` and ``md5`` modes copy
tensors to the host in the hooks (that is the point of a dump; it only happens on dump steps).
Backward gradients are recorded with tensor hooks, which only observe (a module backward hook
breaks training when a dumped output is later modified in place). No hook body can raise into
training: a failure is logged once and the dump goes on without that entry.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainmon.actions.capture import Capture, to_host
from trainmon.actions.naming import is_within, module_parents, modules_for_events
from trainmon.actions.schedule import StepRequests
from trainmon.collect.hooks import HookRegistry
from trainmon.rundir import write_json
from trainmon.safe_io import make_dirs, open_output
from trainmon.sinks.base import OutputThread
from trainmon.targets import select

if TYPE_CHECKING:
    from trainmon.config import DumpConfig

logger = logging.getLogger("trainmon")
_GROUP = "dump"
_MAX_PENDING = 4  # dumps queued for the writer (each holds its host copies) before one is dropped
_MAX_NAMES = 100  # dump directories tried for one step (a resumed run dumping the same step again)


@functools.lru_cache(maxsize=1)
def _package_dirs() -> tuple[Path, ...]:
    """The resolved directories of the installed trainmon and torch packages (their frames are plumbing)."""
    import trainmon

    return tuple(Path(package.__file__).resolve().parent for package in (trainmon, torch))


@functools.lru_cache(maxsize=4096)
def _is_plumbing(filename: str) -> bool:
    """Whether a frame's file lies inside the trainmon or torch package (not: a folder that happens to be
    called ``trainmon``, such as a clone of the repository or a user's project)."""
    if filename.startswith("<"):  # <frozen ...>, <string>: not a package file
        return False
    try:
        path = Path(filename).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(path.is_relative_to(directory) for directory in _package_dirs())


class TargetedDump:
    """Dump the inputs, outputs, parameters and gradients of a few modules during one step.

    The owner calls :meth:`begin_step` before each step's first forward and :meth:`end_step`
    after its optimizer step (on every step, collected or not: both return at once when no
    dump is due). Requests come from :meth:`request` (``monitor.dump``) or :meth:`on_anomaly`
    (the ``dump`` anomaly action) and apply to a step that has not begun yet.

    Args:
        model: the root module (inside any DDP wrapper).
        rank_dir: ``{output_dir}/{run_name}/rank{R}``; dumps go to ``rank_dir/dump/step{S}``.
        config: the ``dump`` section.

    Example:
        >>> dump = TargetedDump(model, Path("out/run/rank0"), DumpConfig(enabled=True))  # doctest: +SKIP
        >>> dump.request(["layers.2"], steps=[6])  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, rank_dir: Path, config: DumpConfig) -> None:
        self.model = model
        self.rank_dir = Path(rank_dir)
        self.config = config
        self.parents = module_parents(model)
        self._modules = {name: module for name, module in model.named_modules() if name}
        self._registry = HookRegistry()
        self._requests = StepRequests("dump")
        self._step: int | None = None
        self._capture: Capture | None = None
        self._dumps = 0
        self._refused = False
        self._output: OutputThread | None = None
        self.written: list[Path] = []
        """Dump directories written so far (complete once :meth:`flush` returns)."""
        self._calls: dict[str, int] = {}
        self._open: list[tuple[str, str]] = []
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ requests
    def request(self, modules: Iterable[str], steps: Iterable[int] | None = None) -> list[str]:
        """Dump ``modules`` (exact names, globs or ``re:`` regexes) on ``steps`` (default: the next step).

        Returns:
            The module names that will be dumped (none when ``dump.enabled`` is false).

        Raises:
            TargetError: a pattern matches no module.
        """
        names = select(list(self._modules), list(modules), "dump.modules")
        if not self.config.enabled:
            logger.warning("trainmon dump: dump.enabled is false; the request for %s is ignored", names)
            return []
        self._requests.add(names, steps, self._step)
        return names

    def on_anomaly(self, events: Iterable[Any]) -> list[str]:
        """The ``dump`` action: dump the first-origin event's module and its neighbours next step.

        Args:
            events: the step's anomaly events, first-origin first (objects with ``name``/``family``).

        Returns:
            The module names requested (empty when no event implicates a module).
        """
        names = modules_for_events(events, self.parents, self.config.depth)
        if names and self.config.enabled:
            self._requests.add(names)
        return names

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self, step: int) -> None:
        """Arm hooks on the modules requested for ``step``; costs a dict lookup otherwise."""
        if self._capture is not None:
            self.end_step()
        self._step = step
        names = self._requests.pop(step)
        if not names or not self.config.enabled:
            return
        if self._dumps >= self.config.max_dumps:
            if not self._refused:
                logger.warning("trainmon dump: dump.max_dumps=%d reached; no more dumps in this run",
                               self.config.max_dumps)
            self._refused = True
            return
        self._capture = Capture(step, self.config.mode, self.config.max_bytes)
        self._calls, self._open = {}, []
        for name in (n for n in self._modules if n in names):
            module = self._modules[name]
            self._registry.add(_GROUP, module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._registry.add(_GROUP, module.register_forward_hook(self._forward_hook(name), with_kwargs=True))
            for param_name, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    hook = self._grad_hook(name, param_name)
                    self._registry.add(_GROUP, param.register_post_accumulate_grad_hook(hook))

    def end_step(self) -> Path | None:
        """Remove the hooks and hand the step's dump to its writer thread (never waits for the disk).

        Returns:
            The dump directory being written (``step{S}``; ``step{S}-{n}`` if a resumed run already
            dumped that step), or None when this step was not dumped.
        """
        self._registry.remove(_GROUP)
        capture, self._capture = self._capture, None
        if capture is None:
            return None
        self._dumps += 1
        values = to_host(capture.stats)
        directory = self.rank_dir / "dump" / f"step{capture.step}"
        if self._output is None:
            self._output = OutputThread("dump", self._write_job, max_pending=_MAX_PENDING, disable_on_error=False)
        self._output.submit((capture, values, directory))
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
        if self._output is not None:
            self._output.close()
            self._output.report()

    # ------------------------------------------------------------------ hooks
    def _prefix(self, name: str) -> str:
        return f"Module.{name}.{type(self._modules[name]).__name__}"

    def _pre_hook(self, name: str):  # noqa: ANN202 - hook closure
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            capture = self._capture
            if capture is None:
                return
            try:
                call = self._calls.get(name, 0)
                self._calls[name] = call + 1
                node = f"{self._prefix(name)}.forward.{call}"
                capture.data[node] = {
                    "input_args": capture.describe(list(args), f"{node}.input"),
                    "input_kwargs": capture.describe(dict(kwargs), f"{node}.input"),
                    "parameters": {pn: capture.describe(p, f"{node}.parameters.{pn}")
                                   for pn, p in module.named_parameters(recurse=False)},
                }
                capture.construct[node] = self._open[-1][1] if self._open else None
                if self.config.stack:
                    frames = traceback.extract_stack()[:-1]
                    capture.stack[node] = [f"File {f.filename}, line {f.lineno}, in {f.name}, \n {f.line}"
                                           for f in frames if not _is_plumbing(f.filename)]
                self._open.append((name, node))
                # Registered now, before the forward runs: a module that modifies its input in
                # place (ReLU(inplace=True)) leaves the hook on the old version, whose gradient it sees.
                inputs = _tensors(args, kwargs)
                self._watch_gradients(capture, node, "output", inputs)
            except Exception as exc:  # noqa: BLE001 - a dump must never stop training
                self._warn_once("hook", "trainmon dump: the forward pre-hook of %s failed (%r); the dump of step "
                                "%d may be incomplete", name, exc, capture.step)

        return hook

    def _forward_hook(self, name: str):  # noqa: ANN202 - hook closure
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            capture = self._capture
            if capture is None or not self._open or self._open[-1][0] != name:
                return
            try:
                _, node = self._open.pop()
                outputs = list(output) if isinstance(output, (list, tuple)) else [output]
                capture.data[node]["output"] = capture.describe(outputs, f"{node}.output")
                # msprobe convention: a backward's input is the gradient w.r.t. the forward output.
                self._watch_gradients(capture, node, "input", _tensors(outputs, {}))
            except Exception as exc:  # noqa: BLE001 - a dump must never stop training
                self._warn_once("hook", "trainmon dump: the forward hook of %s failed (%r); the dump of step %d "
                                "may be incomplete", name, exc, capture.step)

        return hook

    def _watch_gradients(self, capture: Capture, forward_node: str, side: str,
                         tensors: list[torch.Tensor | None]) -> None:
        """Record the gradients of ``tensors`` under ``backward.{call}[side][i]`` with tensor hooks.

        Tensor hooks only observe (unlike ``register_full_backward_hook``, whose view outputs break
        a later in-place modification). Only non-leaf tensors that are part of the graph get a hook:
        parameters and user inputs are leaves and keep no hook of ours.
        """
        if not torch.is_grad_enabled():
            return
        node = _as_backward(forward_node)
        for index, tensor in enumerate(tensors):
            if tensor is None or tensor.grad_fn is None:
                continue
            hook = self._gradient_hook(capture, node, forward_node, side, index, len(tensors))
            self._registry.add(_GROUP, tensor.register_hook(hook))

    def _gradient_hook(self, capture: Capture, node: str, forward_node: str, side: str, index: int,
                       count: int):  # noqa: ANN202 - hook closure
        def hook(grad: torch.Tensor) -> None:
            if self._capture is not capture:  # a backward after the dump step ended
                return
            try:
                entry = capture.data.get(node)
                if entry is None:
                    entry = capture.data[node] = {"input": [], "output": []}
                    parent = capture.construct.get(forward_node)
                    capture.construct[node] = _as_backward(parent) if parent else None
                slots = entry[side]
                slots.extend([None] * (count - len(slots)))
                slots[index] = capture.describe(grad, f"{node}.{side}.{index}")
            except Exception as exc:  # noqa: BLE001 - a dump must never stop training
                self._warn_once("hook", "trainmon dump: a gradient hook of %s failed (%r); the dump of step %d "
                                "may be incomplete", node, exc, capture.step)

        return hook

    def _grad_hook(self, name: str, param_name: str):  # noqa: ANN202 - hook closure
        def hook(param: torch.Tensor) -> None:
            capture = self._capture
            if capture is None or param.grad is None:
                return
            try:
                node = f"{self._prefix(name)}.parameters_grad"
                capture.data.setdefault(node, {})[param_name] = capture.describe(param.grad,
                                                                                 f"{node}.{param_name}")
            except Exception as exc:  # noqa: BLE001 - a dump must never stop training
                self._warn_once("hook", "trainmon dump: the gradient hook of %s.%s failed (%r); the dump of step "
                                "%d may be incomplete", name, param_name, exc, capture.step)

        return hook

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    # ------------------------------------------------------------------ writer thread
    def _write_job(self, item: tuple[Capture, list[list[float]], Path]) -> None:
        self.written.append(self._write(*item))

    def _new_directory(self, directory: Path) -> Path:
        """``directory``, or ``{directory}-{n}`` when it exists: an earlier dump is never overwritten."""
        root = self.rank_dir.parent
        for n in range(_MAX_NAMES):
            candidate = directory if n == 0 else directory.with_name(f"{directory.name}-{n}")
            try:
                make_dirs(candidate, root, exist_ok=False)
            except FileExistsError:
                continue
            return candidate
        raise FileExistsError(f"{directory}: {_MAX_NAMES} dumps of this step already exist")

    def _write(self, capture: Capture, values: list[list[float]], directory: Path) -> Path:
        root = self.rank_dir.parent  # the run directory: nothing below it is followed if it is a symlink
        directory = self._new_directory(directory)
        for desc, (hi, lo, mean, norm) in zip(capture.stat_targets, values):
            desc.update(Max=hi, Min=lo, Mean=mean, Norm=norm)
        for desc, host in capture.hashes:
            desc["md5"] = hashlib.md5(host.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()  # host copy, writer thread: no sync
        tensor_dir = directory / "dump_tensor_data"
        for file_name, host in capture.files.items():
            path = tensor_dir / file_name
            if not is_within(tensor_dir, path):  # safe_file_name guarantees this; checked regardless
                raise AssertionError(f"dump file {file_name!r} escapes {tensor_dir}")
            with open_output(path, "xb", root) as handle:
                torch.save(host.contiguous().clone(), handle)
        task = "tensor" if capture.mode == "tensor" else "statistics"
        write_json(directory / "dump.json", {
            "task": task, "level": "L0", "framework": "pytorch",
            "dump_data_dir": str(tensor_dir) if capture.mode == "tensor" else None,
            "summary_mode": "md5" if capture.mode == "md5" else "statistics",
            "data": capture.data,
        }, root)
        write_json(directory / "stack.json", capture.stack, root)
        write_json(directory / "construct.json", capture.construct, root)
        return directory


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor | None]:
    """The top-level positional arguments (or outputs) and keyword arguments that are tensors, in order;
    None for every other positional argument so indices match ``input_args``."""
    out: list[torch.Tensor | None] = [a if isinstance(a, torch.Tensor) else None for a in args]
    out += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    return out


def _as_backward(node: str) -> str:
    head, kind, call = node.rsplit(".", 2)
    assert kind == "forward", node
    return f"{head}.backward.{call}"
