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

This module decides which modules are dumped on which step and hands each step's capture to the writer
thread (:mod:`trainmon.actions.dump_writer`); the hooks that fill the capture are in
:mod:`trainmon.actions.dump_hooks`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.actions.capture import Capture
from trainmon.actions.dump_hooks import DumpHooks
from trainmon.actions.dump_writer import write_dump
from trainmon.actions.frameworks import Framework, TorchFramework, megatron_layout
from trainmon.actions.localise import Localisation, NonfiniteLocaliser
from trainmon.actions.modules import Key, ModuleTable
from trainmon.actions.naming import describe_event, is_nonfinite_event, names_activation
from trainmon.actions.requests import StepRequests
from trainmon.base.safe_io import make_dirs, open_output
from trainmon.base.threads import OutputThread

if TYPE_CHECKING:
    from trainmon.config import DumpConfig

logger = logging.getLogger("trainmon")
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
        framework: the model's adapter (:func:`trainmon.integrations.actions_framework`; default: plain torch).

    Example:
        >>> dump = TargetedDump(model, Path("out/run/rank0"), DumpConfig(enabled=True))  # doctest: +SKIP
        >>> dump.request(["layers.2"], steps=[6])  # doctest: +SKIP
    """

    def __init__(self, model: Any, rank_dir: Path, config: DumpConfig, *, framework: Framework | None = None) -> None:
        self.model = model
        self.rank_dir = Path(rank_dir)
        self.config = config
        self.framework: Framework = framework if framework is not None else TorchFramework()
        self.table = ModuleTable(model, self.framework)
        self.parents = self.table.parents[0]
        self.layout = megatron_layout() if getattr(self.framework, "megatron", False) else None
        self._hooks = DumpHooks(self.table, self.framework, config.stack)
        self._requests: StepRequests[Key] = StepRequests("dump")
        self._localiser = NonfiniteLocaliser(self.table)
        self._quiet_until = -1
        self._step: int | None = None
        self._dumps = 0
        self._refused = False
        self._output: OutputThread | None = None
        self.written: list[Path] = []
        """Dump directories written so far (complete once :meth:`flush` returns)."""
        self.localisations: list[Localisation] = []
        """What the localiser found for anomalies whose first origin named no module."""

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
        if self._hooks.capture is not None or self._localiser.armed:
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
        self._hooks.arm(Capture(step, self.config.mode, self.config.max_bytes, self.framework), keys)

    def end_step(self) -> Path | None:
        """Remove the hooks and hand the step's dump to its writer thread (never waits for the disk).

        Returns:
            The dump directory being written (``step{S}``; ``step{S}-{n}`` if a resumed run already
            dumped that step), or None when this step was not dumped.
        """
        capture = self._hooks.disarm()
        self._localised(self._localiser.end_step())
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
        if self._hooks.capture is not None:
            self.end_step()
        self._hooks.close()
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
