"""MindSpore (PyNative mode): a ``mindspore.nn.Cell`` and an optional ``nn.Optimizer``.

Imported only when a Cell is attached (``trainmon.integrations.load("mindspore")``), so
``import trainmon`` never imports MindSpore. Statistics are computed with MindSpore ops on the
tensors' device and moved to the host once per step by :class:`MindSporeStepBuffer`; the host side
(records, anomaly detectors, sinks, CLI) is the one PyTorch uses.

Example:
    >>> monitor = TrainerMonitor(cfg).attach(network, optimizer)      # doctest: +SKIP
    >>> grad_fn = ms.value_and_grad(forward_fn, None, optimizer.parameters)  # doctest: +SKIP
    >>> for x, y in data:                                             # doctest: +SKIP
    ...     loss, grads = grad_fn(x, y)
    ...     optimizer(grads)
    ...     monitor.step(loss=loss)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mindspore as ms
from mindspore import nn

from trainmon.base.process_groups import mindspore_layout as dist_layout
from trainmon.collect.activations import ActivationCollector
from trainmon.collect.hooks import HookRegistry
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations.base import Attachment, AttachOptions, select_modules, select_params
from trainmon.integrations.mindspore.buffer import MindSporeStepBuffer, buffer_of, new_buffer
from trainmon.integrations.mindspore.host import MindSporeStats, on_cpu
from trainmon.integrations.mindspore.optimizer import MindSporeOptimizerCollector
from trainmon.integrations.mindspore.stats import partial_stats

if TYPE_CHECKING:
    from trainmon.collect.context import Collector, StepContext
    from trainmon.config import MonitorConfig


class OptimizerStepHooks:
    """Gives a MindSpore optimizer cell the ``register_step_post_hook`` the monitor uses to notice
    that a step happened: a forward hook on the optimizer cell (it runs when ``optimizer(grads)``
    returns). The handle it returns is MindSpore's removable hook handle."""

    def __init__(self, optimizer: nn.Optimizer) -> None:
        self.optimizer = optimizer

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        def forward_hook(cell: nn.Cell, args: tuple[Any, ...], output: Any) -> None:
            hook(cell, args, {})

        return self.optimizer.register_forward_hook(forward_hook)


def unwrap_training_cell(model: Any, optimizer: Any = None) -> tuple[Any, Any]:
    """The network and optimizer inside a ``nn.TrainOneStepCell`` (also ``TrainOneStepWithLossScaleCell``):
    its ``WithLossCell``'s backbone (the network, as ``Model(network, loss_fn, optimizer)`` has it) and its
    optimizer. Anything else is returned as given.

    Raises:
        ValueError: ``optimizer`` is given and is not the training cell's.
    """
    if not isinstance(model, nn.TrainOneStepCell):
        return model, optimizer
    if optimizer is not None and optimizer is not model.optimizer:
        raise ValueError("attach(): the optimizer given is not the one of the nn.TrainOneStepCell; pass the cell "
                         "alone (its optimizer is used) or its own optimizer")
    network = model.network
    if isinstance(network, nn.WithLossCell):
        network = network.backbone_network
    return network, model.optimizer


def attach(ctx: StepContext, config: MonitorConfig, model: nn.Cell, optimizer: nn.Optimizer | None,
           options: AttachOptions) -> Attachment:
    """Build the collectors for a MindSpore network in PyNative mode.

    Args:
        ctx: the monitor's step context (its buffer becomes a :class:`MindSporeStepBuffer`).
        config: the monitor config.
        model: the network whose forward is one micro-step (the cell called inside the function
            given to ``mindspore.value_and_grad``, or wrapped by ``nn.WithLossCell`` in a ``nn.TrainOneStepCell``).
        optimizer: the ``nn.Optimizer`` cell the gradients are applied with, or None.
        options: ``attach`` keyword arguments; the torch process groups do not apply.

    Raises:
        TypeError: ``model`` is not a Cell or ``optimizer`` not an ``nn.Optimizer``.
        UnsupportedSetupError: ``model`` is a ``nn.TrainOneStepCell`` (pass the network inside and its
            optimizer: :func:`unwrap_training_cell`), or MindSpore is not in PyNative mode (cell hooks do not
            run in graph mode).
        ValueError: ``grad_probe`` is enabled without an optimizer.
        TargetError: a target pattern matches no cell or parameter.
    """
    if isinstance(model, nn.TrainOneStepCell):  # its forward is a whole step: the rows would be half of them
        raise UnsupportedSetupError(f"attach() needs the network inside the {type(model).__name__} and its optimizer: "
                        "monitor.attach(network, train_cell.optimizer), with network the cell given to "
                        "nn.WithLossCell (trainmon.integrations.mindspore.unwrap_training_cell(train_cell) "
                        "returns both)")
    if not isinstance(model, nn.Cell):
        raise TypeError(f"attach() needs a mindspore.nn.Cell, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, nn.Optimizer):
        raise TypeError(f"optimizer must be a mindspore.nn.Optimizer, got {type(optimizer).__name__}")
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise UnsupportedSetupError("the MindSpore integration needs PyNative mode (cell hooks do not run in graph "
                                    "mode): "
                           "mindspore.set_context(mode=mindspore.PYNATIVE_MODE)")
    for name in ("tp_group", "pp_group"):
        if getattr(options, name) is not None:
            raise ValueError(f"{name} is not supported for MindSpore (data parallelism only)")
    ctx.buffer_factory = new_buffer
    host = on_cpu()
    ctx.stats_fn = MindSporeStats(ctx, host, int(config.activations.group_mb * 2**20))
    ctx.buffer = new_buffer()
    registry = HookRegistry()
    named_cells = [(name, cell, 0) for name, cell in model.cells_and_names()]
    collectors: list[Collector] = []
    if config.activations.enabled:
        cells = select_modules(named_cells, config)
        collectors.append(ActivationCollector(ctx, cells, config.activations, registry, tensor_type=ms.Tensor,
                                              backward_hook="register_backward_hook"))
    params = [(name, param, 0) for name, param in model.parameters_and_names()]
    rank, world_size = dist_layout()
    if config.weight_grads.enabled or config.optimizer_states.enabled or config.params.enabled:
        chosen = select_params(params, config)
        collectors.append(MindSporeOptimizerCollector(ctx, chosen, optimizer, config, registry, host=host,
                                                      world_size=world_size))
    if config.grad_probe.enabled:
        from trainmon.integrations.mindspore.probe import grad_probe

        collectors.append(grad_probe(ctx, select_params(params, config), config, registry, optimizer))
    if config.communication.enabled:
        from trainmon.integrations.mindspore.comm import MindSporeCommCollector

        # First, as torch's: collectives of the other collectors at the end of the step are not measured.
        collectors.insert(0, MindSporeCommCollector(ctx, config.communication, root=model, optimizer=optimizer))
    step_guard = None
    if optimizer is not None and config.enabled and config.anomaly.guard.enabled:
        from trainmon.integrations.mindspore.guard import step_guard_factory

        step_guard = step_guard_factory(optimizer, {id(param): name for name, param, _ in params})
    return Attachment(collectors=collectors, roots=[(model, 0)], modules=named_cells,
                      optimizer=OptimizerStepHooks(optimizer) if optimizer is not None else None,
                      registry=registry, rank=rank, world_size=world_size, step_guard=step_guard)


__all__ = ["MindSporeStepBuffer", "OptimizerStepHooks", "attach", "buffer_of", "dist_layout", "new_buffer",
           "partial_stats", "unwrap_training_cell"]
