"""``trainmon report`` without a browser: the bulk CSV reader, the heatmap cells (bucket envelopes, the value and
change codes), the curves and the timeline against brute-force references, and bad input (exit 2, one line)."""

from __future__ import annotations

import base64
import json
import math
import re
import statistics
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
from trainmon.tools.report.curves import curves as report_curves
from trainmon.tools.report.source import open_source


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


def _decode(grid: dict, mode: str = "abs") -> np.ndarray:
    return np.frombuffer(base64.b64decode(grid[mode]["data"]), np.uint8).reshape(grid["shape"])


def _steps_grid(page: dict, family: str, metric: str, rank: int = 0) -> dict:
    return next(g for g in page["grids"] if (g["view"], g["family"], g["metric"], g["at"]) ==
                ("steps", family, metric, rank))


def _reference_change(high: list[float | None], low: list[float | None], window: int = 16) -> list[float | None]:
    """The change of each cell of a row: its largest (smallest) magnitude against the median of the previous
    ``window`` finite cells' largest (smallest) magnitudes, as log10; the larger deviation."""

    def ratio(value: float, reference: float | None) -> float:
        if reference is None or (value == 0 and reference == 0):
            return 0.0
        if value == 0:
            return -1.0
        if reference == 0:
            return 1.0
        return math.log10(value / reference)

    out: list[float | None] = []
    for c in range(len(high)):
        if high[c] is None:
            out.append(None)
            continue
        previous = [(h, lo) for h, lo in zip(high[max(0, c - window):c], low[max(0, c - window):c]) if h is not None]
        high_ref = statistics.median([h for h, _ in previous]) if previous else None
        low_ref = statistics.median([lo for _, lo in previous]) if previous else None
        up, down = ratio(high[c], high_ref), ratio(low[c], low_ref)
        out.append(up if abs(up) >= abs(down) else down)
    return out


