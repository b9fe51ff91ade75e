"""How every trainer callback attaches its monitor when training starts (:func:`attach_or_train_on`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainmon.errors import ConfigError, UnsupportedSetupError

logger = logging.getLogger("trainmon")


def attach_or_train_on(attach: Callable[[], None], release: Callable[[], None], run: str) -> None:
    """Attach (``attach()``) when a trainer starts training, after ``release()`` of any earlier monitor.

    A refusal (:class:`ConfigError`, :class:`UnsupportedSetupError`) is raised: its message says what to
    change, before the first step. Any other exception of trainmon's is warned about and training goes on
    without the monitor; ``run`` names the run in that warning (``this Trainer``, ``this Lightning run``).
    """
    release()
    try:
        attach()
    except (ConfigError, UnsupportedSetupError):
        release()
        raise
    except Exception as exc:
        release()
        logger.warning("trainmon: could not attach to %s (%s: %s); training goes on without the monitor", run,
                       type(exc).__name__, exc)


def ddp_options(wrapped: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``dp_group`` set to the process group of ``wrapped`` when the trainer wrapped the model in
    torch's ``DistributedDataParallel`` (and the user gave no ``dp_group``): the callbacks attach the unwrapped model,
    and this tells the monitor that its gradients and optimizer states are the same on every rank of that group, so
    those rows are written once per group (``write_replicated_once``)."""
    if "dp_group" in options:
        return options
    import torch

    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return {**options, "dp_group": wrapped.process_group}
    return options
