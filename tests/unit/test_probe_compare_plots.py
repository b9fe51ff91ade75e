"""grad-compare's PNG plots: at most 10 labelled lines, the rest aggregated, axes labelled; the CLI
lists every file it wrote."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_probe_compare import _write
from trainmon.tools.cli import main as cli_main

pytest.importorskip("matplotlib", reason="the plots need matplotlib (the 'plots' extra)")


def _runs(tmp_path, n_params=25, steps=(0, 1, 2)):
    """Two runs whose parameter p{i} agrees on a fraction i / n_params of its signs at every step."""
    rng = np.random.default_rng(1)
    expected = {}
    for step in steps:
        for i in range(n_params):
            ga = rng.standard_normal(100)
            gb = -ga
            gb[: 4 * i] = ga[: 4 * i]  # 4i of 100 equal signs
            _write(tmp_path / "a", 0, step, f"p{i:02d}", ga)
            _write(tmp_path / "b", 0, step, f"p{i:02d}", gb)
            expected[(step, f"p{i:02d}")] = np.mean((ga > 0) == (gb > 0))
    return expected


def test_lines_plot_labels_the_ten_lowest_and_aggregates_the_rest(tmp_path):
    from trainmon.tools.grad_compare import compare, heatmap_figure, lines_figure, scan_run

    expected = _runs(tmp_path)
    rows = [r for r in compare(scan_run(tmp_path / "a"), scan_run(tmp_path / "b")).rows if r["kind"] == "param"]
    fig = lines_figure(rows, 0)
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    lowest = sorted(expected.items(), key=lambda kv: kv[1])
    ten = sorted({name for (_, name), _ in lowest})[:10]  # equal at every step: p00..p09 agree least
    assert legend == ["other 15 parameters: min-max", "other 15 parameters: median", *ten,
                      "all parameters: element-weighted"]
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "fraction of equal gradient signs"
    lines = {line.get_label(): line for line in ax.get_lines()}
    np.testing.assert_allclose(lines["p03"].get_ydata(), [expected[(s, "p03")] for s in (0, 1, 2)])
    others = [expected[(0, f"p{i:02d}")] for i in range(10, 25)]
    assert lines["other 15 parameters: median"].get_ydata()[0] == pytest.approx(np.median(others))
    weighted = np.mean([expected[(0, f"p{i:02d}")] for i in range(25)])  # equal counts: the plain mean
    assert lines["all parameters: element-weighted"].get_ydata()[0] == pytest.approx(weighted)
    heat = heatmap_figure(rows, 0)
    assert heat.axes[0].get_ylabel() == "parameter" and heat.axes[1].get_ylabel() == "fraction of equal gradient signs"


def test_few_parameters_all_labelled_and_cli_lists_written_files(tmp_path, capsys):
    _runs(tmp_path, n_params=3, steps=(0, 1))
    out = tmp_path / "out"
    assert cli_main(["grad-compare", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    names = ["similarities.csv", "similarity_lines_rank0.png", "similarity_heatmap_rank0.png"]
    assert printed[0] == f"compared 6 parameter-steps; wrote 3 files to {out}:"
    assert printed[1:] == [f"  {out / name}" for name in names]
    for name in names[1:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
