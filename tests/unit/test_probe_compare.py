"""`trainmon grad-compare` on hand-written direction files (framework-free)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from trainmon.probe.storage import direction_path, read_direction_header, write_direction_file
from trainmon.tools.cli import main as cli_main
from trainmon.tools.grad_compare import compare, scan_run


def _write(run: Path, rank: int, step: int, name: str, signs: np.ndarray, vpp_stage: int = 0) -> None:
    header = {"name": name, "vpp_stage": vpp_stage, "step": step, "shape": list(signs.shape),
              "numel": int(signs.size), "count": int(signs.size), "sample": None}
    path = direction_path(run / f"rank{rank}" / "grad_probe", step, name, vpp_stage)
    write_direction_file(path, header, np.packbits(signs.ravel() > 0, bitorder="little"))


def test_similarities_summaries_and_reported_mismatches(tmp_path, capsys):
    rng = np.random.default_rng(0)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    expected = {}
    for step in (0, 1):
        for name, n in (("w", 37), ("v", 200)):
            ga, gb = rng.standard_normal(n), rng.standard_normal(n)
            gb[: n // 2] = ga[: n // 2]
            _write(a_dir, 0, step, name, ga)
            _write(b_dir, 0, step, name, gb)
            expected[(step, name)] = (np.mean((ga > 0) == (gb > 0)), n)
    _write(a_dir, 0, 2, "w", rng.standard_normal(37))  # step 2 only in A
    _write(a_dir, 1, 0, "w", rng.standard_normal(37))  # rank 1 only in A
    _write(a_dir, 0, 1, "shape", rng.standard_normal((4, 3)))
    _write(b_dir, 0, 1, "shape", rng.standard_normal((3, 4)))  # same numel, other shape: not compared
    _write(b_dir, 0, 0, "only_b", rng.standard_normal(5))
    _write(a_dir, 0, 0, "w", rng.standard_normal(37), vpp_stage=1)  # a chunk only in A
    assert read_direction_header(direction_path(a_dir / "rank0/grad_probe", 0, "w", 0)).path.stat().st_size > 5

    out = tmp_path / "out"
    assert cli_main(["grad-compare", str(a_dir), str(b_dir), "-o", str(out), "--no-plots"]) == 0
    df = pd.read_csv(out / "similarities.csv", keep_default_na=False)
    params = df[df["kind"] == "param"]
    assert len(params) == 4
    for _, row in params.iterrows():
        want, n = expected[(row["step"], row["name"])]
        assert row["similarity"] == want and row["count"] == n
    for step in (0, 1):
        sims = np.array([expected[(step, name)][0] for name in ("w", "v")])
        counts = np.array([expected[(step, name)][1] for name in ("w", "v")])
        rows = df[df["step"] == step].set_index("kind")
        assert np.isclose(rows.loc["element_weighted", "similarity"], (sims * counts).sum() / counts.sum())
        assert np.isclose(rows.loc["param_averaged", "similarity"], sims.mean())
    problems = (out / "problems.txt").read_text().splitlines()
    assert "rank 1 only in run A" in problems
    assert "rank 0: step 2 only in run A" in problems
    assert "rank 0 step 0: parameter only_b only in run B" in problems
    assert "rank 0 step 0: parameter w (vpp 1) only in run A" in problems
    assert any(p.startswith("rank 0 step 1: parameter shape differs in layout") for p in problems)
    assert "warning: rank 1 only in run A" in capsys.readouterr().err
    self_cmp = compare(scan_run(a_dir), scan_run(a_dir))
    assert not self_cmp.problems and all(r["similarity"] == 1.0 for r in self_cmp.rows)


def test_bad_usage_exits_2_with_one_line(tmp_path, capsys):
    _write(tmp_path / "a", 0, 0, "w", np.ones(3))
    _write(tmp_path / "b", 1, 0, "w", np.ones(3))
    (tmp_path / "empty").mkdir()
    cases = [[str(tmp_path / "missing"), str(tmp_path / "a")], [str(tmp_path / "a"), str(tmp_path / "empty")],
             [str(tmp_path / "a"), str(tmp_path / "b")]]
    for case in cases:
        capsys.readouterr()
        assert cli_main(["grad-compare", *case, "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("trainmon grad-compare: error:") and "\n" not in err, err


def test_python_dash_m_reports_usage_errors_in_one_line(tmp_path):
    """``python -m trainmon`` and ``python -m trainmon.tools.cli`` run the same command (one UsageError class)."""
    for module in ("trainmon", "trainmon.tools.cli"):
        proc = subprocess.run([sys.executable, "-m", module, "grad-compare", str(tmp_path / "missing"),
                               str(tmp_path), "-o", str(tmp_path / "out")], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().startswith("trainmon grad-compare: error:"), proc.stderr
        assert "Traceback" not in proc.stderr


def test_truncated_and_corrupt_files_are_reported_and_skipped(tmp_path, capsys):
    rng = np.random.default_rng(1)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    signs = {}
    for step in (0, 1):
        for name in ("w", "v"):
            signs[(step, name)] = rng.standard_normal(40), rng.standard_normal(40)
            _write(a_dir, 0, step, name, signs[(step, name)][0])
            _write(b_dir, 0, step, name, signs[(step, name)][1])
    truncated = direction_path(a_dir / "rank0/grad_probe", 1, "v", 0)
    truncated.write_bytes(truncated.read_bytes()[:-2])           # bits cut short: fails when compared
    corrupt = direction_path(b_dir / "rank0/grad_probe", 0, "w", 0)
    blob = bytearray(corrupt.read_bytes())
    blob[14:20] = b"\xff\x00{{{{"                                 # header no longer JSON: fails when scanned
    corrupt.write_bytes(bytes(blob))

    out = tmp_path / "out"
    capsys.readouterr()
    assert cli_main(["grad-compare", str(a_dir), str(b_dir), "-o", str(out), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(corrupt) in err and str(truncated) in err
    params = pd.read_csv(out / "similarities.csv")
    params = params[params["kind"] == "param"]
    assert sorted(zip(params["step"], params["name"])) == [(0, "v"), (1, "w")]
    for _, row in params.iterrows():
        ga, gb = signs[(row["step"], row["name"])]
        assert row["similarity"] == np.mean((ga > 0) == (gb > 0))
    problems = (out / "problems.txt").read_text()
    assert f"unreadable direction file, skipped: {corrupt}: broken header" in problems
    assert f"rank 0 step 1: parameter v not compared: {truncated}: 3 bytes of bits, header says 5" in problems
    assert "rank 0 step 0: parameter w only in run A" in problems

    # Nothing readable at all: exit 2 with one line, still no traceback.
    only_bad = tmp_path / "bad"
    _write(only_bad, 0, 0, "w", np.ones(3))
    direction_path(only_bad / "rank0/grad_probe", 0, "w", 0).write_bytes(b"TMGS\x01")
    assert cli_main(["grad-compare", str(a_dir), str(only_bad), "-o", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainmon grad-compare: error:") and "\n" not in err and "unreadable" in err


def test_unsafe_parameter_names_stay_in_the_step_directory(tmp_path):
    run = tmp_path / "run"
    names = ["../../esc", "w/x", "w_x", "plain.weight"]
    for name in names:
        _write(run, 0, 3, name, np.arange(-3.0, 5.0))
    step_dir = run / "rank0" / "grad_probe" / "step3"
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert all(p.parent == step_dir and p.suffix == ".bits" for p in files), files  # no escape, no subfolder, no tmp
    assert len(files) == len(names)
    assert sorted(read_direction_header(p).header["name"] for p in files) == sorted(names)
    assert direction_path(step_dir.parent, 3, "plain.weight", 0).name == "plain.weight.bits"  # safe names unchanged
    result = compare(scan_run(run), scan_run(run))
    params = [r for r in result.rows if r["kind"] == "param"]
    assert sorted(r["name"] for r in params) == sorted(names) and not result.problems
    assert all(r["similarity"] == 1.0 for r in params)
