"""What an integration hands the monitor: collectors, root modules and the rank layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainmon.collect.hooks import HookRegistry
from trainmon.targets import select

if TYPE_CHECKING:
    import torch

    from trainmon.collect.context import Collector
    from trainmon.config import MonitorConfig
    from trainmon.protocols import GradScaler, Optimizer, ProcessGroup


@dataclass
class AttachOptions:
    """The keyword arguments of :meth:`TrainerMonitor.attach`."""

    grad_acc_steps: int = 1
    tp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    start_step: int = 0
    scaler: GradScaler | None = None


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
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()
        self.registry.remove_all()
        while self.on_close:
            self.on_close.pop()()


def select_modules(named: Sequence[tuple[str, torch.nn.Module, int]], config: MonitorConfig
                   ) -> list[tuple[str, torch.nn.Module, int]]:
    """Target modules (the root, named ``""``, is never a target)."""
    named = [item for item in named if item[0]]
    chosen = set(select([n for n, _, _ in named], config.targets.modules, "targets.modules"))
    return [item for item in named if item[0] in chosen]


def select_params(named: Sequence[tuple[str, torch.nn.Parameter, int]], config: MonitorConfig
                  ) -> list[tuple[str, torch.nn.Parameter, int]]:
    chosen = set(select([n for n, _, _ in named], config.targets.params, "targets.params"))
    return [item for item in named if item[0] in chosen]
