"""``trainmon report`` without a browser: the bulk CSV reader, the heatmap cells and the timeline
against brute-force references, and bad input (exit 2, one line)."""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_anomaly_analyse import write_run
from tests.unit.test_csv2tb import _run
from trainmon.base.records import row_tag
from trainmon.tools.cli import main
from trainmon.tools.readers import CsvFormatError, read_scalars, read_table
from trainmon.tools.report import data as report_data


def _page_data(html: str) -> dict:
    match = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(match.group(1))


def test_read_table_equals_read_scalars(tmp_path):
    """The bulk reader returns exactly the (tag, value, step) triples of csv2tb's reader."""
    run = _run(tmp_path, ranks=1)
    path = run / "rank0" / "actv.csv"
    with open(path, "a") as handle:  # a second VPP stage and a micro-step, and a name with a comma
        handle.write('1,"odd, name",2,1,5.5,0\n0,fc.output,3,0,-inf,0\n')
    for csv_path in sorted((run / "rank0").glob("*.csv")):
        table = read_table(csv_path)
        got = []
        for i in range(len(table.rows)):
            vpp, name = table.keys[table.rows[i]]
            for j, metric in enumerate(table.metrics):
                tag = f"scalars/{name}" if table.family == "scalars" else row_tag(
                    table.family, name, metric, int(table.micro_steps[i]), vpp)
                got.append((tag, table.values[i, j], int(table.steps[i])))
        want = list(read_scalars(csv_path))
        assert len(got) == len(want)
        for (tag_a, value_a, step_a), (tag_b, value_b, step_b) in zip(got, want):
            assert (tag_a, step_a) == (tag_b, step_b)
            assert value_a == value_b or (math.isnan(value_a) and math.isnan(value_b))


@pytest.mark.parametrize("line, message", [
    ("0,w,x,0,1.0,0", "step must be an integer"),
    ("0,w,1,0,abc,0", "could not convert string to float"),
    ("0,w,1,0,1.0", "expected 6 fields, got 5"),
    ("0,w,99999999999999999999,0,1,0", "step must be an integer"),
    ("0,w,-1,0,1,0", "step must be an integer"),
])
def test_read_table_reports_the_line_as_read_scalars_does(tmp_path, line, message):
    path = tmp_path / "actv.csv"
    path.write_text("vpp_stage,name,step,micro_step,norm,nans\n" + "0,w,0,0,1.0,0\n" * 3 + line + "\n")
    with pytest.raises(CsvFormatError) as bulk:
        read_table(path)
    with pytest.raises(CsvFormatError) as slow:
        list(read_scalars(path))
    assert str(bulk.value) == str(slow.value) and f"{path}:5: " in str(bulk.value) and message in str(bulk.value)


def test_read_table_accepts_what_read_scalars_accepts(tmp_path):
    """Spaces around numbers: the bulk path falls back to the line reader and agrees with it."""
    path = tmp_path / "actv.csv"
    path.write_text("vpp_stage,name,step,micro_step,norm\n0,w, 4 ,0, 2.5\n")
    table = read_table(path)
    assert list(read_scalars(path)) == [("actv/w/norm", 2.5, 4)]
    assert table.steps.tolist() == [4] and table.values.tolist() == [[2.5]]


def _decode(grid: dict, shape: tuple[int, int]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(grid["data"]), np.uint8).reshape(shape)


def test_heatmap_cells_bins_and_nonfinite_against_a_reference(tmp_path):
    rng = np.random.default_rng(3)
    names, steps = [f"m{i}" for i in range(7)], np.arange(0, 2500, 10)  # 250 collected steps
    lines, values = [], {}
    for step in steps:
        for name in names:
            for micro in range(2):
                value = float(rng.lognormal(0, 2)) * rng.choice([-1, 1])
                if rng.random() < 0.005:
                    value = rng.choice([math.nan, math.inf, -math.inf])
                if rng.random() < 0.01:
                    value = 0.0
                value = float(value)  # a Python float: numpy 2's repr of np.float64 is 'np.float64(...)'
                lines.append(f"0,{name},{step},{micro},{value!r}")
                values.setdefault((name, int(step)), []).append(value)
    path = tmp_path / "grad_reduced.csv"
    path.write_text("vpp_stage,name,step,micro_step,norm\n" + "\n".join(lines).replace("nan", "nan") + "\n")
    (hm,) = report_data.heatmaps("grad_reduced", [read_table(path)], 0, max_columns=100)
    per_bin = math.ceil(250 / 100)
    assert hm["per_bin"] == per_bin == 3 and hm["steps"] == steps[::3].tolist() and hm["rows"] == names
    codes = _decode(hm, (7, len(hm["steps"])))
    finite_logs = []
    for r, name in enumerate(names):
        for c in range(len(hm["steps"])):
            cell = [v for s in steps[c * 3:(c + 1) * 3] for v in values[(name, int(s))]]
            if any(math.isnan(v) for v in cell):
                assert codes[r, c] == report_data.NAN
            elif math.inf in cell:
                assert codes[r, c] == report_data.POS_INF
            elif -math.inf in cell:
                assert codes[r, c] == report_data.NEG_INF
            elif max(map(abs, cell)) == 0:
                assert codes[r, c] == report_data.ZERO
            else:
                finite_logs.append((r, c, math.log10(max(map(abs, cell)))))
    lo, hi = min(x for _, _, x in finite_logs), max(x for _, _, x in finite_logs)
    assert hm["lo"] == pytest.approx(lo) and hm["hi"] == pytest.approx(hi) and hm["scale"] == "log"
    for r, c, x in finite_logs:
        assert codes[r, c] == round((x - lo) / (hi - lo) * 249)
    assert hm["nonfinite"] == int(((codes >= 251) & (codes <= 253)).sum()) > 0


