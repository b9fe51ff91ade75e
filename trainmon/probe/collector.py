"""The grad probe collector: gradient summaries, packed directions and in-run similarity.

At the optimizer's step pre-hook of a collected step (the gradient the step uses) it computes,
per target parameter and on the gradient's device: max, min, norm (float32), and by level

- L0: a content hash (from two on-device integer checksums, see :func:`content_hash`);
- L1: packed sign bits (``x > 0``, 1 bit per element, optionally of a fixed sample) and the
  in-run similarities ``sign_agree_prev`` (XOR + popcount of the packed bits of this and the
  previous collected step), ``cos_prev`` (only with ``sample_elements``: cosine with the previous
  step's sampled values), ``sign_agree_exp_avg`` and ``cos_exp_avg`` (against Adam's ``exp_avg``
  as the step finds it, i.e. the momentum the new gradient is about to be folded into);
- L2: L1 plus the fractions of elements in the right-closed intervals of ``bounds`` and the
  fraction exactly 0;
- at every level with ``mg_direction``: msprobe's ``mg_direction`` (sign agreement of gradient and
  ``exp_avg`` with a zero sign counting one half; 1.0 at step 0), as scalars only.

All statistics of a step go into one ``[params, W]`` float32 tensor; it and the packed bits are
copied to the host with ``non_blocking`` copies (into pinned memory on CUDA) enqueued during the
step. The step's single synchronising transfer (``StepBuffer.transfer``) completes them; the
writer thread additionally waits on a device event before reading, so it never reads early and
the training thread never waits. Files are written on that thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.buffer import copy_done, events_module
from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.probe import device as dev
from trainmon.probe.storage import AGREE_PREV, PROBE_DIR, SIMILARITIES, ProbeFiles, content_hash, vector_width

if TYPE_CHECKING:
    from trainmon.base.threads import OutputThread
    from trainmon.base.types import Optimizer
    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig
    from trainmon.probe.store import ProbeStore

logger = logging.getLogger("trainmon")
_GROUP = "grad_probe"
_F32 = torch.float32
PENDING_BYTES = 256 << 20
"""Host bytes the steps queued for the probe's writer may hold (a step beyond them is dropped, counted)."""


def _run_job(job: Callable[[], None]) -> None:
    job()


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Enqueue a device-to-host copy (no sync); on CPU the tensor itself is the host copy."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
    host.copy_(tensor, non_blocking=True)
    return host


def record_event(device: torch.device) -> Any:
    """The end of the copies queued for ``device``, on its own stream (not the current device's: see
    :func:`trainmon.collect.buffer.copy_done`)."""
    if device.type == "cpu":
        return None
    module = events_module(device.type)
    if module is not None:
        return copy_done(module, device)
    event = torch.Event(device=device)
    event.record()
    return event


