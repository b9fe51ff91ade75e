"""The attached state of a TrainerMonitor: hooks, step loop, outputs (what becomes of an ended step on the host:
:mod:`trainmon.runtime.results`)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon import integrations
from trainmon.actions.rollback import RollbackKeeper
from trainmon.base.records import StepRecord
from trainmon.base.safe_io import write_json
from trainmon.collect.buffer import PendingScalars, StepBuffer, Transfer
from trainmon.collect.context import StepContext
from trainmon.collect.copies import keep_hooks_out_of_copies
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.struct import StructRecorder
from trainmon.config import ConfigError, MonitorConfig, check_ranks, family_metrics
from trainmon.errors import AnomalyError
from trainmon.integrations.base import Attachment, AttachOptions
from trainmon.runtime.lifecycle import StepLifecycle
from trainmon.runtime.micro_steps import part_of
from trainmon.runtime.replicas import plan_replicas
from trainmon.runtime.results import StepResults
from trainmon.runtime.rundir import (
    remove_empty_dirs,
    run_json,
    unused_name,
    warn_if_appending,
)
from trainmon.runtime.schedule import StepSchedule
from trainmon.runtime.setup import (
    build_actions,
    guard_steps,
    make_dirs,
    refuse_unguarded,
    specs_of,
    supports,
    versions,
    warn_unsupported,
    warn_without_optimizer,
)
from trainmon.runtime.sizing import log_sizing
from trainmon.sinks import SinkWriter, build_sinks
from trainmon.sinks.tensorboard_overview import TagSelection

if TYPE_CHECKING:
    from collections.abc import Callable

    from trainmon.actions import HandOffAction
    from trainmon.anomaly.engine import AnomalyCallback, AnomalyEngine
    from trainmon.anomaly.skips import SkipReporter
    from trainmon.base.types import Model, Optimizer, Scalar
    from trainmon.collect.step_guard import GuardedSteps
    from trainmon.config.dynamic import ConfigWatcher

logger = logging.getLogger("trainmon")


class Session(StepResults):
    """Everything that exists between ``attach()`` and ``close()``."""

    def __init__(self, model: Model, optimizer: Optimizer | None, config: MonitorConfig, config_path: Path | None,
                 callbacks: list[AnomalyCallback], **options: Any) -> None:
        self.config, self.config_path, self.callbacks = config, config_path, callbacks
        self.model, self.optimizer = model, optimizer
        self.options = AttachOptions(**options)
        self.framework = integrations.framework_of(model)
        if config.enabled and config.anomaly.guard.enabled:  # before the integration is loaded, and any hook exists
            refuse_unguarded(self.framework, model, optimizer)
        self.integration = integrations.load(self.framework)
        metrics = family_metrics(config)
        self.ctx = StepContext(specs=specs_of(metrics, config.eps), metrics=metrics, step=self.options.start_step,
                               grad_acc_steps=self.options.grad_acc_steps)
        self.guard = self.ctx.guard
        """Every hook's fail-safe guard (:mod:`trainmon.base.guard`): a part that raised is off from then on."""
        self.actions: dict[str, HandOffAction] = {}
        self.in_flight: tuple[int, Transfer] | None = None
        """``async_results``: the collected step whose transfer has started and whose record is not made yet."""
        self.deferred: AnomalyError | None = None
        """The ``raise`` action's error of a step checked by :meth:`settle`, raised at the end of the next step."""
        self.pending = PendingScalars(lambda: self.ctx.buffer_factory())
        """The scalars (loss, ...) of uncollected steps on their way to the detectors (no host sync)."""
        self.boundary = HookRegistry()
        self.created_dirs: list[Path] = []
        self.parameter_check = None
        """Directories this attach created (deepest first); removed again, when empty, if it fails."""
        self.lifecycle = StepLifecycle(self.ctx, end_step=lambda: self.end_step(None, {}, by_user=False))
        self.step_guard: GuardedSteps | None = None
        self.skips: SkipReporter | None = None
        self.keeper: RollbackKeeper | None = None
        """Health, the skip list and the ``rollback`` action (:mod:`trainmon.actions.rollback`)."""
        keep_hooks_out_of_copies(model)  # before any hook: a deep copy or a pickle of the model leaves them out
        self.attachment: Attachment = self._attach(config)
        try:
            ranks = check_ranks(config.ranks, self.attachment.world_size, config.absent_ranks)  # those that exist
            warn_unsupported(config, self.framework)
            warn_without_optimizer(config, self.framework, optimizer)
            self.ctx.pp_stage = self.attachment.pp_stage
            self._hook_boundaries()
            rank = self.attachment.rank
            self.writes = ranks is None or rank in ranks
            self.schedule = StepSchedule(config, rank_selected=self.writes or self.attachment.collective)
            # who writes the rows that are the same on every rank of a data-parallel group (a collective)
            self.replicas = plan_replicas(self.attachment, config, ranks, self.writes, self.ctx.step)
            self.run_dir, self.rank_dir = make_dirs(self, config)
            writes_run_json = self.rank_dir is not None and rank == (ranks[0] if ranks else 0)
            if self.rank_dir is not None:
                logger.info("trainmon: rank %d writes to %s", rank, self.rank_dir)
                if writes_run_json:  # one rank says that a reused run_name appends
                    warn_if_appending(self.run_dir, self.rank_dir, self.options.start_step)
            self._bind_outputs()
            anomaly = config.anomaly
            self.keeper = RollbackKeeper(anomaly.rollback, anomaly.actions, anomaly.guard.escalate, rank, self.run_dir,
                                         self.rank_dir, self.options.start_step, checks=self.writes)
            from trainmon.anomaly.engine import AnomalyEngine

            self.anomaly = AnomalyEngine(config.anomaly, rank, self.rank_dir)
            for callback in callbacks:
                self.anomaly.on_anomaly(callback)
            if config.enabled and config.anomaly.guard.enabled:
                guard_steps(self, config)
            self.actions = build_actions(self, config)  # filled as it goes: a failure part-way is released
            self.struct = (StructRecorder(self.ctx, self.attachment.modules, self.boundary) if config.print_struct
                           else None)
            if self.struct is not None:
                self.struct.arm()
            from trainmon.config.dynamic import ConfigWatcher

            self.watcher: ConfigWatcher | None = (ConfigWatcher(config_path, config.dynamic.poll_seconds)
                                                  if config.dynamic.watch and config_path else None)
            if config.dynamic.watch and not config_path:
                logger.warning("trainmon: dynamic.watch needs a config file (TrainerMonitor(path)); "
                               "this monitor was built from a dict and is not watched")
            # The writer last: an attach that failed above wrote no file (no run.json, no writer_stats.json).
            board = config.tensorboard
            selection = TagSelection(board.per_tensor, board.tensors, board.families, board.metrics)
            sinks = build_sinks(config.sinks, self.rank_dir, config.flush_seconds, selection) if self.rank_dir else []
            self.writer = SinkWriter(sinks, config.flush_seconds, root=self.run_dir,
                                     stats_path=self.rank_dir / "writer_stats.json" if self.rank_dir else None)
            if writes_run_json:
                info = run_json(config, self.attachment.world_size, self.framework, versions(self.framework))
                info["replicated"] = self.replicas.layout.as_json()
                info["sizing"] = log_sizing(self.attachment, config, self.options.grad_acc_steps,
                                            self.replicas.layout).as_dict()
                run_dir = self.run_dir
                # on the writer's thread; a resumed run keeps the first run.json and adds run.resume{n}.json
                self.writer.submit(lambda: write_json(unused_name(run_dir, "run", ".json", "resume"), info,
                                                      root=run_dir))
            self._arm(self.schedule.is_collected(self.ctx.step))
            if config.enabled and self.writes:
                self.lifecycle.on_first_forward = lambda: self.guard.run("param_check", self._check_parameters)
        except BaseException:
            self._release()  # a failed attach leaves no hook, thread or file handle behind ...
            remove_empty_dirs(self.created_dirs)  # ... nor the (empty) directories it made
            raise

    def _release(self) -> None:
        """Remove every hook and close the actions, the anomaly engine and the writer (what exists).

        Each part is closed in its own guard: one failing part never keeps the others open, and
        an output failure never raises into the user's ``close()``.
        """
        parts: list[tuple[str, Callable[[], None]]] = [(name, action.close) for name, action in self.actions.items()]
        parts += [("hooks", self.attachment.close), ("step hooks", self.lifecycle.close),
                  ("hooks", self.boundary.remove_all)]
        if self.step_guard is not None:
            parts.append(("step guard", self.step_guard.close))
        if self.keeper is not None:
            parts.append(("skip list", self.keeper.close))
        # A failed attach may not have made the anomaly engine and the writer yet.
        anomaly: AnomalyEngine | None = getattr(self, "anomaly", None)
        writer: SinkWriter | None = getattr(self, "writer", None)
        if anomaly is not None:
            parts.append(("anomaly", anomaly.close))
        if writer is not None:
            parts.append(("writer", writer.close))
        for name, close in parts:
            try:
                close()
            except Exception as exc:
                logger.warning("trainmon: closing %s failed (%s: %s)", name, type(exc).__name__, exc)

    # ----------------------------------------------------------------------------- set-up
    def _attach(self, config: MonitorConfig) -> Attachment:
        attachment = self.integration.attach(self.ctx, config, self.model, self.optimizer, self.options)
        # torch.distributed collectives; MindSpore's integration brings its own collector
        if config.communication.enabled and supports(self.framework, "communication") \
                and self.framework != "mindspore":
            from trainmon.collect.comm import CommCollector

            # First in the list: once it has flushed, collectives run by the other collectors at the
            # end of the step (their one cross-rank reduction) are not measured. The roots and the
            # optimizer tell it which phase (forward, optimizer, ...) a collective runs in.
            collector = CommCollector(self.ctx, config.communication, roots=[root for root, _ in attachment.roots],
                                      optimizer=attachment.optimizer)
            attachment.collectors.insert(0, collector)
        return attachment

    def _hook_boundaries(self) -> None:
        self.lifecycle.hook_roots([root for root, _ in self.attachment.roots])
        self.lifecycle.hook_optimizer(self.attachment.optimizer)
        self.lifecycle.hook_scaler(self.options.scaler if self.options.scaler is not None else self.attachment.scaler)

    def _bind_outputs(self) -> None:
        """Tell collectors that write their own files (the grad probe) where this rank writes."""
        for collector in self.attachment.collectors:
            bind = getattr(collector, "bind_output", None)
            if bind is not None:
                bind(self.rank_dir)

    # ----------------------------------------------------------------------------- step loop
    def end_step(self, loss: Scalar | None, scalars: dict[str, Scalar], by_user: bool) -> StepRecord | None:
        """End the current step (from ``monitor.step()`` or the step model); never raises trainmon's own
        exceptions (the ``raise`` action's :class:`AnomalyError` is the user's choice and passes)."""
        guard = self.guard
        if guard.stopped:
            if by_user:  # outside any hook: the place to take the hooks of a stopped monitor away
                self._stop()
            return None
        try:
            return self._end_step(loss, scalars, by_user)
        except AnomalyError:
            raise
        except Exception as exc:
            guard.fail("step", exc)
            if by_user:
                self._stop()
            return None

    def _stop(self) -> None:
        """The monitor failed as a whole: remove every hook of the collectors (the step model's stay, inert)."""
        if self.ctx.collecting or any(getattr(c, "armed", False) for c in self.attachment.collectors):
            self.ctx.collecting = False
            for collector in self.attachment.collectors:
                try:
                    collector.disarm()
                except Exception as exc:
                    logger.debug("trainmon: disarming %s failed: %s", type(collector).__name__, exc)

    def _end_step(self, loss: Scalar | None, scalars: dict[str, Scalar], by_user: bool) -> StepRecord | None:
        guard = self.guard
        lifecycle = self.lifecycle
        lifecycle.user_steps = lifecycle.user_steps or by_user
        ctx = self.ctx
        if by_user and lifecycle.ended_without_forward and not lifecycle.active and not len(ctx.buffer):
            # the step model ended this step at its optimizer step (no forward of the model ran in it): this call
            # closes that same step, whose scalars go to the detectors and the outputs as an uncollected step's
            lifecycle.ended_without_forward = False
            if loss is not None:
                scalars = {"loss": loss if not hasattr(loss, "detach") else loss.detach().float().mean(), **scalars}
            if scalars and self.writes and self.config.enabled and not guard.off("loss"):
                guard.run("loss", self.pending.add, ctx.step - 1, scalars)
            return None
        if by_user and self.attachment.micro_steps_by_user and not lifecycle.optimizer_stepped:
            # DeepSpeed: engine.step() after every micro-batch; only a boundary ends a monitor step.
            if loss is not None and ctx.collecting:
                ctx.buffer.add_scalar(f"loss/micro{ctx.micro_step}", loss.detach().float().mean())
            return None
        decided = lifecycle.before_end(by_user, has_scalars=loss is not None or bool(scalars))
        if self.keeper is not None:
            self.keeper.end_step(ctx.step)  # the step's data, until its record is checked
        if self.step_guard is not None:
            decided.update(self.step_guard.take())
        for name, action in self.actions.items():
            guard.run(name, action.end_step)
        record, error = None, None
        # an uncollected step's scalars go to the detectors on a rank that writes (nothing is made for them elsewhere)
        checked = self.writes and self.config.enabled and not guard.off("loss")
        if loss is not None and (ctx.collecting or checked):
            scalars = {"loss": loss if not hasattr(loss, "detach") else loss.detach().float().mean(), **scalars}
        scalars = {**scalars, **decided}
        if ctx.collecting:
            buffer = ctx.buffer
            for name, value in scalars.items():
                buffer.add_scalar(name, value)
            guard.run("activations", ctx.grouped.flush)
            for collector in self.attachment.collectors:
                guard.run(part_of(collector), collector.before_transfer)
            if guard.failures:  # in the run's records, every collected step from the first failure on
                buffer.add_scalar("trainmon_failures", float(guard.total))
            self.schedule.collected += 1
            if self.config.async_results and isinstance(buffer, StepBuffer):
                # the copy starts now, without waiting for the device; the previous step's ended long ago
                transfer = buffer.start_transfer()
                record, error = self.finish_in_flight()
                self.in_flight = (ctx.step, transfer)
            else:
                self.pending.merge_into(buffer)  # values that wait for a collected step go with its transfer
                host = buffer.transfer()  # sync: the one transfer of this step
                self.pending.split_from(host)
                error = self._take_pending(before=ctx.step)  # their copies ended before this one: no wait
                record, late = self._finish(ctx.step, host)
                error = error or late
        else:
            if scalars and checked:
                guard.run("loss", self.pending.add, ctx.step, scalars)  # to the detectors without a sync
            if self.in_flight is not None:
                record, error = self.finish_in_flight()
        error = self._take_pending() or error
        if error is None and self.deferred is not None:  # found while settling for a checkpoint
            error, self.deferred = self.deferred, None
        if self.struct is not None and self.struct.seen and not self.struct.done:
            self._write_struct()
        ctx.step += 1
        ctx.new_step()
        lifecycle.reset()
        for name, action in self.actions.items():
            guard.run(name, action.begin_step, ctx.step)
        if self.watcher is not None:
            self._reload(self.watcher.poll())
        self._arm(self.schedule.is_collected(ctx.step))
        stop = self.keeper.exit_due(by_user) if self.keeper is not None else None
        if stop is not None:  # the rollback action: at the end of a step ended by monitor.step(), never in a hook
            raise stop
        if error is not None:
            raise error
        return record

    def _arm(self, collecting: bool) -> None:
        """At a step boundary: arm the collectors for a collected step, disarm them for another. A collector
        whose part failed is disarmed for good (its hooks, inert since the failure, are removed here)."""
        guard = self.guard
        if guard.failures:
            for collector in self.attachment.collectors:
                if guard.off(part_of(collector)) and getattr(collector, "armed", True):
                    guard.run("step", collector.disarm)
        if collecting == self.ctx.collecting and collecting:
            return
        self.ctx.collecting = collecting and not guard.stopped
        for collector in self.attachment.collectors:
            part = part_of(collector)
            if collecting and not guard.off(part):
                guard.run(part, collector.arm)
            else:
                guard.run("step", collector.disarm)

    def _reload(self, config: MonitorConfig | None) -> None:
        """Apply a changed config from the next step; keep the old one if the new one cannot apply."""
        if config is None:
            return
        old = self.config
        for key in ("output_dir", "run_name", "sinks", "ranks", "write_replicated_once"):
            if getattr(config, key) != getattr(old, key):
                logger.warning("trainmon: config key %r cannot change while attached; keeping %r", key,
                               getattr(old, key))
                setattr(config, key, getattr(old, key))
        if config.anomaly.guard != old.anomaly.guard:
            logger.warning("trainmon: config key 'anomaly.guard' cannot change while attached; keeping the step "
                           "guard's settings of attach")
            config.anomaly.guard = old.anomaly.guard
        old_specs, old_metrics = self.ctx.specs, self.ctx.metrics
        self.ctx.metrics = family_metrics(config)
        self.ctx.specs = specs_of(self.ctx.metrics, config.eps)
        try:
            attachment = self._attach(config)
        except (ConfigError, TypeError) as exc:
            self.ctx.specs, self.ctx.metrics = old_specs, old_metrics
            logger.warning("trainmon: the edited config cannot apply (%s); keeping the previous config", exc)
            return
        self.attachment.close()
        self.attachment = attachment
        self._bind_outputs()
        self.lifecycle.registry.remove_all()
        self._hook_boundaries()
        self.ctx.collecting = False
        self.config = self.schedule.config = config
        if config.anomaly != old.anomaly:
            from trainmon.anomaly.engine import AnomalyEngine

            self.anomaly.close()
            self.anomaly = AnomalyEngine(config.anomaly, self.attachment.rank, self.rank_dir)
            for callback in self.callbacks:
                self.anomaly.on_anomaly(callback)
            for name, action in self.actions.items():
                self.anomaly.register_action(name, action.on_anomaly)
        if self.keeper is not None:
            self.keeper.configure(config.anomaly.rollback, config.anomaly.actions, config.anomaly.guard.escalate)
        logger.info("trainmon: config reloaded from %s; applies from step %d", self.config_path, self.ctx.step)

    def close(self) -> None:
        try:
            if self.ctx.collecting and len(self.ctx.buffer) and self.lifecycle.active:
                self.lifecycle.closing = True
                self.end_step(None, {}, by_user=False)  # the last step when the user never called step()
            self.finish_in_flight()  # async_results: the last collected step
            self._take_pending(before=math.inf)  # the uncollected steps after it
        except AnomalyError:
            pass
        except Exception as exc:
            logger.warning("trainmon: the last step could not be recorded at close (%s: %s)", type(exc).__name__, exc)
        finally:
            self.ctx.collecting = False
            self._release()
            self._write_failures()
            summary = self.skips.summary() if self.skips is not None else None
            if summary:
                logger.warning(summary)
