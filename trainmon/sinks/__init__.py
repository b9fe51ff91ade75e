"""Output sinks; each implements ``write``, ``flush`` and ``close``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainmon.sinks.base import Sink, SinkWriter

if TYPE_CHECKING:
    from trainmon.sinks.tensorboard_overview import TagSelection


def build_sinks(names: list[str], rank_dir: Path, flush_seconds: float = 2.0,
                tensorboard: TagSelection | None = None) -> list[Sink]:
    """Instantiate the configured sinks for one rank directory (``flush_seconds``: the Parquet sink's roll
    interval, what a ``kill -9`` may lose; ``tensorboard``: what the TensorBoard sink writes beyond its overview)."""
    sinks: list[Sink] = []
    for name in names:
        if name == "csv":
            from trainmon.sinks.csv import CsvSink

            sinks.append(CsvSink(rank_dir))
        elif name == "tensorboard":
            from trainmon.sinks.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(rank_dir, selection=tensorboard))
        elif name == "parquet":
            from trainmon.sinks.parquet import ParquetSink

            sinks.append(ParquetSink(rank_dir, roll_seconds=flush_seconds))
        else:  # pragma: no cover - validated by the config
            raise AssertionError(name)
    return sinks


__all__ = ["Sink", "SinkWriter", "build_sinks"]
