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

logger = logging.getLogger("trainmon")


def default_run_name(now: float | None = None) -> str:
    """A UTC timestamp, e.g. ``20261121-100000``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))


def run_json(config: MonitorConfig, world_size: int, framework: str, versions: dict[str, str]) -> dict[str, Any]:
    from trainmon import __version__

    return {
        "trainmon": __version__,
        "framework": framework,
        "versions": {"python": platform.python_version(), **versions},
        "world_size": world_size,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": dataclasses.asdict(config),
    }


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)
