"""What an integration hands the monitor: collectors, root modules and the rank layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from trainmon.base.precursors import PRECURSORS
from trainmon.base.targets import plain_name, select
from trainmon.collect.hooks import HookRegistry

if TYPE_CHECKING:
    import torch

    from trainmon.base.types import GradScaler, Model, Optimizer, ProcessGroup
    from trainmon.collect.context import Collector, StepContext
    from trainmon.collect.step_guard import GuardFactory
    from trainmon.config import MonitorConfig

_Item = TypeVar("_Item")


@dataclass
class AttachOptions:
    """The keyword arguments of :meth:`TrainerMonitor.attach`."""

    grad_acc_steps: int = 1
    tp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    start_step: int = 0
    scaler: GradScaler | None = None


REPLICATED_FAMILIES = ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "momentum", "update", "ratio", PRECURSORS)
"""The families that can be the same on every rank of a data-parallel group: what the optimizer steps with and
keeps (``grad_unreduced``, activations and ``comm`` are each rank's own)."""


@dataclass(frozen=True)
class Replicated:
    """Row families that are the same on every rank of a data-parallel group (``write_replicated_once``).

    Attributes:
        families: those families (whether the config turns them on or not).
        group: the data-parallel process group (None: the world group).
        combined: True when the collectors add these rows only on the rank that writes them (the combined shard
            statistics of FSDP2 and DeepSpeed: their ``writes_rows``), False when every rank adds them to its
            record (its anomaly detectors see them) and only the writer's sinks get them.
    """

    families: tuple[str, ...]
    group: ProcessGroup | None = None
    combined: bool = False


@dataclass
class Attachment:
    """The result of attaching to one model/optimizer.

    Attributes:
        collectors: armed before collected steps, disarmed before uncollected ones.
        roots: ``(root module, vpp_stage)``; their forward pre-hook counts micro-steps.
        modules: ``(name, module, vpp_stage)`` of every named module (``print_struct``).
        optimizer: the object whose step ends a monitor step (has ``register_step_post_hook``), or None.
        rank, world_size, pp_stage: this process's place in the job.
        collective: True when collectors run a collective in ``before_transfer``: then every
            rank collects on collected steps, and ``ranks`` only selects who writes.
        registry: the hook handles of this attachment.
        micro_steps_by_user: the user calls ``monitor.step()`` after every micro-batch (DeepSpeed's
            ``engine.step()`` idiom); only a call after the optimizer really stepped ends a step.
        scaler: a torch ``GradScaler`` found behind the optimizer (accelerate), or None.
        replicated: the families that are the same on every rank of a data-parallel group, or None (no such
            group, or one trainmon cannot be sure of: every rank writes its own rows).
        shard_group: the process group over which each gradient is sharded (FSDP2's shard group: the step guard
            sums the shards' squared norms over it), or None where every rank holds whole gradients.
        step_guard: builds the step guard (``anomaly.guard``) of a framework that skips steps its own way
            (DeepSpeed, Megatron-Core); None: the torch guard wraps ``optimizer``.
        on_close: extra clean-up (e.g. undoing an instance wrapper).
    """

    collectors: list[Collector]
    roots: list[tuple[torch.nn.Module, int]]
    modules: list[tuple[str, torch.nn.Module, int]]
    optimizer: Optimizer | None
    registry: HookRegistry
    rank: int = 0
    world_size: int = 1
    pp_stage: int = 0
    collective: bool = False
    micro_steps_by_user: bool = False
    scaler: GradScaler | None = None
    replicated: Replicated | None = None
    shard_group: Any = None
    step_guard: GuardFactory | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()
        self.registry.remove_all()
        while self.on_close:
            self.on_close.pop()()


def named_modules(root: torch.nn.Module, vpp_stage: int = 0
                  ) -> tuple[list[tuple[str, torch.nn.Module, int]], dict[str, list[str]]]:
    """Every module under ``root`` once, with its row name, and the other names of modules reached by several.

    Names are :func:`trainmon.base.targets.plain_name` (no compile or checkpoint wrapper levels; where a wrapper
    and the module it wraps get one name, the name is the wrapped module's). A module reached by several
    names (T5's ``shared`` embedding, also ``encoder.embed_tokens`` and ``decoder.embed_tokens``) is named by
    the first in ``named_modules()`` order; the others are its aliases: target patterns match them too.

    Returns:
        ``[(name, module, vpp_stage)]`` in ``named_modules()`` order, and ``{name: [alias, ...]}``.
    """
    return _by_plain_name(root.named_modules(remove_duplicate=False), vpp_stage)


def named_parameters(root: torch.nn.Module, vpp_stage: int = 0
                     ) -> tuple[list[tuple[str, torch.nn.Parameter, int]], dict[str, list[str]]]:
    """:func:`named_modules` for parameters: a tied parameter (``lm_head.weight`` is ``embed_tokens.weight``)
    is named by its first name, the others are aliases that target patterns match too."""
    return _by_plain_name(root.named_parameters(remove_duplicate=False), vpp_stage)


def _by_plain_name(items: Iterable[tuple[str, _Item]], vpp_stage: int
                   ) -> tuple[list[tuple[str, _Item, int]], dict[str, list[str]]]:
    by_name: dict[str, _Item] = {}
    for name, item in items:
        by_name[plain_name(name)] = item  # the first name's place, the innermost object (a wrapper's name: its module)
    names_of: dict[int, list[str]] = {}
    for name, item in by_name.items():
        names_of.setdefault(id(item), []).append(name)
    named = [(names[0], by_name[names[0]], vpp_stage) for names in names_of.values()]
    return named, {names[0]: names[1:] for names in names_of.values() if len(names) > 1}


def select_modules(named: Sequence[tuple[str, torch.nn.Module, int]], config: MonitorConfig,
                   aliases: Mapping[str, Sequence[str]] | None = None) -> list[tuple[str, torch.nn.Module, int]]:
    """Target modules; a pattern matching one of a module's ``aliases`` selects it too. The root, named ``""``,
    is never matched by a pattern: it is a target (first) when ``activations.root`` is set, or when the model has
    no submodule and the patterns are the default ``["*"]``."""
    roots = [item for item in named if not item[0]]
    if not any(name for name, _, _ in named) and list(config.targets.modules) == ["*"]:
        return roots  # a model without submodules (one nn.Linear): every module is the model itself
    roots = roots if config.activations.root else []
    named = [item for item in named if item[0]]
    chosen = _select([n for n, _, _ in named], config.targets.modules, "targets.modules", aliases)
    return roots + [item for item in named if item[0] in chosen]


def select_params(named: Sequence[tuple[str, torch.nn.Parameter, int]], config: MonitorConfig,
                  aliases: Mapping[str, Sequence[str]] | None = None) -> list[tuple[str, torch.nn.Parameter, int]]:
    """Target parameters; a pattern matching one of a parameter's ``aliases`` selects it too."""
    chosen = _select([n for n, _, _ in named], config.targets.params, "targets.params", aliases)
    return [item for item in named if item[0] in chosen]


def _select(names: list[str], patterns: Sequence[str], key: str, aliases: Mapping[str, Sequence[str]] | None
            ) -> set[str]:
    canonical = {alias: name for name in names for alias in (aliases or {}).get(name, ())}
    return {canonical.get(name, name) for name in select([*dict.fromkeys(names), *canonical], patterns, key)}


class Integration(Protocol):
    """A framework integration module (``trainmon.integrations.{torch,fsdp,deepspeed,megatron,mindspore}``).

    Its ``attach`` finds the model chunks, gradients, optimizer states and process groups of its framework
    and returns the collectors that measure them; it hooks nothing that the returned
    :class:`~trainmon.integrations.base.Attachment` does not remove on ``close()``.
    """

    def attach(self, ctx: StepContext, config: MonitorConfig, model: Model, optimizer: Optimizer | None,
               options: AttachOptions) -> Attachment: ...
