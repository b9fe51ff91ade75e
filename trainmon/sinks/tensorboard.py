"""TensorBoard sink (tensorboardX protos): tags ``{family}/{name}/{metric}`` and ``scalars/{name}``."""

from __future__ import annotations

import socket
import struct
import time
import warnings
from pathlib import Path
from typing import IO, Any

from trainmon.records import StepRecord
from trainmon.safe_io import open_output

_MAX_NAMES = 100  # event files tried per second before giving up (another writer in the same directory)


class TensorBoardSink:
    """One event file per rank, in the rank directory itself.

    All values of a step go into one ``Summary`` event (tensorboardX's ``add_scalar`` would write
    one event per value and log a warning for every NaN, which is exactly what a monitor must
    report quietly). The event file is created and written here, on this sink's writer thread, in
    TFRecord framing (length, masked CRC32C, data, masked CRC32C, as tensorboardX's
    ``RecordWriter``), not through tensorboardX's ``FileWriter``: a full disk then raises here,
    where the writer disables the sink with one warning, and the file is opened through
    :mod:`trainmon.safe_io` (no symlink followed, an existing file never reused or overwritten).
    ``flush`` hands the data to the OS without an ``fsync`` per step (enough for a killed process).

    Args:
        rank_dir: ``{output_dir}/{run_name}/rank{R}``.
        root: the directory below which no symlink is followed (default: ``rank_dir``'s parent).
    """

    name = "tensorboard"

    def __init__(self, rank_dir: Path, root: Path | None = None) -> None:
        try:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.record_writer import masked_crc32c
        except ImportError as exc:  # pragma: no cover - tensorboardX is a dependency
            raise ImportError("the tensorboard sink needs tensorboardX: pip install tensorboardX") from exc
        from tensorboardX import crc32c

        if crc32c._crc32c_native is None:  # tensorboardX's own optional accelerator
            warnings.warn("tensorboard sink: the crc32c package is not installed, so tensorboardX checksums every "
                          "event in pure Python (about 6 ms of the writer thread, holding the GIL, per 1,000 "
                          "values); pip install 'trainmon[fast-tensorboard]' (or crc32c)", stacklevel=2)
        self._event = Event
        self._summary = Summary
        self._crc = masked_crc32c
        self.rank_dir = Path(rank_dir)
        self.root = Path(root) if root is not None else self.rank_dir.parent
        self.path: Path | None = None
        self._file: IO[bytes] | None = None

    def _open(self) -> IO[bytes]:
        """Create a new event file (``events.out.tfevents.{seconds}.{host}[.{n}]``) with its version event."""
        stem = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
        for n in range(_MAX_NAMES):
            path = self.rank_dir / (stem if n == 0 else f"{stem}.{n}")
            try:
                handle = open_output(path, "xb", self.root)
            except FileExistsError:
                continue
            self.path = path
            self._file = handle
            self._write_event(self._event(wall_time=time.time(), file_version="brain.Event:2"))
            return handle
        raise FileExistsError(f"{self.rank_dir}: {_MAX_NAMES} event files named {stem}* already exist")

    def _write_event(self, event: Any) -> None:
        assert self._file is not None
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data)))

    def write(self, record: StepRecord) -> None:
        if self._file is None:
            self._open()
        value = self._summary.Value
        values = [value(tag=f"{row.family}/{row.name}/{metric}", simple_value=v)
                  for row in record.rows for metric, v in row.values.items()]
        values += [value(tag=f"scalars/{name}", simple_value=v) for name, v in record.scalars.items()]
        self._write_event(self._event(wall_time=time.time(), step=record.step, summary=self._summary(value=values)))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()
