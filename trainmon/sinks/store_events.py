"""Anomaly events in the run store: ``{run}/store/anomalies/rank={R}/events-{start}-{end}.parquet``.

Events are written to ``rank{R}/anomalies.jsonl`` as they happen (flushed at once, the crash-safe record). When the
Parquet sink closes, the lines of that file it has not stored yet become one Parquet file named after their byte
range in the file (``start``, ``end``: 15 digits), so a resumed run that appends to the same file stores only its
new lines and no event is stored twice. A reader takes the stored files plus the lines after the last ``end``
(:func:`events_of_rank`): an open or killed run's events are all there too.

Columns: those of an ``AnomalyEvent`` (``step``, ``micro_step``, ``phase``, ``pp_stage``, ``vpp_stage``, ``order``,
``detector``, ``family``, ``name``, ``metric``, ``value``, ``baseline``, ``message``, ``time``) without ``rank``, which
is the partition's (Spark refuses a column that is also a partition key). NaN and Inf (strings in the JSON) are
DOUBLE values. A line that is not an event (cut short by a crash, corrupt) is skipped.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trainmon.base.safe_io import open_output, write_atomic
from trainmon.sinks.store_layout import ANOMALIES, parquet_bytes, table_dir

EVENTS_FILE = "anomalies.jsonl"
"""The file of a rank's events (written by the anomaly engine's ``jsonl`` action)."""
EVENT_SCHEMA = pa.schema([
    ("step", pa.int64()), ("micro_step", pa.int32()), ("phase", pa.string()), ("pp_stage", pa.int32()),
    ("vpp_stage", pa.int32()), ("order", pa.int32()), ("detector", pa.string()), ("family", pa.string()),
    ("name", pa.string()), ("metric", pa.string()), ("value", pa.float64()), ("baseline", pa.float64()),
    ("message", pa.string()), ("time", pa.string())])
"""The stored columns of an event."""
_EVENTS = re.compile(r"^events-(\d+)-(\d+)\.parquet$")
_INTS = {"step", "micro_step", "pp_stage", "vpp_stage", "order"}
_OPTIONAL = {"pp_stage": 0, "vpp_stage": 0, "time": ""}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _event(line: bytes) -> dict[str, Any] | None:
    """The stored fields of one JSON line; None when it is not an event."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    event: dict[str, Any] = {}
    for name in EVENT_SCHEMA.names:
        value = data.get(name, _OPTIONAL.get(name))
        if name in _INTS:
            bound = 1 << (63 if name == "step" else 31)
            if isinstance(value, bool) or not isinstance(value, int) or not -bound <= value < bound:
                return None
        elif name in ("value", "baseline"):
            if isinstance(value, str) and value in _NONFINITE:
                value = _NONFINITE[value]
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
            value = float(value)
        elif not isinstance(value, str):
            return None
        event[name] = value
    return event


def events_table(text: bytes) -> pa.Table:
    """The events of complete JSON lines as an Arrow table (:data:`EVENT_SCHEMA`)."""
    events = [event for event in map(_event, text.splitlines()) if event is not None]
    return pa.Table.from_pylist(events, schema=EVENT_SCHEMA)


def stored_ranges(directory: Path) -> list[tuple[int, int, Path]]:
    """``(start, end, path)`` of the event files in one rank's folder, by start."""
    try:
        names = [path.name for path in directory.iterdir()]
    except OSError:
        return []
    found = [(m, name) for m, name in ((_EVENTS.match(name), name) for name in names) if m]
    return sorted((int(m.group(1)), int(m.group(2)), directory / name) for m, name in found)


def _unstored(jsonl: Path, start: int, root: Path) -> tuple[bytes, int]:
    """The complete lines of ``jsonl`` from byte ``start`` on, and the offset after the last of them."""
    with open_output(jsonl, "rb", root) as handle:
        handle.seek(start)
        text = handle.read()
    end = text.rfind(b"\n") + 1  # a last line without its newline may still be being written
    return text[:end], start + end


def store_events(rank_dir: Path, rank: int, root: Path) -> None:
    """Store the lines of ``rank_dir/anomalies.jsonl`` not stored yet as one Parquet file (see the module)."""
    jsonl = rank_dir / EVENTS_FILE
    if not jsonl.is_file():
        return
    directory = table_dir(root, ANOMALIES, rank)
    start = max((end for _, end, _ in stored_ranges(directory)), default=0)
    text, end = _unstored(jsonl, start, root)
    if end == start:
        return
    write_atomic(directory / f"events-{start:015d}-{end:015d}.parquet", parquet_bytes(events_table(text)), root=root,
                 exclusive=True)


def unstored_events(run_dir: Path, rank: int) -> tuple[int, pa.Table]:
    """The events of one rank not in its stored files: the lines of its ``anomalies.jsonl`` after the last stored
    byte (all of them for a run without a store), and the byte offset they start at."""
    start = max((end for _, end, _ in stored_ranges(table_dir(run_dir, ANOMALIES, rank))), default=0)
    jsonl = run_dir / f"rank{rank}" / EVENTS_FILE
    if not jsonl.is_file():
        return start, EVENT_SCHEMA.empty_table()
    return start, events_table(_unstored(jsonl, start, run_dir)[0])


def events_of_rank(run_dir: Path, rank: int) -> pa.Table:
    """Every event of one rank: its stored files and the lines of its ``anomalies.jsonl`` after them."""
    tables, start = [], 0
    for _, end, path in stored_ranges(table_dir(run_dir, ANOMALIES, rank)):
        with open_output(path, "rb", run_dir) as handle:
            tables.append(pq.read_table(handle, schema=EVENT_SCHEMA))
        start = max(start, end)
    jsonl = run_dir / f"rank{rank}" / EVENTS_FILE
    if jsonl.is_file():
        tables.append(events_table(_unstored(jsonl, start, run_dir)[0]))
    return pa.concat_tables(tables) if tables else EVENT_SCHEMA.empty_table()
