"""The typed seams between trainmon's parts: what an integration, a hand-off action and a subcommand provide.

The core must not import an optional framework, so the framework objects it passes along untouched (the
user's model and optimizer, process groups, a loss scaler) are named aliases of ``Any``: the name says what is
expected, and the integration that receives the object types it with its framework. The collectors' protocol
is :class:`trainmon.collect.context.Collector`; the anomaly callbacks' types are in
:mod:`trainmon.anomaly.engine`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    import argparse

    from trainmon.anomaly.events import AnomalyEvent
    from trainmon.cli import CommandParser
    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig
    from trainmon.integrations.base import Attachment, AttachOptions

Model: TypeAlias = Any
"""What ``attach`` takes as the model: a ``torch.nn.Module`` (also under DDP or FSDP2), a ``DeepSpeedEngine``,
a list of Megatron-Core model chunks or a MindSpore ``Cell``; the integration is chosen from its type."""

Optimizer: TypeAlias = Any
"""The optimizer of the model's framework (torch, DeepSpeed's, Megatron-Core's, MindSpore's), or its wrapper."""

ProcessGroup: TypeAlias = Any
"""A process group of the model's framework (``torch.distributed.ProcessGroup``, a MindSpore group name)."""

GradScaler: TypeAlias = Any
"""A ``torch.amp.GradScaler`` (or a duck-typed one with ``get_scale``), given to ``attach`` or found there."""

DeepSpeedParameter: TypeAlias = Any
"""A ``torch.nn.Parameter`` of a DeepSpeed engine, with the attributes DeepSpeed sets on it that torch's
``Parameter`` does not declare: ZeRO-3's ``ds_numel``, ``ds_shape``, ``ds_tensor``, ``ds_process_group``;
ZeRO 1/2's (and the BF16 optimizer's) ``_hp_mapping`` and ``_index_in_param_group``."""

MegatronParameter: TypeAlias = Any
"""A ``torch.nn.Parameter`` of a Megatron-Core model chunk, with the attributes Megatron sets on it that
torch's ``Parameter`` does not declare: ``main_grad`` (the gradient buffer's view), ``partition_dim``
and ``tensor_model_parallel`` (its tensor-parallel split)."""

Scalar: TypeAlias = Any
"""A value given to ``monitor.step()``: a Python number or a 0-d tensor of any framework (read after the
step's one host transfer)."""

Subparsers: TypeAlias = "argparse._SubParsersAction[CommandParser]"
"""The ``trainmon`` command's subparsers, which each subcommand module adds its parser to."""


class Integration(Protocol):
    """A framework integration module (``trainmon.integrations.{torch,fsdp,deepspeed,megatron,mindspore}``).

    Its ``attach`` finds the model chunks, gradients, optimizer states and process groups of its framework
    and returns the collectors that measure them; it hooks nothing that the returned
    :class:`~trainmon.integrations.base.Attachment` does not remove on ``close()``.
    """

    def attach(self, ctx: StepContext, config: MonitorConfig, model: Model, optimizer: Optimizer | None,
               options: AttachOptions) -> Attachment: ...


class HandOffAction(Protocol):
    """An anomaly action that acts on the model over the next steps: the dump and the free benchmark.

    The session calls :meth:`begin_step` when a step starts, :meth:`end_step` when it ends and
    :meth:`close` once; the anomaly engine hands it a step's events (first origin first) through
    :meth:`on_anomaly`; ``monitor.dump()`` and ``monitor.free_benchmark()`` call :meth:`request`.
    """

    def request(self, modules: Iterable[str], steps: Iterable[int] | None = None) -> list[str]:
        """Act on ``modules`` (names, globs, ``re:``) on ``steps`` (default: the next step); the module names."""
        ...

    def on_anomaly(self, events: Iterable[AnomalyEvent]) -> object: ...

    def begin_step(self, step: int) -> None: ...

    def end_step(self) -> object: ...

    def close(self) -> None: ...


class Subcommand(Protocol):
    """A module of a ``trainmon`` subcommand (``csv2tb``, ``analyse``, ``grad-compare``, ``report``)."""

    def add_parser(self, sub: Subparsers) -> object:
        """Add the subcommand's parser to ``sub``; its ``func`` default runs it and returns the exit code."""
        ...


if TYPE_CHECKING:  # read by mypy only: each implementation satisfies its protocol (never imported at run time)
    from trainmon import csv2tb, report
    from trainmon.actions.dump import TargetedDump
    from trainmon.actions.free_benchmark import FreeBenchmark
    from trainmon.anomaly import analyse
    from trainmon.integrations import deepspeed, fsdp, megatron, mindspore
    from trainmon.integrations import torch as torch_integration
    from trainmon.probe import compare

    _INTEGRATIONS: tuple[Integration, ...] = (torch_integration, fsdp, deepspeed, megatron, mindspore)
    _HAND_OFF_ACTIONS: tuple[type[HandOffAction], ...] = (TargetedDump, FreeBenchmark)
    _SUBCOMMANDS: tuple[Subcommand, ...] = (csv2tb, analyse, compare, report)
