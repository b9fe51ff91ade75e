"""Sinks on a hand-made StepRecord: the files they write, read back with pandas and tensorboard."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.tensorboard import TensorBoardSink
from trainmon.sinks.tensorboard_overview import TagSelection

PER_TENSOR = TagSelection(per_tensor=True)


def _record(step: int) -> StepRecord:
    rows = [Row(RowKey("grad_reduced", "fc.weight", 0, 0, 0), step, {"norm": 1.5 * step, "nans": 0.0}, False),
            Row(RowKey("actv", "fc.output", 0, 0, 1), step, {"norm": math.nan, "nans": 3.0}, True)]
    return StepRecord(step=step, rank=0, rows=rows, scalars={"loss": 2.0 / (step + 1)}, pp_stage=0)


def test_csv_and_tensorboard_round_trip_with_nan(tmp_path):
    sinks = [CsvSink(tmp_path), TensorBoardSink(tmp_path, selection=PER_TENSOR)]
    for step in (0, 1):
        for sink in sinks:
            sink.write(_record(step))
    for sink in sinks:
        sink.close()
    grads = pd.read_csv(tmp_path / "grad_reduced.csv")
    assert list(grads.columns) == ["vpp_stage", "name", "step", "micro_step", "norm", "nans"]
    assert grads.norm.tolist() == [0.0, 1.5]
    assert pd.read_csv(tmp_path / "actv.csv").norm.isna().all()
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [e.value for e in events.Scalars("grad_reduced/fc.weight/norm")] == [0.0, 1.5]
    assert math.isnan(events.Scalars("actv/fc.output/norm")[0].value)
    assert [round(e.value, 6) for e in events.Scalars("scalars/loss")] == [2.0, 1.0]
    # the overview beside the per-tensor tags: one tensor per family, so its values are the tensor's
    assert [e.value for e in events.Scalars("grad_reduced/norm_max")] == [0.0, 1.5]
    assert [e.value for e in events.Scalars("actv/nonfinite_tensors")] == [1.0, 1.0]
    assert math.isnan(events.Scalars("actv/norm_max")[0].value)


def test_tensorboard_writes_no_per_tensor_tag_by_default(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in (0, 1):
        sink.write(_record(step))
    sink.close()
    tags = EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"]
    assert sorted(tags) == ["0_overview/loss", "actv/nans_sum", "actv/nonfinite_tensors", "actv/norm_argmax",
                            "actv/norm_max", "actv/norm_median", "grad_reduced/nans_sum",
                            "grad_reduced/nonfinite_tensors", "grad_reduced/norm_argmax", "grad_reduced/norm_max",
                            "grad_reduced/norm_median", "scalars/loss"]


def test_tensorboard_sink_warns_without_native_crc32c(tmp_path, monkeypatch):
    from tensorboardX import crc32c

    monkeypatch.setattr(crc32c, "_crc32c_native", None)
    with pytest.warns(UserWarning, match="crc32c"):
        TensorBoardSink(tmp_path).close()


def test_slow_output_drops_records_instead_of_blocking_training(caplog):
    import threading
    import time

    from trainmon.sinks.base import SinkWriter

    release, written = threading.Event(), []

    class StuckDisk:
        name = "stuck"

        def write(self, record: StepRecord) -> None:
            release.wait(10)
            written.append(record.step)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    writer = SinkWriter([StuckDisk()], max_pending=2)
    start = time.perf_counter()
    for step in range(10):
        writer.submit(_record(step))
    assert time.perf_counter() - start < 0.5  # never waits for the disk
    release.set()
    writer.close()
    assert written[0] == 0 and 2 <= len(written) <= 3  # the one being written + the queued ones
    assert sum("output stuck is slower than training" in r.getMessage() for r in caplog.records) == 1
    # at close: one warning naming the sink and how many records it never wrote
    (report,) = [r.getMessage() for r in caplog.records if "output stuck did not write" in r.getMessage()]
    assert f"did not write {10 - len(written)} of 10 records" in report


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to play a full disk")
def test_tensorboard_on_a_full_disk_warns_once_and_prints_no_traceback(tmp_path, caplog, capfd):
    from trainmon.sinks.base import SinkWriter

    sink = TensorBoardSink(tmp_path)
    sink._file = open("/dev/full", "wb")  # noqa: SIM115 - the sink closes it; ENOSPC on every flush
    writer = SinkWriter([sink], flush_seconds=0.01)
    for step in range(4):
        writer.submit(_record(step))
    writer.close()
    disabled = [r.getMessage() for r in caplog.records if "output tensorboard failed and is disabled" in r.getMessage()]
    assert len(disabled) == 1 and "OSError" in disabled[0]
    lost = [r.getMessage() for r in caplog.records if "output tensorboard did not write" in r.getMessage()]
    assert len(lost) == 1 and "did not write 4 of 4 records" in lost[0]
    assert "Traceback" not in capfd.readouterr().err


def test_tensorboard_overview_micro_steps_anomaly_text_and_layout(tmp_path):
    """Run-level series sort first (``0_overview/``), each micro-step/VPP chunk has its own tag, anomalies
    from ``anomalies.jsonl`` show as counts and text at their step, and the Custom Scalars layout is written."""
    import json

    from tensorboard.plugins.custom_scalar import layout_pb2

    from trainmon.base.records import row_tag

    old = {"step": 0, "detector": "nonfinite", "message": "from an earlier attach"}
    (tmp_path / "anomalies.jsonl").write_text(json.dumps(old) + "\n")
    sink = TensorBoardSink(tmp_path, selection=PER_TENSOR)
    for step in (0, 1, 2):
        rows = [Row(RowKey("actv", "fc.output", micro, vpp, micro), step, {"norm": 10.0 * micro + step}, False)
                for vpp in (0, 1) for micro in (0, 1)]
        sink.write(StepRecord(step=step, rank=0, rows=rows, scalars={"loss": 1.0, "lr/group0": 0.1, "tokens": 5.0}))
        if step == 1:
            with open(tmp_path / "anomalies.jsonl", "a") as handle:
                handle.writelines(json.dumps({"step": 1, "detector": "nonfinite", "message": f"{name} is nan"}) + "\n"
                                  for name in ("a", "b"))
                handle.write(json.dumps({"step": 1, "detector": "loss_spike", "message": "loss x4"}) + "\n")
                handle.write('{"step": 2, "detector": "nonfinite", "mess')  # a line being written: not read yet
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    tags = events.Tags()["scalars"]
    assert sorted(tags)[:2] == ["0_overview/loss", "0_overview/lr/group0"]
    assert {"0_overview/lr/group0", "scalars/loss", "scalars/tokens"} <= set(tags)
    assert "0_overview/tokens" not in tags
    for vpp in (0, 1):
        for micro in (0, 1):
            assert [e.value for e in events.Scalars(row_tag("actv", "fc.output", "norm", micro, vpp))] == \
                [10.0 * micro + s for s in (0, 1, 2)]
    assert "actv/fc.output/norm" in tags and "actv/fc.output/norm/vpp1/micro1" in tags
    # counts in TensorBoard's tensor form of scalars (a point only at steps with events), read by its scalar plugin
    counts = {tag: [(e.step, e.tensor_proto.float_val[0]) for e in events.Tensors(tag)]
              for tag in events.Tags()["tensors"] if tag.startswith("0_overview/anomalies/")}
    assert counts == {"0_overview/anomalies/nonfinite": [(1, 2.0)], "0_overview/anomalies/loss_spike": [(1, 1.0)]}
    assert events.SummaryMetadata("0_overview/anomalies/nonfinite").plugin_data.plugin_name == "scalars"
    (text,) = events.Tensors("anomalies/nonfinite/text_summary")
    assert text.step == 1 and text.tensor_proto.string_val[0].decode() == "- a is nan\n- b is nan"
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    charts = {(c.title, ch.title): list(ch.multiline.tag) for c in layout.category for ch in c.chart}
    assert charts[("actv", "norm")] == [r"^actv/.*/norm(/vpp\d+)?(/micro\d+)?$"]
    assert charts[("actv", "norm over tensors: max, median")] == [r"^actv/norm_(max|median)$"]
    assert ("overview", "loss") in charts
    # the overview spans every micro-step and VPP chunk: 4 tensors, the largest norm is micro-step 1's
    assert [e.value for e in events.Scalars("actv/norm_max")] == [10.0 + s for s in (0, 1, 2)]
    (table,) = events.Tensors("actv/tensors/text_summary")
    assert table.tensor_proto.string_val[0].decode().splitlines()[-4:] == [
        "| 0 | fc.output |", "| 1 | fc.output/micro1 |", "| 2 | fc.output/vpp1 |", "| 3 | fc.output/vpp1/micro1 |"]
    assert [e.value for e in events.Scalars("actv/norm_argmax")] == [1.0] * 3
