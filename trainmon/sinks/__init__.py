"""Output sinks; each implements ``write``, ``flush`` and ``close``."""

from __future__ import annotations

from pathlib import Path

from trainmon.sinks.base import Sink, SinkWriter


def build_sinks(names: list[str], rank_dir: Path, flush_seconds: float = 2.0) -> list[Sink]:
    """Instantiate the configured sinks for one rank directory (``flush_seconds``: the Parquet sink's roll
    interval, what a ``kill -9`` may lose)."""
    sinks: list[Sink] = []
    for name in names:
        if name == "csv":
            from trainmon.sinks.csv import CsvSink

            sinks.append(CsvSink(rank_dir))
        elif name == "tensorboard":
            from trainmon.sinks.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(rank_dir))
        elif name == "parquet":
            from trainmon.sinks.parquet import ParquetSink

            sinks.append(ParquetSink(rank_dir, roll_seconds=flush_seconds))
        else:  # pragma: no cover - validated by the config
            raise AssertionError(name)
    return sinks


__all__ = ["Sink", "SinkWriter", "build_sinks"]
