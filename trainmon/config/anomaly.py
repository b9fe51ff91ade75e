"""The config sections of what happens on an anomaly: detectors and actions, the step guard, the rollback, the
targeted dump and the free benchmark (re-exported by :mod:`trainmon.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainmon.anomaly.detectors import DETECTORS, check_specs
from trainmon.anomaly.skips import DETECTOR as GUARD_DETECTOR
from trainmon.base.schema import setting
from trainmon.config.fields import pattern_list
from trainmon.errors import ConfigError

__all__ = ["ACTIONS", "DUMP_MODES", "FIXING_PERT_MODES", "HANDLERS", "MAX_DUMP_DEPTH", "MAX_GUARD_WINDOW", "PERT_MODES",
           "ROLLBACK_DETECTORS", "AnomalyConfig", "DumpConfig", "FreeBenchmarkConfig", "GuardConfig", "RollbackConfig"]

ACTIONS: tuple[str, ...] = ("log", "jsonl", "callback", "raise", "dump", "free_benchmark", "rollback")
DUMP_MODES: tuple[str, ...] = ("statistics", "tensor", "md5")
PERT_MODES: tuple[str, ...] = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
FIXING_PERT_MODES: tuple[str, ...] = ("improve_precision", "to_cpu")
"""The perturbations whose result may replace a module's output (``free_benchmark.handler: fix``)."""
HANDLERS: tuple[str, ...] = ("check", "fix")
MAX_DUMP_DEPTH = 64
"""Deeper than any module tree; a huge ``dump.depth`` would stall every anomalous step."""
MAX_GUARD_WINDOW = 100_000
"""Longer than any useful history; the guard keeps ``window x (1 + parameters)`` floats on the device."""


@dataclass
class GuardConfig:
    """The step guard: a step whose gradients are poisoned is not applied (docs/actions.md, "Step guard").

    Checked on every step, before the optimizer applies the gradients (a torch optimizer's after unscaling and
    clipping; DeepSpeed and Megatron-Core clip after it); a skipped step leaves the parameters and the optimizer
    state (moments, step counts, master weights) as they were. torch, FSDP2, DeepSpeed and Megatron-Core (the last
    two skip through their own overflow paths); MindSpore and the set-ups a framework cannot skip exactly are
    refused at ``attach``."""

    enabled: bool = False
    """Check every step's gradients and skip the update when a rule below fires."""
    nonfinite: bool = True
    """Skip a step whose gradients hold a NaN or an Inf (under a ``GradScaler`` the scaler does this)."""
    max_grad_norm: float | None = setting(None, above=0.0)
    """Skip a step whose global gradient norm is above this; null: no absolute limit."""
    z_threshold: float | None = setting(6.0, above=0.0)
    """Skip a step whose global gradient norm is more than this many standard deviations above its mean over
    the applied steps among the last ``window`` (the deviation counts as at least 1% of the mean); null: off."""
    per_parameter: bool = False
    """Apply ``z_threshold`` to each parameter's gradient norm too, each against its own history."""
    window: int = setting(128, minimum=2, maximum=MAX_GUARD_WINDOW)
    """Steps whose gradient norms make the history (kept on the device; skipped steps leave a gap)."""
    warmup: int = setting(64, minimum=2)
    """Applied steps the history must hold before ``z_threshold`` may fire (at most ``window``)."""
    escalate_after: int | None = setting(5, minimum=1)
    """This many skipped steps in a row escalate (again at each further multiple); null: never."""
    escalate: list[str] = setting(["log", "jsonl", "raise"], choices=ACTIONS, unique=True)
    """Anomaly actions applied to the escalation event: any of log, jsonl, callback, raise, dump,
    free_benchmark, rollback (``raise``: :class:`~trainmon.errors.AnomalyError` at the end of the step;
    ``rollback``: the run stops with ``anomaly.rollback.exit_code``, docs/actions.md, "Rollback")."""

    def cross_check(self, path: str) -> None:
        """The warm-up fits in the window."""
        if self.warmup > self.window:
            raise ConfigError(f"{path}.warmup", f"must be <= window ({self.window}), got {self.warmup}")



ROLLBACK_DETECTORS: tuple[str, ...] = (*DETECTORS, GUARD_DETECTOR)
"""What ``anomaly.rollback.detectors`` may name: the detector types and the step guard."""


