"""The run store's layout: where Parquet parts live, how they are named, which of them a reader takes.

A run's store is ``{run}/store/{table}/rank={R}/part-{first}-{last}-{writer}-{lo}-{hi}.parquet``:

- ``{table}``: a row family (``actv``, ``grad_reduced``, ...) or ``scalars``; one table per family, so a family
  is read without filtering the others and each has its own metric columns.
- ``rank={R}``: a Hive-style partition key; DuckDB (``hive_partitioning``), Dask and Spark add it as a ``rank``
  column, so one rank is read alone by its directory.
- ``{first}-{last}``: the first and last step in the file (9 digits, zero-padded, so names sort by step): a step
  range is read alone by its files (and by each file's row-group statistics).
- ``{writer}``: a random token per sink instance (a resumed run writes beside, never over, earlier files).
- ``{lo}-{hi}``: the sequence numbers of the small files the part holds. A writer rolls a small file every
  couple of seconds (``lo == hi``) and merges runs of them into larger parts (``lo < hi``), writing the larger
  one first and removing its inputs after: a part whose range lies inside another part of the same writer is
  superseded (a crash between the two left it behind) and :func:`live_parts` leaves it out.

Every file is written whole to a hidden temporary name and renamed (:func:`trainmon.base.safe_io.write_atomic`):
a reader never sees half a file, and hidden names (``.``) are skipped by DuckDB's glob here, Dask and Spark.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

STORE_DIR = "store"
"""The store's folder inside a run directory."""
ANOMALIES = "anomalies"
"""The table of anomaly events (``events-*.parquet`` files: :mod:`trainmon.sinks.store_events`)."""
SCALARS = "scalars"
"""The table of ``step, name, value`` scalars (loss, grad_norm, lr/group0, ...)."""
GRAD_PROBE = "grad_probe"
"""The grad probe's summary table (one row per target parameter per collected step: :mod:`trainmon.probe.store`)."""
GRAD_DIRECTIONS = "grad_directions"
"""The grad probe's packed gradient signs (one row per parameter per collected step: :mod:`trainmon.probe.store`)."""
NOT_FAMILIES: tuple[str, ...] = (ANOMALIES, GRAD_PROBE, GRAD_DIRECTIONS)
"""Tables of the store that are not row families (readers of families skip them; ``open_run`` makes their views)."""
KEY_COLUMNS: tuple[str, ...] = ("step", "micro_step", "vpp_stage", "pp_stage", "order", "phase", "name", "nonfinite")
"""The columns of a row table before its metric columns (one DOUBLE column per configured metric)."""

_DICTIONARY = ("name", "phase", "family", "metric", "detector", "shape", "dtype", "sample")
_MARK = re.compile(r"^_schema-([0-9a-f]+)-([0-9a-f]+)\.json$")
_PART = re.compile(r"^part-(\d+)-(\d+)-([0-9a-f]+)-(\d+)-(\d+)\.parquet$")


@dataclass(frozen=True)
class Part:
    """One Parquet file of the store, described by its name.

    Attributes:
        path: the file.
        first_step: the first step it holds.
        last_step: the last step it holds.
        writer: the token of the sink instance that wrote it.
        lo: the sequence number of the first small file it holds.
        hi: the sequence number of the last small file it holds.
    """

    path: Path
    first_step: int
    last_step: int
    writer: str
    lo: int
    hi: int


def part_name(first_step: int, last_step: int, writer: str, lo: int, hi: int) -> str:
    """The file name of a part.

    Example:
        >>> part_name(12, 15, "0a1b2c3d", 4, 4)
        'part-000000012-000000015-0a1b2c3d-000004-000004.parquet'
    """
    return f"part-{first_step:09d}-{last_step:09d}-{writer}-{lo:06d}-{hi:06d}.parquet"


def parse_part(path: Path) -> Part | None:
    """The :class:`Part` a file name describes; None for any other file (temporary, foreign, hidden).

    Example:
        >>> parse_part(Path("part-000000012-000000015-0a1b2c3d-000004-000007.parquet")).hi
        7
    """
    found = _PART.match(path.name)
    if found is None:
        return None
    first, last, writer, lo, hi = found.groups()
    return Part(path, int(first), int(last), writer, int(lo), int(hi))


