"""Bad input to every ``trainmon`` subcommand: exit 2 with one line on stderr (or 0 where the input is
fine), never a traceback, never a hang.

Most cases run in-process through :func:`trainmon.tools.cli.main`; those that could block forever (named
pipes) run the command in a subprocess under a timeout.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from trainmon.anomaly.events import AnomalyEvent
from trainmon.probe.storage import direction_path, write_direction_file
from trainmon.tools.cli import main

CSV_HEADER = "vpp_stage,name,step,micro_step,norm\n"
GOOD_CSV = CSV_HEADER + "0,fc.weight,0,0,1.5\n0,fc.weight,1,0,2.5\n"
DEEP = 100_000  # nesting levels: far beyond json's and yaml's recursion limits
UNWRITABLE = "/proc/trainmon-cannot-create-this"


# --------------------------------------------------------------------------- run builders
def csv_run(tmp: Path, files: dict[str, str | bytes] | None = None, name: str = "run") -> Path:
    rank = tmp / name / "rank0"
    rank.mkdir(parents=True)
    for file, content in (files or {"grad_reduced.csv": GOOD_CSV}).items():
        data = content.encode() if isinstance(content, str) else content
        (rank / file).write_bytes(data)
    return tmp / name


def event(step: int = 3, **changes: object) -> dict:
    e = AnomalyEvent(step, 0, 0, "forward", "actv", "fc.output", "nans", 4.0, 0.0, "nonfinite", "fc.output nans",
                     1, 0, 0, "2026-11-21T10:00:00.000Z").to_dict()
    e.update(changes)
    return e


def jsonl_run(tmp: Path, content: str | bytes | None = None, name: str = "run") -> Path:
    rank = tmp / name / "rank0"
    rank.mkdir(parents=True)
    if content is None:
        content = json.dumps(event(), separators=(",", ":")) + "\n"
    (rank / "anomalies.jsonl").write_bytes(content.encode() if isinstance(content, str) else content)
    return tmp / name


def probe_file(run: Path, name: str = "w", step: int = 0, n: int = 20) -> Path:
    header = {"name": name, "vpp_stage": 0, "step": step, "shape": [n], "numel": n, "count": n, "sample": None}
    path = direction_path(run / "rank0" / "grad_probe", step, name, 0)
    write_direction_file(path, header, np.packbits(np.arange(n) % 3 > 0, bitorder="little"))
    return path


def crafted(header: object = None, *, raw_header: bytes | None = None, magic: bytes = b"TMGS", version: int = 1,
            length: int | None = None, bits: bytes = b"\x00" * 3) -> bytes:
    """A direction file with a chosen prefix, header and bits."""
    if raw_header is None:
        base = {"name": "w", "vpp_stage": 0, "step": 0, "shape": [20], "numel": 20, "count": 20, "sample": None}
        if isinstance(header, dict):
            base.update(header)
            header = {k: v for k, v in base.items() if v is not ...}
        raw_header = json.dumps(header if header is not None else base).encode()
    size = len(raw_header) if length is None else length
    return struct.pack("<4sB3xI", magic, version, size) + raw_header + bits


def compare_runs(tmp: Path, content: bytes | None = None, kind: str = "file") -> list[str]:
    """Run A has one direction file ``w`` replaced by ``content`` (or a directory); run B is valid."""
    probe_file(tmp / "b")
    path = probe_file(tmp / "a")
    if kind == "dir":
        path.unlink()
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    return ["grad-compare", str(tmp / "a"), str(tmp / "b"), "-o", str(tmp / "out"), "--no-plots"]


def afile(tmp: Path) -> Path:
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def symlink_loop(tmp: Path) -> list[str]:
    run = csv_run(tmp)
    os.symlink("loop.csv", run / "rank0" / "loop.csv")
    return ["csv2tb", str(run)]


def dangling(tmp: Path) -> list[str]:
    run = csv_run(tmp)
    os.symlink(tmp / "nowhere.csv", run / "rank0" / "actv.csv")
    return ["csv2tb", str(run)]


def csv_dir_named_csv(tmp: Path) -> list[str]:
    run = csv_run(tmp)
    (run / "rank0" / "actv.csv").mkdir()
    return ["csv2tb", str(run)]


def empty_rank(tmp: Path, command: str) -> list[str]:
    (tmp / "run" / "rank0").mkdir(parents=True)
    return [command, str(tmp / "run")]


def parent_of_runs(tmp: Path, command: str) -> list[str]:
    if command == "csv2tb":
        csv_run(tmp / "out", name="run_a")
        csv_run(tmp / "out", name="run_b")
    elif command == "analyse":
        jsonl_run(tmp / "out", name="run_a")
        jsonl_run(tmp / "out", name="run_b")
    else:
        probe_file(tmp / "out" / "run_a")
        probe_file(tmp / "out" / "run_b")
        return [command, str(tmp / "out"), str(tmp / "out" / "run_b"), "-o", str(tmp / "cmp")]
    return [command, str(tmp / "out")]


def csv_dir_run(tmp: Path) -> Path:
    run = csv_run(tmp)
    (run / "rank0" / "actv.csv").mkdir()
    return run


def msprobe_run(tmp: Path, rows: str) -> Path:
    """msprobe's output folder with one rank folder and one ``grad_reduced`` file (header and ``rows``)."""
    folder = tmp / "monitor_output" / "Nov24_09-51-00-rank0-1130abab"
    folder.mkdir(parents=True)
    (folder / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,norm\n" + rows)
    return folder.parent


def store_run(tmp: Path, content: bytes | None = None) -> Path:
    """A run whose store holds one part of ``grad_reduced`` (a real one, or ``content``: a corrupt one)."""
    from trainmon.base.records import Row, RowKey, StepRecord
    from trainmon.sinks.parquet import ParquetSink

    sink = ParquetSink(tmp / "run" / "rank0")
    sink.write(StepRecord(0, 0, rows=[Row(RowKey("grad_reduced", "w"), 0, {"norm": 1.0}, False)]))
    sink.close()
    if content is not None:
        (part,) = (tmp / "run" / "store" / "grad_reduced" / "rank=0").glob("*.parquet")
        part.write_bytes(content)
    return tmp / "run"


def analyse_dir_as_jsonl(tmp: Path) -> list[str]:
    (tmp / "run" / "rank0" / "anomalies.jsonl").mkdir(parents=True)
    return ["analyse", str(tmp / "run")]


def analyse_rank_dir(tmp: Path) -> list[str]:
    return ["analyse", str(jsonl_run(tmp) / "rank0")]


def csv_rows(*rows: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["csv2tb", str(csv_run(tmp, {"grad_reduced.csv": CSV_HEADER + "".join(rows)}))]


def csv_file(name: str, content: str | bytes) -> Callable[[Path], list[str]]:
    return lambda tmp: ["csv2tb", str(csv_run(tmp, {name: content}))]


def jsonl(content: str | bytes, *extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["analyse", str(jsonl_run(tmp, content)), *extra]


def analyse_args(*extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["analyse", str(jsonl_run(tmp)), *extra]


def csv2tb_args(*extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["csv2tb", str(csv_run(tmp)), *extra]


def bits(content: bytes) -> Callable[[Path], list[str]]:
    return lambda tmp: compare_runs(tmp, content)


def line(**changes: object) -> str:
    return json.dumps(event(**changes)) + "\n"


OK, BAD, EITHER = {0}, {2}, {0, 2}

# (id, argv builder, allowed exit codes)
CASES: list[tuple[str, Callable[[Path], list[str]], set[int]]] = [
    # ---- the command itself
    ("no-command", lambda tmp: [], BAD),
    ("unknown-command", lambda tmp: ["frobnicate"], BAD),
    ("unknown-option", lambda tmp: ["csv2tb", str(tmp), "--bogus"], BAD),
    ("missing-argument", lambda tmp: ["csv2tb"], BAD),
    # ---- csv2tb: arguments and paths
    ("csv2tb-missing-dir", lambda tmp: ["csv2tb", str(tmp / "missing")], BAD),
    ("csv2tb-run-is-file", lambda tmp: ["csv2tb", str(afile(tmp))], BAD),
    ("csv2tb-empty-dir", lambda tmp: ["csv2tb", str(tmp)], BAD),
    ("csv2tb-rank-without-csv", lambda tmp: empty_rank(tmp, "csv2tb"), BAD),
    ("csv2tb-nul-in-path", lambda tmp: ["csv2tb", str(tmp) + "/a\0b"], BAD),
    ("csv2tb-name-too-long", lambda tmp: ["csv2tb", str(tmp / ("x" * 5000))], BAD),
    ("csv2tb-newline-in-path", lambda tmp: ["csv2tb", str(tmp / "a\nb\x1b[2J")], BAD),
    ("csv-header-with-newline", csv_file("grad_reduced.csv", '"a\nb",c\n1,2\n'), BAD),
    ("csv2tb-workers-0", csv2tb_args("--workers", "0"), BAD),
    ("csv2tb-workers-negative", csv2tb_args("--workers", "-3"), BAD),
    ("csv2tb-workers-text", csv2tb_args("--workers", "two"), BAD),
    ("csv2tb-workers-huge", csv2tb_args("--workers", "99999999999999999999"), EITHER),
    ("csv2tb-unknown-family", csv2tb_args("--families", "bogus"), BAD),
    ("csv2tb-unknown-metric", csv2tb_args("--metrics", "p99"), BAD),
    ("csv2tb-bad-regex", csv2tb_args("--per-tensor", "--tensors", "re:(("), BAD),
    ("csv2tb-empty-pattern", csv2tb_args("--per-tensor", "--tensors", ""), BAD),
    ("csv2tb-tensors-without-per-tensor", csv2tb_args("--tensors", "fc.*"), BAD),
    ("csv2tb-per-tensor-filter", csv2tb_args("--per-tensor", "--tensors", "fc.*", "--metrics", "norm"), OK),
    ("csv2tb-output-under-file", lambda tmp: ["csv2tb", str(csv_run(tmp)), "-o", str(afile(tmp) / "tb")], BAD),
    ("csv2tb-output-is-file", lambda tmp: ["csv2tb", str(csv_run(tmp)), "-o", str(afile(tmp))], BAD),
    ("csv2tb-output-unwritable", csv2tb_args("-o", UNWRITABLE), BAD),
    ("csv2tb-output-nul", csv2tb_args("-o", "out\0put"), BAD),
    ("analyse-output-nul", analyse_args("-o", "out\0put"), BAD),
    ("csv2tb-parent-of-runs", lambda tmp: parent_of_runs(tmp, "csv2tb"), OK),
    ("csv2tb-parent-of-empty-runs", lambda tmp: (empty_rank(tmp / "p", "csv2tb"), ["csv2tb", str(tmp / "p")])[1],
     BAD),
    # ---- csv2tb: file contents
    ("csv-empty-file", csv_file("grad_reduced.csv", b""), OK),
    ("csv-header-only", csv_file("grad_reduced.csv", CSV_HEADER), OK),
    ("csv-binary-garbage", csv_file("grad_reduced.csv", bytes(range(256)) * 8), BAD),
    ("csv-nul-byte", csv_file("grad_reduced.csv", CSV_HEADER + "0,w,\x001,0,2\n"), BAD),
    ("csv-not-utf8", csv_file("grad_reduced.csv", (CSV_HEADER + "0,poids\xe9,1,0,2\n").encode("latin-1")), BAD),
    ("csv-utf16", csv_file("grad_reduced.csv", GOOD_CSV.encode("utf-16")), BAD),
    ("csv-wrong-header", csv_file("grad_reduced.csv", "a,b,c\n1,2,3\n"), BAD),
    ("csv-short-row", csv_rows("0,w,1\n"), BAD),
    ("csv-long-row", csv_rows("0,w,1,0,2,3\n"), BAD),
    ("csv-value-text", csv_rows("0,w,1,0,abc\n"), BAD),
    ("csv-step-text", csv_rows("0,w,one,0,2\n"), BAD),
    ("csv-step-float", csv_rows("0,w,1.5,0,2\n"), BAD),
    ("csv-step-beyond-int64", csv_rows("0,w,99999999999999999999999,0,2\n"), BAD),
    ("csv-step-negative", csv_rows("0,w,-1,0,2\n"), BAD),
    ("csv-step-huge-digits", csv_rows("0,w," + "9" * 5000 + ",0,2\n"), BAD),
    ("csv-value-overflow", csv_rows("0,w,1,0,1e999\n"), OK),
    ("csv-value-nan", csv_rows("0,w,1,0,nan\n"), OK),
    ("csv-huge-field", csv_rows("0," + "w" * 200_000 + ",1,0,2\n"), BAD),
    ("csv-unterminated-quote", csv_rows('0,"w,1,0,2\n'), EITHER),
    ("csv-scalars-bad-header", csv_file("scalars.csv", "step,value\n1,2\n"), BAD),
    ("csv-scalars-bad-value", csv_file("scalars.csv", "step,name,value\n1,loss,high\n"), BAD),
    ("csv-scalars-step-beyond-int64", csv_file("scalars.csv", "step,name,value\n18446744073709551616,loss,1\n"),
     BAD),
    ("csv-directory-named-csv", csv_dir_named_csv, BAD),
    ("csv-symlink-loop", symlink_loop, BAD),
    ("csv-dangling-symlink", dangling, BAD),
    # ---- analyse: arguments and paths
    ("analyse-missing-dir", lambda tmp: ["analyse", str(tmp / "missing")], BAD),
    ("analyse-run-is-file", lambda tmp: ["analyse", str(afile(tmp))], BAD),
    ("analyse-empty-dir", lambda tmp: ["analyse", str(tmp)], BAD),
    ("analyse-nul-in-path", lambda tmp: ["analyse", str(tmp) + "/a\0b"], BAD),
    ("analyse-rank-without-anomalies", lambda tmp: empty_rank(tmp, "analyse"), OK),
    ("analyse-rank-dir", analyse_rank_dir, OK),
    ("analyse-parent-of-runs", lambda tmp: parent_of_runs(tmp, "analyse"), BAD),
    ("analyse-top-0", analyse_args("--top", "0"), BAD),
    ("analyse-top-text", analyse_args("--top", "ten"), BAD),
    ("analyse-top-huge", analyse_args("--top", "99999999999999999999"), OK),
    ("analyse-steps-empty", analyse_args("--steps", ""), BAD),
    ("analyse-steps-text", analyse_args("--steps", "a"), BAD),
    ("analyse-steps-descending", analyse_args("--steps", "5-3"), BAD),
    ("analyse-steps-double-comma", analyse_args("--steps", "1,,2"), BAD),
    ("analyse-steps-negative", analyse_args("--steps", "-1"), BAD),
    ("analyse-steps-huge-range", analyse_args("--steps", "0-99999999999999"), OK),
    ("analyse-steps-many-huge-ranges", analyse_args("--steps", ",".join(["0-99999999999999"] * 1000)), OK),
    ("analyse-steps-beyond-int64", analyse_args("--steps", "99999999999999999999999"), OK),
    ("analyse-steps-range-beyond-int64", analyse_args("--steps", "3-99999999999999999999999"), OK),
    ("analyse-steps-huge-digits", analyse_args("--steps", "9" * 5000), OK),
    ("analyse-output-under-file", lambda tmp: ["analyse", str(jsonl_run(tmp)), "-o", str(afile(tmp) / "o")], BAD),
    ("analyse-output-dir-named-json",
     lambda tmp: (tmp.joinpath("o.json").mkdir(), ["analyse", str(jsonl_run(tmp)), "-o", str(tmp / "o.json")])[1],
     BAD),
    ("analyse-output-unwritable", analyse_args("-o", UNWRITABLE), BAD),
    # ---- analyse: file contents (corrupt lines are reported and skipped: exit 0)
    ("jsonl-empty", jsonl(b""), OK),
    ("jsonl-binary-garbage", jsonl(bytes(range(256)) * 8), OK),
    ("jsonl-not-utf8", jsonl(line(name="poids\u00e9").encode("latin-1")), OK),
    ("jsonl-deep-array", jsonl("[" * DEEP + "\n"), OK),
    ("jsonl-deep-object", jsonl('{"a":' * DEEP + "\n"), OK),
    ("jsonl-deep-in-field", jsonl(line().replace('"message":"fc.output nans"', '"message":' + "[" * DEEP)), OK),
    ("jsonl-step-beyond-int64", jsonl(line(step=2**64)), OK),
    ("jsonl-all-ints-beyond-int64", jsonl(line(step=2**70, rank=2**70, order=2**70, micro_step=2**70)), OK),
    ("jsonl-step-negative", jsonl(line(step=-1)), OK),
    ("jsonl-step-float", jsonl(line(step=1.0)), OK),
    ("jsonl-value-overflow", jsonl(line().replace('"value":4.0', '"value":1e999')), OK),
    ("jsonl-value-nan-literal", jsonl(line().replace('"value":4.0', '"value":NaN')), OK),
    ("jsonl-not-an-object", jsonl("[1, 2, 3]\n42\nnull\n"), OK),
    ("jsonl-unknown-phase", jsonl(line(phase="sideways")), OK),
    ("jsonl-huge-digits", jsonl(line().replace('"step":3', '"step":' + "9" * 5000)), OK),
    ("jsonl-is-directory", analyse_dir_as_jsonl, EITHER),
    ("jsonl-escape-sequences", jsonl(line(name="x\x1b[2J\ny", message="m\x1b]0;title\x07")), OK),
    ("jsonl-valid-with-huge-steps", jsonl(line() + line(step=5), "--steps", "4-99999999999999999"), OK),
    # ---- grad-compare: arguments and paths
    ("compare-no-output", lambda tmp: ["grad-compare", str(tmp), str(tmp)], BAD),
    ("compare-run-a-missing", lambda tmp: ["grad-compare", str(tmp / "x"), str(tmp), "-o", str(tmp / "o")], BAD),
    ("compare-run-b-missing",
     lambda tmp: ["grad-compare", str(probe_file(tmp / "a").parents[3]), str(tmp / "x"), "-o", str(tmp / "o")],
     BAD),
    ("compare-run-is-file", lambda tmp: ["grad-compare", str(afile(tmp)), str(tmp), "-o", str(tmp / "o")], BAD),
    ("compare-empty-dirs", lambda tmp: ["grad-compare", str(tmp), str(tmp), "-o", str(tmp / "o")], BAD),
    ("compare-nul-in-path", lambda tmp: ["grad-compare", str(tmp) + "/a\0b", str(tmp), "-o", str(tmp / "o")], BAD),
    ("compare-parent-of-runs", lambda tmp: parent_of_runs(tmp, "grad-compare"), BAD),
    ("compare-output-under-file",
     lambda tmp: [*compare_runs(tmp)[:3], "-o", str(afile(tmp) / "o"), "--no-plots"], BAD),
    ("compare-output-is-file", lambda tmp: [*compare_runs(tmp)[:3], "-o", str(afile(tmp)), "--no-plots"], BAD),
    ("compare-output-unwritable", lambda tmp: [*compare_runs(tmp)[:3], "-o", UNWRITABLE, "--no-plots"], BAD),
    ("compare-same-run", lambda tmp: [*compare_runs(tmp)[:2], str(tmp / "a"), "-o", str(tmp / "o"), "--no-plots"],
     OK),
    # ---- grad-compare: crafted direction files (run A's only file is bad: nothing to compare)
    ("bits-empty-file", bits(b""), BAD),
    ("bits-truncated-prefix", bits(b"TMGS\x01"), BAD),
    ("bits-wrong-magic", bits(crafted(magic=b"XXXX")), BAD),
    ("bits-wrong-version", bits(crafted(version=99)), BAD),
    ("bits-binary-garbage", bits(bytes(range(256)) * 4), BAD),
    ("bits-header-length-huge", bits(crafted(length=0xFFFFFFFF)), BAD),
    ("bits-header-length-beyond-file", bits(crafted(length=4000)), BAD),
    ("bits-header-length-zero", bits(crafted(length=0)), BAD),
    ("bits-header-not-json", bits(crafted(raw_header=b"{not json")), BAD),
    ("bits-header-not-utf8", bits(crafted(raw_header=b'{"name":"\xff"}')), BAD),
    ("bits-header-list", bits(crafted([1, 2, 3])), BAD),
    ("bits-header-deep", bits(crafted(raw_header=b"[" * DEEP)), BAD),
    ("bits-header-missing-keys", bits(crafted({"count": ..., "shape": ...})), BAD),
    ("bits-count-negative", bits(crafted({"count": -8})), BAD),
    ("bits-count-huge", bits(crafted({"count": 10**30})), BAD),
    ("bits-count-text", bits(crafted({"count": "20"})), BAD),
    ("bits-count-float", bits(crafted({"count": 20.5})), BAD),
    ("bits-shape-int", bits(crafted({"shape": 5})), BAD),
    ("bits-shape-huge", bits(crafted({"shape": [10**30, 10**30]})), BAD),
    ("bits-shape-negative", bits(crafted({"shape": [-20]})), BAD),
    ("bits-shape-nested", bits(crafted({"shape": [[1], {"a": 2}]})), BAD),
    ("bits-step-beyond-int64", bits(crafted({"step": 2**64})), BAD),
    ("bits-step-negative", bits(crafted({"step": -1})), BAD),
    ("bits-step-text", bits(crafted({"step": "0"})), BAD),
    ("bits-vpp-text", bits(crafted({"vpp_stage": "zero"})), BAD),
    ("bits-name-list", bits(crafted({"name": ["w"]})), BAD),
    ("bits-name-escape-sequence", lambda tmp: [*compare_runs(tmp, crafted({"name": "w\x1b[2J"}))[:4],
                                               str(tmp / "out"), "--no-plots"], BAD),
    ("jsonl-field-escape-sequence", jsonl(line(step="\x1b[2J")), OK),
    ("bits-sample-unhashable", bits(crafted({"sample": {"a": [1, {"b": 2}]}})), BAD),
    ("bits-bits-truncated", bits(crafted(bits=b"\x00")), BAD),
    ("bits-bits-too-long", bits(crafted(bits=b"\x00" * 300)), BAD),
    ("bits-is-directory", lambda tmp: compare_runs(tmp, kind="dir"), BAD),
    # ---- query: runs, stores and SQL
    ("query-ok", lambda tmp: ["query", str(store_run(tmp)), "SELECT * FROM grad_reduced"], OK),
    ("query-missing-run", lambda tmp: ["query", str(tmp / "x"), "SELECT 1"], BAD),
    ("query-run-is-file", lambda tmp: ["query", str(afile(tmp)), "SELECT 1"], BAD),
    ("query-no-store", lambda tmp: ["query", str(tmp), "SELECT 1"], BAD),
    ("query-no-sql", lambda tmp: ["query", str(store_run(tmp))], BAD),
    ("query-unknown-table", lambda tmp: ["query", str(store_run(tmp)), "SELECT * FROM actv"], BAD),
    ("query-syntax", lambda tmp: ["query", str(store_run(tmp)), "SELEC 1"], BAD),
    ("query-writes", lambda tmp: ["query", str(store_run(tmp)), f"COPY grad_reduced TO '{tmp}/x.csv'"], BAD),
    ("query-two-statements", lambda tmp: ["query", str(store_run(tmp)), "SELECT 1; SELECT 2"], BAD),
    ("query-corrupt-part", lambda tmp: ["query", str(store_run(tmp, b"PAR1 not parquet")), "FROM grad_reduced"], BAD),
    ("query-empty-part", lambda tmp: ["query", str(store_run(tmp, b"")), "SELECT count(*) FROM grad_reduced"], BAD),
    ("query-nul-in-path", lambda tmp: ["query", str(tmp) + "/a\0b", "SELECT 1"], BAD),
    ("query-bad-format", lambda tmp: ["query", str(store_run(tmp)), "SELECT 1", "--format", "xml"], BAD),
    # ---- analyse on a store: SQL
    ("analyse-store-ok", lambda tmp: ["analyse", str(store_run(tmp))], OK),
    ("analyse-store-corrupt-part", lambda tmp: ["analyse", str(store_run(tmp, b"PAR1 not parquet"))], BAD),
    ("analyse-store-empty-part", lambda tmp: ["analyse", str(store_run(tmp, b""))], BAD),
    ("analyse-store-unknown-detector", lambda tmp: ["analyse", str(store_run(tmp)), "--detector", "bogus"], BAD),
    # ---- convert: runs, files, an existing store
    ("convert-ok", lambda tmp: ["convert", str(csv_run(tmp))], OK),
    ("convert-missing-run", lambda tmp: ["convert", str(tmp / "x")], BAD),
    ("convert-run-is-file", lambda tmp: ["convert", str(afile(tmp))], BAD),
    ("convert-empty-dir", lambda tmp: ["convert", str(tmp)], BAD),
    ("convert-parent-of-runs", lambda tmp: ["convert", str(csv_run(tmp).parent)], BAD),
    ("convert-rank-folder", lambda tmp: ["convert", str(csv_run(tmp) / "rank0")], BAD),
    ("convert-store-exists", lambda tmp: ["convert", str(store_run(tmp))], BAD),
    ("convert-bad-header", lambda tmp: ["convert", str(csv_run(tmp, {"actv.csv": "a,b\n1,2\n"}))], BAD),
    ("convert-short-row", lambda tmp: ["convert", str(csv_run(tmp, {"actv.csv": CSV_HEADER + "0,x,1\n"}))], BAD),
    ("convert-bad-value", lambda tmp: ["convert", str(csv_run(tmp, {"actv.csv": CSV_HEADER + "0,x,1,0,one\n"}))],
     BAD),
    ("convert-not-utf8", lambda tmp: ["convert", str(csv_run(tmp, {"actv.csv": b"\xff\xfe" + b"x" * 10}))], BAD),
    ("convert-csv-is-dir", lambda tmp: ["convert", str(csv_dir_run(tmp))], BAD),
    ("convert-nul-in-path", lambda tmp: ["convert", str(tmp) + "/a\0b"], BAD),
    ("convert-msprobe-bad-step", lambda tmp: ["convert", str(msprobe_run(tmp, "0,w,x,1.0\n"))], BAD),
    ("convert-msprobe-bad-value", lambda tmp: ["convert", str(msprobe_run(tmp, "0,w,1,one\n"))], BAD),
    # ---- report and serve on a store
    ("report-store-ok", lambda tmp: ["report", str(store_run(tmp)), "-o", str(tmp / "r.html")], OK),
    ("report-store-corrupt-part", lambda tmp: ["report", str(store_run(tmp, b"PAR1 not parquet"))], BAD),
    ("report-store-empty-part", lambda tmp: ["report", str(store_run(tmp, b""))], BAD),
    ("report-store-unknown-rank", lambda tmp: ["report", str(store_run(tmp)), "--ranks", "3"], BAD),
    ("report-store-unknown-family", lambda tmp: ["report", str(store_run(tmp)), "--families", "actv"], BAD),
    ("report-store-unknown-metric", lambda tmp: ["report", str(store_run(tmp)), "--metrics", "mean"], BAD),
    ("report-store-bad-max-size", lambda tmp: ["report", str(store_run(tmp)), "--max-size", "0"], BAD),
    ("serve-missing-run", lambda tmp: ["serve", str(tmp / "x")], BAD),
    ("serve-run-is-file", lambda tmp: ["serve", str(afile(tmp))], BAD),
    ("serve-nul-in-path", lambda tmp: ["serve", str(tmp) + "/a\0b"], BAD),
    ("serve-bad-port", lambda tmp: ["serve", str(store_run(tmp)), "--port", "-1"], BAD),
    ("serve-corrupt-part", lambda tmp: ["serve", str(store_run(tmp, b"PAR1 not parquet"))], BAD),
    ("serve-cannot-listen", lambda tmp: ["serve", str(store_run(tmp)), "--host", "256.1.1.1", "--port", "0"], BAD),
    ("serve-parent-of-runs", lambda tmp: parent_of_runs(tmp, "serve"), BAD),
]


def _run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err, "escape sequences from the input reached the terminal"
    return code, captured.err


def _check(code: int, err: str, allowed: set[int]) -> None:
    assert "Traceback" not in err, err
    assert code in allowed, f"exit {code}, stderr: {err}"
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
        assert lines[0].startswith("trainmon"), lines[0]


@pytest.mark.parametrize(("builder", "allowed"), [(b, a) for _, b, a in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_exit_code(tmp_path, capsys, builder, allowed):
    argv = builder(tmp_path)
    capsys.readouterr()
    code, err = _run_in_process(argv, capsys)
    _check(code, err, allowed)


def test_enough_cases():
    assert len(CASES) >= 70


def test_parent_folder_lists_its_runs(tmp_path, capsys):
    _run_in_process(parent_of_runs(tmp_path, "analyse"), capsys)
    argv = parent_of_runs(tmp_path / "again", "analyse")
    code, err = _run_in_process(argv, capsys)
    assert code == 2 and "run_a" in err and "run_b" in err and "pass one" in err, err


def test_csv2tb_converts_every_run_of_a_parent_folder(tmp_path, capsys):
    argv = parent_of_runs(tmp_path, "csv2tb")
    assert main(argv) == 0
    for run in ("run_a", "run_b"):
        assert list((tmp_path / "out" / run / "tensorboard" / "rank0").glob("events.out.tfevents.*"))
    assert main([*argv, "-o", str(tmp_path / "tb")]) == 0
    for run in ("run_a", "run_b"):
        assert list((tmp_path / "tb" / run / "rank0").glob("events.out.tfevents.*"))


# --------------------------------------------------------------------------- named pipes: could hang
def _fifo_cases(tmp: Path) -> list[tuple[str, list[str]]]:
    run = csv_run(tmp / "c")
    os.mkfifo(run / "rank0" / "actv.csv")
    os.mkfifo(tmp / "fifo_run")
    arun = jsonl_run(tmp / "j")
    (arun / "rank0" / "anomalies.jsonl").unlink()
    os.mkfifo(arun / "rank0" / "anomalies.jsonl")
    compare_runs(tmp / "g")
    bits_path = direction_path(tmp / "g" / "a" / "rank0" / "grad_probe", 0, "w", 0)
    bits_path.unlink()
    os.mkfifo(bits_path)
    convert_run = csv_run(tmp / "v")
    os.mkfifo(convert_run / "rank0" / "actv.csv")
    return [("csv2tb-fifo-csv", ["csv2tb", str(run)]),
            ("convert-fifo-csv", ["convert", str(convert_run)]),
            ("csv2tb-fifo-run", ["csv2tb", str(tmp / "fifo_run")]),
            ("analyse-fifo-jsonl", ["analyse", str(arun)]),
            ("compare-fifo-bits", ["grad-compare", str(tmp / "g" / "a"), str(tmp / "g" / "b"), "-o",
                                   str(tmp / "g" / "out"), "--no-plots"])]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_named_pipes_do_not_hang(tmp_path):
    """One subprocess runs every FIFO case (a hang would block it; the timeout turns that into a failure)."""
    cases = _fifo_cases(tmp_path)
    script = ("import sys, json\nfrom trainmon.tools.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
              "    try:\n        code = main(argv)\n    except SystemExit as exc:\n        code = exc.code\n"
              "    print(f'exit={code}', flush=True)\n    print('---', file=sys.stderr, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps([argv for _, argv in cases])],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    codes = re.findall(r"^exit=(\d+)$", proc.stdout, re.M)
    errors = proc.stderr.split("---\n")
    assert len(codes) == len(cases), (proc.stdout, proc.stderr)
    for (name, _), code, err in zip(cases, codes, errors):
        allowed = EITHER if name == "analyse-fifo-jsonl" else BAD
        _check(int(code), err, allowed)
        if name != "csv2tb-fifo-run":
            assert "named pipe" in err, err
