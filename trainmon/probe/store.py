"""The grad probe in the run store (``sinks`` with ``parquet``; framework-free): two tables per rank.

``{run}/store/grad_probe/rank={R}/part-*.parquet``: one row per target parameter per collected step, the columns of
``grad_summary.csv`` (:func:`store_columns`; the interval fractions of L2 named ``interval_{lo}_{hi}``: Spark refuses
spaces, commas and brackets in a Parquet column name). ``{run}/store/grad_directions/rank={R}/part-*.parquet``: the
packed gradient signs of L1 and L2, one row per parameter per collected step (:data:`DIRECTION_COLUMNS`; a
parameter of more than :data:`CHUNK_ELEMENTS` stored elements takes one row per chunk, ``first`` its first element).

:class:`ProbeStore` writes them on the probe's writer thread through :class:`~trainmon.sinks.store_parts.TableParts`:
rows stay in memory at most ``roll_seconds`` (or ``roll_bytes``, 256 MiB, of bits), then each table gets one small
part (written whole and renamed: a ``kill -9`` leaves readable files); runs of 64 small parts, or of ``merge_bytes``
(256 MiB) of bits, are merged into one, and a part of 256 MiB or more is kept as it is; 8 merged parts of a level
are merged into one of the next (streamed, row groups of 64 MiB). The files of a rank do not depend on the number
of parameters: per table at most 7 per level of merges (8^k x 64 rolls or 8^k x 256 MiB of bits), plus 63 small ones.
:func:`scan_directions` and :func:`read_summary` read them back (``trainmon grad-compare``, ``trainmon report``).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from trainmon.base.inputs import is_dir, open_regular
from trainmon.probe.storage import SIMILARITIES, DirectionFormatError
from trainmon.sinks.store_layout import (
    GRAD_DIRECTIONS,
    GRAD_PROBE,
    STORE_DIR,
    live_parts,
    parquet_bytes,
    table_dir,
)
from trainmon.sinks.store_parts import TableParts

CHUNK_ELEMENTS = 1 << 30
"""Stored elements (sign bits) of one ``grad_directions`` row at most: 128 MiB of bits. A larger parameter takes
several rows; a Parquet byte array holds less than 2 GiB and a reader decodes a row group's values whole."""
DIRECTION_COLUMNS = ("step", "vpp_stage", "name", "shape", "numel", "dtype", "count", "sample", "first", "bits")
"""Columns of ``grad_directions``: ``count`` stored elements (``numel`` unless sampled), ``sample`` the JSON of
the sample (null: the whole parameter), ``first`` the first stored element in this row's ``bits``
(``numpy.packbits(g > 0, bitorder="little")`` of elements ``first .. first + CHUNK_ELEMENTS``)."""
ROW_GROUP_BYTES = 64 << 20
"""Bits per row group of ``grad_directions`` (about): what a reader decodes at a time."""
_BIT_LAYOUT = {"sign": "x > 0", "bitorder": "little", "chunk_elements": CHUNK_ELEMENTS}


def interval_names(bounds: Sequence[float]) -> list[str]:
    """The store's names of the L2 interval columns (the CSV's ``(-1, 0]`` is ``interval_-1_0``).

    Example:
        >>> interval_names([-1, 0, 1])
        ['interval_-inf_-1', 'interval_-1_0', 'interval_0_1', 'interval_1_inf']
    """
    edges = ["-inf", *(f"{b:g}" for b in bounds), "inf"]
    return [f"interval_{lo}_{hi}" for lo, hi in zip(edges[:-1], edges[1:])]


def store_columns(level: str, bounds: Sequence[float]) -> list[str]:
    """Columns of the ``grad_probe`` table for a level (those of ``grad_summary.csv``, intervals renamed)."""
    columns = ["step", "vpp_stage", "name", "shape", "numel", "max", "min", "norm"]
    if level == "L0":
        return [*columns, "hash"]
    columns += list(SIMILARITIES)
    if level == "L2":
        columns += [*interval_names(bounds), "zero_fraction"]
    return columns


