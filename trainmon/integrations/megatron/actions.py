"""The anomaly actions (dump, free benchmark, non-finite localiser) on Megatron-Core model chunks.

:class:`MegatronFramework` is the torch adapter of :mod:`trainmon.actions.frameworks` with Megatron's
differences: a chunk is unwrapped from Megatron's ``DistributedDataParallel`` / ``Float16Module``, a forward
inside ``tensor_parallel.checkpoint`` with grad enabled is a recompute re-run, and a parameter's gradient is
``main_grad`` plus the micro-step's ``grad`` (what it has accumulated before the data-parallel reduction).
"""

from __future__ import annotations

import torch

from trainmon.actions.frameworks import TorchFramework
from trainmon.integrations.megatron.chunks import unwrap
from trainmon.integrations.megatron.collect import unreduced_grad


class MegatronFramework(TorchFramework):
    """Megatron-Core model chunks (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(megatron=True)

    def unwrap(self, chunk: torch.nn.Module) -> torch.nn.Module:
        return unwrap(chunk)

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        return unreduced_grad(param)
