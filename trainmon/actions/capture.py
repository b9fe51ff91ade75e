"""What a dump step captures: msprobe-style descriptions of module arguments, device statistics
(copied to the host once per dump step) and, in ``tensor``/``md5`` modes, host copies within a byte budget.

The framework (torch or MindSpore) comes in through :class:`trainmon.actions.frameworks.Framework`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from trainmon.base.safe_io import safe_file_name

if TYPE_CHECKING:
    from trainmon.actions.frameworks import Framework

logger = logging.getLogger("trainmon")


class Capture:
    """What one dump step captured; filled by hooks on the training thread.

    Args:
        step: the dumped step.
        mode: ``statistics``, ``tensor`` or ``md5``.
        max_bytes: host bytes the step may copy (tensor and md5 modes).
        framework: describes, measures and copies the framework's tensors.
    """

    def __init__(self, step: int, mode: str, max_bytes: int, framework: Framework) -> None:
        self.step = step
        self.mode = mode
        self.max_bytes = max_bytes
        self.framework = framework
        self.data: dict[str, dict[str, Any]] = {}
        self.stack: dict[str, list[str]] = {}
        self.construct: dict[str, str | None] = {}
        self.stats: list[torch.Tensor] = []
        self.stat_targets: list[dict[str, Any]] = []
        self.files: dict[str, Any] = {}
        self.hashes: list[tuple[dict[str, Any], Any]] = []
        self.bytes = 0
        self.budget_hit = False

    def describe(self, value: Any, stem: str) -> Any:
        """msprobe's description of an argument; tensors get statistics (filled in later)."""
        if isinstance(value, self.framework.tensor_type):
            return self._tensor(value, stem)
        if isinstance(value, (list, tuple)):
            return [self.describe(item, f"{stem}.{i}") for i, item in enumerate(value)]
        if isinstance(value, dict):
            return {str(k): self.describe(v, f"{stem}.{k}") for k, v in value.items()}
        if value is None:
            return None
        if isinstance(value, (bool, int, float, str)):
            return {"type": type(value).__name__, "value": value}
        other = self.framework.describe_other(value)
        return other if other is not None else {"type": type(value).__name__}

    def _tensor(self, tensor: Any, stem: str) -> dict[str, Any]:
        framework = self.framework
        desc = framework.describe_tensor(tensor)
        stats = framework.statistics(tensor)
        if stats is not None:
            self.stats.append(stats)
            self.stat_targets.append(desc)
        if self.mode == "statistics":
            return desc
        file_name = safe_file_name(stem, framework.file_suffix)
        previous = self.files.pop(file_name, None)  # a parameter grad re-captured at a later micro-step
        if previous is not None:
            self.bytes -= previous.nbytes
        nbytes = framework.nbytes(tensor)
        if self.bytes + nbytes > self.max_bytes:
            if not self.budget_hit:
                logger.warning("trainmon dump: step %d reached dump.max_bytes=%d; later tensors keep their "
                               "statistics but are not %s", self.step, self.max_bytes,
                               "saved" if self.mode == "tensor" else "hashed")
            self.budget_hit = True
            return desc
        self.bytes += nbytes
        host = framework.host_copy(tensor)  # sync: the dump's host copy (dump steps only)
        if self.mode == "tensor":
            self.files[file_name] = host
            desc["data_name"] = file_name
        else:
            self.hashes.append((desc, host))
        return desc
