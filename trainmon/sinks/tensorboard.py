"""TensorBoard sink (tensorboardX): tags ``{family}/{name}/{metric}`` and ``scalars/{name}``."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from trainmon.records import StepRecord


class TensorBoardSink:
    """One event-file directory per rank (the rank directory itself).

    All values of a step go into one ``Summary`` event (tensorboardX's ``add_scalar`` would
    write one event per value and log a warning for every NaN, which is exactly what a
    monitor must report quietly). Events are written synchronously by tensorboardX's
    ``EventsWriter`` on trainmon's writer thread, not through ``FileWriter``'s own thread: a
    full disk then raises here, where the writer disables the sink with one warning, instead of
    printing tracebacks from a thread nobody can catch.
    """

    name = "tensorboard"

    def __init__(self, rank_dir: Path) -> None:
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError as exc:  # pragma: no cover - tensorboardX is a dependency
            raise ImportError("the tensorboard sink needs tensorboardX: pip install tensorboardX") from exc
        from tensorboardX import crc32c

        if crc32c._crc32c_native is None:  # tensorboardX's own optional accelerator
            warnings.warn("tensorboard sink: the crc32c package is not installed, so tensorboardX checksums every "
                          "event in pure Python (about 6 ms of the writer thread, holding the GIL, per 1,000 "
                          "values); pip install 'trainmon[fast-tensorboard]' (or crc32c)", stacklevel=2)
        self._writer_class = EventsWriter
        self._event = Event
        self._summary = Summary
        self.rank_dir = rank_dir
        self._writer: Any = None

    def write(self, record: StepRecord) -> None:
        if self._writer is None:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._writer_class(str(self.rank_dir / "events"))
        value = self._summary.Value
        values = [value(tag=f"{row.family}/{row.name}/{metric}", simple_value=v)
                  for row in record.rows for metric, v in row.values.items()]
        values += [value(tag=f"scalars/{name}", simple_value=v) for name, v in record.scalars.items()]
        event = self._event(wall_time=time.time(), step=record.step, summary=self._summary(value=values))
        self._writer.write_event(event)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