def test_heatmap_cells_buckets_and_nonfinite_against_a_reference(tmp_path):
    """The step x module grid of a CSV run: bucket envelopes, NaN/Inf codes, log codes and change codes against a
    brute-force reference from the values written."""
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
    run = tmp_path / "run"
    (run / "rank0").mkdir(parents=True)
    (run / "rank0" / "grad_reduced.csv").write_text("vpp_stage,name,step,micro_step,norm\n" + "\n".join(lines) + "\n")
    assert main(["report", str(run), "--max-columns", "100"]) == 0
    page = _page_data((run / "report.html").read_text())
    hm = _steps_grid(page, "grad_reduced", "norm")
    width = math.ceil(2491 / 100)
    assert hm["cols"]["width"] == width == 25 and page["rowsets"]["grad_reduced"]["names"] == names
    starts = sorted({int(s) // width * width for s in steps})
    assert hm["cols"]["steps"] == starts and hm["shape"] == [7, len(starts)]
    codes, change_codes = _decode(hm), _decode(hm, "change")
    finite_logs, high, low = [], {}, {}
    for r, name in enumerate(names):
        for c, start in enumerate(starts):
            cell = [v for s in steps if start <= s < start + width for v in values[(name, int(s))]]
            special = (251 if any(math.isnan(v) for v in cell) else 252 if math.inf in cell
                       else 253 if -math.inf in cell else None)
            if special is not None:
                assert codes[r, c] == change_codes[r, c] == special
                continue
            high[r, c], low[r, c] = max(map(abs, cell)), min(map(abs, cell))
            if high[r, c] == 0:
                assert codes[r, c] == 250
            else:
                finite_logs.append((r, c, math.log10(high[r, c])))
    lo, hi = min(x for _, _, x in finite_logs), max(x for _, _, x in finite_logs)
    assert hm["abs"]["lo"] == pytest.approx(lo) and hm["abs"]["hi"] == pytest.approx(hi)
    for r, c, x in finite_logs:
        assert codes[r, c] == round((x - lo) / (hi - lo) * 249)
    for r in range(len(names)):
        row_high = [high.get((r, c)) for c in range(len(starts))]
        row_low = [low.get((r, c)) for c in range(len(starts))]
        for c, shift in enumerate(_reference_change(row_high, row_low)):
            if shift is not None:
                assert change_codes[r, c] == round(max(-1.0, min(1.0, shift)) * 124) + 124, (r, c)
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
    assert page["grids"] == [] and page["curves"] == {}


def test_timeline_bins_many_ranks_into_rows():
    """4,096 ranks with events: at most 160 rows of consecutive ranks, each cell the sum of its ranks' events."""
    cells = [[rank, step, 1 + rank % 3] for rank in range(4096) for step in (5, 900)]
    got = report_data.timeline({"counts": {"by_rank_step": cells}}, 1000)
    per_rank = math.ceil(4096 / report_data.TIMELINE_ROWS)
    assert got["per_rank"] == per_rank == 26 and len({rank for rank, _, _ in got["cells"]}) <= report_data.TIMELINE_ROWS
    want: dict[tuple[int, int], int] = {}
    for rank, step, count in cells:
        key = (rank // per_rank * per_rank, step)
        want[key] = want.get(key, 0) + count
    assert {(rank, step): count for rank, step, count in got["cells"]} == want


def test_curves_are_bucketed_min_max_beyond_the_limit(tmp_path):
    run = tmp_path / "run"
    (run / "rank0").mkdir(parents=True)
    steps = np.arange(5000)
    loss = np.sin(steps / 50.0) + steps / 1000.0
    loss[1234] = math.nan
    (run / "rank0" / "scalars.csv").write_text("step,name,value\n" + "".join(
        f"{s},loss,{float(v)!r}\n" for s, v in zip(steps, loss)))
    source = open_source(run, report_data.sources(run))
    try:
        curves = report_curves(source, 0, max_points=2000)["loss"]
    finally:
        source.close()
    per_bin = math.ceil(5000 / 2000)
    assert curves["per_bin"] == per_bin and curves["steps"] == steps[::per_bin].tolist()
    for i, start in enumerate(range(0, 5000, per_bin)):
        chunk = loss[start:start + per_bin]
        assert curves["lo"][i] == pytest.approx(np.nanmin(chunk)) and curves["hi"][i] == pytest.approx(np.nanmax(chunk))
    assert curves["bad"] == [1234] and curves["bad_total"] == 1


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


def test_sparse_huge_steps_up_to_int64_max(tmp_path):
    """Steps far apart, up to 2**63 - 1: equal-width buckets without overflow, each column the envelope of its
    steps, empty buckets dropped."""
    run = tmp_path / "run"
    (run / "rank0").mkdir(parents=True)
    steps = [0, 5, 2**40, 2**63 - 1]
    (run / "rank0" / "actv.csv").write_text("vpp_stage,name,step,micro_step,norm\n" + "".join(
        f"0,w,{s},0,{i + 1}.0\n" for i, s in enumerate(reversed(steps))))  # 4.0 at step 0 ... 1.0 at 2**63 - 1
    assert main(["report", str(run), "--max-columns", "10"]) == 0
    hm = _steps_grid(_page_data((run / "report.html").read_text()), "actv", "norm")
    width = -(-(2**63) // 10)
    assert hm["cols"] == {"steps": [0, 9 * width], "width": width, "last": 2**63 - 1}
    assert _decode(hm)[0].tolist() == [249, 0]  # bucket 0 holds 4.0 (and 3.0, 2.0); the last 1.0


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
    assert {h["family"] for h in page["grids"] if h["view"] == "steps"} == csv_families


def test_families_and_metrics_select_heatmaps(tmp_path):
    run = _run(tmp_path, ranks=2)
    out = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(out), "--families", "actv", "grad_reduced", "--metrics", "nans",
                 "--ranks", "1"]) == 0
    page = _page_data(out.read_text())
    assert sorted((h["family"], h["metric"], h["at"]) for h in page["grids"] if h["view"] == "steps") == [
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
