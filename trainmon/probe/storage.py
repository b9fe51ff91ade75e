"""Grad-probe files on the host (framework-free): ``grad_summary.csv`` and packed direction files.

This is the probe's layout when the run's sinks do not include ``parquet`` (:class:`ProbeFiles`); with it the
probe writes into the run store instead (:mod:`trainmon.probe.store`). Layout under a rank directory::

    grad_probe/grad_summary.csv                 one row per target parameter per collected step
    grad_probe/step{S}/{name}.bits              packed gradient signs (L1, L2); vpp{v}.{name}.bits
                                                for virtual-pipeline chunk v > 0; the file name is made
                                                safe (``safe_file_name``), the header keeps the real name

A direction file is a 12-byte prefix (``b"TMGS"``, format version, 3 zero bytes, the header
length as little-endian uint32), a UTF-8 JSON header, then ``ceil(count / 8)`` bytes of bits in
``numpy.packbits(x > 0, bitorder="little")`` layout.
"""

from __future__ import annotations

import csv
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt

from trainmon.base.safe_io import safe_file_name, write_atomic
from trainmon.sinks.csv import open_csv_table

MAGIC = b"TMGS"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sB3xI")
SUMMARY_FILE = "grad_summary.csv"
PROBE_DIR = "grad_probe"

# Columns of the per-parameter statistics vector copied from the device (float32).
MAX, MIN, NORM, AGREE_PREV, COS_PREV, AGREE_EXP_AVG, COS_EXP_AVG = range(7)
BASE_WIDTH = 7
SIMILARITIES: tuple[str, ...] = ("sign_agree_prev", "cos_prev", "sign_agree_exp_avg", "cos_exp_avg")
"""In-run similarity columns (L1, L2), in vector order after max, min, norm."""


def interval_labels(bounds: Sequence[float]) -> list[str]:
    """Column names of the right-closed intervals, e.g. ``(-inf, -1]``, ``(-1, 0]``, ``(1, inf)``."""
    edges = ["-inf", *(f"{b:g}" for b in bounds), "inf"]
    return [f"({lo}, {hi}{')' if hi == 'inf' else ']'}" for lo, hi in zip(edges[:-1], edges[1:])]


def summary_columns(level: str, bounds: Sequence[float]) -> list[str]:
    """The header of ``grad_summary.csv`` for a level."""
    columns = ["vpp_stage", "name", "step", "shape", "numel", "max", "min", "norm"]
    if level == "L0":
        return [*columns, "hash"]
    columns += list(SIMILARITIES)
    if level == "L2":
        columns += [*interval_labels(bounds), "zero_fraction"]
    return columns


def vector_width(level: str, bounds: Sequence[float]) -> int:
    """Length of the per-parameter device statistics vector for a level."""
    return BASE_WIDTH + (len(bounds) + 2 if level == "L2" else 0)