@dataclass
class RollbackConfig:
    """Healthy checkpoints, the skip list and the ``rollback`` action (docs/actions.md, "Rollback")."""

    detectors: list[str] = setting(["nonfinite", "loss_spike"], choices=ROLLBACK_DETECTORS, unique=True)
    """The detectors (by ``type``) whose events, at a step whose update was applied, make the training state
    unhealthy (``monitor.state_dict()['healthy']``), enter the skip list and trigger the ``rollback`` action;
    ``step_guard``: also every step the guard skipped triggers it (such a step enters the skip list anyway)."""
    exit_code: int = setting(17, minimum=3, maximum=125)
    """The exit status of a run the ``rollback`` action stops (``SystemExit``): what a launcher script tests to
    resume from the last healthy checkpoint (3 to 125: not success, an uncaught error, bad usage or a signal)."""
    skip_list: bool = True
    """Append the flagged and skipped steps, with the identity of their data, to ``{run}/rank{R}/skip_list.jsonl``."""


@dataclass
class AnomalyConfig:
    """Anomaly detectors and what happens when they fire."""

    detectors: list[dict[str, Any]] = setting([], check=check_specs)
    """Detector specs, each ``{type: nonfinite|spike|loss_spike|growth|level, ...}`` (docs/anomaly.md), run in
    addition to the default detectors (``default_detectors``). A spec replaces the default it overlaps rather than
    running next to it: a ``nonfinite`` or ``loss_spike`` spec replaces that default, a ``spike``, ``growth`` or
    ``level`` spec each default of its type sharing a ``series`` entry with it."""
    default_detectors: bool = True
    """Run the default detectors: ``nonfinite``, ``loss_spike``, the per-layer gradient early warning
    (``{type: spike, series: ["grad_reduced/*/norm"], method: log, persist: 3}``), the global gradient norm
    watch (``{type: spike, series: [grad_norm], method: log, threshold: 7, min_relative_change: 2.2,
    range_factor: 3}``: a jump above 3.2x its level) and drop watch (the same, ``direction: down``, 10x), the
    attention logit growth (``{type: growth, series: ["attn/*/max_logit"], window: 40, factor: 1.7, min_value: 25,
    reduce: max}``: the model's largest logit)
    and Adam's epsilon underflow (``{type: level, series: ["precursors/*/eps_underflow"], threshold: 0.9,
    persist: 5}``). ``false``: only ``detectors`` run."""
    actions: list[str] = setting(["log", "jsonl"], choices=ACTIONS, unique=True)
    """Any of log, jsonl, callback, raise, dump, free_benchmark, rollback (stop the run with
    ``rollback.exit_code`` on an event of ``rollback.detectors``, naming the last healthy checkpoint and the data
    to skip in ``{run}/rollback.json``)."""
    log_limit: int = setting(10, minimum=1)
    """At most this many log lines per step (the rest are summarised)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The step guard: skip a poisoned step instead of applying it."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    """Healthy checkpoints, the skip list, and what the ``rollback`` action does."""


@dataclass
class DumpConfig:
    """Targeted tensor dump of the modules implicated by an anomaly."""

    enabled: bool = False
    """Allow dumps (as the ``dump`` action or through ``monitor.dump``)."""
    mode: str = setting("statistics", choices=DUMP_MODES)
    """statistics, tensor or md5."""
    depth: int = setting(1, minimum=0, maximum=MAX_DUMP_DEPTH)
    """Also dump the parent and children this many levels around the implicated module (at most 64)."""
    max_bytes: int = setting(1 << 30, minimum=1)
    """Byte budget of one dump."""
    max_dumps: int = setting(3, minimum=1)
    """Dumps per run."""
    stack: bool = True
    """Write ``stack.json``: the Python call stack of each dumped forward call."""


@dataclass
class FreeBenchmarkConfig:
    """Perturbation checks of a module's forward."""

    enabled: bool = False
    """Allow free-benchmark checks (as the ``free_benchmark`` action or by hand)."""
    pert_mode: str = setting("improve_precision", choices=PERT_MODES)
    """improve_precision, add_noise, bit_noise, change_value, no_change or to_cpu."""
    handler: str = setting("check", choices=HANDLERS)
    """check: compare and write failures to ``free_benchmark.csv``; fix: also replace the module's
    output by the improve_precision / to_cpu result (value only; gradients flow through the original)."""
    targets: list[str] = pattern_list([])
    """Modules checked every ``interval`` steps (exact names, globs or ``re:`` regexes); empty: only on anomaly
    or by hand."""
    interval: int = setting(1, minimum=1)
    """Check ``targets`` on every N-th step."""
    max_per_step: int = setting(4, minimum=1)
    """At most this many modules are re-run per step (a whole network is never re-run by accident)."""

    def cross_check(self, path: str) -> None:
        """``handler: fix`` needs a perturbation whose result may replace the output."""
        if self.handler == "fix" and self.pert_mode not in FIXING_PERT_MODES:
            raise ConfigError(f"{path}.handler", f"fix needs pert_mode improve_precision or to_cpu, "
                                                 f"got {self.pert_mode!r}")
