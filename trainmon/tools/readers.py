"""Reading the CSV files of a run as rows or columns (framework-free): one home of the CSV checks.

:func:`read_scalars` yields ``(tag, value, step)`` row by row; :func:`read_table` reads a whole file as
columns (the bulk form, with the same checks and messages). Both read trainmon's CSV files and msprobe's
(1.2 and 8.x-26.x layouts, see :mod:`trainmon.tools.msprobe_output`); :func:`family_of` names a file's family.
Used by ``trainmon csv2tb`` (:mod:`trainmon.tools.csv2tb`) and ``trainmon report``.
"""

from __future__ import annotations

import csv
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from trainmon.base.inputs import INT64_MAX, open_regular
from trainmon.base.records import row_tag, split_row_tag
from trainmon.tools.msprobe_output import csv_family, layout_of, msprobe_rows

_FIXED = ("vpp_stage", "name", "step", "micro_step")

class CsvFormatError(ValueError):
    """A CSV file is malformed; the message names the file and line."""



def family_of(path: Path) -> str:
    """``grad_reduced.csv`` and ``grad_reduced_120.csv`` (metrics changed at step 120) -> ``grad_reduced``;
    msprobe's ``grad_reduced_0-99.csv`` -> ``grad_reduced``."""
    msprobe = csv_family(path)
    if msprobe is not None:
        return msprobe
    head, _, tail = path.stem.rpartition("_")
    return head if head and tail.isdigit() else path.stem


def read_scalars(path: Path) -> Any:
    """Yield ``(tag, value, step)`` from one trainmon (or msprobe) CSV file.

    Raises:
        CsvFormatError: a malformed or undecodable file (file and line in the message).
    """
    return read_scalars_noting_layout(path, set())


def read_scalars_noting_layout(path: Path, layouts: set[str]) -> Any:
    """:func:`read_scalars`, also adding the layout read to ``layouts`` (``trainmon CSV``, ``msprobe 1.2 CSV``, ...)."""
    try:
        yield from _read_scalars(path, family_of(path), layouts)
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise CsvFormatError(f"{path}: {exc}") from None


MAX_FIELD = 131072
"""Longest CSV field read (a row name is a module path: far shorter). Checked here, not through
``csv.field_size_limit``, a process-wide setting that other libraries change (MindSpore raises it)."""


def _bounded_rows(handle: Any) -> Any:
    """``csv.reader`` rows, each field at most :data:`MAX_FIELD` characters (else ``csv.Error``)."""
    for row in csv.reader(handle):
        yield _bounded(row)


def _bounded(row: list[str]) -> list[str]:
    """``row``, or ``csv.Error`` when a field is longer than :data:`MAX_FIELD`."""
    if row and max(map(len, row)) > MAX_FIELD:
        raise csv.Error(f"a field longer than {MAX_FIELD} characters")
    return row


def _read_scalars(path: Path, family: str, layouts: set[str]) -> Any:
    with open_regular(path, text=True, newline="") as handle:
        reader = _bounded_rows(handle)
        header = next(reader, None)
        if header is None:
            return
        layout = layout_of(header) if csv_family(path) is not None else None
        if layout is not None:
            layouts.add(f"{layout} CSV")
            yield from _read_msprobe(path, family, header, reader)
            return
        layouts.add("trainmon CSV")
        scalars = _check_header(path, family, header)
        for line, row in enumerate(reader, 2):
            vpp_stage, name, step, micro_step, values = _parse_row(path, line, header, row, scalars)
            if scalars:
                yield f"scalars/{name}", values[0], step
                continue
            for metric, value in zip(header[4:], values):
                yield row_tag(family, name, metric, micro_step, vpp_stage), value, step