class GradProbe(HookedCollector):
    """Collector of the ``grad_probe`` section (see the module docstring).

    Args:
        ctx: the monitor's step context (``step``, ``collecting``, ``buffer``).
        params: ``(name, parameter, vpp_stage)`` of the target parameters.
        config: the monitor config (``grad_probe`` and ``flush_seconds`` are read).
        registry: where the optimizer hook handle lives.
        optimizer: its step pre-hook triggers the measurement; without one (or without
            ``register_step_pre_hook``) the integration calls :meth:`measure` itself, else
            :meth:`before_transfer` measures whatever gradients are still there.
        grad_of: ``parameter -> gradient tensor or None`` (default ``param.grad``).
        exp_avg_of: ``parameter -> exp_avg tensor or None`` (default ``optimizer.state[p]["exp_avg"]``).
        rank_dir: the rank's output directory; outputs go to ``{rank_dir}/grad_probe/``. Without
            one (a rank that does not write) the probe measures nothing; see :meth:`bind_output`.
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, torch.Tensor, int]], config: MonitorConfig,
                 registry: HookRegistry, optimizer: Optimizer | None = None, *,
                 grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 exp_avg_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 rank_dir: Path | None = None) -> None:
        super().__init__(ctx, registry)
        self.params = list(params)
        self.settings = config.grad_probe
        self.optimizer = optimizer
        self.grad_of = grad_of or (lambda p: p.grad)
        self.exp_avg_of = exp_avg_of or self._adam_exp_avg
        self.level = self.settings.level
        self.bounds = list(self.settings.bounds)
        self.width = vector_width(self.level, self.bounds)
        self._flush_seconds = config.flush_seconds
        self._to_store = "parquet" in config.sinks  # the run store (probe/store.py), else the per-file layout
        self._hookable = optimizer is not None and hasattr(optimizer, "register_step_pre_hook")
        self._prev_bits: dict[int, torch.Tensor] = {}
        self._prev_sample: dict[int, torch.Tensor] = {}
        self._samples: dict[int, torch.Tensor] = {}
        self._measured_step: int | None = None
        self._writer: OutputThread | None = None
        self._output: ProbeFiles | ProbeStore | None = None
        self.bind_output(rank_dir)

    # ----------------------------------------------------------------------------- lifecycle
    def bind_output(self, rank_dir: Path | None) -> None:
        """Set the rank directory (the monitor knows it only after ``attach``); None turns output off."""
        if self._writer is not None or rank_dir is None or self._closed:
            return
        from trainmon.base.threads import OutputThread

        rank_dir = Path(rank_dir)
        root = rank_dir.parent  # the run directory: no symlink below it is followed
        store: ProbeStore | None = None
        if self._to_store:
            from trainmon.probe.store import ProbeStore

            digits = rank_dir.name.removeprefix("rank")
            store = ProbeStore(root, int(digits) if digits.isdigit() else 0, self.level, self.bounds,
                               roll_seconds=self._flush_seconds)
        output = self._output = store or ProbeFiles(rank_dir / PROBE_DIR, self.level, self.bounds, root)
        # Few pending steps (bounded by bytes at each step): a queued step may hold every parameter's bits in host
        # memory. The
        # output is closed on the writer thread, after the last queued step; the store writes
        # what it holds when the thread idles (a pause of training).
        self._writer = OutputThread("grad_probe", _run_job, flush=output.flush, close=output.close,
                                    idle=store.idle if store is not None else None,
                                    flush_seconds=self._flush_seconds, max_pending=4, disable_on_error=False)

    HOOK_GROUPS = (_GROUP,)
    PART = "grad_probe"

    def install_hooks(self) -> None:
        if self._hookable and self.optimizer is not None:
            self.registry.add(_GROUP, self.optimizer.register_step_pre_hook(self.guarded(self._pre_step)))

    def before_transfer(self) -> None:
        if not self._hookable:
            self.measure()

    def release(self) -> None:
        """Write what is queued (within a bounded time) and close the files (once, by ``close``).

        Never raises for an output failure (it is reported once and counted)."""
        if self._writer is not None:
            self._writer.close()  # bounded; never raises
            self._writer.report()
        self._prev_bits.clear()
        self._prev_sample.clear()

    def _pre_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self.ctx.state_init_step:  # torch.distributed.checkpoint's state initialisation is not a step
            self.measure()

    def _adam_exp_avg(self, param: torch.Tensor) -> torch.Tensor | None:
        state = getattr(self.optimizer, "state", None)
        entry = state.get(param) if state is not None else None
        return entry.get("exp_avg") if entry else None

    # ----------------------------------------------------------------------------- measuring
    def measure(self) -> None:
        """Measure the current gradients of the target parameters (once per collected step).

        Enqueues device work and asynchronous copies only; never synchronises with the host.
        """
        ctx = self.ctx
        if not ctx.collecting or self._writer is None or self._measured_step == ctx.step:
            return
        self._measured_step = ctx.step
        vectors: list[torch.Tensor] = []
        metas: list[dict[str, Any]] = []
        bits: list[torch.Tensor] = []
        checksums: list[torch.Tensor] = []
        totals: dict[str, list[torch.Tensor]] = {}
        directions: list[tuple[str, torch.Tensor | None]] = []
        for index, (name, param, vpp_stage) in enumerate(self.params):
            grad = self.grad_of(param)
            if grad is None or grad.numel() == 0:
                continue
            grad = grad.detach()
            flat = (torch.view_as_real(grad) if grad.is_complex() else grad).reshape(-1)
            meta = {"name": name, "vpp_stage": vpp_stage, "shape": list(grad.shape), "numel": flat.numel(),
                    "dtype": str(grad.dtype).removeprefix("torch.")}
            row = self._base_stats(flat)
            if self.level == "L0":
                packed = dev.pack_positive(flat)
                checksums.append(torch.stack([dev.raw_checksum(flat).to(torch.int64), dev.words_checksum(packed)]))
                row += [self._nan(flat)] * (len(SIMILARITIES))
            else:
                packed, count, similarities = self._directions(index, param, flat, row[2], totals)
                meta["count"] = count
                meta["available"] = [s is not None for s in similarities]
                bits.append(packed)
                row += [self._nan(flat) if s is None else s for s in similarities]
                if self.level == "L2":
                    numel = flat.numel()
                    row += [c / numel for c in dev.interval_counts(flat, self.bounds)]
                    row.append((numel - torch.count_nonzero(flat)).to(_F32) / numel)
            vectors.extend(row)
            metas.append(meta)
            if self.settings.mg_direction:
                directions.append((name, self._mg_direction(param, flat)))
        if directions:
            self._add_mg_direction(directions)
        if not metas:
            return
        stats = torch.stack([v.to(_F32) for v in vectors]).view(len(metas), self.width)
        self._add_scalars(stats, metas, totals)
        host_stats = pinned_copy(stats)
        host_checksums = pinned_copy(torch.stack(checksums)) if checksums else None
        host_bits = [pinned_copy(b) for b in bits] if stats.device.type == "cpu" else (
            self._split_host(torch.cat(bits), bits) if bits else [])
        event = record_event(stats.device)
        step = ctx.step
        # Queued steps hold their bits in host memory: as many as fit in PENDING_BYTES (4 at least, 64 at most).
        step_bytes = host_stats.nbytes + sum(b.nbytes for b in host_bits)
        self._writer.bound(min(64, max(4, PENDING_BYTES // max(1, step_bytes))))
        self._writer.submit(lambda: self._write(step, metas, host_stats, host_checksums, host_bits, event))

    def _base_stats(self, flat: torch.Tensor) -> list[torch.Tensor]:
        lo, hi = torch.aminmax(flat)
        return [hi, lo, torch.linalg.vector_norm(flat, dtype=_F32)]

    def _nan(self, like: torch.Tensor) -> torch.Tensor:
        return self._const(float("nan"), like)

    @staticmethod
    def _const(value: float, like: torch.Tensor) -> torch.Tensor:
        """A 0-d float32 constant on ``like``'s device, written by a fill kernel (no host copy)."""
        return torch.full((), value, dtype=_F32, device=like.device)

    def _directions(self, index: int, param: torch.Tensor, flat: torch.Tensor, norm: torch.Tensor,
                    totals: dict[str, list[torch.Tensor]]) -> tuple[torch.Tensor, int, list[torch.Tensor | None]]:
        """Packed signs (sampled or full), and the four similarities of one parameter (None: unavailable).

        Each full-size tensor is read a minimal number of times: ``g > 0`` once (packed, then
        compared as bits), ``m > 0`` once, one dot product and one norm of ``m``; the gradient's
        norm is reused from the base statistics.
        """
        sample_size = self.settings.sample_elements
        cos_prev: torch.Tensor | None = None
        packed_full: torch.Tensor | None = None
        values: torch.Tensor | None
        if sample_size is not None and sample_size < flat.numel():
            indices = self._samples.get(index)
            if indices is None or indices.device != flat.device:
                indices = self._samples[index] = dev.sample_indices(flat.numel(), sample_size, flat.device)
            values = flat[indices].to(_F32)
            packed = dev.pack_positive(values)
            count = values.numel()
        else:
            # a copy: the gradient may be zeroed or reused in place before the next collected step
            values = flat.to(_F32, copy=True) if sample_size is not None else None
            packed = packed_full = dev.pack_positive(flat)
            count = flat.numel()
        if values is not None:
            previous = self._prev_sample.get(index)
            if previous is not None and previous.shape == values.shape:
                dot, norm_v, norm_p = torch.dot(values, previous), torch.linalg.vector_norm(values), \
                    torch.linalg.vector_norm(previous)
                cos_prev = dot / (norm_v * norm_p)
                totals.setdefault("cos_prev", []).append(torch.stack([dot, norm_v.square(), norm_p.square()]))
            self._prev_sample[index] = values
        agree_prev: torch.Tensor | None = None
        previous_bits = self._prev_bits.get(index)
        if previous_bits is not None and previous_bits.shape == packed.shape:
            differing = dev.differing_bits(packed, previous_bits).to(_F32)
            agree_prev = 1.0 - differing / count
            totals.setdefault("sign_agree_prev", []).append(torch.stack([differing, self._const(count, flat)]))
        self._prev_bits[index] = packed
        agree_exp_avg: torch.Tensor | None = None
        cos_exp_avg: torch.Tensor | None = None
        exp_avg = self.exp_avg_of(param)
        if exp_avg is not None and exp_avg.numel() == flat.numel():
            momentum = exp_avg.detach().reshape(-1)
            if packed_full is None:
                packed_full = dev.pack_positive(flat)
            differing_m = dev.differing_bits(packed_full, dev.pack_positive(momentum)).to(_F32)
            agree_exp_avg = 1.0 - differing_m / flat.numel()
            dot = torch.dot(flat.to(_F32), momentum.to(_F32))
            norm_m = torch.linalg.vector_norm(momentum, dtype=_F32)
            cos_exp_avg = dot / (norm * norm_m)
            totals.setdefault("sign_agree_exp_avg", []).append(
                torch.stack([differing_m, self._const(flat.numel(), flat)]))
            totals.setdefault("cos_exp_avg", []).append(torch.stack([dot, norm.square(), norm_m.square()]))
        return packed, count, [agree_prev, cos_prev, agree_exp_avg, cos_exp_avg]

    def _mg_direction(self, param: torch.Tensor, flat: torch.Tensor) -> torch.Tensor | None:
        """msprobe's ``mg_direction`` parts ``[sum(sign(g) * sign(m)), numel]`` (float32, on device);
        ``[numel, numel]`` (a ratio of 1.0) at step 0, None when there is no ``exp_avg`` later on.

        msprobe (``module_hook.py``, ``get_sign_matches``) reports ``(sum / numel + 1) / 2``, so an
        element where either sign is 0 counts one half, and 1.0 at step 0."""
        numel = self._const(flat.numel(), flat)
        if self.ctx.step == 0:
            return torch.stack([numel, numel])
        exp_avg = self.exp_avg_of(param)
        if exp_avg is None or exp_avg.numel() != flat.numel():
            return None
        momentum = exp_avg.detach().reshape(-1)
        agree = (torch.sign(flat) * torch.sign(momentum)).sum(dtype=_F32)
        return torch.stack([agree, numel])

    def _add_mg_direction(self, directions: list[tuple[str, torch.Tensor | None]]) -> None:
        """``grad_probe/mg_direction`` (element-weighted) and, with ``scalars: param``, one per parameter."""
        mode = self.settings.scalars
        parts = [(name, p) for name, p in directions if p is not None]
        if mode == "none" or not parts:
            return
        buffer = self.ctx.buffer
        summed = torch.stack([p for _, p in parts]).sum(dim=0)
        buffer.add_scalar("grad_probe/mg_direction", (summed[0] / summed[1] + 1) / 2)
        if mode == "param":
            for name, p in parts:
                buffer.add_scalar(f"grad_probe/{name}/mg_direction", (p[0] / p[1] + 1) / 2)

    def _add_scalars(self, stats: torch.Tensor, metas: list[dict[str, Any]],
                     totals: dict[str, list[torch.Tensor]]) -> None:
        """In-run similarities as step scalars (they ride on the step's one transfer)."""
        mode = self.settings.scalars
        if mode == "none" or self.level == "L0":
            return
        buffer = self.ctx.buffer
        for metric, parts in totals.items():
            summed = torch.stack(parts).sum(dim=0)
            if metric.startswith("sign_agree"):
                value = 1.0 - summed[0] / summed[1]
            else:
                value = summed[0] / (summed[1].sqrt() * summed[2].sqrt())
            buffer.add_scalar(f"grad_probe/{metric}", value)
        if mode == "param":
            for j, meta in enumerate(metas):
                for k, metric in enumerate(SIMILARITIES):
                    if not meta["available"][k]:
                        continue
                    buffer.add_scalar(f"grad_probe/{meta['name']}/{metric}", stats[j, AGREE_PREV + k])

    @staticmethod
    def _split_host(joined: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        host = pinned_copy(joined)
        return list(torch.split(host, [p.numel() for p in parts]))

    # ----------------------------------------------------------------------------- writer thread
    def _write(self, step: int, metas: list[dict[str, Any]], host_stats: torch.Tensor,
               host_checksums: torch.Tensor | None, host_bits: list[torch.Tensor], event: Any) -> None:
        """Runs on the writer thread: wait for the copies, hand the step to the output (files or the store)."""
        if event is not None:
            event.synchronize()  # waits on this thread only; the step's transfer has usually completed it
        assert self._output is not None
        stats = host_stats.numpy()  # host copies on the writer thread: no sync
        hashes = None
        if host_checksums is not None:
            checksums = host_checksums.numpy()  # host copy: no sync
            hashes = [content_hash(meta["dtype"], meta["shape"], stats[j][:3], *checksums[j])
                      for j, meta in enumerate(metas)]
        for meta in metas:
            if "count" in meta:
                meta["sample"] = None if meta["count"] == meta["numel"] else \
                    {"method": "stratified", "seed": dev.SAMPLE_SEED, "elements": meta["count"]}
        self._output.write_step(step, metas, stats, hashes, [bits.numpy() for bits in host_bits])  # host copies
