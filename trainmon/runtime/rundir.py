"""The run directory and ``run.json`` (framework-free)."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainmon.anomaly.detectors import effective_specs
from trainmon.base.inputs import open_regular
from trainmon.config import MonitorConfig
from trainmon.sinks.store_layout import STORE_DIR, parse_part
from trainmon.version import __version__

logger = logging.getLogger("trainmon")


def default_run_name(now: float | None = None) -> str:
    """A UTC timestamp, e.g. ``20261121-100000``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))


def run_json(config: MonitorConfig, world_size: int, framework: str, versions: dict[str, str]) -> dict[str, Any]:
    return {
        "trainmon": __version__,
        "framework": framework,
        "versions": {"python": platform.python_version(), **versions},
        "world_size": world_size,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": dataclasses.asdict(config),
        "anomaly_detectors": effective_specs(config.anomaly.detectors, config.anomaly.default_detectors),
    }


def unused_name(directory: Path, stem: str, suffix: str, tag: str) -> Path:
    """``directory/{stem}{suffix}``, or when that exists the first free ``{stem}.{tag}{n}{suffix}`` (n = 1, 2, ...).

    Used for files written once per attach (``run.json``, ``module_struct.json``): a resumed run
    adds a file instead of replacing what the first attach wrote.
    """
    path = directory / f"{stem}{suffix}"
    n = 0
    while path.exists() or path.is_symlink():
        n += 1
        path = directory / f"{stem}.{tag}{n}{suffix}"
    return path


def missing_dirs(directory: Path, top: Path) -> list[Path]:
    """The directories from ``directory`` up to ``top`` (both included) that do not exist yet, deepest first:
    what ``directory.mkdir(parents=True)`` is about to create inside ``top``, so a failed attach can remove
    them again (:func:`remove_empty_dirs`). Nothing above ``top`` is listed."""
    if directory != top and top not in directory.parents:
        return []
    missing = []
    for path in (directory, *directory.parents):
        if os.path.lexists(path):
            break
        missing.append(path)
        if path == top:
            break
    return missing


def remove_empty_dirs(directories: list[Path]) -> None:
    """Remove ``directories`` (deepest first) while they are empty; stops at the first that is not (another rank
    wrote there meanwhile) or that is gone. Never removes a file or a non-empty directory."""
    for path in directories:
        try:
            os.rmdir(path)
        except OSError:
            return


_TAIL = 64 * 1024
"""Bytes read from the end of a file to find its last step (a line of a CSV file is far shorter)."""
_NEWEST = 16
"""CSV files of a rank read for its last step: the most recently written ones."""


def warn_if_appending(run_dir: Path, rank_dir: Path, start_step: int) -> None:
    """One warning when ``run_dir`` already holds a run: this one appends to it (a reused ``run_name``)."""
    held, last = _previous(run_dir, rank_dir)
    if not held:
        return
    overlap = last is not None and start_step <= last  # its steps would be written twice
    logger.warning("trainmon: %s already holds a run (%s); this run appends to it from step %d (start_step) - %s",
                   run_dir, _describe(last), start_step,
                   f"attach(..., start_step={last + 1}) continues its step count, or set another run_name"
                   if overlap and last is not None else "set another run_name to start a new run")


def previous_run(run_dir: Path, rank_dir: Path) -> str | None:
    """``last step N`` (or ``last step unknown``) when ``run_dir`` already holds a run, else None."""
    held, last = _previous(run_dir, rank_dir)
    return _describe(last) if held else None


def _describe(last: int | None) -> str:
    return f"last step {last}" if last is not None else "last step unknown"


def _previous(run_dir: Path, rank_dir: Path) -> tuple[bool, int | None]:
    """Whether ``run_dir`` already holds a run, and its last step where one is found.

    Cheap at any run length: it reads the header and the last ``_TAIL`` bytes of the newest ``_NEWEST`` CSV files
    of ``rank_dir`` and the tail of its ``anomalies.jsonl``, never a whole file, and the names of the rank's store
    parts (which hold their step range).
    """
    try:
        held = os.path.lexists(run_dir / "run.json") or (rank_dir.is_dir() and any(rank_dir.iterdir()))
    except OSError:
        return False, None
    if not held:
        return False, None
    steps = [_last_csv_step(path) for path in _newest(rank_dir.glob("*.csv"))]
    steps.append(_last_jsonl_step(rank_dir / "anomalies.jsonl"))
    steps.append(_last_store_step(run_dir, rank_dir.name))
    known = [step for step in steps if step is not None]
    return True, max(known) if known else None


def _newest(paths: Iterable[Path]) -> list[Path]:
    dated = []
    for path in paths:
        try:
            dated.append((path.lstat().st_mtime, path))
        except OSError:
            continue
    return [path for _, path in sorted(dated, reverse=True)[:_NEWEST]]


def _tail_lines(path: Path) -> tuple[bytes, list[bytes]]:
    """``(first line, complete lines of the last _TAIL bytes)``; a line cut short by a crash is left out."""
    with open_regular(path) as handle:
        head = handle.read(_TAIL).split(b"\n", 1)[0]
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - _TAIL))
        tail = handle.read(_TAIL)
    lines = tail.split(b"\n")[:-1]  # the part after the last newline is not a complete line
    return head, lines[1:] if size > _TAIL else lines  # the first line of a tail may be a line's end


def _last_csv_step(path: Path) -> int | None:
    try:
        head, lines = _tail_lines(path)
        header = next(csv.reader([head.decode("utf-8")]))
        column = header.index("step")
        for line in reversed(lines):
            row = next(csv.reader([line.decode("utf-8")]), [])
            if len(row) == len(header) and row[column].strip().isdigit():
                return int(row[column])
    except (OSError, ValueError, csv.Error):  # unreadable, not a trainmon CSV: no step from it
        pass
    return None


def _last_store_step(run_dir: Path, rank_dir_name: str) -> int | None:
    """The last step in the names of the store's parts of this rank (``store/{table}/rank={R}/part-...``)."""
    if not rank_dir_name.startswith("rank"):
        return None
    partition = f"rank={rank_dir_name[len('rank'):]}"
    last = None
    try:
        tables = [entry.path for entry in os.scandir(run_dir / STORE_DIR) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return None
    for table in tables:
        try:
            names = [entry.name for entry in os.scandir(os.path.join(table, partition))]
        except OSError:
            continue
        for part in filter(None, (parse_part(Path(name)) for name in names)):
            last = part.last_step if last is None else max(last, part.last_step)
    return last


def _last_jsonl_step(path: Path) -> int | None:
    try:
        _, lines = _tail_lines(path)
        for line in reversed(lines):
            step = json.loads(line).get("step")
            if isinstance(step, int):
                return step
    except (OSError, ValueError, AttributeError):
        pass
    return None