def _check_header(path: Path, family: str, header: list[str]) -> bool:
    """Raise unless ``header`` is a trainmon header for ``family``; True for ``scalars.csv``."""
    scalars = family == "scalars"
    if scalars and header != ["step", "name", "value"]:
        raise CsvFormatError(f"{path}:1: expected header step,name,value, got {','.join(header)[:80]!r}")
    if not scalars and tuple(header[:4]) != _FIXED:
        raise CsvFormatError(f"{path}:1: expected header to start with {','.join(_FIXED)}, "
                             f"got {','.join(header)[:80]!r}")
    return scalars


def _parse_row(path: Path, line: int, header: list[str], row: list[str],
               scalars: bool) -> tuple[int, str, int, int, list[float]]:
    """``(vpp_stage, name, step, micro_step, values)`` of one data row of a trainmon CSV file.

    Raises:
        CsvFormatError: a malformed row (file and line in the message).
    """
    if len(row) != len(header):
        raise CsvFormatError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
    try:
        if scalars:
            return 0, row[1], _step(row[0]), 0, [float(row[2])]
        step = _step(row[2])
        micro_step, vpp_stage = _index(row[3], "micro_step"), _index(row[0], "vpp_stage")
        return vpp_stage, row[1], step, micro_step, [float(text) for text in row[4:]]
    except ValueError as exc:
        raise CsvFormatError(f"{path}:{line}: {exc}") from None


@dataclass
class Table:
    """One CSV file's statistics as columns (:func:`read_table`).

    Attributes:
        family: the family (``scalars`` for ``scalars.csv``).
        metrics: the value columns (``["value"]`` for scalars).
        keys: ``(vpp_stage, name)`` of each row id, in the order of first appearance (execution order).
        rows: row id of each line (int32).
        steps, micro_steps: of each line (int64, int32).
        values: ``[lines, metrics]`` float64 (NaN and Inf as written).
    """

    family: str
    metrics: list[str]
    keys: list[tuple[int, str]]
    rows: npt.NDArray[np.int32]
    steps: npt.NDArray[np.int64]
    micro_steps: npt.NDArray[np.int32]
    values: npt.NDArray[np.float64]


_Part: TypeAlias = ("tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.int32], "
                    "npt.NDArray[np.float64]]")
"""The rows, steps, micro-steps and values of a block of lines (see :class:`Table`)."""


_CHUNK = 1 << 24
"""Characters read at a time by :func:`read_table` (then up to the end of the line)."""


def read_table(path: Path) -> Table:
    """Read one trainmon (or msprobe) CSV file as columns: the bulk form of :func:`read_scalars`.

    Same checks and messages as :func:`read_scalars`: a chunk that does not parse in bulk is
    re-read row by row with its checks, for the message or the values. Chunks without a quoted
    field are split with ``str.split`` and parsed column by column in C (about 5x faster than
    :mod:`csv` on big files).

    Raises:
        CsvFormatError: a malformed or undecodable file (file and line in the message).
    """
    (table,) = read_table_blocks(path, rows=None)
    return table


def read_table_blocks(path: Path, rows: int | None = 1 << 22) -> Iterator[Table]:
    """:func:`read_table` a block of about ``rows`` lines at a time (None: the whole file as one block), so a big
    file is read in bounded memory. Each block's ``keys`` are every key seen up to its end (row ids stay valid
    from block to block); a file without data lines gives one empty block.

    Raises:
        CsvFormatError: a malformed or undecodable file (file and line in the message).
    """
    family = family_of(path)
    try:
        with open_regular(path, text=True, newline="") as handle:
            first = handle.readline()
            header = _bounded(next(csv.reader([first]))) if first else None
            if header is not None and csv_family(path) is not None and layout_of(header) is not None:
                yield _table_of_tags(path, family)
                return
            scalars = _check_header(path, family, header) if header is not None else False
            metrics = ["value"] if scalars else (header or [])[4:]
            table = _TableBuilder(family, metrics)
            line, held, given = 2, 0, False
            while header is not None:
                text = handle.read(_CHUNK)
                if not text:
                    break
                text += handle.readline()
                while text.count('"') % 2:  # end the chunk outside a quoted field (which may hold a newline)
                    more = handle.readline()
                    if not more:
                        break
                    text += more
                count = table.add_text(path, line, header, text, scalars)
                line, held = line + count, held + count
                if rows is not None and held >= rows:
                    yield table.build()
                    table.parts, held, given = [], 0, True
            if held or not given:
                yield table.build()
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise CsvFormatError(f"{path}: {exc}") from None


