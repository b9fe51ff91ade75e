"""CSV sink: ``{family}.csv`` per row family and ``scalars.csv``, one open handle per file.

Nothing is ever truncated: a file that already has the same header (a resumed run) is appended
to; one with another header is left alone and rows go to ``{family}_{n}.csv`` (``n`` the first step
written there, or the next free number). Files are opened through :mod:`trainmon.base.safe_io`, so no
symlink inside the run directory is followed.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from trainmon.base.records import StepRecord
from trainmon.base.safe_io import open_output

logger = logging.getLogger("trainmon")
_MAX_NAMES = 1000  # alternative names tried before giving up on a family (a directory full of them)
_HEADER_BYTES = 1 << 16


def format_value(value: float) -> str:
    """Shortest round-trip text; NaN and Inf as ``nan``, ``inf``, ``-inf``."""
    return repr(float(value))


def _existing_header(path: Path, root: Path) -> tuple[list[str] | None, bool] | None:
    """``(header, ends with a newline)`` of an existing file; None when there is no such file.

    An empty file gives ``(None, True)``: it is taken over (a crash right after its creation).
    """
    try:
        handle = open_output(path, "rb", root)
    except FileNotFoundError:
        return None
    with handle:
        head = handle.read(_HEADER_BYTES)
        if not head:
            return None, True
        handle.seek(-1, io.SEEK_END)
        ends_with_newline = handle.read(1) == b"\n"
    first = head.split(b"\n", 1)[0].decode("utf-8", errors="replace")
    return next(csv.reader([first]), []), ends_with_newline


def open_csv_table(directory: Path, stem: str, header: Sequence[str], first_step: int,
                   root: Path) -> tuple[IO[str], Path]:
    """Open ``{stem}.csv`` for appending rows under ``header``; never truncates anything.

    The file gets the header (written and flushed at once) when it is new or empty, is appended to
    when its header is the same, and is left alone when its header differs: then the first of
    ``{stem}_{first_step}.csv``, ``{stem}_{first_step + 1}.csv``, ... that is new or has the same
    header is used. A row cut short by a crash is ended with a newline before appending.

    Args:
        directory: where the file lives.
        stem: the file name without ``.csv``.
        header: the column names.
        first_step: the first step that will be written (names the alternative file).
        root: the directory below which no symlink is followed.

    Returns:
        The open text handle (for ``csv.writer``) and the path used.

    Raises:
        OSError: the file cannot be opened (including a refused symlink).
    """
    header = list(header)
    candidates = [stem] + [f"{stem}_{first_step + i}" for i in range(_MAX_NAMES)]
    for name in candidates:
        path = directory / f"{name}.csv"
        existing = _existing_header(path, root)
        if existing is not None and existing[0] is not None and existing[0] != header:
            continue
        handle = open_output(path, "a", root)
        try:
            if existing is None or existing[0] is None:
                csv.writer(handle).writerow(header)
                handle.flush()  # the header is in the file before the first row is queued behind it
            elif not existing[1]:
                handle.write("\n")
        except BaseException:
            handle.close()
            raise
        return handle, path
    raise FileExistsError(f"{directory}: {stem}.csv and {_MAX_NAMES} alternatives all have other columns")


class CsvSink:
    """Writes ``vpp_stage,name,step,micro_step,<metric>...`` rows per family.

    The metric columns are fixed by the first row of a family; if the configured metrics change
    later (dynamic config), rows go on in another file (see :func:`open_csv_table`).

    Args:
        rank_dir: ``{output_dir}/{run_name}/rank{R}``.
        root: the directory below which no symlink is followed (default: the run directory,
            ``rank_dir``'s parent).
    """

    name = "csv"

    def __init__(self, rank_dir: Path, root: Path | None = None) -> None:
        self.rank_dir = Path(rank_dir)
        self.root = Path(root) if root is not None else self.rank_dir.parent
        self._files: dict[str, tuple[IO[str], Any, tuple[str, ...]]] = {}
        self._warned_resume = False

    def _writer(self, family: str, metrics: tuple[str, ...], step: int) -> Any:
        entry = self._files.get(family)
        if entry is not None and entry[2] == metrics:
            return entry[1]
        if entry is not None:
            del self._files[family]
            entry[0].close()
        header = (("vpp_stage", "name", "step", "micro_step", *metrics) if family != "scalars"
                  else ("step", "name", "value"))
        handle, path = open_csv_table(self.rank_dir, family, header, step, self.root)
        if entry is None and path.stem != family and not self._warned_resume:
            self._warned_resume = True
            logger.warning("trainmon: %s already holds %s.csv with other columns (a resumed run with another "
                           "config?); it is kept as it is and new rows go to %s (likewise for other files)",
                           self.rank_dir, family, path.name)
        writer = csv.writer(handle)
        self._files[family] = (handle, writer, metrics)
        return writer

    def write(self, record: StepRecord) -> None:
        for row in record.rows:
            metrics = tuple(row.values)
            writer = self._writer(row.family, metrics, record.step)
            k = row.key
            # csv writes a float as str(float): the shortest round-trip text, as format_value
            writer.writerow([k.vpp_stage, k.name, record.step, k.micro_step, *row.values.values()])
        if record.scalars:
            writer = self._writer("scalars", (), record.step)
            for name, value in record.scalars.items():
                writer.writerow([record.step, name, format_value(value)])

    def flush(self) -> None:
        for handle, _, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        """Close every file, even when one of them fails to flush (the first error is raised after)."""
        files, self._files = list(self._files.values()), {}
        error: OSError | None = None
        for handle, _, _ in files:
            try:
                handle.close()
            except OSError as exc:
                error = error or exc
        if error is not None:
            raise error
