"""One writer's Parquet parts of one table of one rank: small files rolled from Arrow tables, merged in levels.

The run store's file policy (:mod:`.store_layout`, docs/store.md) in one place, for every writer of the store (the
Parquet sink's row tables, the grad probe's tables): each :meth:`TableParts.add` writes one small part whole under a
hidden name and renames it into place, never over an existing file; runs of ``fan_in`` small parts (or of
``merge_rows`` rows, or ``merge_bytes`` bytes) are merged into one part of level 1. Merged parts are merged again in
levels (size-tiered, as a log-structured merge tree): as soon as ``level_fan_in`` parts of level k accumulate they
become one part of level k + 1, streamed row group by row group (its memory is a row group's, not the part's). A
table's folder of a rank thus holds at most ``fan_in - 1`` small parts and ``level_fan_in - 1`` parts per level
however long the run, and each row is written at most ``2 + log_{level_fan_in}(n / fan_in)`` times for ``n`` small
parts (once small, once per level; :meth:`TableParts.close` merges only the small parts). Every merge writes its
part first (under a hidden name, renamed into place) and removes its inputs after: the part's sequence range covers
its inputs' (nested across levels), so a crash in between leaves parts :func:`~.store_layout.live_parts` skips and
the next writer removes. A small part that alone reaches ``merge_bytes`` is already of the merged size: it joins
level 1 as it is.

Before the first part of each schema, the writer marks that schema in the folder
(:func:`~.store_layout.schema_mark_name`): readers learn from the listing alone whether a table has one schema.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from trainmon.base.safe_io import atomic_output, make_dirs, open_output, remove_file, write_atomic
from trainmon.sinks.store_layout import (
    Part,
    live_parts,
    parquet_bytes,
    parquet_options,
    parse_part,
    part_name,
    schema_mark_bytes,
    schema_mark_name,
    schema_token,
)

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger("trainmon")

Encode = Callable[["pa.Table", int], bytes]
"""``(table, zstd level) -> Parquet file bytes`` (default :func:`~.store_layout.parquet_bytes`)."""


def _default_encode(table: pa.Table, level: int) -> bytes:
    return parquet_bytes(table, compression_level=level)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s columns in its order: a column it lacks is nulls, one of another type cast."""
    import pyarrow as pa

    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(column if column.type == field.type else column.cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(columns, schema=schema)


class TableParts:
    """The parts one writer adds to ``{run}/store/{table}/rank={R}``.

    Args:
        directory: the table's folder of one rank (:func:`~.store_layout.table_dir`).
        root: the run directory, below which no symlink is followed.
        writer: the writer's token (part names carry it: a resumed run writes beside earlier parts).
        sequence: gives the writer's next sequence number (shared by the writer's tables, or its own).
        fan_in: small parts merged into one part of level 1 as soon as there are this many.
        merge_rows: small parts merged as soon as they hold this many rows (bounds a merge's memory).
        merge_bytes: small parts merged as soon as their files hold this many bytes; a small part this large
            alone is kept as it is. None: no byte bound.
        level_fan_in: parts of one level merged into one part of the next as soon as there are this many.
        row_group_rows: rows of a row group of a part of level 2 or more (written as the inputs stream in).
        row_group_bytes: bytes of data of such a row group at most (large binary values), None for no bound.
        encode: how a table becomes file bytes (zstd level 1 for small parts, 3 for merged ones).
    """

    def __init__(self, directory: Path, root: Path, writer: str, sequence: Callable[[], int], *, fan_in: int = 64,
                 merge_rows: int = 1 << 22, merge_bytes: int | None = None, level_fan_in: int = 8,
                 row_group_rows: int = 1 << 17, row_group_bytes: int | None = 64 << 20,
                 encode: Encode = _default_encode) -> None:
        self.directory, self.root, self.writer = Path(directory), Path(root), writer
        self.fan_in, self.merge_rows, self.merge_bytes = max(2, fan_in), merge_rows, merge_bytes
        self.level_fan_in, self.row_group_rows, self.row_group_bytes = max(2, level_fan_in), row_group_rows, \
            row_group_bytes
        self._sequence, self._encode = sequence, encode
        self._levels: list[list[Part]] = [[]]  # [0]: small parts; [k]: parts of k merges; older levels first
        self._rows = 0
        self._bytes = 0
        self._marked: set[str] = set()
        self._repaired = False
        self._stopped = False  # a merge failed: no more merges (one could cover a part left out of the levels)

    @property
    def _small(self) -> list[Part]:
        return self._levels[0]

    def add(self, table: pa.Table, first_step: int, last_step: int) -> Path:
        """Write ``table`` (steps ``first_step..last_step``) as one small part; merge a run of them when due.

        Returns:
            the part written.
        """
        if not self._repaired:
            self._repair()
            self._repaired = True
        token = schema_token(table.schema)
        if token not in self._marked:  # before the part: a part is never there without its schema's mark
            mark = self.directory / schema_mark_name(self.writer, token)
            with contextlib.suppress(FileExistsError):
                write_atomic(mark, schema_mark_bytes(table.schema), root=self.root, exclusive=True)
            self._marked.add(token)
        seq = self._sequence()
        data = self._encode(table, 1)
        path = self.directory / part_name(first_step, last_step, self.writer, seq, seq)
        write_atomic(path, data, root=self.root, exclusive=True)
        part = Part(path, first_step, last_step, self.writer, seq, seq)
        if self._stopped:
            return path
        if self.merge_bytes is not None and len(data) >= self.merge_bytes:
            self.merge()  # the small parts before it: their sequence range stays below this part's
            with self._guard():
                self._push(1, part)  # of the merged size already
            return path
        self._small.append(part)
        self._rows += table.num_rows
        self._bytes += len(data)
        if (len(self._small) >= self.fan_in or self._rows >= self.merge_rows
                or (self.merge_bytes is not None and self._bytes >= self.merge_bytes)):
            self.merge()
        return path

    def merge(self) -> None:
        """Merge the small parts not merged yet into one part of level 1 (and the levels above when due): the part
        is renamed into place first, its inputs removed after (a crash in between leaves parts that
        :func:`~.store_layout.live_parts` skips)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        small, self._levels[0], self._rows, self._bytes = self._small, [], 0, 0
        if self._stopped:
            return
        with self._guard():
            if len(small) < 2:
                for part in small:
                    self._push(1, part)
                return
            tables = []
            for part in small:
                with open_output(part.path, "rb", self.root) as handle:
                    tables.append(pq.ParquetFile(handle).read())  # pq.read_table would import pandas (~0.5 s)
            merged = pa.concat_tables(tables, promote_options="default")
            path = self.directory / self._name(small)
            write_atomic(path, self._encode(merged, 3), root=self.root, exclusive=True)
            for part in small:
                remove_file(part.path, self.root)
            self._push(1, self._part(path, small))

    def close(self) -> None:
        """Merge the small parts not merged yet into one (a writer's last act on the table), as :meth:`merge`.

        The parts of level 1 and above stay as they are (at most ``level_fan_in - 1`` per level): merging them
        into fewer files at close would rewrite up to all of the run's rows once more, at the end of training,
        for a file or two fewer per level.
        """
        self.merge()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Stop merging for good when a merge fails (a full disk, a removed folder): its inputs would be out of
        the levels, and a later merge's sequence range could cover them, so that readers took them for merged.
        The parts written stay as they are; later ones stay small."""
        try:
            yield
        except BaseException:
            self._stopped = True
            logger.warning("trainmon: a merge in %s failed: %s keeps its parts there as they are from now on",
                           self.directory, self.writer)
            raise

    def _push(self, level: int, part: Part) -> None:
        """Add ``part`` to ``level``; merge the level into one part of the next while it holds ``level_fan_in``."""
        while len(self._levels) <= level:
            self._levels.append([])
        self._levels[level].append(part)
        while len(self._levels[level]) >= self.level_fan_in:
            inputs, self._levels[level] = self._levels[level], []
            merged = self._stream(inputs)
            level += 1
            while len(self._levels) <= level:
                self._levels.append([])
            self._levels[level].append(merged)

    def _stream(self, parts: list[Part]) -> Part:
        """Merge ``parts`` (in sequence order) into one part, a row group at a time: each input row group is read
        alone, and row groups of ``row_group_rows`` rows (or ``row_group_bytes``) are written as they fill."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schemas = []
        for part in parts:
            with open_output(part.path, "rb", self.root) as handle:
                schemas.append(pq.ParquetFile(handle).schema_arrow)
        schema = pa.unify_schemas(schemas, promote_options="permissive")
        path = self.directory / self._name(parts)
        with atomic_output(path, self.root) as out, \
                pq.ParquetWriter(out, schema, **parquet_options(schema, 3)) as writer:
            buffered: list[pa.Table] = []
            rows = size = 0
            for group in self._row_groups(parts):
                buffered.append(_conform(group, schema))
                rows, size = rows + group.num_rows, size + group.nbytes
                del group  # let go before the next row group is read (its buffers live on in ``buffered``)
                full = self.row_group_rows
                if self.row_group_bytes is not None and size >= self.row_group_bytes:
                    full = min(full, max(1, self.row_group_bytes * rows // max(size, 1)))
                if rows >= full:
                    table = pa.concat_tables(buffered)
                    done = rows - rows % full
                    writer.write_table(table.slice(0, done), row_group_size=full)  # row groups of ``full`` rows
                    buffered, rows = [table.slice(done)], rows - done
                    size = buffered[0].nbytes
            if rows:
                writer.write_table(pa.concat_tables(buffered), row_group_size=rows)
        for part in parts:
            remove_file(part.path, self.root)
        return self._part(path, parts)

    def _row_groups(self, parts: list[Part]) -> Iterator[pa.Table]:
        """The row groups of ``parts``, in order, one at a time."""
        import pyarrow.parquet as pq

        for part in parts:
            with open_output(part.path, "rb", self.root) as handle:
                file = pq.ParquetFile(handle)
                for index in range(file.num_row_groups):
                    yield file.read_row_group(index)

    def _name(self, parts: list[Part]) -> str:
        first, last = min(p.first_step for p in parts), max(p.last_step for p in parts)
        return part_name(first, last, self.writer, parts[0].lo, parts[-1].hi)

    def _part(self, path: Path, parts: list[Part]) -> Part:
        first, last = min(p.first_step for p in parts), max(p.last_step for p in parts)
        return Part(path, first, last, self.writer, parts[0].lo, parts[-1].hi)

    def _repair(self) -> None:
        """Remove the parts a merge superseded before a crash could remove them (an earlier run's)."""
        make_dirs(self.directory, self.root)
        paths = [self.directory / entry for entry in os.listdir(self.directory)]
        live = {part.path for part in live_parts(paths)}
        for part in filter(None, map(parse_part, paths)):
            if part.path not in live:
                logger.info("trainmon: removing %s (merged into a larger part before a crash)", part.path)
                remove_file(part.path, self.root)

