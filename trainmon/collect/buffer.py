"""The per-step buffer: device statistics appended by hooks, moved to the host once per step."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.base.records import RowKey

DeviceHook = Callable[[list[torch.Tensor]], None]
"""Runs on the device tensors just before the transfer (e.g. one cross-rank collective)."""


@dataclass
class HostStep:
    """What :meth:`StepBuffer.transfer` returns: row keys with their partial statistics, scalars."""

    keys: list[RowKey]
    partials: npt.NDArray[np.float64]  # [len(keys), 8]
    scalars: dict[str, float]


class Buffer(Protocol):
    """What ``StepContext.buffer`` is: a :class:`StepBuffer`, or a framework's own step buffer with the same
    members (MindSpore's ``MindSporeStepBuffer``, whose partials are MindSpore tensors). Only a
    :class:`StepBuffer` has :meth:`StepBuffer.reserve_orders` and :meth:`StepBuffer.add_block`."""

    keys: list[RowKey]
    partials: list[Any]
    scalar_names: list[str]
    scalar_values: list[Any]
    host_scalars: dict[str, float]

    def next_order(self) -> int: ...

    def add(self, key: RowKey, partial: Any) -> None: ...

    def add_scalar(self, name: str, value: Any) -> None: ...

    def truncate(self, n_rows: int) -> None: ...

    def __len__(self) -> int: ...

    def transfer(self) -> HostStep: ...


@dataclass
class StepBuffer:
    """Collects row keys with their ``[8]`` partial statistics, and 0-d scalar tensors, during a step.

    Hooks call :meth:`add` (one row), :meth:`add_block` (``N`` rows computed together, a flat
    ``[8 N]`` tensor) and :meth:`add_scalar`, which only append: no computation, no
    synchronisation. :meth:`transfer` concatenates everything and performs the step's single
    device-to-host copy per device (one device in every ordinary run): one ``cat`` per device,
    whatever the number of rows.
    """

    keys: list[RowKey] = field(default_factory=list)
    partials: list[torch.Tensor] = field(default_factory=list)
    """Flat float32 tensors of ``8 k`` values, the partials of ``k`` consecutive ``keys``."""
    scalar_names: list[str] = field(default_factory=list)
    scalar_values: list[torch.Tensor] = field(default_factory=list)
    host_scalars: dict[str, float] = field(default_factory=dict)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def next_order(self) -> int:
        """Execution-order counter within the step (the ``order`` of rows and events)."""
        return next(self._order)

    def reserve_orders(self, count: int) -> int:
        """The first of ``count`` consecutive execution-order numbers, reserved for rows measured together."""
        first = next(self._order)
        if count > 1:
            self._order = itertools.count(first + count)
        return first

    def add(self, key: RowKey, partial: torch.Tensor) -> None:
        self.keys.append(key)
        self.partials.append(partial)

    def add_block(self, keys: list[RowKey], block: torch.Tensor) -> None:
        """``len(keys)`` rows whose partials are the consecutive 8-value slices of the flat ``block``."""
        self.keys.extend(keys)
        self.partials.append(block)

    def truncate(self, n_rows: int) -> None:
        """Keep the first ``n_rows`` rows only (the rows of a pass that raised go); a block is cut where needed."""
        if n_rows >= len(self.keys):
            return
        del self.keys[n_rows:]
        kept: list[torch.Tensor] = []
        rows = 0
        for partial in self.partials:  # each holds numel / 8 rows: host metadata, no sync
            if rows >= n_rows:
                break
            count = partial.numel() // PARTIAL_SLOTS
            kept.append(partial if rows + count <= n_rows else partial.reshape(-1)[:(n_rows - rows) * PARTIAL_SLOTS])
            rows += count
        self.partials = kept

    def drop_rows(self, start: int, stop: int, micro_step: int) -> None:
        """Remove rows ``start:stop`` (an abandoned micro-step's) and renumber the later rows' micro-steps.

        Rows after ``stop`` whose micro-step is above ``micro_step`` move down by one, so micro-steps stay
        dense. Blocks are cut into views where needed (host metadata only, no sync).
        """
        stop = min(stop, len(self.keys))
        if start >= stop:
            return
        kept: list[torch.Tensor] = []
        rows = 0
        for partial in self.partials:
            count = partial.numel() // PARTIAL_SLOTS
            flat = partial.reshape(-1)
            first, last = rows, rows + count
            if last <= start or first >= stop:
                kept.append(partial)
            else:
                if first < start:
                    kept.append(flat[:(start - first) * PARTIAL_SLOTS])
                if last > stop:
                    kept.append(flat[(stop - first) * PARTIAL_SLOTS:])
            rows = last
        self.partials = kept
        later = [key if key.micro_step <= micro_step else dataclasses.replace(key, micro_step=key.micro_step - 1)
                 for key in self.keys[stop:]]
        self.keys[start:] = later

    def add_scalar(self, name: str, value: torch.Tensor | float | int) -> None:
        if isinstance(value, torch.Tensor):
            self.scalar_names.append(name)
            self.scalar_values.append(value.detach().reshape(()).to(torch.float32))
        else:
            self.host_scalars[name] = float(value)

    def __len__(self) -> int:
        return len(self.keys) + len(self.scalar_names)

    def transfer(self) -> HostStep:
        """Concatenate and copy to the host: THE host synchronisation of a collected step."""
        return self.start_transfer(wait=True).result()

    def start_transfer(self, wait: bool = False) -> Transfer:
        """Concatenate and start the copy to the host; :meth:`Transfer.result` gives the :class:`HostStep`.

        ``wait=False``: a device's copy goes to pinned host memory without waiting for the device, and an
        event marks its end (``result`` waits for that event only); a device without events is copied
        at once. ``wait=True``: every copy is made now (the step's one synchronisation).
        """
        # Entries in the order they were added (row blocks, then the scalars), grouped by device so
        # that a model spread over devices still costs one copy per device.
        entries: list[torch.Tensor] = [p if p.dim() == 1 else p.reshape(-1) for p in self.partials]
        scalar_devices: dict[torch.device, list[int]] = {}
        if self.scalar_values:
            for i, value in enumerate(self.scalar_values):
                scalar_devices.setdefault(value.device, []).append(i)
            entries.extend(torch.stack([self.scalar_values[i] for i in indices])
                           for indices in scalar_devices.values())
        by_device: dict[torch.device, list[int]] = {}
        for i, tensor in enumerate(entries):
            by_device.setdefault(tensor.device, []).append(i)
        copies = []
        for indices in by_device.values():
            stacked = torch.cat([entries[i] for i in indices]) if len(indices) > 1 else entries[indices[0]]
            copies.append((indices, [entries[i].numel() for i in indices], *copy_to_host(stacked, wait)))
        scalar_names = [[self.scalar_names[i] for i in indices] for indices in scalar_devices.values()]
        return Transfer(list(self.keys), len(self.partials), copies, scalar_names, dict(self.host_scalars))


def device_module(device_type: str) -> Any:
    """``torch.cuda``, ``torch.npu``, ...: the module of a device type's streams and events (None: torch has none)."""
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError):
        return None


def copy_to_host(tensor: torch.Tensor, wait: bool) -> tuple[torch.Tensor, Any]:
    """``(host tensor, event or None)``: a copy started on the device's stream, or made now."""
    if tensor.device.type == "cpu" and not wait:
        return tensor, None  # on the host already (a fresh tensor: the entries were concatenated or stacked)
    if tensor.device.type == "cpu" or wait:
        return tensor.cpu(), None  # sync (on a device): the one device-to-host transfer of the step
    module = events_module(tensor.device.type)
    if module is None:
        return tensor.cpu(), None  # sync: a device without events copies the step's one transfer now
    try:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # no pinned memory here: torch stages the copy itself
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
    host.copy_(tensor, non_blocking=True)  # into pinned memory: the host does not wait for the device
    return host, copy_done(module, tensor.device)


def events_module(device_type: str) -> Any:
    """The device module (``torch.cuda``, ``torch.npu``, ...) when it has events and streams, else None."""
    module = device_module(device_type)
    if getattr(module, "Event", None) is None or getattr(module, "current_stream", None) is None:
        return None
    return module


def copy_done(module: Any, device: torch.device) -> Any:
    """An event that ends what was queued so far on ``device``'s current stream, where a copy of a tensor of
    ``device`` went: that device need not be the current one (a model spread over GPUs in one process, as
    ``device_map="auto"`` does), and an event recorded on the current device's stream would end too early."""
    event = module.Event()
    event.record(module.current_stream(device))
    return event


@dataclass
class Transfer:
    """A step's partials on their way to the host (:meth:`StepBuffer.start_transfer`)."""

    keys: list[RowKey]
    n_blocks: int
    copies: list[tuple[list[int], list[int], torch.Tensor, Any]]
    """Per device: entry indices, their sizes, the host tensor, the event that ends its copy (or None)."""
    scalar_names: list[list[str]]
    host_scalars: dict[str, float]

    def done(self) -> bool:
        """Whether every copy has ended (asks the devices' events; never waits)."""
        return all(event is None or event.query() for *_, event in self.copies)

    def result(self) -> HostStep:
        """The host copy (waits for the copies' events only, which have long ended one step later)."""
        pieces: list[npt.NDArray[np.float32]] = [np.empty(0, np.float32)] * sum(len(c[0]) for c in self.copies)
        n_blocks = self.n_blocks
        partials = None
        for indices, sizes, host, event in self.copies:
            if event is not None:
                event.synchronize()  # this copy only, not the device
            values = host.numpy()  # host memory (its copy ended with the event): no sync
            if len(self.copies) == 1 and n_blocks:  # one device: the blocks are the copy's first values, in order
                end = sum(sizes[:n_blocks])
                partials = values[:end].astype(np.float64).reshape(-1, PARTIAL_SLOTS)
                values, indices, sizes = values[end:], indices[n_blocks:], sizes[n_blocks:]
            for i, piece in zip(indices, np.split(values, np.cumsum(sizes)[:-1])):
                pieces[i] = piece
        if partials is None:
            partials = (np.concatenate(pieces[:n_blocks]).astype(np.float64).reshape(-1, PARTIAL_SLOTS) if n_blocks
                        else np.empty((0, PARTIAL_SLOTS)))
        scalars = dict(self.host_scalars)
        for names, piece in zip(self.scalar_names, pieces[n_blocks:]):
            scalars.update((name, float(value)) for name, value in zip(names, piece))
        return HostStep(self.keys, partials, scalars)


class PendingScalars:
    """The scalars given to ``step()`` on steps that are not collected, on their way to the anomaly detectors
    without a host synchronisation.

    Each such step's scalars go into a buffer of their own whose copy to the host starts at once without
    waiting for the device (pinned memory and an event, as ``async_results`` does; on the CPU the values
    are simply there). :meth:`take` hands over, oldest first, the steps whose copy has ended, asking the
    events only; at a collected step (which synchronises anyway) it hands over all of them. A buffer that
    cannot copy without waiting (MindSpore's) waits for the next collected step, whose one transfer takes
    its values along (:meth:`merge_into`, :meth:`split_from`).

    Args:
        make_buffer: makes one step's buffer (``StepContext.buffer_factory``).
        limit: at most this many steps wait; an older one is then finished (waiting for its copy only).
    """

    def __init__(self, make_buffer: Callable[[], Buffer], limit: int = 1024) -> None:
        self._make = make_buffer
        self._limit = limit
        self._queue: deque[tuple[int, Transfer | Buffer | dict[str, float]]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Start moving one uncollected step's scalars to the host (device tensors or numbers; no sync)."""
        buffer = self._make()
        for name, value in scalars.items():
            buffer.add_scalar(name, value)
        self._queue.append((step, buffer.start_transfer() if isinstance(buffer, StepBuffer) else buffer))

    def merge_into(self, buffer: Buffer) -> None:
        """Add the values of the steps that wait for a collected step to that step's ``buffer``, before its
        transfer (under reserved names that :meth:`split_from` takes out of the result)."""
        for step, pending in self._queue:
            if not isinstance(pending, (Transfer, dict)):
                for name, value in zip(pending.scalar_names, pending.scalar_values, strict=True):
                    buffer.add_scalar(f"{_MERGED}{step}/{name}", value)
                for name, number in pending.host_scalars.items():
                    buffer.add_scalar(f"{_MERGED}{step}/{name}", number)

    def split_from(self, host: HostStep) -> None:
        """Take the values :meth:`merge_into` added out of a collected step's ``host`` result."""
        merged: dict[int, dict[str, float]] = {}
        for key in [key for key in host.scalars if key.startswith(_MERGED)]:
            step, name = key[len(_MERGED):].split("/", 1)
            merged.setdefault(int(step), {})[name] = host.scalars.pop(key)
        if merged:
            self._queue = deque((step, merged.get(step, {}) if not isinstance(pending, (Transfer, dict)) else pending)
                                for step, pending in self._queue)

    def take(self, before: float = 0) -> Iterator[tuple[int, dict[str, float]]]:
        """``(step, scalars)`` of the waiting steps, oldest first: every step before ``before`` (waiting for its
        copy only, if it has not ended), then those whose copy has ended. ``math.inf``: all of them."""
        queue = self._queue
        while queue:
            step, pending = queue[0]
            if not (step < before or len(queue) > self._limit or isinstance(pending, dict)
                    or (isinstance(pending, Transfer) and pending.done())):
                return
            queue.popleft()
            if isinstance(pending, Transfer):
                yield step, pending.result().scalars
            else:
                yield step, pending if isinstance(pending, dict) else pending.transfer().scalars


_MERGED = "\0pending/"
