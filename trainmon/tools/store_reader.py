"""Reading a run's store (``sinks: [parquet]``) in the shapes of the CSV readers (framework-free).

``trainmon report`` and ``trainmon csv2tb`` read a rank's families from its CSV files
(:mod:`trainmon.tools.readers`); a family that has no CSV file but is in ``{run}/store/{family}/rank={R}/``
is read from there instead (:func:`with_store`). :func:`read_source` gives the
:class:`~trainmon.tools.readers.Table` that :func:`~trainmon.tools.readers.read_table` gives for its CSV file
(same keys, dtypes, NaN and Inf; rows in the order the CSV sink appended them: by step, then execution order, a
resumed run's after the run it resumed), and :func:`source_scalars` the ``(tag, value, step)`` rows of
:func:`~trainmon.tools.readers.read_scalars`. Only the columns asked for are read (pyarrow, a batch of rows of
one part at a time).

Families written once per data-parallel group (``run.json``'s ``"replicated"``: :mod:`trainmon.sinks.store_replicas`)
are read where they were written, once: the group's writer holds them, for the whole group. The tools do not copy
them to every rank (that would undo the saving in the report's data and in TensorBoard's files); they label them
with the group's ranks (:func:`replica_writers`, :func:`replica_note`). ``trainmon query`` gives them for every rank.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from trainmon.base.inputs import is_dir, open_regular
from trainmon.base.records import row_tag
from trainmon.sinks.store_layout import KEY_COLUMNS, NOT_FAMILIES, SCALARS, STORE_DIR, Part, live_parts
from trainmon.sinks.store_replicas import ReplicaLayoutError, ranks_text, replica_groups, replica_layouts
from trainmon.tools.readers import Table, family_of, read_scalars_noting_layout, read_table

if TYPE_CHECKING:
    import pyarrow as pa

STORE_LAYOUT = "trainmon store"
"""The layout name ``csv2tb`` prints for what it read from a store."""
_ROW_KEYS = ("step", "micro_step", "vpp_stage", "name")
_SCALAR_KEYS = ("step", "name", "value")
_CHUNK = 1 << 14
"""Rows turned into Python values at a time by :func:`source_scalars`."""
_BATCH = 1 << 13
"""Rows decoded from a Parquet part at a time."""


class StoreError(ValueError):
    """A run directory without a store, or a store that cannot be read; the message names the path."""


@dataclass(frozen=True)
class StoreFamily:
    """One family (or ``scalars``) of one rank in the run store: its live Parquet parts, by first step.

    Attributes:
        family: the table (``grad_reduced``, ``scalars``, ...).
        rank: the rank (its ``rank={R}`` folder).
        parts: the live parts (:func:`~trainmon.sinks.store_layout.live_parts`).
    """

    family: str
    rank: int
    parts: tuple[Path, ...]

    @property
    def name(self) -> str:
        """``store/{family}/rank={R}`` (what messages name)."""
        return f"{STORE_DIR}/{self.family}/rank={self.rank}"


Source: TypeAlias = "Path | StoreFamily"
"""A CSV file, or a family of the store."""


def source_family(source: Source) -> str:
    """The family of a CSV file (:func:`~trainmon.tools.readers.family_of`) or of a store family."""
    return source.family if isinstance(source, StoreFamily) else family_of(source)


def store_families(run_dir: Path) -> dict[int, list[StoreFamily]]:
    """``rank -> families`` of a run's store, each rank's by name; empty when the run has no ``store/``.

    Raises:
        StoreError: the store cannot be listed.
    """
    store = Path(run_dir) / STORE_DIR
    out: dict[int, list[StoreFamily]] = {}
    if not is_dir(store):
        return out
    try:
        for table in sorted(store.iterdir()):
            if not is_dir(table) or table.name.startswith((".", "_")) or table.name in NOT_FAMILIES:
                continue
            for rank_dir in sorted(table.glob("rank=*")):
                if not (rank_dir.name[5:].isdigit() and is_dir(rank_dir)):
                    continue
                parts = _in_write_order(live_parts(sorted(rank_dir.iterdir())))
                if parts:
                    out.setdefault(int(rank_dir.name[5:]), []).append(StoreFamily(table.name, int(rank_dir.name[5:]),
                                                                                  parts))
    except OSError as exc:
        raise StoreError(f"{store}: cannot list the store ({exc.strerror or exc})") from None
    return out


def _in_write_order(parts: list[Part]) -> tuple[Path, ...]:
    """The parts as the CSV sink appended their rows: writer after writer (a resumed run's writer after the one
    it resumed: by the oldest modification time of each writer's parts), each writer's in its sequence order.

    Raises:
        OSError: a part cannot be stat'ed.
    """
    by_writer: dict[str, list[Part]] = {}
    for part in parts:
        by_writer.setdefault(part.writer, []).append(part)
    started = {writer: min(os.stat(part.path).st_mtime_ns for part in own) for writer, own in by_writer.items()}
    return tuple(part.path for writer in sorted(by_writer, key=lambda w: (started[w], w))
                 for part in sorted(by_writer[writer], key=lambda part: part.lo))


def with_store(run_dir: Path, by_rank: Mapping[int, Sequence[Source]]) -> dict[int, list[Source]]:
    """``by_rank`` (each rank's CSV files) with the store families that no CSV file of the rank holds.

    A rank that has both keeps its CSV files as they are; the store's families are added among them by
    family name. A rank only in the store (no ``rank{R}/`` folder) is added.

    Raises:
        StoreError: the store cannot be listed.
    """
    out: dict[int, list[Source]] = {rank: list(files) for rank, files in by_rank.items()}
    for rank, families in store_families(run_dir).items():
        files = out.setdefault(rank, [])
        have = {source_family(source) for source in files}
        added = [family for family in families if family.family not in have]
        if added:
            files += added
            files.sort(key=source_family)  # stable: a family's CSV files keep their order
    return dict(sorted(out.items()))


def replica_writers(run_dir: Path) -> dict[tuple[str, int], list[int]]:
    """``(family, writer rank) -> the ranks whose rows the writer's are``, for the families a run wrote once per
    data-parallel group (its latest layout of each); empty for other runs (a rank folder, msprobe's output).

    Raises:
        StoreError: a ``run*.json`` that cannot be read (the file in the message).
    """
    try:
        return replica_groups(replica_layouts(run_dir))
    except ReplicaLayoutError as exc:
        raise StoreError(str(exc)) from None


def replica_note(writers: Mapping[tuple[str, int], Sequence[int]], families: Collection[str] | None = None,
                 where: str = "rank") -> str | None:
    """One line saying which families are written once per data-parallel group and whose rows each writer's are
    (None when no family of ``families`` is).

    Example:
        >>> replica_note({("param", 0): [0, 1], ("param", 2): [2, 3]}, where="the event files of rank")
        'param: written once per data-parallel group: the event files of rank 0 for ranks 0-1, 2 for ranks 2-3'
    """
    shown = {key: group for key, group in writers.items() if families is None or key[0] in families}
    if not shown:
        return None
    names = sorted({family for family, _ in shown})
    groups = {writer: group for (_, writer), group in sorted(shown.items(), key=lambda item: item[0][1])}
    listed = [f"{writer} for ranks {ranks_text(group)}" for writer, group in list(groups.items())[:8]]
    more = f", ... ({len(groups)} groups)" if len(groups) > 8 else ""
    return f"{', '.join(names)}: written once per data-parallel group: {where} {', '.join(listed)}{more}"


def read_source(source: Source, metrics: Collection[str] | None = None) -> tuple[list[Table], set[str]]:
    """The tables of a CSV file (one) or store family (one per set of metric columns, in the order written),
    and every metric the source holds.

    Args:
        metrics: read only these metric columns of a store family (a CSV file is read whole); None: all.

    Raises:
        CsvFormatError: a malformed CSV file (file and line in the message).
        StoreError: a part that is not a readable store table (the file in the message).
    """
    if not isinstance(source, StoreFamily):
        table = read_table(source)
        return [table], set(table.metrics)
    groups = _groups(source)
    tables = []
    for held, paths in groups.items():
        wanted = [m for m in held if metrics is None or m in metrics or source.family == SCALARS]
        builder = _Builder(source.family, wanted)
        for path in paths:
            for batch in _batches(path, source.family, builder.metrics):
                builder.add(path, batch)
        tables.append(builder.build())
    return tables, {metric for held in groups for metric in held}


def source_scalars(source: Source, layouts: set[str]) -> Iterator[tuple[str, float, int]]:
    """``(tag, value, step)`` of a CSV file (:func:`~trainmon.tools.readers.read_scalars`) or store family,
    adding the layout read to ``layouts``.

    Raises:
        CsvFormatError: a malformed CSV file.
        StoreError: an unreadable part.
    """
    if not isinstance(source, StoreFamily):
        yield from read_scalars_noting_layout(source, layouts)
        return
    layouts.add(STORE_LAYOUT)
    for table in _streamed(source):
        cache: dict[tuple[int, int], list[str]] = {}
        for start in range(0, len(table.steps), _CHUNK):  # Python floats for a chunk at a time, not the table
            end = start + _CHUNK
            for row, step, micro, values in zip(table.rows[start:end].tolist(), table.steps[start:end].tolist(),
                                                table.micro_steps[start:end].tolist(),
                                                table.values[start:end].tolist()):
                tags = cache.get((row, micro))
                if tags is None:
                    vpp, name = table.keys[row]
                    tags = cache[(row, micro)] = ([f"scalars/{name}"] if table.family == SCALARS else
                                                  [row_tag(table.family, name, m, micro, vpp) for m in table.metrics])
                for tag, value in zip(tags, values):
                    yield tag, value, step


def _streamed(source: StoreFamily) -> Iterator[Table]:
    """:func:`read_source`'s tables in pieces: a batch of a part at a time (row ids per piece)."""
    for held, paths in _groups(source).items():
        for path in paths:
            for batch in _batches(path, source.family, list(held)):
                builder = _Builder(source.family, list(held))
                builder.add(path, batch)
                yield builder.build()


def _groups(source: StoreFamily) -> dict[tuple[str, ...], list[Path]]:
    """The parts of ``source`` by the metric columns they hold (``("value",)`` for the scalars), in order."""
    import pyarrow as pa

    groups: dict[tuple[str, ...], list[Path]] = {}
    for path, schema in _schemas(source):
        # the float columns after the keys: a column a later sink may add (not a float) is not taken for a metric
        held = tuple(f.name for f in schema if f.name not in KEY_COLUMNS and pa.types.is_floating(f.type))
        groups.setdefault(("value",) if source.family == SCALARS else held, []).append(path)
    return groups


def _schemas(source: StoreFamily) -> Iterator[tuple[Path, pa.Schema]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in source.parts:
        try:
            with open_regular(path) as handle:
                schema = pq.read_schema(handle)
        except (OSError, pa.ArrowException) as exc:
            raise StoreError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None
        needed = _SCALAR_KEYS if source.family == SCALARS else _ROW_KEYS
        missing = [column for column in needed if column not in schema.names]
        if missing:
            raise StoreError(f"{path}: not a store table of {source.family} (no column {missing[0]})")
        yield path, schema


def _batches(path: Path, family: str, metrics: list[str]) -> Iterator[pa.RecordBatch]:
    """The key columns and ``metrics`` of one part, :data:`_BATCH` rows at a time (a merged part is one row group
    of up to millions of rows: read whole, its decoding buffers raised the peak memory by about half again)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(_SCALAR_KEYS if family == SCALARS else (*_ROW_KEYS, *metrics))
    try:
        with open_regular(path) as handle:
            yield from pq.ParquetFile(handle).iter_batches(batch_size=_BATCH, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise StoreError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class _Builder:
    """Parts of one family with one set of metric columns -> one :class:`Table` (row ids by first appearance)."""

    def __init__(self, family: str, metrics: list[str]) -> None:
        self.family, self.metrics = family, metrics
        self.index: dict[tuple[int, str], int] = {}
        self.parts: list[tuple[Any, ...]] = []

    def add(self, path: Path, table: pa.RecordBatch) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        count = table.num_rows
        if not count:
            return
        names = table.column("name")
        if pa.types.is_dictionary(names.type):
            names = names.cast(pa.string())
        if names.null_count:
            raise StoreError(f"{path}: a row without a name")
        distinct = pc.unique(names)
        local = pc.index_in(names, value_set=distinct).to_numpy().astype(np.int64)
        scalars = self.family == SCALARS
        vpp = np.zeros(count, np.int64) if scalars else _ints(table, "vpp_stage", path).astype(np.int64)
        width = int(vpp.max()) + 1
        unique, first, inverse = np.unique(local * width + vpp, return_index=True, return_inverse=True)
        words = distinct.to_pylist()
        lookup = np.empty(len(unique), np.int32)
        for position in np.argsort(first, kind="stable").tolist():  # keys in the order of first appearance
            key_code = int(unique[position])
            key = (key_code % width, str(words[key_code // width]))
            lookup[position] = self.index.setdefault(key, len(self.index))
        steps = _ints(table, "step", path).astype(np.int64)
        micro = np.zeros(count, np.int32) if scalars else _ints(table, "micro_step", path).astype(np.int32)
        values = np.empty((count, len(self.metrics)), np.float64)
        for column, metric in enumerate(self.metrics):
            values[:, column] = table.column(metric).to_numpy().astype(np.float64)
        self.parts.append((lookup[inverse.reshape(-1)], steps, micro, values))

    def build(self) -> Table:
        if not self.parts:
            return Table(self.family, self.metrics, [], np.zeros(0, np.int32), np.zeros(0, np.int64),
                         np.zeros(0, np.int32), np.zeros((0, len(self.metrics))))
        rows, steps, micro, values = (np.concatenate(column) for column in zip(*self.parts))
        return Table(self.family, self.metrics, list(self.index), rows, steps, micro, values)


def _ints(table: pa.RecordBatch, column: str, path: Path) -> Any:
    array = table.column(column)
    if array.null_count:
        raise StoreError(f"{path}: a row without {column}")
    values = array.to_numpy()
    if values.dtype.kind not in "iu" or (len(values) and int(values.min()) < 0):
        raise StoreError(f"{path}: {column} must be non-negative integers")
    return values


def source_tables(source: Source) -> Iterator[Table]:
    """The rows of a CSV file (one :class:`~trainmon.tools.readers.Table`) or of a store family (a table per batch
    of a part, each with row ids of its own), in the order written.

    Raises:
        CsvFormatError: a malformed CSV file.
        StoreError: an unreadable part.
    """
    if isinstance(source, StoreFamily):
        yield from _streamed(source)
    else:
        yield read_table(source)


__all__ = ["STORE_LAYOUT", "Source", "StoreError", "StoreFamily", "read_source", "replica_note", "replica_writers",
           "source_family", "source_scalars", "source_tables", "store_families", "with_store"]