class _TableBuilder:
    def __init__(self, family: str, metrics: list[str]) -> None:
        self.family, self.metrics = family, metrics
        self.index: dict[tuple[int, str], int] = {}
        self.plain: dict[str, int] = {}  # names of VPP stage 0 -> row id
        self.parts: list[_Part] = []

    def add_text(self, path: Path, line: int, header: list[str], text: str, scalars: bool) -> int:
        """Add the rows of ``text`` (whole lines; the first is line ``line`` of the file); returns the row count."""
        width = len(header)
        if '"' not in text:  # no quoted field: every line is width - 1 commas apart
            text = text.replace("\r", "")
            if text.endswith("\n"):
                text = text[:-1]
            lines = text.split("\n")
            if set(map(str.count, lines, repeat(","))) == {width - 1} and max(map(len, lines)) <= MAX_FIELD:
                fields = text.replace("\n", ",").split(",")
                try:
                    self.parts.append(self._bulk([fields[i::width] for i in range(width)], scalars))
                    return len(lines)
                except (ValueError, OverflowError):
                    pass
        block = list(csv.reader(io.StringIO(text, newline="")))
        self.add(path, line, header, block, scalars)
        return len(block)

    def add(self, path: Path, line: int, header: list[str], block: list[list[str]], scalars: bool) -> None:
        if not block:
            return
        try:
            if set(map(len, block)) != {len(header)}:
                raise ValueError("field count")
            columns = list(zip(*block))
            if max(max(map(len, column)) for column in columns) > MAX_FIELD:
                raise ValueError("a field too long")
            self.parts.append(self._bulk(columns, scalars))
        except (ValueError, OverflowError):  # line by line, as read_scalars reads it: its error, or its values
            parsed = [_parse_row(path, number, header, _bounded(row), scalars)
                      for number, row in enumerate(block, line)]
            rows = [self._id((vpp, name)) for vpp, name, _, _, _ in parsed]
            self.parts.append((np.array(rows, dtype=np.int32), np.array([p[2] for p in parsed], dtype=np.int64),
                               np.array([p[3] for p in parsed], dtype=np.int32),
                               np.array([p[4] for p in parsed], dtype=np.float64).reshape(len(parsed), -1)))

    def _bulk(self, columns: list[Any], scalars: bool) -> _Part:
        """Columns of equal length -> (rows, steps, micro-steps, values); ValueError where a field does not
        parse as :func:`_parse_row` parses it (then the caller re-reads the rows one by one)."""
        if scalars:
            steps_text, names, micro_text, vpp_text, value_columns = columns[0], columns[1], None, None, columns[2:]
        else:
            vpp_text, names, steps_text, micro_text = columns[:4]
            value_columns = columns[4:]
        for texts, digits in ((steps_text, 19), (micro_text, 9), (vpp_text, 9)):
            if texts is not None and not ("".join(texts).isdigit() and max(map(len, texts)) <= digits):
                raise ValueError("not a non-negative integer")
        if max(map(len, steps_text)) == 19 and any(int(text) > INT64_MAX for text in steps_text if len(text) == 19):
            raise ValueError("step beyond int64")
        steps = _integers(steps_text, np.int64)
        micro = _integers(micro_text, np.int32) if micro_text is not None else np.zeros(len(steps), np.int32)
        if vpp_text is None or set(vpp_text) == {"0"}:
            rows = list(map(self.plain.get, names))  # one C-level lookup per row; new names below
            if None in rows:
                rows = [self._id((0, name)) for name in names]
        else:
            rows = [self._id((int(v), name)) for v, name in zip(vpp_text, names)]
        values = np.empty((len(steps), len(value_columns)), dtype=np.float64)
        for i, texts in enumerate(value_columns):  # float() itself, so exactly what read_scalars accepts
            values[:, i] = np.fromiter(map(float, texts), np.float64, len(texts))
        return np.array(rows, dtype=np.int32), steps, micro, values

    def _id(self, key: tuple[int, str]) -> int:
        row = self.index.setdefault(key, len(self.index))
        if key[0] == 0:
            self.plain[key[1]] = row
        return row

    def build(self) -> Table:
        parts = self.parts or [(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32),
                                np.zeros((0, len(self.metrics))))]
        rows, steps, micro, values = (np.concatenate(column) for column in zip(*parts))
        return Table(self.family, self.metrics, list(self.index), rows, steps, micro, values)


