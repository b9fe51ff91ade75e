"""The run directory and ``run.json`` (framework-free)."""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from pathlib import Path
from typing import Any

from trainmon.anomaly.detectors import effective_specs
from trainmon.config import MonitorConfig
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
