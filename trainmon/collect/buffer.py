"""The per-step buffer: device statistics appended by hooks, moved to the host once per step."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from trainmon.records import PARTIAL_SLOTS, RowKey

DeviceHook = Callable[[list[torch.Tensor]], None]
"""Runs on the device tensors just before the transfer (e.g. one cross-rank collective)."""


@dataclass
class HostStep:
    """What :meth:`StepBuffer.transfer` returns: row keys with their partial statistics, scalars."""

    keys: list[RowKey]
    partials: np.ndarray  # [len(keys), 8] float64
    scalars: dict[str, float]


@dataclass
class StepBuffer:
    """Collects ``(RowKey, [8] device tensor)`` pairs and 0-d scalar tensors during a step.

    Hooks call :meth:`add` and :meth:`add_scalar`, which only append: no computation, no
    synchronisation. :meth:`transfer` stacks everything and performs the step's single
    device-to-host copy per device (one device in every ordinary run).
    """

    keys: list[RowKey] = field(default_factory=list)
    partials: list[torch.Tensor] = field(default_factory=list)
    scalar_names: list[str] = field(default_factory=list)
    scalar_values: list[torch.Tensor] = field(default_factory=list)
    host_scalars: dict[str, float] = field(default_factory=dict)
    _order: itertools.count = field(default_factory=itertools.count)

    def next_order(self) -> int:
        """Execution-order counter within the step (the ``order`` of rows and events)."""
        return next(self._order)

    def add(self, key: RowKey, partial: torch.Tensor) -> None:
        self.keys.append(key)
        self.partials.append(partial)

    def add_scalar(self, name: str, value: torch.Tensor | float | int) -> None:
        if isinstance(value, torch.Tensor):
            self.scalar_names.append(name)
            self.scalar_values.append(value.detach().reshape(()).to(torch.float32))
        else:
            self.host_scalars[name] = float(value)

    def __len__(self) -> int:
        return len(self.keys) + len(self.scalar_names)

    def transfer(self) -> HostStep:
        """Stack and copy to the host: THE host synchronisation of a collected step."""
        tensors = self.partials + self.scalar_values
        pieces: list[np.ndarray] = [np.empty(0)] * len(tensors)
        # Group by device so a model spread over devices still costs one copy per device.
        by_device: dict[torch.device, list[int]] = {}
        for i, tensor in enumerate(tensors):
            by_device.setdefault(tensor.device, []).append(i)
        for indices in by_device.values():
            stacked = torch.cat([tensors[i].reshape(-1) for i in indices])
            values = stacked.cpu().numpy()  # sync: the one device-to-host transfer of the step
            sizes = np.cumsum([tensors[i].numel() for i in indices])[:-1]
            for i, piece in zip(indices, np.split(values, sizes)):
                pieces[i] = piece
        n_rows = len(self.partials)
        partials = (np.stack(pieces[:n_rows]).astype(np.float64) if n_rows
                    else np.empty((0, PARTIAL_SLOTS)))
        scalars = dict(self.host_scalars)
        scalars.update((name, float(piece[0])) for name, piece in zip(self.scalar_names, pieces[n_rows:]))
        return HostStep(list(self.keys), partials, scalars)