def _integers(texts: Any, dtype: Any) -> npt.NDArray[Any]:
    """One C-level parse of a column of digit strings (checked by the caller); ValueError when it does not
    read every field (digits that ``int()`` reads and C does not, such as ``"٣"``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy's warning for text it stops at
        array = np.fromstring(",".join(texts), dtype=dtype, sep=",")
    if len(array) != len(texts):
        raise ValueError("not a number")
    return array


def _table_of_tags(path: Path, family: str) -> Table:
    """A msprobe CSV file as a :class:`Table`, through :func:`read_scalars` (names as msprobe wrote them)."""
    index: dict[Any, int] = {}
    metric_index: dict[str, int] = {}
    lines: dict[tuple[int, int], dict[int, float]] = {}
    for tag, value, step in read_scalars(path):
        parts = split_row_tag(tag)  # {family}/{name}/{metric}, as _read_msprobe made it
        assert parts is not None
        _, name, metric, _, _ = parts
        row = index.setdefault((0, name), len(index))
        lines.setdefault((row, step), {})[metric_index.setdefault(metric, len(metric_index))] = value
    values = np.full((len(lines), len(metric_index)), np.nan)
    for i, by_metric in enumerate(lines.values()):
        for column, value in by_metric.items():
            values[i, column] = value
    keys = list(lines)
    return Table(family, list(metric_index), list(index), np.array([k[0] for k in keys], dtype=np.int32),
                 np.array([k[1] for k in keys], dtype=np.int64), np.zeros(len(keys), np.int32), values)


def _read_msprobe(path: Path, family: str, header: list[str], reader: Any) -> Any:
    """Rows of a msprobe CSV file as ``(tag, value, step)`` (see :func:`trainmon.tools.msprobe_output.msprobe_rows`)."""
    for line, row in enumerate(reader, 2):
        if len(row) != len(header):
            raise CsvFormatError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
        try:
            for name, metric, text, step in msprobe_rows(header, row, family):
                yield row_tag(family, name, metric), float(text), _step(step)
        except ValueError as exc:
            raise CsvFormatError(f"{path}:{line}: {exc}") from None


def _index(text: str, column: str) -> int:
    """A micro-step or VPP stage: a small non-negative integer."""
    digits = text.strip()
    if not digits.isdigit() or len(digits) > 9:
        raise ValueError(f"{column} must be a non-negative integer, got {text[:30]!r}")
    return int(digits)


def _step(text: str) -> int:
    """A step: an integer in 0..2**63-1 (TensorBoard stores int64 steps)."""
    digits = text.strip()
    if not digits.isdigit() or len(digits) > 19 or int(digits) > INT64_MAX:
        raise ValueError(f"step must be an integer in 0..{INT64_MAX}, got {text[:30]!r}"
                         f"{'...' if len(text) > 30 else ''}")
    return int(digits)


__all__ = ["MAX_FIELD", "CsvFormatError", "Table", "family_of", "read_scalars", "read_scalars_noting_layout",
           "read_table", "read_table_blocks"]