def test_timeline_counts_every_rank_and_step(tmp_path):
    good = write_run(tmp_path, ranks=6, per_rank=80)
    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    page = _page_data(out.read_text())
    want: dict[tuple[int, int], int] = {}
    for e in good:
        want[(e["rank"], e["step"])] = want.get((e["rank"], e["step"]), 0) + 1
    assert {(r, s): n for r, s, n in page["anomalies"]["timeline"]["cells"]} == want
    assert page["anomalies"]["events"] == len(good)
    assert page["heatmaps"] == [] and page["curves"] == {}


def test_curves_are_binned_min_max_beyond_the_limit(tmp_path):
    path = tmp_path / "scalars.csv"
    steps = np.arange(5000)
    loss = np.sin(steps / 50.0) + steps / 1000.0
    loss[1234] = math.nan
    path.write_text("step,name,value\n" + "".join(f"{s},loss,{float(v)!r}\n" for s, v in zip(steps, loss)))
    curves = report_data.curves([read_table(path)], max_points=2000)["loss"]
    per_bin = math.ceil(5000 / 2000)
    assert curves["per_bin"] == per_bin and curves["steps"] == steps[::per_bin].tolist()
    for i, start in enumerate(range(0, 5000, per_bin)):
        chunk = loss[start:start + per_bin]
        assert curves["lo"][i] == pytest.approx(np.nanmin(chunk)) and curves["hi"][i] == pytest.approx(np.nanmax(chunk))
    assert curves["bad"] == [1234]


