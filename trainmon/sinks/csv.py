"""CSV sink: ``{family}.csv`` per row family and ``scalars.csv``, one open handle per file."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

from trainmon.records import StepRecord


def format_value(value: float) -> str:
    """Shortest round-trip text; NaN and Inf as ``nan``, ``inf``, ``-inf``."""
    return repr(float(value))


class CsvSink:
    """Writes ``vpp_stage,name,step,micro_step,<metric>...`` rows per family.

    The metric columns are fixed by the first row of a family; if the configured metrics
    change later (dynamic config), rows go on in a new file ``{family}_{step}.csv``.
    """

    name = "csv"

    def __init__(self, rank_dir: Path) -> None:
        self.rank_dir = rank_dir
        self._files: dict[str, tuple[IO[str], Any, tuple[str, ...]]] = {}

    def _writer(self, family: str, metrics: tuple[str, ...], step: int) -> Any:
        entry = self._files.get(family)
        if entry is not None and entry[2] == metrics:
            return entry[1]
        if entry is not None:
            entry[0].close()
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        stem = family if entry is None else f"{family}_{step}"
        handle = open(self.rank_dir / f"{stem}.csv", "w", newline="", encoding="utf-8")
        writer = csv.writer(handle)
        header = ("vpp_stage", "name", "step", "micro_step", *metrics) if family != "scalars" else ("step", "name", "value")
        writer.writerow(header)
        self._files[family] = (handle, writer, metrics)
        return writer

    def write(self, record: StepRecord) -> None:
        for row in record.rows:
            metrics = tuple(row.values)
            writer = self._writer(row.family, metrics, record.step)
            k = row.key
            writer.writerow([k.vpp_stage, k.name, record.step, k.micro_step, *map(format_value, row.values.values())])
        if record.scalars:
            writer = self._writer("scalars", (), record.step)
            for name, value in record.scalars.items():
                writer.writerow([record.step, name, format_value(value)])

    def flush(self) -> None:
        for handle, _, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _, _ in self._files.values():
            handle.close()
        self._files.clear()
