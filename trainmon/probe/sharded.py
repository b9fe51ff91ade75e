"""The grad probe of a parameter kept in pieces across ranks (ZeRO 1-3, Megatron TP / distributed optimizer).

Each rank measures its own piece in the hook (float64 partials, packed sign bits of the piece, L0
checksum shares; :mod:`trainmon.probe.shards`), and at the end of the step ONE ``gather`` over the
group of ranks holding the pieces brings every rank's bytes to the *writer* (the lowest rank of
the group that ``ranks`` selects). The writer combines the partials on its device into the rows
of the whole parameter, and its writer thread places the pieces' sign bits at their positions in
the whole parameter and writes one direction per parameter (a file, or a row of the run store), as an
unsharded run does. The other ranks write nothing of the probe. Bits are 1/32 of a float32 gradient: the writer receives
the direction of the whole model, never a gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from trainmon.base import process_groups
from trainmon.probe import device as dev
from trainmon.probe import shards as sh
from trainmon.probe.collector import GradProbe, pinned_copy, record_event
from trainmon.probe.storage import AGREE_PREV, SIMILARITIES

if TYPE_CHECKING:
    from trainmon.base.types import Optimizer, ProcessGroup
    from trainmon.collect.context import StepContext
    from trainmon.collect.hooks import HookRegistry
    from trainmon.config import MonitorConfig

logger = logging.getLogger("trainmon")
_F32, _F64 = torch.float32, torch.float64


class ShardedGradProbe(GradProbe):
    """:class:`GradProbe` of parameters whose gradients are split across the ranks of ``group``.

    Args:
        ctx, params, config, registry, optimizer, exp_avg_of, rank_dir: as for :class:`GradProbe`;
            ``exp_avg_of`` returns this rank's piece of ``exp_avg`` (aligned with the gradient's).
        grad_of: ``parameter -> this rank's piece of the gradient`` (any shape; ``spec.numel``
            elements) or None when it holds none.
        spec_of: ``parameter -> ShardSpec`` of this rank's piece (static; read once here).
        group: the process group whose ranks hold the pieces (None: the default group).

    Every rank of ``group`` must construct it with the same parameters in the same order: the
    specs of all ranks are exchanged here (one ``all_gather_object`` at attach, none per step).

    Raises:
        ValueError: the pieces of a parameter do not add up to the whole parameter.
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, torch.Tensor, int]], config: MonitorConfig,
                 registry: HookRegistry, optimizer: Optimizer | None = None, *,
                 grad_of: Callable[[torch.Tensor], torch.Tensor | None],
                 spec_of: Callable[[torch.Tensor], sh.ShardSpec],
                 exp_avg_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 group: ProcessGroup | None = None, rank_dir: Path | None = None) -> None:
        self.group = group
        self.distributed = process_groups.initialized()
        self.rank = process_groups.global_rank()
        self.dst = process_groups.lowest_selected(group, config.ranks)
        self.group_rank, self.world = process_groups.layout(group)
        specs = [spec_of(p) for _, p, _ in params]
        self.all_specs = self._exchange(specs)
        self.partial_width = sh.partial_width(config.grad_probe.bounds)
        super().__init__(ctx, params, config, registry, optimizer, grad_of=grad_of, exp_avg_of=exp_avg_of,
                         rank_dir=rank_dir)
        self._check_cover()
        sample = self.settings.sample_elements
        self._samples_global = [sh.sample_global(spec.total, sample) for spec in specs]
        self._stored = [[self._stored_count(i, r) for i in range(len(specs))] for r in range(self.world)]
        self._bytes = [[8 * dev.packed_words(n) for n in row] for row in self._stored]
        self._header = len(specs) * self.partial_width * 8 + (len(specs) * 16 if self.level == "L0" else 0)
        per_rank = [self._header + (0 if self.level == "L0" else sum(row)) for row in self._bytes]
        self._size = -(-max(per_rank) // 8) * 8
        self._local_samples: dict[int, torch.Tensor] = {}
        self._positions: dict[tuple[int, int], tuple[npt.NDArray[np.int64] | None, sh.Positions]] = {}
        self._pending: tuple[Any, ...] | None = None
        self._measured_before: set[int] = set()
        self._dtypes: dict[int, str] = {}
        self._warned_size = False

    # ----------------------------------------------------------------------------- set-up
    def _exchange(self, specs: list[sh.ShardSpec]) -> list[list[sh.ShardSpec]]:
        if not self.distributed or self.world == 1:
            return [specs]
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, specs, group=self.group)  # once, at attach
        return everyone

    def _check_cover(self) -> None:
        for i, (name, _, _) in enumerate(self.params):
            pieces = [specs[i] for specs in self.all_specs]
            shapes = {piece.shape for piece in pieces}
            covered = sum(piece.numel for piece in pieces)
            if len(shapes) != 1 or covered != pieces[0].total:
                raise ValueError(f"grad_probe: the pieces of {name} on the {self.world} ranks cover {covered} "
                                 f"elements of shapes {sorted(shapes)}, not the whole parameter once")

    def _stored_count(self, index: int, rank: int) -> int:
        spec, sample = self.all_specs[rank][index], self._samples_global[index]
        return spec.numel if sample is None else len(spec.local_positions(sample)[0])

    @property
    def is_writer(self) -> bool:
        return self.dst == self.rank

    def bind_output(self, rank_dir: Path | None) -> None:
        """Only the writer of the group writes the probe's files."""
        if self.dst is not None and self.dst == getattr(self, "rank", None):
            super().bind_output(rank_dir)

    # ----------------------------------------------------------------------------- in the hook
    def measure(self) -> None:
        """Measure this rank's pieces (device work only; the gather is in :meth:`before_transfer`)."""
        ctx = self.ctx
        if not ctx.collecting or self.dst is None or self._closed or self._measured_step == ctx.step:
            return
        self._measured_step = ctx.step
        rows: list[torch.Tensor | None] = []
        checksums: list[torch.Tensor | None] = []
        bits: list[torch.Tensor | None] = []
        exp_avg_seen = False
        device = None
        flags: list[bool] = []
        for index, (name, param, _) in enumerate(self.params):
            spec = self.all_specs[self.group_rank][index]
            grad = self.grad_of(param) if spec.numel else None
            if grad is not None and grad.numel() != spec.numel:
                if not self._warned_size:
                    self._warned_size = True
                    logger.warning("trainmon: grad_probe: the gradient piece of %s has %d elements, its layout "
                                   "says %d; it is left out of the combination", name, grad.numel(), spec.numel)
                grad = None
            if grad is not None:
                device = grad.device
                flat = grad.detach().reshape(-1)
                self._dtypes[index] = str(grad.dtype).removeprefix("torch.")
                row, packed, checksum, had_exp_avg = self._piece(index, param, flat, spec)
                exp_avg_seen |= had_exp_avg
                flags.append(had_exp_avg)
            else:
                row, packed, checksum = None, None, None
                flags.append(False)
            rows.append(row)
            checksums.append(checksum)
            bits.append(packed)
        device = device or self._device()
        empty = self._empty_row(device)
        table = torch.stack([empty if row is None else row for row in rows])
        zero_sum = torch.zeros(2, dtype=torch.int64, device=device)
        sums = torch.stack([zero_sum if c is None else c for c in checksums]) if self.level == "L0" else None
        previous = set(self._measured_before)
        self._measured_before.update(range(len(self.params)))
        available = [flag or (self.all_specs[self.group_rank][i].numel == 0 and exp_avg_seen)
                     for i, flag in enumerate(flags)]
        self._pending = (ctx.step, table, sums, bits, previous, available)

    def _device(self) -> torch.device:
        return self.params[0][1].device if self.params else torch.device("cpu")

    def _empty_row(self, device: torch.device) -> torch.Tensor:
        row = torch.zeros(self.partial_width, dtype=_F64, device=device)
        row[sh.MAX], row[sh.MIN] = float("-inf"), float("inf")
        return row

    def _piece(self, index: int, param: torch.Tensor, flat: torch.Tensor, spec: sh.ShardSpec
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
        """One piece's partial vector, packed stored signs and L0 checksum shares (all on the device)."""
        def const(value: float, like: torch.Tensor) -> torch.Tensor:  # float64: counts above 2**24 stay exact
            return torch.full((), value, dtype=_F64, device=like.device)

        numel = flat.numel()
        lo, hi = torch.aminmax(flat)
        sumsq = torch.linalg.vector_norm(flat, dtype=_F32).to(_F64).square()
        zero = const(0.0, flat)
        values: list[torch.Tensor] = [const(numel, flat), hi, lo, sumsq] + [zero] * (len(sh.COLUMNS) - 4)
        packed_full = dev.pack_positive(flat)
        packed = None
        checksum = None
        if self.level == "L0":
            checksum = torch.stack([dev.raw_checksum(flat).to(torch.int64), sh.words_checksum(packed_full, flat, spec)])
        else:
            packed = self._directions_piece(index, flat, packed_full, values)
            if self.level == "L2":
                values += sh.interval_counts(flat, self.bounds)
                values[sh.ZERO_COUNT] = numel - torch.count_nonzero(flat)
        values += [zero] * (self.partial_width - len(values))
        had_exp_avg = False
        exp_avg = self.exp_avg_of(param)
        if exp_avg is not None and exp_avg.numel() == numel:
            had_exp_avg = True
            momentum = exp_avg.detach().reshape(-1)
            if self.level != "L0":
                values[sh.EXP_DIFF] = dev.differing_bits(packed_full, dev.pack_positive(momentum))
                values[sh.EXP_COUNT] = const(numel, flat)
                values[sh.EXP_DOT] = torch.dot(flat.to(_F32), momentum.to(_F32))
                values[sh.EXP_SQ] = torch.linalg.vector_norm(momentum, dtype=_F32).to(_F64).square()
                values[sh.EXP_GRAD_SQ] = sumsq
        if self.settings.mg_direction:
            if self.ctx.step == 0:
                values[sh.MG_AGREE] = values[sh.MG_COUNT] = const(numel, flat)
            elif had_exp_avg and exp_avg is not None:
                momentum = exp_avg.detach().reshape(-1)
                values[sh.MG_AGREE] = (torch.sign(flat) * torch.sign(momentum)).sum(dtype=_F32)
                values[sh.MG_COUNT] = const(numel, flat)
        row = torch.stack([v.to(device=flat.device, dtype=_F64) for v in values])
        return row, packed, checksum, had_exp_avg

    def _directions_piece(self, index: int, flat: torch.Tensor, packed_full: torch.Tensor,
                          values: list[torch.Tensor]) -> torch.Tensor:
        """Packed stored signs of the piece; fills the ``prev`` columns (bits and sampled values)."""
        sample = self._samples_global[index]
        stored_values: torch.Tensor | None = None
        if sample is not None:
            local = self._local_samples.get(index)
            if local is None or local.device != flat.device:
                spec = self.all_specs[self.group_rank][index]
                local = self._local_samples[index] = torch.from_numpy(spec.local_positions(sample)[0]).to(flat.device)
            stored_values = flat[local].to(_F32)
            packed = dev.pack_positive(stored_values)
        else:
            packed = packed_full
            if self.settings.sample_elements is not None:  # stored whole: the values are the "sample"
                stored_values = flat.to(_F32, copy=True)
        count = self._stored[self.group_rank][index]
        previous_bits = self._prev_bits.get(index)
        if previous_bits is not None and previous_bits.shape == packed.shape:
            values[sh.PREV_DIFF] = dev.differing_bits(packed, previous_bits)
            values[sh.PREV_COUNT] = torch.full((), count, dtype=_F64, device=flat.device)
        self._prev_bits[index] = packed
        if stored_values is not None:
            previous = self._prev_sample.get(index)
            if previous is not None and previous.shape == stored_values.shape:
                values[sh.PREV_DOT] = torch.dot(stored_values, previous)
                values[sh.PREV_SQ_NOW] = stored_values.square().sum()
                values[sh.PREV_SQ_BEFORE] = previous.square().sum()
                values[sh.PREV_VALUES] = torch.full((), stored_values.numel(), dtype=_F64, device=flat.device)
            self._prev_sample[index] = stored_values
        return packed

    # ----------------------------------------------------------------------------- end of step
    def before_transfer(self) -> None:
        if not self._hookable:
            self.measure()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, table, sums, bits, previous, available = pending
        gathered = self._gather(self._payload(table, sums, bits))
        if gathered is None or self._writer is None:
            return  # not the writer (or it cannot write): its bytes went to the writer
        self._combine(step, gathered, previous, available)

    def _payload(self, table: torch.Tensor, sums: torch.Tensor | None, bits: list[torch.Tensor | None]) -> torch.Tensor:
        """This rank's bytes: partials, L0 checksum shares, packed bits (zeros where it has none), padding."""
        parts = [table.contiguous().view(torch.uint8).reshape(-1)]
        if sums is not None:
            parts.append(sums.contiguous().view(torch.uint8).reshape(-1))
        else:
            sizes = self._bytes[self.group_rank]
            for index, packed in enumerate(bits):
                if sizes[index]:
                    parts.append(packed if packed is not None and packed.numel() == sizes[index] else
                                 torch.zeros(sizes[index], dtype=torch.uint8, device=table.device))
        used = sum(p.numel() for p in parts)
        if used < self._size:
            parts.append(torch.zeros(self._size - used, dtype=torch.uint8, device=table.device))
        return torch.cat(parts)

    def _gather(self, payload: torch.Tensor) -> torch.Tensor | None:
        """THE collective of the probe in a collected step: every rank's bytes to the writer."""
        if self.world == 1:
            return payload.unsqueeze(0)
        import torch.distributed as dist

        if self.rank == self.dst:
            parts = [torch.empty_like(payload) for _ in range(self.world)]
            dist.gather(payload, parts, dst=self.dst, group=self.group)
            return torch.stack(parts)
        dist.gather(payload, None, dst=self.dst, group=self.group)
        return None

    def _combine(self, step: int, gathered: torch.Tensor, previous: set[int], available: list[bool]) -> None:
        """On the writer: the whole parameters' rows from the gathered partials; bits go to the writer thread."""
        n_params, width = len(self.params), self.partial_width
        partials = gathered[:, : n_params * width * 8].contiguous().view(_F64).view(self.world, n_params, width)
        combined = sh.combine_partials(partials)
        stats = self._stats(combined)
        checksums = None
        if self.level == "L0":
            start = n_params * width * 8
            shares = gathered[:, start: start + n_params * 16].contiguous().view(torch.int64)
            checksums = sh.combine_checksums(shares.view(self.world, n_params, 2))
        keep = [i for i, (_, param, _) in enumerate(self.params) if param.requires_grad]
        metas = [self._meta(i) for i in keep]
        if not metas:
            return
        index = torch.tensor(keep, device=stats.device)
        stats, combined = stats.index_select(0, index), combined.index_select(0, index)
        if checksums is not None:
            checksums = checksums.index_select(0, index)
        self._scalars(stats, combined, metas, [i in previous for i in keep], [available[i] for i in keep])
        host_stats = pinned_copy(stats)
        host_checksums = pinned_copy(checksums) if checksums is not None else None
        host_gathered = pinned_copy(gathered) if self.level != "L0" else None
        event = record_event(stats.device)
        assert self._writer is not None  # before_transfer combines only where there is one
        self._writer.submit(lambda: self._write_whole(step, keep, metas, host_stats, host_checksums,
                                                      host_gathered, event))

    def _meta(self, index: int) -> dict[str, Any]:
        name, param, vpp_stage = self.params[index]
        spec = self.all_specs[0][index]
        sample = self._samples_global[index]
        count = sample.size if sample is not None else spec.total
        dtype = self._dtypes.get(index) or str(param.dtype).removeprefix("torch.")
        return {"name": name, "vpp_stage": vpp_stage, "shape": list(spec.shape), "numel": spec.total,
                "dtype": dtype, "count": count}

    def _stats(self, combined: torch.Tensor) -> torch.Tensor:
        totals = [self.all_specs[0][i].total for i in range(len(self.params))]
        counts = [sum(row[i] for row in self._stored) for i in range(len(self.params))]
        return sh.whole_stats(combined, totals, counts, self.level, len(self.bounds))

    def _scalars(self, stats: torch.Tensor, c: torch.Tensor, metas: list[dict[str, Any]], previous: list[bool],
                 available: list[bool]) -> None:
        """The step scalars of :class:`GradProbe` from the combined sums (writer only)."""
        mode = self.settings.scalars
        if mode == "none":
            return
        buffer = self.ctx.buffer
        total = c.sum(dim=0)
        if self.settings.mg_direction and (self.ctx.step == 0 or any(available)):
            buffer.add_scalar("grad_probe/mg_direction", (total[sh.MG_AGREE] / total[sh.MG_COUNT] + 1) / 2)
            if mode == "param":
                for j, meta in enumerate(metas):
                    if self.ctx.step == 0 or available[j]:
                        buffer.add_scalar(f"grad_probe/{meta['name']}/mg_direction",
                                          (c[j, sh.MG_AGREE] / c[j, sh.MG_COUNT] + 1) / 2)
        if self.level == "L0":
            return
        sampled = self.settings.sample_elements is not None
        if any(previous):
            buffer.add_scalar("grad_probe/sign_agree_prev", 1.0 - total[sh.PREV_DIFF] / total[sh.PREV_COUNT])
            if sampled:
                buffer.add_scalar("grad_probe/cos_prev", total[sh.PREV_DOT] / (
                    total[sh.PREV_SQ_NOW].sqrt() * total[sh.PREV_SQ_BEFORE].sqrt()))
        if any(available):
            buffer.add_scalar("grad_probe/sign_agree_exp_avg", 1.0 - total[sh.EXP_DIFF] / total[sh.EXP_COUNT])
            buffer.add_scalar("grad_probe/cos_exp_avg", total[sh.EXP_DOT] / (
                total[sh.EXP_GRAD_SQ].sqrt() * total[sh.EXP_SQ].sqrt()))
        if mode == "param":
            for j, meta in enumerate(metas):
                flags = (previous[j], previous[j] and sampled, available[j], available[j])
                for k, metric in enumerate(SIMILARITIES):
                    if flags[k]:
                        buffer.add_scalar(f"grad_probe/{meta['name']}/{metric}", stats[j, AGREE_PREV + k])

    # ----------------------------------------------------------------------------- writer thread
    def _write_whole(self, step: int, keep: list[int], metas: list[dict[str, Any]], host_stats: torch.Tensor,
                     host_checksums: torch.Tensor | None, host_gathered: torch.Tensor | None, event: Any) -> None:
        """Runs on the writer thread: the pieces' bits placed into whole-parameter bits, then the files."""
        if event is not None:
            event.synchronize()  # this thread only
        whole_bits: list[torch.Tensor] = []
        if host_gathered is not None:
            data = host_gathered.numpy()  # a host copy, on the writer thread: no sync
            for j, index in enumerate(keep):
                pieces = []
                for rank in range(self.world):
                    offset = self._header + sum(self._bytes[rank][:index])
                    size = self._bytes[rank][index]
                    positions = self._positions_of(index, rank)[1]
                    pieces.append((data[rank, offset: offset + size], self._stored[rank][index], positions))
                whole_bits.append(torch.from_numpy(sh.assemble_bits(metas[j]["count"], pieces)))
        self._write(step, metas, host_stats, host_checksums, whole_bits, None)

    def _positions_of(self, index: int, rank: int) -> tuple[npt.NDArray[np.int64] | None, sh.Positions]:
        key = (index, rank)
        found = self._positions.get(key)
        if found is None:
            found = sh.stored_positions(self.all_specs[rank][index], self._samples_global[index])
            if not isinstance(found[1], np.ndarray) or found[1].size <= 1 << 20:
                self._positions[key] = found  # large index arrays are recomputed rather than kept
        return found
