"""TensorBoard sink (tensorboardX protos).

Tags (shared with ``trainmon csv2tb`` through :mod:`trainmon.sinks.tensorboard_overview`,
:func:`~trainmon.base.records.row_tag` and :func:`scalar_tags`; docs/tensorboard.md):

- ``0_overview/{loss, grad_norm, lr/group{i}, loss_scale, step_skipped}``: the run at a glance, in the
  group TensorBoard lists first (also written as ``scalars/{name}``, the tag earlier versions used);
- ``0_overview/anomalies/{detector}``: anomaly events per step and detector, with the events' messages as
  text at their step (tag ``anomalies/{detector}/text_summary`` as ``add_text`` names it, Text tab), read from
  ``anomalies.jsonl``;
- ``{family}/{metric}_{stat}``: per family and metric, summaries over all the tensors of the step
  (``norm_max``, ``norm_median``, ``norm_argmax``, ...; ``{family}/nonfinite_tensors``), and the table of
  ``norm_argmax`` indices as text (``{family}/tensors``): a bounded overview, < 200 tags whatever the model size;
- with ``tensorboard.per_tensor``: ``{family}/{name}/{metric}`` of the selected tensors, with ``/vpp{v}`` and
  ``/micro{m}`` appended only when not 0, so each tag has one value per step under gradient accumulation and
  virtual pipelining;
- ``scalars/{name}`` for the other scalars;
- a custom-scalars layout (Custom Scalars tab): the overview, per family the norm's max and median and the
  values' range on one chart each, and with ``per_tensor`` one multi-line chart per family and metric, across
  tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from trainmon.base.inputs import open_regular
from trainmon.base.records import StepRecord, row_tag, split_row_tag
from trainmon.base.safe_io import open_output
from trainmon.sinks.tensorboard_overview import RUN_SCALARS, SCALAR_TAGS, Block, Overview, TagSelection

logger = logging.getLogger("trainmon")

_MAX_NAMES = 100  # event files tried per second before giving up (another writer in the same directory)

OVERVIEW = "0_overview"
"""Tag group of the run-level series; ``0`` so that TensorBoard, which sorts groups by name, lists it first."""
_OVERVIEW_PREFIXES = ("lr/", "loss/micro")


def scalar_tags(name: str) -> list[str]:
    """Tags of one step scalar: ``scalars/{name}``, and ``0_overview/{name}`` for the run-level ones.

    Example:
        >>> scalar_tags("loss"), scalar_tags("lr/group0"), scalar_tags("tokens")
        (['0_overview/loss', 'scalars/loss'], ['0_overview/lr/group0', 'scalars/lr/group0'], ['scalars/tokens'])
    """
    if name in RUN_SCALARS or name.startswith(_OVERVIEW_PREFIXES):
        return [f"{OVERVIEW}/{name}", f"scalars/{name}"]
    return [f"scalars/{name}"]


def anomaly_summaries(events: Iterable[dict[str, Any]]) -> dict[int, tuple[dict[str, int], dict[str, str]]]:
    """Per step: ``({count tag: events}, {text tag: markdown lines})`` of anomaly event dicts (``anomalies.jsonl``).

    Example:
        >>> anomaly_summaries([{"step": 3, "detector": "nonfinite", "message": "loss is nan"}])
        {3: ({'0_overview/anomalies/nonfinite': 1}, {'anomalies/nonfinite': '- loss is nan'})}
    """
    counts: dict[int, Counter[str]] = defaultdict(Counter)
    texts: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for event in events:
        step, detector = event.get("step"), str(event.get("detector", "unknown"))
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            continue
        counts[step][f"{OVERVIEW}/anomalies/{detector}"] += 1
        texts[step][f"anomalies/{detector}"].append("- " + str(event.get("message", "")).replace("\n", " "))
    return {step: (dict(counts[step]), {tag: "\n".join(lines) for tag, lines in texts[step].items()})
            for step in sorted(counts)}


def anomaly_summary(counts: dict[str, int], texts: dict[str, str]) -> Any:
    """One step's anomaly ``Summary``: counts as scalars in the tensor form (TensorBoard's scalar plugin, as TF2's
    ``tf.summary.scalar`` writes them: a series only where events happened, apart from the ``simple_value``
    series that carry one value at every collected step), and the messages as ``add_text`` records."""
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboardX.proto.tensor_pb2 import TensorProto
    from tensorboardX.summary import text

    scalar = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
    values = [Summary.Value(tag=tag, metadata=scalar, tensor=TensorProto(dtype="DT_FLOAT", float_val=[float(n)]))
              for tag, n in counts.items()]
    values += [value for tag, lines in texts.items() for value in text(tag, lines).value]
    return Summary(value=values)


def read_anomaly_lines(data: bytes) -> list[dict[str, Any]]:
    """Anomaly event dicts of complete JSONL lines (corrupt lines skipped)."""
    events = []
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def custom_scalar_layout(tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """tensorboardX ``custom_scalars`` layout: the overview; per family the norm's max and median on one chart and
    the values' range (``max_max``, ``min_min``) on another; with per-tensor tags, one chart per family and metric
    (a regex over the tensors)."""
    layout: dict[str, dict[str, list[Any]]] = {
        "overview": {"loss": ["Multiline", [f"^{OVERVIEW}/loss($|/)"]],
                     "grad_norm": ["Multiline", [f"^{OVERVIEW}/grad_norm$"]],
                     "lr": ["Multiline", [f"^{OVERVIEW}/lr/"]],
                     "anomalies": ["Multiline", [f"^{OVERVIEW}/anomalies/"]]}}
    for tag in tags:
        family, _, summary = tag.partition("/")
        if family in (OVERVIEW, "scalars"):
            continue
        if summary in ("norm_max", "norm_median"):
            layout.setdefault(family, {})["norm over tensors: max, median"] = [
                "Multiline", [f"^{re.escape(family)}/norm_(max|median)$"]]
        elif summary in ("max_max", "min_min"):
            layout.setdefault(family, {})["values over tensors: max, min"] = [
                "Multiline", [f"^{re.escape(family)}/(max_max|min_min)$"]]
        row = split_row_tag(tag)
        if row is None:
            continue
        family, _, metric, _, _ = row
        layout.setdefault(family, {})[metric] = [
            "Multiline", [f"^{re.escape(family)}/.*/{re.escape(metric)}(/vpp\\d+)?(/micro\\d+)?$"]]
    return layout


def text_summary(texts: dict[str, str]) -> Any:
    """One ``Summary`` of ``add_text`` records (tags ``{tag}/text_summary``)."""
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import text

    return Summary(value=[value for tag, body in texts.items() for value in text(tag, body).value])


class EventFile:
    """One TensorBoard event file, written synchronously on the caller's thread.

    Events are framed as TFRecords (length, masked CRC32C, data, masked CRC32C, as tensorboardX's
    ``RecordWriter``), not through tensorboardX's ``FileWriter``, whose writer thread dies on a full disk
    and then blocks every later ``add_summary`` forever (``trainmon csv2tb`` hung there): here a failing
    write raises ``OSError`` to the caller. The file is created on the first event (or by :meth:`open`)
    through :mod:`trainmon.base.safe_io`: no symlink followed below ``root``, an existing file never
    reused or overwritten. ``flush`` hands the data to the OS without an ``fsync``.

    Args:
        directory: where ``events.out.tfevents.{seconds}.{host}[.{n}]`` is created (made if missing).
        root: the directory below which no symlink is followed (default: ``directory``'s parent).
    """

    def __init__(self, directory: Path, root: Path | None = None) -> None:
        try:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.record_writer import masked_crc32c
        except ImportError as exc:  # pragma: no cover - tensorboardX is a dependency
            raise ImportError("the tensorboard sink needs tensorboardX: pip install tensorboardX") from exc
        self._event = Event
        self._summary = Summary
        self._crc = masked_crc32c
        self.rank_dir = Path(directory)
        self.root = Path(root) if root is not None else self.rank_dir.parent
        self.path: Path | None = None
        self._file: IO[bytes] | None = None

    def open(self) -> IO[bytes]:
        """Create a new event file (``events.out.tfevents.{seconds}.{host}[.{n}]``) with its version event.

        Raises:
            OSError: the file cannot be created or written.
        """
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

    def write_summary(self, step: int, summary: Any) -> None:
        """Append one ``Summary`` at ``step`` (creating the file on the first call).

        Raises:
            OSError: the disk refused the write.
        """
        if self._file is None:
            self.open()
        self._write_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()


class TensorBoardSink(EventFile):
    """One event file per rank, in the rank directory itself (an :class:`EventFile` written on this sink's
    writer thread).

    All values of a step go into one ``Summary`` event (tensorboardX's ``add_scalar`` would write
    one event per value and log a warning for every NaN, which is exactly what a monitor must
    report quietly). The overview's summaries are computed here, on the writer thread, never on the training
    thread. A full disk raises in :class:`EventFile`'s write, where the writer disables the sink with one warning.

    Args:
        rank_dir: ``{output_dir}/{run_name}/rank{R}``.
        root: the directory below which no symlink is followed (default: ``rank_dir``'s parent).
        selection: what is written beyond the overview (config ``tensorboard``); default the overview alone.
    """

    name = "tensorboard"

    def __init__(self, rank_dir: Path, root: Path | None = None, selection: TagSelection | None = None) -> None:
        super().__init__(rank_dir, root)
        from tensorboardX import crc32c

        if crc32c._crc32c_native is None:  # tensorboardX's own optional accelerator
            warnings.warn("tensorboard sink: the crc32c package is not installed, so tensorboardX checksums every "
                          "event in pure Python (about 6 ms of the writer thread, holding the GIL, per 1,000 "
                          "values); pip install 'trainmon[fast-tensorboard]' (or crc32c)", stacklevel=2)
        from tensorboardX.summary import custom_scalars

        self._custom_scalars = custom_scalars
        self.overview = Overview(selection, on_dropped=_warn_dropped)
        # Anomalies of earlier attaches (a resumed run) are in earlier event files: start at the current end.
        self._anomalies = self.rank_dir / ANOMALIES_FILE
        self._anomaly_offset = _size(self._anomalies)

    def write(self, record: StepRecord) -> None:
        first = self._file is None
        if first:
            self.open()
        value = self._summary.Value
        selection = self.overview.selection
        blocks = self.overview.record_blocks(record.step, record.rows)
        values = [value(tag=tag, simple_value=v) for _, numbers, _ in blocks for tag, v in numbers.items()]
        if selection.per_tensor:
            values += [value(tag=row_tag(row.family, row.name, metric, row.key.micro_step, row.key.vpp_stage),
                             simple_value=v)
                       for row in record.rows if selection.family(row.family) and selection.tensor(row.name)
                       for metric, v in row.values.items() if selection.metric(metric)]
        values += [value(tag=tag, simple_value=v) for name, v in record.scalars.items()
                   for tag in self.overview.scalar_tags(name, scalar_tags)]
        if first:  # the Custom Scalars tab's charts, from the tags of the first step
            self.write_summary(0, self._custom_scalars(custom_scalar_layout(v.tag for v in values)))
        self.write_summary(record.step, self._summary(value=values))
        self._write_texts(blocks)
        self._write_anomalies()

    def _write_texts(self, blocks: list[Block]) -> None:
        """The tables of ``norm_argmax`` indices due in ``blocks``, at their step."""
        for step, _, texts in blocks:
            if texts:
                self.write_summary(step, text_summary(texts))

    def _write_anomalies(self) -> None:
        """Anomaly events appended to ``anomalies.jsonl`` since the last call (complete lines only): per step, a
        count per detector and the messages as text. That file is written by its own thread, so the events of a
        step usually arrive with the next step's record (TensorBoard places them by their step)."""
        try:
            with open_regular(self._anomalies) as handle:
                handle.seek(self._anomaly_offset)
                data = handle.read(_MAX_ANOMALY_BYTES)
        except OSError:  # no anomaly yet, or no jsonl action: nothing to show
            return
        end = data.rfind(b"\n") + 1
        if not end:
            return
        self._anomaly_offset += end
        for step, (counts, texts) in anomaly_summaries(read_anomaly_lines(data[:end])).items():
            self.write_summary(step, anomaly_summary(counts, texts))

    def close(self) -> None:
        try:
            if self._file is not None:
                self._write_texts(self.overview.finish())
                self._write_anomalies()
        finally:
            super().close()


def _warn_dropped(name: str) -> None:
    logger.warning("trainmon: tensorboard: the overview writes at most %d scalar tags; %r and any later new scalar "
                   "are not written to TensorBoard (they are in scalars.csv or the store); tensorboard.per_tensor: "
                   "true writes every scalar", SCALAR_TAGS, name)


ANOMALIES_FILE = "anomalies.jsonl"
_MAX_ANOMALY_BYTES = 16 * 1024 * 1024  # read per step at most (the rest comes with the next steps)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except (OSError, ValueError):
        return 0