def live_parts(paths: list[Path]) -> list[Part]:
    """The parts among ``paths`` that hold data no other part holds, sorted by first step.

    A part is superseded when another part of the same writer covers its sequence range and more
    (a merge that was renamed into place before a crash removed its inputs).

    Example:
        >>> names = [part_name(0, 9, "ab", 0, 0), part_name(10, 19, "ab", 1, 1), part_name(0, 19, "ab", 0, 1)]
        >>> [p.path.name for p in live_parts([Path(n) for n in names])] == [names[2]]
        True
    """
    parts = [part for part in map(parse_part, paths) if part is not None]
    ranges: dict[str, list[tuple[int, int]]] = {}
    for part in parts:
        ranges.setdefault(part.writer, []).append((part.lo, part.hi))

    def superseded(part: Part) -> bool:
        return any(lo <= part.lo and part.hi <= hi and (lo, hi) != (part.lo, part.hi)
                   for lo, hi in ranges[part.writer])

    return sorted((part for part in parts if not superseded(part)),
                  key=lambda part: (part.first_step, part.last_step, part.writer, part.lo))


def table_dir(run_dir: Path, table: str, rank: int) -> Path:
    """``{run_dir}/store/{table}/rank={rank}``."""
    return Path(run_dir) / STORE_DIR / table / f"rank={rank}"


def parquet_options(schema: pa.Schema, compression_level: int = 3) -> dict[str, object]:
    """The ``pyarrow.parquet`` writer options of the store's files: zstd, dictionary-encoded names,
    BYTE_STREAM_SPLIT floats (their zero low mantissa bytes compress away), statistics for step-range pruning."""
    import pyarrow as pa

    floats = [f.name for f in schema if pa.types.is_floating(f.type)]
    return {"compression": "zstd", "compression_level": compression_level,
            "use_dictionary": [c for c in _DICTIONARY if c in schema.names],
            "use_byte_stream_split": floats or False, "write_statistics": True}


def parquet_bytes(table: pa.Table, compression_level: int = 3, row_group_bytes: int | None = None) -> bytes:
    """``table`` as a Parquet file (:func:`parquet_options`); with ``row_group_bytes``, row groups of about that
    many bytes of data (a reader decodes a row group's column whole: large binary values need it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = None
    if row_group_bytes is not None and table.num_rows:
        rows = max(1, row_group_bytes * table.num_rows // max(table.nbytes, 1))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=rows, **parquet_options(table.schema, compression_level))
    return bytes(sink.getvalue())


def schema_token(schema: pa.Schema) -> str:
    """A short digest of a schema's column names and types, in order (its metadata left out).

    Example:
        >>> import pyarrow as pa
        >>> schema_token(pa.schema([("step", pa.int64())])) == schema_token(pa.schema([("step", pa.int64())]))
        True
    """
    text = "\n".join(f"{field.name}\t{field.type}" for field in schema)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def schema_mark_name(writer: str, token: str) -> str:
    """The file that says a writer wrote parts of the schema ``token`` in its folder.

    Every writer of :class:`~trainmon.sinks.store_parts.TableParts` marks each schema it writes in a table's
    folder of a rank before the first part of that schema, so a reader learns from the folder's listing alone
    whether all parts of a table have one schema (``_`` names: DuckDB's list, Dask and Spark skip them).

    Example:
        >>> schema_mark_name("0a1b2c3d", "00ff00ff00ff00ff")
        '_schema-0a1b2c3d-00ff00ff00ff00ff.json'
    """
    return f"_schema-{writer}-{token}.json"


def schema_mark_bytes(schema: pa.Schema) -> bytes:
    """A mark's content: the schema's columns and types, one a line (for a reader's eyes; readers use names).

    Example:
        >>> import pyarrow as pa
        >>> schema_mark_bytes(pa.schema([("step", pa.int64())]))
        b'step\\tint64\\n'
    """
    return "".join(f"{field.name}\t{field.type}\n" for field in schema).encode()


def parse_schema_mark(name: str) -> tuple[str, str] | None:
    """``(writer, token)`` of a :func:`schema_mark_name`; None for any other name.

    Example:
        >>> parse_schema_mark("_schema-0a1b2c3d-00ff00ff00ff00ff.json")
        ('0a1b2c3d', '00ff00ff00ff00ff')
    """
    found = _MARK.match(name)
    return None if found is None else (found.group(1), found.group(2))


def schema_of_marks(parts: list[Part], names: list[str]) -> str | None:
    """The one schema token of ``parts`` (live parts of a table's folder of a rank) when every part's writer
    marked exactly one schema in the folder's file ``names``; None when a writer marked none (a run older than
    the marks, a converted one) or several (its metrics changed)."""
    marks: dict[str, set[str]] = {}
    for name in names:
        mark = parse_schema_mark(name)
        if mark is not None:
            marks.setdefault(mark[0], set()).add(mark[1])
    tokens: set[str] = set()
    for writer in {part.writer for part in parts}:
        if len(marks.get(writer, ())) != 1:
            return None
        tokens |= marks[writer]
    return tokens.pop() if len(tokens) == 1 else None
