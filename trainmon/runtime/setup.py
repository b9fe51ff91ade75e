"""What a :class:`~trainmon.runtime.session.Session` sets up at ``attach`` besides hooks: its directories, the actions,
the step guard and its refusals, the features an integration does not provide, the shared run name and the versions
recorded."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainmon import integrations
from trainmon.collect.stats_base import StatsSpec
from trainmon.errors import UnsupportedSetupError
from trainmon.runtime.rundir import default_run_name, missing_dirs

if TYPE_CHECKING:
    from trainmon.actions import HandOffAction
    from trainmon.config import MonitorConfig

logger = logging.getLogger("trainmon")


class Session(Protocol):
    """What these functions read and set of a :class:`~trainmon.runtime.session.Session` (a protocol: this module
    is below the session in the import graph)."""

    model: Any
    framework: str
    attachment: Any
    ctx: Any
    guard: Any
    anomaly: Any
    lifecycle: Any
    actions: dict[str, Any]
    rank_dir: Path | None
    writes: bool
    created_dirs: list[Path]
    step_guard: Any
    skips: Any


def build_actions(session: Session, config: MonitorConfig) -> dict[str, HandOffAction]:
    """The dump and free-benchmark actions (torch models) of ``session``, registered with its anomaly engine
    (into ``session.actions`` as they are made, so a failure part-way is released with the session)."""
    actions = session.actions  # filled as it goes, so a failure part-way is released by _release
    if session.rank_dir is None:
        return actions
    root = getattr(session.model, "module", session.model)  # inside DDP / DeepSpeedEngine: the rows' names
    if config.dump.enabled and supports(session.framework, "dump"):
        from trainmon.actions.dump import TargetedDump

        actions["dump"] = TargetedDump(root, session.rank_dir, config.dump,
                                        framework=integrations.actions_framework(root))
    if config.free_benchmark.enabled and supports(session.framework, "free_benchmark"):
        from trainmon.actions.free_benchmark import FreeBenchmark

        actions["free_benchmark"] = FreeBenchmark(root, session.rank_dir, config.free_benchmark,
                                                  rank=session.attachment.rank,
                                                  framework=integrations.actions_framework(root))
    import torch

    for name, action in actions.items():
        framework = getattr(action, "framework", None)
        if framework is not None:  # the action's hooks under the fail-safe guard, as part ``name``
            framework.wrap = functools.partial(session.guard.wrap, name, bypass=torch.compiler.is_compiling)
        session.anomaly.register_action(name, session.guard.wrap(name, action.on_anomaly))
        action.begin_step(session.ctx.step)
    return actions



def guard_steps(session: Session, config: MonitorConfig) -> None:
    """The step guard on the attached optimizer, and its host side (``anomaly.guard``): the integration's own guard
    where it has one (DeepSpeed, Megatron-Core: their overflow paths; MindSpore: the optimizer cell's ``construct``),
    else the torch guard on the optimizer."""
    from trainmon.anomaly.skips import SkipReporter
    from trainmon.collect.step_guard import GuardedSteps, StepGuard
    from trainmon.integrations.base import named_parameters

    attachment = session.attachment
    step_guard: GuardedSteps
    if attachment.step_guard is not None:
        step_guard = attachment.step_guard(config.anomaly.guard, session.guard, session.lifecycle.step_guarded)
    else:
        optimizer = attachment.optimizer
        if optimizer is None:
            raise UnsupportedSetupError("anomaly.guard needs the optimizer: pass it to attach(model, optimizer)")
        roots = [module for name, module, _ in attachment.modules if not name]
        names = {id(param): name for root in roots for name, param, _ in named_parameters(root)[0]}
        step_guard = StepGuard(config.anomaly.guard, optimizer, names, session.guard,
                               on_decided=session.lifecycle.step_guarded, reduce_group=attachment.shard_group)
    session.step_guard = step_guard
    session.skips = SkipReporter(config.anomaly.guard, step_guard.names, attachment.rank)


def make_dirs(session: Session, config: MonitorConfig) -> tuple[Path, Path | None]:
    """The run directory and this rank's (None when the rank writes nothing or cannot write there: warned);
    the directories made are kept in ``session.created_dirs`` for a failed attach to remove."""
    output_dir = Path(config.output_dir)
    claimed: list[Path] = []
    if config.run_name:
        run_name = config.run_name
    else:
        run_name, claimed = shared_run_name(session.attachment.world_size, session.attachment.rank, output_dir)
    run_dir = output_dir / run_name
    if not session.writes:
        session.created_dirs = claimed
        return run_dir, None
    rank_dir = run_dir / f"rank{session.attachment.rank}"
    session.created_dirs = missing_dirs(rank_dir, output_dir) + claimed  # the run's folder, when claimed here
    try:
        rank_dir.mkdir(parents=True, exist_ok=True)  # here, so an unwritable place is known at attach
    except OSError as exc:
        logger.warning("trainmon: cannot write to %s (%s); outputs are disabled, training goes on",
                       run_dir, exc.strerror or exc)
        return run_dir, None
    return run_dir, rank_dir


# Features an integration does not provide yet: enabling them warns once at attach instead of
# doing nothing silently.
_UNSUPPORTED: dict[tuple[str, str], str] = {  # (section, framework): one line each
}


GUARDED_FRAMEWORKS = ("torch", "fsdp", "deepspeed", "megatron", "mindspore")
"""Set-ups whose optimizer step the step guard can hold back (``anomaly.guard``)."""
_GUARD_DOC = "see docs/actions.md, 'Step guard'"


def refuse_unguarded(framework: str, model: Any, optimizer: Any) -> None:
    """Raise :class:`UnsupportedSetupError` for a set-up the step guard cannot guard correctly (never half-guarded).

    Raises:
        UnsupportedSetupError: a DeepSpeed, Megatron-Core or MindSpore set-up their guards refuse (fp16, offload,
            pipeline parallelism, graph mode, ...: :func:`trainmon.integrations.deepspeed.guard_refusal`,
            :func:`trainmon.integrations.megatron.guard_refusal`,
            :func:`trainmon.integrations.mindspore.guard.guard_refusal`); accelerate's optimizer with a GradScaler
            (fp16), which puts back the optimizer's original ``step`` around every step.
    """
    if framework not in GUARDED_FRAMEWORKS:
        raise UnsupportedSetupError(
            f"anomaly.guard is not supported with {framework}: the step guard holds back the step of a torch optimizer "
            "(plain torch, DDP, FSDP2, HF Trainer and Lightning with torch optimizers), of a DeepSpeed engine, of a "
            "Megatron-Core optimizer or of a MindSpore optimizer cell (PyNative). Set anomaly.guard.enabled: false to "
            "monitor this run; " + _GUARD_DOC)
    reason = None
    if framework == "deepspeed":
        from trainmon.integrations.deepspeed import guard_refusal

        reason = guard_refusal(model)
    elif framework == "megatron":
        from trainmon.integrations.megatron import guard_refusal as megatron_refusal

        reason = megatron_refusal(model, optimizer)
    elif framework == "mindspore":
        from trainmon.integrations.mindspore.guard import guard_refusal as mindspore_refusal

        reason = mindspore_refusal(model, optimizer)
    if reason is not None:
        raise UnsupportedSetupError(f"anomaly.guard is not supported with this {framework} set-up: {reason}. Set "
                                    f"anomaly.guard.enabled: false to monitor this run; see docs/{framework}.md, "
                                    "'Step guard'")
    if type(optimizer).__module__.split(".")[0] == "accelerate" and getattr(optimizer, "scaler", None) is not None:
        raise UnsupportedSetupError(
            "anomaly.guard is not supported with accelerate's GradScaler (fp16 mixed precision): accelerate "
            "replaces optimizer.step around every step, so the guard would be bypassed. Use bf16 (no scaler), or "
            "set anomaly.guard.enabled: false; " + _GUARD_DOC)


def supports(framework: str, section: str) -> bool:
    return (section, framework) not in _UNSUPPORTED


def warn_without_optimizer(config: MonitorConfig, framework: str, optimizer: Any) -> None:
    """One warning when a torch model is attached without its optimizer and the config asks for what is read at the
    optimizer's step (the reduced gradients, optimizer states, parameters): those are not written, and nothing else
    would say so (``attach(model)`` is right for activations alone)."""
    if optimizer is not None or framework not in ("torch", "fsdp"):
        return
    wanted = [name for name, on in (("weight_grads (grad_reduced)", config.weight_grads.enabled),
                                    ("optimizer_states", config.optimizer_states.enabled),
                                    ("params", config.params.enabled)) if on]
    if wanted:
        logger.warning("trainmon: attach() got no optimizer, so %s are not written (they are read at the optimizer's "
                       "step; grad_unreduced and activations are): pass it, attach(model, optimizer), or turn them "
                       "off", ", ".join(wanted))


def warn_unsupported(config: MonitorConfig, framework: str) -> None:
    for section in sorted({section for section, _ in _UNSUPPORTED}):
        if not supports(framework, section) and getattr(config, section).enabled:
            logger.warning("trainmon: %s is not supported with %s yet and is off for this run", section, framework)
    if framework == "mindspore" and config.features.enabled:
        logger.warning("trainmon: features are computed for torch models only (docs/features.md); off for this run")


def specs_of(metrics: dict[str, list[str]], eps: float) -> dict[str, StatsSpec]:
    return {family: StatsSpec.from_metrics(names, eps) for family, names in metrics.items()}


def claim_run_name(output_dir: Path) -> tuple[str, list[Path]]:
    """A default run name no other run has: the UTC timestamp, or the timestamp and ``-1``, ``-2``, ... when a run
    of that second exists (independent processes started together: hogwild workers, a sweep, test workers; they
    would otherwise append to one run). The folder is made here, exclusively, so two processes never get the same
    one; returns the name and the folders made (deepest first, for a failed attach to remove). Where the folder
    cannot be made (an unwritable place, warned later) the timestamp is returned and nothing is made.

    Example:
        >>> import tempfile
        >>> top = Path(tempfile.mkdtemp())
        >>> first, second = claim_run_name(top)[0], claim_run_name(top)[0]
        >>> second.startswith(first) and second != first
        True
    """
    stamp = default_run_name()
    for index in range(10_000):
        name = stamp if index == 0 else f"{stamp}-{index}"
        made = missing_dirs(output_dir / name, output_dir)
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / name).mkdir()
        except FileExistsError:
            continue
        except OSError:
            return stamp, []
        return name, made
    return stamp, []


def shared_run_name(world_size: int, rank: int, output_dir: Path) -> tuple[str, list[Path]]:
    """Rank 0's claimed run name (:func:`claim_run_name`), broadcast so every rank writes into the same run
    directory; and the folders this rank made."""
    name, made = claim_run_name(output_dir) if rank == 0 or world_size == 1 else (default_run_name(), [])
    if world_size > 1:
        import torch.distributed as dist

        holder = [name]
        dist.broadcast_object_list(holder, src=0)
        name = holder[0]
    return name, made


def versions(framework: str) -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for package in ("torch", "deepspeed", "megatron-core", "mindspore"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            continue
    return out