def content_hash(dtype: str, shape: Sequence[int], stats: Sequence[float], raw_sum: int, sign_sum: int) -> str:
    """The L0 fingerprint of a gradient: 16 hex digits of BLAKE2b over its dtype, shape, float32
    max/min, the wrapping int32 sum of its raw bit patterns and the position-weighted sum
    of its packed sign words. Equal gradients give equal hashes on every device, and a gradient
    kept in shards (ZeRO, tensor parallelism) gives the hash of the whole one: every input is
    exact under the combination of shards (the norm, a floating-point sum, is left out). It is a
    cheap change detector, not a cryptographic digest of every byte. ``stats`` starts with max, min."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{dtype}|{list(shape)}|".encode())
    h.update(np.asarray(stats[:2], dtype=np.float32).tobytes())
    h.update(struct.pack("<qq", int(raw_sum), int(sign_sum)))
    return h.hexdigest()


def format_value(value: float) -> str:
    """Shortest text that round-trips the float32 value; NaN and Inf as ``nan``, ``inf``, ``-inf``."""
    return str(np.float32(value))


def direction_path(probe_dir: Path, step: int, name: str, vpp_stage: int) -> Path:
    """Where the direction file of a parameter at a step lives.

    The name is made safe with :func:`~trainmon.base.safe_io.safe_file_name`: a parameter named
    ``../../x`` or ``w/x`` still gives a file directly in ``step{S}/`` (the header keeps the real name).
    """
    stem = name if vpp_stage == 0 else f"vpp{vpp_stage}.{name}"
    return probe_dir / f"step{step}" / safe_file_name(stem, ".bits")


def write_direction_file(path: Path, header: dict[str, Any], bits: npt.NDArray[np.uint8],
                         root: Path | None = None) -> None:
    """Write one packed direction file (prefix, JSON header, ``ceil(count / 8)`` bytes).

    Written to a hidden temporary file in the same directory and renamed: a crash or a full disk
    leaves either the complete file or none, never a truncated one. No symlink below ``root``
    (default: the file's directory) is followed, and a symlink at ``path`` is refused.
    """
    nbytes = (int(header["count"]) + 7) // 8
    data = np.ascontiguousarray(bits, dtype=np.uint8)[:nbytes]
    assert data.size == nbytes, (data.size, nbytes)
    blob = json.dumps(header, separators=(",", ":")).encode()
    write_atomic(path, b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)), blob, data.tobytes())), root)


class Direction(Protocol):
    """One parameter's stored direction at one step: a :class:`DirectionFile`, or a row of the run store
    (:class:`trainmon.probe.store.StoredDirection`)."""

    @property
    def header(self) -> dict[str, Any]:
        """``name, vpp_stage, step, shape, numel, count, dtype, sign, bitorder, sample``."""

    @property
    def key(self) -> tuple[int, str]:
        """``(vpp_stage, name)``."""

    def bits(self) -> npt.NDArray[np.uint8]:
        """The packed bits, ``ceil(count / 8)`` bytes (DirectionFormatError when they cannot be read)."""


_REQUIRED = ("name", "step", "shape", "count")
"""Header keys every direction file has."""


class DirectionFormatError(ValueError):
    """A file is not a readable grad-probe direction file; the message names it."""


@dataclass(frozen=True)
class DirectionFile:
    """A direction file's header (bits are read on demand by :meth:`bits`)."""

    path: Path
    header: dict[str, Any]
    offset: int

    @property
    def key(self) -> tuple[int, str]:
        return int(self.header.get("vpp_stage", 0)), str(self.header["name"])

    def bits(self) -> npt.NDArray[np.uint8]:
        """The packed bits as a uint8 array of ``ceil(count / 8)`` bytes.

        Raises:
            DirectionFormatError: the file is truncated (or longer than its header says), not a
                regular file, or unreadable.
        """
        from trainmon.base.inputs import open_regular

        nbytes = (int(self.header["count"]) + 7) // 8
        try:
            with open_regular(self.path) as handle:
                size = handle.seek(0, 2) - self.offset  # the file's size, less the prefix and header
                if size != nbytes:  # checked before reading: a crafted count never sizes a buffer
                    raise DirectionFormatError(f"{self.path}: {max(size, 0)} bytes of bits, header says {nbytes}")
                handle.seek(self.offset)
                data = np.frombuffer(handle.read(nbytes), dtype=np.uint8)
        except OSError as exc:
            raise DirectionFormatError(f"{self.path}: cannot read the bits ({exc.strerror or exc})") from None
        if data.size != nbytes:
            raise DirectionFormatError(f"{self.path}: {data.size} bytes of bits, header says {nbytes}")
        return data


_INT64_MAX = 2**63 - 1


def _is_count(value: Any) -> bool:
    """A JSON integer in 0..2**63-1 (not a bool, a float or a string)."""
    return type(value) is int and 0 <= value <= _INT64_MAX


def read_direction_header(path: Path) -> DirectionFile:
    """Read the prefix and JSON header of a direction file.

    Raises:
        DirectionFormatError: not a regular file, unreadable, wrong magic, unknown version, a header
            length beyond the file, or a broken header (not a JSON object; ``name`` not a string;
            ``step``, ``count``, ``vpp_stage`` or a ``shape`` entry not an integer in 0..2**63-1).
    """
    from trainmon.base.inputs import open_regular

    try:
        with open_regular(path) as handle:
            prefix = handle.read(_PREFIX.size)
            if len(prefix) != _PREFIX.size:
                raise DirectionFormatError(f"{path}: too short for a direction file")
            magic, version, length = _PREFIX.unpack(prefix)
            if magic != MAGIC or version != FORMAT_VERSION:
                raise DirectionFormatError(f"{path}: not a grad-probe direction file (format {version})")
            size = handle.seek(0, 2)
            handle.seek(_PREFIX.size)
            if length > size - _PREFIX.size:  # checked before reading: a crafted length never sizes a buffer
                raise DirectionFormatError(f"{path}: header length {length} beyond the end of the file ({size} bytes)")
            blob = handle.read(length)
    except OSError as exc:
        raise DirectionFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(blob)
    except ValueError as exc:
        raise DirectionFormatError(f"{path}: broken header ({exc})") from None
    except RecursionError:
        raise DirectionFormatError(f"{path}: broken header (nested too deeply)") from None
    missing = [key for key in _REQUIRED if not isinstance(header, dict) or key not in header]
    if missing:
        raise DirectionFormatError(f"{path}: broken header (no {', '.join(missing)})")
    bad = [key for key in ("step", "count", "vpp_stage") if key in header and not _is_count(header[key])]
    if not isinstance(header["shape"], list) or not all(_is_count(n) for n in header["shape"]):
        bad.append("shape")
    if not isinstance(header["name"], str):
        bad.append("name")
    if bad:
        raise DirectionFormatError(f"{path}: broken header ({', '.join(f'{k}={str(header[k])[:40]}' for k in bad)}: "
                                   "name must be a string, the others integers in 0..2**63-1)")
    return DirectionFile(path, header, _PREFIX.size + length)


class GradSummaryCsv:
    """``grad_summary.csv`` with one open handle, opened on first write; flushed once per step.

    An existing file with the same header is appended to (a re-attached probe goes on); one with
    another header (the level or bounds changed) is left alone and rows go to
    ``grad_summary_{step}.csv`` (or the next free number); nothing is truncated and no symlink below
    ``root`` (default: the run directory, ``probe_dir/../..``) is followed.
    """

    def __init__(self, probe_dir: Path, columns: Sequence[str], root: Path | None = None) -> None:
        self.probe_dir = probe_dir
        self.columns = list(columns)
        self.root = Path(root) if root is not None else Path(probe_dir).parent.parent
        self.path: Path | None = None
        self._handle: IO[str] | None = None
        self._writer: Any = None

    def _open(self, step: int) -> None:
        self._handle, self.path = open_csv_table(self.probe_dir, SUMMARY_FILE.removesuffix(".csv"), self.columns,
                                                 step, self.root)
        self._writer = csv.writer(self._handle)

    def write_rows(self, rows: Sequence[Sequence[object]], step: int) -> None:
        if self._handle is None:
            self._open(step)
        self._writer.writerows(rows)
        assert self._handle is not None
        self._handle.flush()

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()


class ProbeFiles:
    """The probe's per-file layout (sinks without ``parquet``): ``grad_summary.csv`` and, at L1 and L2, one
    direction file per parameter per step. Used on the probe's writer thread only.

    Args:
        probe_dir: ``{rank_dir}/grad_probe``.
        level, bounds: the probe's level and L2 bounds (the columns).
        root: the run directory, below which no symlink is followed.
    """

    def __init__(self, probe_dir: Path, level: str, bounds: Sequence[float], root: Path) -> None:
        self.probe_dir, self.root = Path(probe_dir), Path(root)
        self._summary = GradSummaryCsv(self.probe_dir, summary_columns(level, bounds), self.root)

    def write_step(self, step: int, metas: Sequence[dict[str, Any]], stats: npt.NDArray[np.float32],
                   hashes: Sequence[str] | None, bits: Sequence[npt.NDArray[np.uint8]]) -> None:
        """Write one collected step: ``metas[j]`` (name, vpp_stage, shape, numel, dtype, count, sample),
        ``stats[j]`` (the float32 statistics vector), ``hashes[j]`` (L0) or ``bits[j]`` (L1, L2)."""
        rows = []
        for j, meta in enumerate(metas):
            values = stats[j]
            row: list[object] = [meta["vpp_stage"], meta["name"], step, str(meta["shape"]), meta["numel"],
                                 *map(format_value, values[:3])]
            if hashes is not None:
                row.append(hashes[j])
            else:
                row += map(format_value, values[3:])
                header = {"name": meta["name"], "vpp_stage": meta["vpp_stage"], "step": step,
                          "shape": meta["shape"], "numel": meta["numel"], "count": meta["count"],
                          "dtype": meta["dtype"], "sign": "x > 0", "bitorder": "little", "sample": meta["sample"]}
                path = direction_path(self.probe_dir, step, meta["name"], meta["vpp_stage"])
                write_direction_file(path, header, bits[j], self.root)
            rows.append(row)
        self._summary.write_rows(rows, step)

    def flush(self) -> None:
        """Nothing to do: each step's rows are flushed as they are written."""

    def close(self) -> None:
        self._summary.close()