def _encode_directions(table: pa.Table, level: int) -> bytes:
    return parquet_bytes(table, level, row_group_bytes=ROW_GROUP_BYTES)


class ProbeStore:
    """Writes one rank's grad-probe rows into the run store (on the probe's writer thread only).

    Args:
        run_dir: the run directory (the store is ``{run_dir}/store``; no symlink below it is followed).
        rank: the rank's partition (``rank={R}``).
        level, bounds: the probe's level and L2 bounds (the columns).
        roll_seconds: the longest time rows stay in memory only (what a ``kill -9`` can lose).
        roll_bytes: bits kept in memory before they are written whatever the time (checked after each parameter).
        max_rows: summary rows kept in memory before they are written whatever the time.
        fan_in: small parts merged into one as soon as there are this many.
        merge_bytes: small ``grad_directions`` parts merged as soon as they hold this many bytes (a part this
            large alone is kept as it is, not merged with the small ones): bounds a merge's memory and the bytes it
            rewrites. Merged parts are merged again in levels (:class:`~trainmon.sinks.store_parts.TableParts`).
        clock: the time source (tests replace it).
    """

    def __init__(self, run_dir: Path, rank: int, level: str, bounds: Sequence[float], *, roll_seconds: float = 2.0,
                 roll_bytes: int = 256 << 20, max_rows: int = 1 << 18, fan_in: int = 64,
                 merge_bytes: int = 256 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.level = level
        self.columns = store_columns(level, bounds)
        self.roll_seconds, self.roll_bytes, self.max_rows = roll_seconds, roll_bytes, max_rows
        self._clock = clock
        self._last_roll = clock()
        writer, sequence = os.urandom(4).hex(), itertools.count().__next__
        root = Path(run_dir)
        self._summary_parts = TableParts(table_dir(root, GRAD_PROBE, rank), root, writer, sequence, fan_in=fan_in)
        self._direction_parts = TableParts(table_dir(root, GRAD_DIRECTIONS, rank), root, writer, sequence,
                                           fan_in=fan_in, merge_bytes=merge_bytes, encode=_encode_directions)
        self._summary: list[pa.Table] = []
        self._summary_rows = 0
        self._summary_steps: list[int] = []
        self._directions: list[tuple[Any, ...]] = []
        self._bits_bytes = 0
        self._meta = {"trainmon.grad_probe": json.dumps({"level": level, "bounds": list(bounds)})}

    def write_step(self, step: int, metas: Sequence[dict[str, Any]], stats: npt.NDArray[np.float32],
                   hashes: Sequence[str] | None, bits: Sequence[npt.NDArray[np.uint8]]) -> None:
        """Add one collected step: ``metas[j]`` (name, vpp_stage, shape, numel, dtype, count, sample), ``stats[j]``
        (the float32 statistics vector), ``hashes[j]`` (L0) or ``bits[j]`` (L1, L2: packed signs)."""
        columns: dict[str, pa.Array] = {
            "step": _numbers(np.full(len(metas), step, np.int64)),
            "vpp_stage": _numbers(np.array([m["vpp_stage"] for m in metas], np.int32)),
            "name": _strings([m["name"] for m in metas]),
            "shape": _strings([str(m["shape"]) for m in metas]),
            "numel": _numbers(np.array([m["numel"] for m in metas], np.int64)),
        }
        values = self.columns[5:]
        if hashes is not None:
            values = values[:-1]
        for i, name in enumerate(values):
            columns[name] = _numbers(stats[:, i].astype(np.float32))
        if hashes is not None:
            columns["hash"] = _strings(hashes)
        self._summary.append(pa.table(columns))
        self._summary_rows += len(metas)
        self._summary_steps.append(step)
        for meta, packed in zip(metas, bits):
            count = int(meta["count"])
            sample = meta["sample"]
            text = None if sample is None else json.dumps(sample, separators=(",", ":"))
            for first in range(0, max(count, 1), CHUNK_ELEMENTS):
                # a copy: the step's host buffers (pinned memory on CUDA) are released when its job ends
                chunk = packed[first // 8: (min(first + CHUNK_ELEMENTS, count) + 7) // 8].copy()
                self._directions.append((step, meta["vpp_stage"], meta["name"], str(meta["shape"]), meta["numel"],
                                         meta["dtype"], count, text, first, chunk))
                self._bits_bytes += chunk.size
            if self._bits_bytes >= self.roll_bytes:  # within a step too: bounds the memory a roll takes
                self._roll_directions()
        if self._summary_rows >= self.max_rows:
            self.roll()

    def flush(self) -> None:
        """Write what is in memory once ``roll_seconds`` have passed since the last write."""
        if self._clock() - self._last_roll >= self.roll_seconds:
            self.roll()

    def idle(self) -> None:
        """Write what is in memory: nothing came for a while (a pause of training loses nothing to a crash)."""
        self.roll()

    def roll(self) -> None:
        """Write each table's rows in memory as one small part."""
        self._last_roll = self._clock()
        summary, self._summary, self._summary_rows = self._summary, [], 0
        steps, self._summary_steps = self._summary_steps, []
        if summary:
            table = pa.concat_tables(summary).replace_schema_metadata(self._meta)
            self._summary_parts.add(table, steps[0], steps[-1])
        self._roll_directions()

    def _roll_directions(self) -> None:
        directions, self._directions, self._bits_bytes = self._directions, [], 0
        if directions:
            self._direction_parts.add(_directions_table(directions), int(directions[0][0]), int(directions[-1][0]))

    def close(self) -> None:
        """Write what is in memory and merge each table's small parts (the writer's last act)."""
        self.roll()
        self._summary_parts.close()
        self._direction_parts.close()


def _numbers(values: npt.NDArray[Any]) -> pa.Array:
    """A numpy vector as an Arrow array over its buffer. The writer builds every column from buffers: ``pa.array``
    imports pandas (where installed) at its first call, ~0.5 s that the probe's short queue cannot wait."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _strings(values: Sequence[str | None]) -> pa.Array:
    """Strings (None: null) as an Arrow string array over one UTF-8 buffer (see :func:`_numbers`)."""
    encoded = [b"" if value is None else value.encode() for value in values]
    offsets = np.zeros(len(encoded) + 1, np.int32)  # a roll's names and shapes: far below 2 GiB
    np.cumsum([len(item) for item in encoded], out=offsets[1:])
    valid = None
    if any(value is None for value in values):
        valid = pa.py_buffer(np.packbits([value is not None for value in values], bitorder="little"))
    return pa.Array.from_buffers(pa.string(), len(encoded), [valid, pa.py_buffer(offsets),
                                                             pa.py_buffer(b"".join(encoded))])


def _directions_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    """The ``grad_directions`` rows as a table; the bits joined into one buffer (one copy) under 64-bit offsets."""
    step, vpp_stage, name, shape, numel, dtype, count, sample, first, chunks = zip(*rows)
    offsets = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum([c.size for c in chunks], out=offsets[1:])
    data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    bits = pa.Array.from_buffers(pa.large_binary(), len(chunks), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    arrays = [_numbers(np.array(step, np.int64)), _numbers(np.array(vpp_stage, np.int32)), _strings(name),
              _strings(shape), _numbers(np.array(numel, np.int64)), _strings(dtype),
              _numbers(np.array(count, np.int64)), _strings(sample), _numbers(np.array(first, np.int64)), bits]
    return pa.table(arrays, names=list(DIRECTION_COLUMNS),
                    metadata={"trainmon.grad_directions": json.dumps(_BIT_LAYOUT)})


# ----------------------------------------------------------------------------------------------- reading
def stored_ranks(run_dir: Path, table: str) -> dict[int, list[Path]]:
    """``rank -> live parts`` (by first step) of a grad-probe table of a run's store; empty without one.

    Raises:
        OSError: the store cannot be listed.
    """
    folder = Path(run_dir) / STORE_DIR / table
    out: dict[int, list[Path]] = {}
    if not is_dir(folder):
        return out
    for rank_dir in sorted(folder.glob("rank=*")):
        if rank_dir.name[5:].isdigit() and is_dir(rank_dir):
            parts = [part.path for part in live_parts(sorted(rank_dir.iterdir()))]
            if parts:
                out[int(rank_dir.name[5:])] = parts
    return out


def read_summary(parts: Sequence[Path], columns: Sequence[str] | None = None) -> pa.Table:
    """The ``grad_probe`` rows of ``parts`` (one rank's), only ``columns`` of them where given (a column a part
    lacks, another level's, is null there).

    Raises:
        DirectionFormatError: a part is not a readable Parquet file (the message names it).
    """
    import pyarrow.parquet as pq

    tables = []
    for path in parts:
        try:
            with open_regular(path) as handle:
                file = pq.ParquetFile(handle)
                names = file.schema_arrow.names
                tables.append(file.read(columns=None if columns is None else [c for c in columns if c in names]))
        except (OSError, pa.ArrowException) as exc:
            raise DirectionFormatError(f"{path}: not a readable grad-probe store part ({exc})") from None
    if not tables:
        return pa.table({name: pa.array([], pa.float32()) for name in columns or ()})
    return pa.concat_tables(tables, promote_options="permissive")


class BitsCache:
    """The ``bits`` column of the last few row groups read (a comparison reads a step's parameters in turn)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._groups: OrderedDict[tuple[Path, int], pa.Array] = OrderedDict()

    def column(self, path: Path, row_group: int) -> pa.Array:
        key = (path, row_group)
        found = self._groups.get(key)
        if found is None:
            import pyarrow.parquet as pq

            try:
                with open_regular(path) as handle:
                    found = pq.ParquetFile(handle).read_row_group(row_group, columns=["bits"]).column(0)
            except (OSError, pa.ArrowException) as exc:
                raise DirectionFormatError(f"{path}: cannot read the bits of row group {row_group} ({exc})") from None
            self._groups[key] = found
            while len(self._groups) > self.size:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return found


@dataclass(frozen=True)
class StoredDirection:
    """One parameter's direction at one step in ``grad_directions``: the header a direction file would have,
    and where its bits are (:meth:`bits` reads them)."""

    path: Path
    header: dict[str, Any]
    chunks: tuple[tuple[int, int, int], ...]
    """``(first, row group, row)`` of each row holding the bits."""
    cache: BitsCache

    @property
    def key(self) -> tuple[int, str]:
        return int(self.header["vpp_stage"]), str(self.header["name"])

    def bits(self) -> npt.NDArray[np.uint8]:
        """The packed bits as a uint8 array of ``ceil(count / 8)`` bytes.

        Raises:
            DirectionFormatError: the part cannot be read, or its rows do not hold ``count`` bits.
        """
        count = int(self.header["count"])
        pieces = []
        for first, row_group, row in sorted(self.chunks):
            value = self.cache.column(self.path, row_group)[row]
            pieces.append(np.frombuffer(value.as_buffer() or b"", np.uint8))
            expected = (min(first + CHUNK_ELEMENTS, count) - first + 7) // 8
            if first != 8 * sum(p.size for p in pieces[:-1]) or pieces[-1].size != expected:
                raise DirectionFormatError(f"{self.path}: {self.header['name']} at step {self.header['step']}: "
                                           f"row of element {first} holds {pieces[-1].size} bytes of bits, "
                                           f"expected {expected}")
        data = np.concatenate(pieces) if len(pieces) > 1 else pieces[0] if pieces else np.zeros(0, np.uint8)
        if data.size != (count + 7) // 8:
            raise DirectionFormatError(f"{self.path}: {self.header['name']} at step {self.header['step']}: "
                                       f"{data.size} bytes of bits, {count} elements need {(count + 7) // 8}")
        return data


DirectionTree = dict[int, dict[int, dict[tuple[int, str], StoredDirection]]]
"""``rank -> step -> (vpp_stage, name) -> StoredDirection``."""
_KEYS = [c for c in DIRECTION_COLUMNS if c != "bits"]


def scan_directions(run_dir: Path, ranks: set[int] | None = None, problems: list[str] | None = None,
                    cache: BitsCache | None = None) -> DirectionTree:
    """Every stored direction of a run's ``grad_directions`` table (of ``ranks`` where given), reading only the
    key columns; the bits stay in their files until :meth:`StoredDirection.bits`.

    Args:
        problems: when given, a part that cannot be read is described here and skipped; when None, it raises.

    Raises:
        DirectionFormatError: a part is not a readable ``grad_directions`` part (only when ``problems`` is None).
        OSError: the store cannot be listed.
    """
    cache = cache or BitsCache()
    tree: DirectionTree = {}
    for rank, parts in stored_ranks(run_dir, GRAD_DIRECTIONS).items():
        if ranks is not None and rank not in ranks:
            continue
        for path in parts:
            try:
                found = _scan_part(path)
            except DirectionFormatError as error:
                if problems is None:
                    raise
                problems.append(f"unreadable store part, skipped: {error}")
                continue
            for (step, vpp, name), (header, chunks) in found.items():
                tree.setdefault(rank, {}).setdefault(step, {})[(vpp, name)] = StoredDirection(
                    path, header, tuple(chunks), cache)
    return tree


def _scan_part(path: Path) -> dict[tuple[int, int, str], tuple[dict[str, Any], list[tuple[int, int, int]]]]:
    """``(step, vpp_stage, name) -> (header, [(first, row group, row), ...])`` of one ``grad_directions`` part."""
    import pyarrow.parquet as pq

    found: dict[tuple[int, int, str], tuple[dict[str, Any], list[tuple[int, int, int]]]] = {}
    parsed: dict[str | None, Any] = {None: None}  # shapes and samples repeat: each text is parsed once
    try:
        with open_regular(path) as handle:
            file = pq.ParquetFile(handle)
            groups = [file.read_row_group(i, columns=_KEYS) for i in range(file.num_row_groups)]
        for group, table in enumerate(groups):
            for column in ("step", "vpp_stage", "name", "shape", "numel", "count", "first"):
                values = table.column(column)
                if values.null_count or (column not in ("name", "shape") and (values.to_numpy() < 0).any()):
                    raise ValueError(f"row group {group}: a null or negative {column}")
            data = table.to_pydict()
            for row, values in enumerate(zip(*(data[c] for c in _KEYS))):
                step, vpp, name, shape, numel, dtype, count, sample, first = values
                entry = found.get((step, vpp, name))
                if entry is None:
                    for text in (shape, sample):
                        if text not in parsed:
                            parsed[text] = json.loads(text)
                    header = {"name": name, "vpp_stage": vpp, "step": step, "shape": list(parsed[shape]),
                              "numel": numel, "count": count, "dtype": dtype, "sign": _BIT_LAYOUT["sign"],
                              "bitorder": _BIT_LAYOUT["bitorder"], "sample": parsed[sample]}
                    entry = found[(step, vpp, name)] = (header, [])
                entry[1].append((first, group, row))
    except (OSError, ValueError, TypeError, KeyError, pa.ArrowException) as exc:  # ArrowInvalid is a ValueError
        raise DirectionFormatError(f"{path}: not a readable grad_directions part ({type(exc).__name__}: "
                                   f"{str(exc)[:200]})") from None
    return found
