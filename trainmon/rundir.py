"""The run directory and ``run.json`` (framework-free)."""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.safe_io import write_atomic
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
    }


def write_json(path: Path, data: object, root: Path | None = None) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file.

    Args:
        path: the file.
        data: anything ``json.dumps`` can write (other objects as ``str``).
        root: the directory below which no symlink is followed (default: the file's directory);
            a symlink at ``path`` itself is refused, never replaced or followed.

    Raises:
        OSError: the file cannot be written (:class:`~trainmon.safe_io.UnsafePathError` for a symlink).
    """
    write_atomic(path, json.dumps(data, indent=1, default=str).encode("utf-8"), root=root)


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
