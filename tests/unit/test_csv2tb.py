"""``trainmon csv2tb``: CSV written by the CSV sink back to TensorBoard, read with tensorboard's reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.sinks.csv import CsvSink
from trainmon.tools.cli import main

FAMILIES = ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq", "actv", "actv_grad")


def _run(tmp_path: Path, ranks: int = 2) -> Path:
    run_dir = tmp_path / "run"
    for rank in range(ranks):
        sink = CsvSink(run_dir / f"rank{rank}")
        for step in range(3):
            rows = [Row(RowKey(family, "fc.weight", 0, 0, i), step, {"norm": rank + step + i / 10, "nans": 0.0}, False)
                    for i, family in enumerate(FAMILIES)]
            rows.append(Row(RowKey("actv", "fc.output", 0, 0, 9), step, {"norm": math.nan, "nans": 2.0}, True))
            sink.write(StepRecord(step=step, rank=rank, rows=rows, scalars={"loss": 1.0 / (step + 1)}, pp_stage=0))
        sink.close()
    return run_dir


def _tags(directory: Path) -> dict[str, list[float]]:
    events = EventAccumulator(str(directory)).Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_round_trip_every_family_and_nan(tmp_path, capsys):
    run_dir = _run(tmp_path)
    assert main(["csv2tb", str(run_dir), "--per-tensor"]) == 0
    # 2 ranks x 3 steps x (7 rows x 2 metrics + loss twice: 0_overview/loss and scalars/loss
    # + the overview: 6 families x (norm_max, norm_median, norm_argmax, nans_sum, nonfinite_tensors))
    assert "wrote 276 scalars" in capsys.readouterr().out
    tags = _tags(run_dir / "tensorboard" / "rank1")
    assert tags["grad_reduced/fc.weight/norm"] == [1.0, 2.0, 3.0]
    assert tags["exp_avg_sq/fc.weight/norm"] == pytest.approx([1.3, 2.3, 3.3])
    assert all(math.isnan(v) for v in tags["actv/fc.output/norm"]) and tags["actv/fc.output/nans"] == [2.0] * 3
    assert tags["scalars/loss"] == pytest.approx([1.0, 0.5, 1 / 3])
    # actv holds fc.weight (finite) and fc.output (NaN norm, 2 NaNs): the NaN is the max, fc.output its holder
    assert all(math.isnan(v) for v in tags["actv/norm_max"]) and tags["actv/norm_argmax"] == [1.0] * 3
    assert tags["actv/norm_median"] == pytest.approx([1.4, 2.4, 3.4])  # the median skips NaN
    assert tags["actv/nans_sum"] == [2.0] * 3 and tags["actv/nonfinite_tensors"] == [1.0] * 3


def test_default_is_the_overview_and_the_options_narrow_it(tmp_path, capsys):
    run_dir = _run(tmp_path, ranks=1)
    assert main(["csv2tb", str(run_dir), "-o", str(tmp_path / "all")]) == 0
    assert "wrote 96 scalars" in capsys.readouterr().out  # 3 steps x (6 families x 5 summaries + loss twice)
    tags = _tags(tmp_path / "all" / "rank0")
    assert not [tag for tag in tags if tag.count("/") > 1]  # no per-tensor tag
    assert tags["grad_reduced/norm_max"] == [0.0, 1.0, 2.0]
    assert tags["exp_avg/norm_max"] == pytest.approx([0.2, 1.2, 2.2])
    assert tags["0_overview/loss"] == pytest.approx([1, .5, 1 / 3])
    argv = ["csv2tb", str(run_dir), "-o", str(tmp_path / "some"), "--families", "actv", "--metrics", "nans",
            "--per-tensor", "--tensors", "re:output$"]
    assert main(argv) == 0
    assert sorted(_tags(tmp_path / "some" / "rank0")) == ["actv/fc.output/nans", "actv/nans_sum",
                                                          "actv/nonfinite_tensors"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--metrics", "p99"], "argument --metrics: invalid choice: 'p99'"),
    (["--families", "gradients"], "argument --families: invalid choice: 'gradients'"),
    (["--per-tensor", "--tensors", "re:(layers"], "--tensors[0]: invalid regex '(layers'"),
    (["--per-tensor", "--tensors", ""], "--tensors[0]: must not be empty"),
    (["--tensors", "layers.*"], "--tensors selects the per-tensor tags: add --per-tensor"),
])
def test_bad_filters_exit_2_with_one_line(tmp_path, capsys, argv, message):
    run_dir = _run(tmp_path, ranks=1)
    try:
        code = main(["csv2tb", str(run_dir), *argv])
    except SystemExit as exc:  # argparse's own checks (choices)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert not (run_dir / "tensorboard").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_families_filter_takes_exactly_that_family(tmp_path, family):
    """``grad_reduced`` must not take ``grad_unreduced``; ``actv`` must not take ``actv_grad``."""
    run_dir = _run(tmp_path, ranks=1)
    out = tmp_path / "tb"
    assert main(["csv2tb", str(run_dir), "-o", str(out), "--families", family, "--per-tensor"]) == 0
    assert {tag.split("/")[0] for tag in _tags(out / "rank0")} == {family}


def test_metrics_changed_mid_run_file_keeps_its_family(tmp_path):
    run_dir = _run(tmp_path, ranks=1)
    (run_dir / "rank0" / "exp_avg_120.csv").write_text("vpp_stage,name,step,micro_step,max\n0,w,120,0,4.5\n")
    out = tmp_path / "tb"
    assert main(["csv2tb", str(run_dir), "-o", str(out), "--families", "exp_avg", "--per-tensor"]) == 0
    assert _tags(out / "rank0")["exp_avg/w/max"] == [4.5]
    assert _tags(out / "rank0")["exp_avg/max_max"] == [4.5]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainmon csv2tb: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line_with_exit_2(tmp_path, capsys):
    assert main(["csv2tb", str(tmp_path / "missing")]) == 2
    assert "no such directory" in _one_line_error(capsys)
    run_dir = _run(tmp_path, ranks=1)
    bad = run_dir / "rank0" / "grad_reduced.csv"
    bad.write_text(bad.read_text() + "0,fc.weight,3\n")
    assert main(["csv2tb", str(run_dir)]) == 2
    assert "grad_reduced.csv:5: expected 6 fields, got 3" in _one_line_error(capsys)
    bad.write_bytes(b"vpp_stage,name,step,micro_step,norm\n0,\xff\xfe,1,0,2.0\n")
    assert main(["csv2tb", str(run_dir)]) == 2
    assert "not UTF-8" in _one_line_error(capsys)
    bad.write_text("vpp_stage,name,step,micro_step,norm\n0,fc,one,0,2.0\n")
    assert main(["csv2tb", str(run_dir)]) == 2
    assert "grad_reduced.csv:2" in _one_line_error(capsys)


def test_unwritable_output_is_one_line(tmp_path, capsys):
    """An output path under a regular file cannot be created (what an unwritable -o looks like as root)."""
    run_dir = _run(tmp_path, ranks=1)
    (tmp_path / "afile").write_text("x")
    assert main(["csv2tb", str(run_dir), "-o", str(tmp_path / "afile" / "tb")]) == 2
    _one_line_error(capsys)


def test_a_huge_field_is_refused_whatever_the_process_wide_csv_limit(tmp_path):
    """MindSpore raises ``csv.field_size_limit`` for the whole process when it is imported."""
    import csv

    import pytest

    from trainmon.tools.readers import CsvFormatError, read_scalars

    path = tmp_path / "grad_reduced.csv"
    path.write_text("vpp_stage,name,step,micro_step,norm\n0," + "w" * 200_000 + ",1,0,2\n")
    previous = csv.field_size_limit(10 * 1024 * 1024)
    try:
        with pytest.raises(CsvFormatError, match="grad_reduced.csv"):
            list(read_scalars(path))
    finally:
        csv.field_size_limit(previous)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_csv2tb_writes_the_tags_the_tensorboard_sink_writes(tmp_path, per_tensor):
    """Same tags and values live and offline: overview (summaries, tables of tensors), per-tensor tags with their
    micro-step/VPP suffixes, anomaly counts and text."""
    import json

    from trainmon.sinks.tensorboard import TensorBoardSink
    from trainmon.sinks.tensorboard_overview import TagSelection

    rank_dir = tmp_path / "run" / "rank0"
    rank_dir.mkdir(parents=True)
    sinks = [CsvSink(rank_dir), TensorBoardSink(rank_dir, selection=TagSelection(per_tensor))]
    for step in range(3):
        rows = [Row(RowKey("actv", "fc.output", micro, vpp, micro), step, {"norm": micro + step / 10}, False)
                for vpp in (0, 2) for micro in (0, 1)]
        # tensors that appear later (the table of tensors grows), a NaN, and an empty tensor (NaN max, norm 0)
        rows += [Row(RowKey("grad_reduced", f"layers.{i}.weight", 0, 0, i), step,
                     {"norm": math.nan if (i, step) == (1, 2) else float(i + step), "max": math.nan if i == 0 else i,
                      "nans": float((i, step) == (1, 2))}, (i, step) == (1, 2)) for i in range(2 * step + 1)]
        record = StepRecord(step=step, rank=0, rows=rows, scalars={"loss": 1.0, "grad_norm": 2.0, "x": 3.0})
        for sink in sinks:
            sink.write(record)
        if step == 1:
            event = {"step": 1, "detector": "nonfinite", "message": "fc.output has nan"}
            (rank_dir / "anomalies.jsonl").write_text(json.dumps(event) + "\n")
    for sink in sinks:
        sink.close()
    assert main(["csv2tb", str(tmp_path / "run"), *(["--per-tensor"] if per_tensor else [])]) == 0
    live = EventAccumulator(str(rank_dir), size_guidance={"tensors": 0}).Reload()
    offline = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "rank0"), size_guidance={"tensors": 0}).Reload()
    assert live.Tags()["scalars"] and sorted(live.Tags()["scalars"]) == sorted(offline.Tags()["scalars"])
    assert sorted(live.Tags()["tensors"]) == sorted(offline.Tags()["tensors"]) == [
        "0_overview/anomalies/nonfinite", "actv/tensors/text_summary", "anomalies/nonfinite/text_summary",
        "custom_scalars__config__", "grad_reduced/tensors/text_summary"]
    for tag in live.Tags()["tensors"]:
        if tag != "custom_scalars__config__":
            assert [(e.step, e.tensor_proto) for e in live.Tensors(tag)] == \
                [(e.step, e.tensor_proto) for e in offline.Tensors(tag)]
    for tag in live.Tags()["scalars"]:
        assert [(e.step, str(e.value)) for e in live.Scalars(tag)] == \
            [(e.step, str(e.value)) for e in offline.Scalars(tag)], tag  # str: NaN == NaN
    assert ("actv/fc.output/norm/vpp2/micro1" in live.Tags()["scalars"]) == per_tensor
    # the table of grad_reduced's tensors: written at step 0 (1 tensor), step 1 (3: doubled), at the end (5)
    tables = [(e.step, e.tensor_proto.string_val[0].decode().count("layers.")) for e in
              live.Tensors("grad_reduced/tensors/text_summary")]
    assert tables == [(0, 1), (1, 3), (2, 5)]
    assert [str(e.value) for e in live.Scalars("grad_reduced/norm_max")] == ["0.0", "3.0", "nan"]
    assert [e.value for e in live.Scalars("grad_reduced/norm_argmax")] == [0.0, 2.0, 1.0]
    # the empty tensor's NaN max is skipped (alone at step 0: no value), the NaN tensor's NaN max too
    assert [str(e.value) for e in live.Scalars("grad_reduced/max_max")] == ["nan", "2.0", "4.0"]


def _main_within(argv: list[str], seconds: float = 60.0) -> int:
    """``main(argv)`` on a thread; fails (instead of hanging the suite) when it has not returned in ``seconds``."""
    import threading

    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"trainmon {' '.join(argv[:1])} still running after {seconds} s: it hangs"
    return result[0]


def _big_run(tmp_path: Path) -> Path:
    """A run whose event files are larger than 1 MiB (2 ranks x 400 steps x 40 rows x 2 metrics)."""
    run_dir = tmp_path / "big"
    for rank in range(2):
        sink = CsvSink(run_dir / f"rank{rank}")
        for step in range(400):
            rows = [Row(RowKey("grad_reduced", f"layers.{i}.weight", 0, 0, i), step, {"norm": step + i, "nans": 0.0},
                        False) for i in range(40)]
            sink.write(StepRecord(step=step, rank=rank, rows=rows, scalars={"loss": 1.0}, pp_stage=0))
        sink.close()
    return run_dir


def test_full_disk_output_exits_2_with_one_line_and_does_not_hang(tmp_path, tmpfs_1m, capsys):
    """A real 1 MiB tmpfs fills up while the event files are written (tensorboardX's FileWriter used to lose its
    writer thread there and block csv2tb for ever)."""
    run_dir = _big_run(tmp_path)
    assert _main_within(["csv2tb", str(run_dir), "-o", str(tmpfs_1m / "tb"), "--per-tensor"]) == 2
    err = _one_line_error(capsys)
    assert "cannot write to" in err and str(tmpfs_1m / "tb") in err and "No space left on device" in err, err


def test_full_disk_simulated_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    """The same without a mountable tmpfs: the event file's write raises ``OSError(ENOSPC)`` after a few events,
    as a full disk does (simulated in-process; the tmpfs test above is the real one)."""
    import errno

    from trainmon.sinks import tensorboard

    written = []
    real = tensorboard.EventFile._write_event

    def filling(self, event):
        written.append(1)
        if len(written) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, event)

    monkeypatch.setattr(tensorboard.EventFile, "_write_event", filling)
    run_dir = _run(tmp_path, ranks=2)
    assert _main_within(["csv2tb", str(run_dir), "-o", str(tmp_path / "tb")]) == 2
    err = _one_line_error(capsys)
    assert f"cannot write to {tmp_path / 'tb'}" in err and "No space left on device" in err, err


def test_read_only_output_exits_2_with_one_line(tmp_path, readonly_dir, capsys):
    run_dir = _run(tmp_path, ranks=2)
    for output in (readonly_dir, readonly_dir / "tb"):
        assert _main_within(["csv2tb", str(run_dir), "-o", str(output)]) == 2
        err = _one_line_error(capsys)
        assert "cannot write to" in err and str(readonly_dir) in err, err
    assert not any(readonly_dir.iterdir())


def test_empty_run_and_rank_folders_are_skipped_with_a_note(tmp_path, capsys):
    """What an attach that failed used to leave (an empty ``rank0/``) does not stop the other runs."""
    out = tmp_path / "out"
    _run(out, ranks=2).rename(out / "good")
    (out / "good" / "rank2").mkdir()
    (out / "failed" / "rank0").mkdir(parents=True)
    assert main(["csv2tb", str(out)]) == 0
    captured = capsys.readouterr()
    notes = captured.err.strip().splitlines()
    assert notes == [f"note: skipped {out / 'failed'}: no CSV files in rank0",
                     f"note: {out / 'good'}: skipped rank2: no CSV files"], notes
    assert sorted(p.name for p in (out / "good" / "tensorboard").iterdir()) == ["rank0", "rank1"]
    assert _tags(out / "good" / "tensorboard" / "rank1")["grad_reduced/norm_max"] == [1.0, 2.0, 3.0]
    assert not (out / "failed" / "tensorboard").exists()
    # the empty run alone: nothing to convert, exit 2 with one line
    assert main(["csv2tb", str(out / "failed")]) == 2
    assert "no CSV files in rank0" in _one_line_error(capsys)