@pytest.mark.parametrize("make, expected", [
    (lambda p: None, "no such directory"),
    (lambda p: p.mkdir(), "no rank*/ directories and no CSV files"),
    (lambda p: (p / "rank0").mkdir(parents=True), "nothing to report"),
    (lambda p: (p / "run_a" / "rank0").mkdir(parents=True), "is a folder of 1 runs, not a run: pass one of them, "
                                                             "e.g. trainmon report"),
    (lambda p: (p / "rank0").mkdir(parents=True) or (p / "rank0" / "actv.csv").write_text(
        "vpp_stage,name,step,micro_step,norm\n0,w,1,0,oops\n"), "actv.csv:2: could not convert"),
    (lambda p: (p / "rank0").mkdir(parents=True) or (p / "rank0" / "actv.csv").write_bytes(b"\xff\xfe"), "not UTF-8"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, make, expected):
    run = tmp_path / "run"
    make(run)
    done = subprocess.run([sys.executable, "-m", "trainmon", "report", str(run)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("trainmon report: error: ")
    assert expected in done.stderr, done.stderr


@pytest.mark.parametrize("args, expected", [
    (["--max-columns", "3"], "--max-columns: must be an integer in 10..100000"),
    (["--ranks", "x"], "--ranks: bad rank list"),
    (["--ranks", "5"], "--ranks 5: the run has ranks 0"),
    (["-o", "."], "is a directory"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, expected):
    run = _run(tmp_path, ranks=1)
    try:
        code = main(["report", str(run), *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err


def test_read_table_long_fields_quotes_and_blank_lines_as_read_scalars(tmp_path):
    from trainmon.tools.readers import MAX_FIELD

    header = "vpp_stage,name,step,micro_step,norm\n"
    cases = {
        "long": header + "0,w,1,0,1\n0," + "a" * (MAX_FIELD + 1) + ",2,0,1\n",
        "blank": header + "0,w,1,0,1\n\n0,w,2,0,1\n",
        "quoted": header + '0,"a ""b"",\nc",1,0,1.5\r\n0,w,2,0,nan\r\n',
        "empty": "",
        "header only": header,
    }
    for label, text in cases.items():
        path = tmp_path / "actv.csv"
        path.write_text(text, newline="")
        try:
            want = list(read_scalars(path))
        except CsvFormatError as exc:
            with pytest.raises(CsvFormatError) as bulk:
                read_table(path)
            assert str(bulk.value) == str(exc), label
            continue
        table = read_table(path)
        if not want:
            assert len(table.rows) == 0, label
            continue
        got = [(row_tag("actv", table.keys[r][1], "norm"), v, int(s))
               for r, v, s in zip(table.rows, table.values[:, 0], table.steps)]
        assert [(t, s) for t, _, s in got] == [(t, s) for t, _, s in want], label
        assert np.allclose([v for _, v, _ in got], [v for _, v, _ in want], equal_nan=True), label


def test_sparse_huge_steps_bin_by_distinct_step(tmp_path):
    """Steps far apart (not a dense range) are columns in order, through the sorting path."""
    path = tmp_path / "actv.csv"
    steps = [0, 5, 2**40, 2**62]
    path.write_text("vpp_stage,name,step,micro_step,norm\n" + "".join(f"0,w,{s},0,{i + 1}.0\n" for i, s in
                                                                       enumerate(reversed(steps))))
    (hm,) = report_data.heatmaps("actv", [read_table(path)], 0, max_columns=10)
    assert hm["steps"] == steps and hm["per_bin"] == 1
    codes = _decode(hm, (1, 4))[0]
    logs = np.log10([4.0, 3.0, 2.0, 1.0])  # values by ascending step
    assert codes.tolist() == np.rint((logs - logs.min()) / (logs.max() - logs.min()) * 249).astype(int).tolist()


@pytest.mark.parametrize("version", ["msprobe-1.2.1", "msprobe-26.2.0"])
def test_msprobe_output_folder(tmp_path, version):
    """msprobe's CSV output and anomaly.json files (real outputs of msprobe, see tests/data): heatmaps
    from csv2tb's msprobe reader, the first origin by msprobe's rule."""
    folder = Path(__file__).parents[1] / "data" / "msprobe_output" / version
    out = tmp_path / "report.html"
    assert main(["report", str(folder), "-o", str(out)]) == 0
    page = _page_data(out.read_text())
    from trainmon.tools.msprobe_output import analyse_msprobe, anomaly_files

    expected = analyse_msprobe(folder, anomaly_files(folder), top=20)
    assert page["anomalies"]["events"] == expected["events"] > 0
    assert page["anomalies"]["first_origin"]["message"] == expected["first_origin"]["message"]
    csv_families = {re.fullmatch(r"(.+)_\d+-\d+\.csv", p.name).group(1) for p in folder.glob("*rank0*/*.csv")}
    assert {h["family"] for h in page["heatmaps"]} == csv_families


def test_families_and_metrics_select_heatmaps(tmp_path):
    run = _run(tmp_path, ranks=2)
    out = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(out), "--families", "actv", "grad_reduced", "--metrics", "nans",
                 "--ranks", "1"]) == 0
    page = _page_data(out.read_text())
    assert sorted((h["family"], h["metric"], h["rank"]) for h in page["heatmaps"]) == [
        ("actv", "nans", 1), ("grad_reduced", "nans", 1)]
    assert list(page["curves"]) == ["1"] and page["ranks"] == [1]


@pytest.mark.parametrize("args, expected", [
    (["--families", "actvv"], "--families actvv: no such family in {run} (did you mean actv?); it has: actv, "),
    (["--families", "actv", "comm"], "--families comm: no such family in {run}"),
    (["--metrics", "nrom"], "--metrics nrom: no such metric in {run} (did you mean norm?); it has: nans, norm"),
    (["--families", "actv", "--metrics", "max"], "--metrics max: no such metric of the --families in {run}"),
])
def test_a_filter_that_selects_nothing_exits_2_and_leaves_the_report_as_it_was(tmp_path, capsys, args, expected):
    """A typo in --families or --metrics used to write an empty page over report.html, with exit 0."""
    run = _run(tmp_path, ranks=1)
    assert main(["report", str(run)]) == 0
    before = (run / "report.html").read_bytes()
    capsys.readouterr()
    assert main(["report", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainmon report: error: ") and expected.format(run=run) in err, err
    assert (run / "report.html").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == ["rank0", "report.html"]  # no temporary file left either


def test_an_empty_rank_folder_is_skipped_with_a_warning(tmp_path, capsys):
    """An empty ``rank{R}/`` (an attach that failed, a rank that wrote nothing yet) is named once and left out."""
    run = _run(tmp_path, ranks=2)
    (run / "rank5").mkdir()
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {run}: skipped rank folder(s) 5: no CSV files\n"
    assert "of 2 rank(s)" in captured.out
    page = _page_data((run / "report.html").read_text())
    assert page["ranks"] == [0, 1] and sorted(page["curves"]) == ["0", "1"]
