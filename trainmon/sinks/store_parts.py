"""One writer's Parquet parts of one table of one rank: small files rolled from Arrow tables, merged in runs.

The run store's file policy (:mod:`.store_layout`, docs/store.md) in one place, for every writer of the store (the
Parquet sink's row tables, the grad probe's tables): each :meth:`TableParts.add` writes one small part whole under a
hidden name and renames it into place, never over an existing file; runs of ``fan_in`` small parts (or of
``merge_rows`` rows, or ``merge_bytes`` bytes) are merged into one part, written first, and its inputs removed after
(a crash in between leaves parts :func:`~.store_layout.live_parts` skips and the next writer removes). A small part
that alone reaches ``merge_bytes`` is already of the merged size: it is kept as it is, never rewritten.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainmon.base.safe_io import make_dirs, open_output, remove_file, write_atomic
from trainmon.sinks.store_layout import Part, live_parts, parquet_bytes, parse_part, part_name

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger("trainmon")

Encode = Callable[["pa.Table", int], bytes]
"""``(table, zstd level) -> Parquet file bytes`` (default :func:`~.store_layout.parquet_bytes`)."""


def _default_encode(table: pa.Table, level: int) -> bytes:
    return parquet_bytes(table, compression_level=level)


class TableParts:
    """The parts one writer adds to ``{run}/store/{table}/rank={R}``.

    Args:
        directory: the table's folder of one rank (:func:`~.store_layout.table_dir`).
        root: the run directory, below which no symlink is followed.
        writer: the writer's token (part names carry it: a resumed run writes beside earlier parts).
        sequence: gives the writer's next sequence number (shared by the writer's tables, or its own).
        fan_in: small parts merged into one as soon as there are this many.
        merge_rows: small parts merged as soon as they hold this many rows (bounds a merge's memory).
        merge_bytes: small parts merged as soon as their files hold this many bytes; a small part this large
            alone is kept as it is. None: no byte bound.
        encode: how a table becomes file bytes (zstd level 1 for small parts, 3 for merged ones).
    """

    def __init__(self, directory: Path, root: Path, writer: str, sequence: Callable[[], int], *, fan_in: int = 64,
                 merge_rows: int = 1 << 22, merge_bytes: int | None = None, encode: Encode = _default_encode) -> None:
        self.directory, self.root, self.writer = Path(directory), Path(root), writer
        self.fan_in, self.merge_rows, self.merge_bytes = max(2, fan_in), merge_rows, merge_bytes
        self._sequence, self._encode = sequence, encode
        self._small: list[Part] = []
        self._rows = 0
        self._bytes = 0
        self._repaired = False

    def add(self, table: pa.Table, first_step: int, last_step: int) -> Path:
        """Write ``table`` (steps ``first_step..last_step``) as one small part; merge a run of them when due.

        Returns:
            the part written.
        """
        if not self._repaired:
            self._repair()
            self._repaired = True
        seq = self._sequence()
        data = self._encode(table, 1)
        path = self.directory / part_name(first_step, last_step, self.writer, seq, seq)
        write_atomic(path, data, root=self.root, exclusive=True)
        if self.merge_bytes is not None and len(data) >= self.merge_bytes:
            self.merge()  # the small parts before it: their sequence range stays below this part's
            return path
        self._small.append(Part(path, first_step, last_step, self.writer, seq, seq))
        self._rows += table.num_rows
        self._bytes += len(data)
        if (len(self._small) >= self.fan_in or self._rows >= self.merge_rows
                or (self.merge_bytes is not None and self._bytes >= self.merge_bytes)):
            self.merge()
        return path

    def merge(self) -> None:
        """Merge the small parts not merged yet into one part: the part is renamed into place first, its inputs
        removed after (a crash in between leaves parts that :func:`~.store_layout.live_parts` skips)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        small, self._small, self._rows, self._bytes = self._small, [], 0, 0
        if len(small) < 2:
            return
        tables = []
        for part in small:
            with open_output(part.path, "rb", self.root) as handle:
                tables.append(pq.ParquetFile(handle).read())  # pq.read_table would import pandas (~0.5 s)
        merged = pa.concat_tables(tables, promote_options="default")
        first, last = min(p.first_step for p in small), max(p.last_step for p in small)
        path = self.directory / part_name(first, last, self.writer, small[0].lo, small[-1].hi)
        write_atomic(path, self._encode(merged, 3), root=self.root, exclusive=True)
        for part in small:
            remove_file(part.path, self.root)

    def close(self) -> None:
        """Merge what is not merged yet (a writer's last act on the table)."""
        self.merge()

    def _repair(self) -> None:
        """Remove the parts a merge superseded before a crash could remove them (an earlier run's)."""
        make_dirs(self.directory, self.root)
        paths = [self.directory / entry for entry in os.listdir(self.directory)]
        live = {part.path for part in live_parts(paths)}
        for part in filter(None, map(parse_part, paths)):
            if part.path not in live:
                logger.info("trainmon: removing %s (merged into a larger part before a crash)", part.path)
                remove_file(part.path, self.root)
