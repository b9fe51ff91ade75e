"""The report's heatmap views on a run store at a 7B shape (the 291 parameter names of LlamaForCausalLM with 32
layers, written with pyarrow by ``benchmarks/synthetic_store.py``): rows grouped by layer and block, the three
views' envelopes against the stored values (read back with pyarrow), the change mode showing a one-layer spike that
the value scale hides, the page's size budget and bad filters."""

from __future__ import annotations

import base64
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from benchmarks.synthetic_store import Spike, llama_names, write_store
from trainmon.tools.cli import main
from trainmon.tools.report import data as report_data
from trainmon.tools.report.colours import largest_change, running_median
from trainmon.tools.report.grids import module_grids, rank_grids, step_grids
from trainmon.tools.report.rows import order_rows, parse_name
from trainmon.tools.report.source import open_source

NAMES = llama_names(32)
SPIKE_STEP, SPIKE_LAYER = 65, 12
RANKS, STEPS = 4, 200


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """4 ranks x 200 steps of ``grad_reduced`` and ``exp_avg`` (norm, max, nans); rank 0's layer 12 jumps x8 in
    ``grad_reduced`` at step 65 (with spike events)."""
    run_dir = tmp_path_factory.mktemp("views") / "run"
    write_store(run_dir, NAMES, ranks=RANKS, steps=STEPS, families=("grad_reduced", "exp_avg"), steps_per_part=64,
                spikes=[Spike(SPIKE_STEP, rf"layers\.{SPIKE_LAYER}\.", 8.0, rank=0, family="grad_reduced")])
    return run_dir


def _stored(run_dir: Path, family: str) -> dict[tuple[int, str, int], float]:
    """``(rank, name, step) -> norm`` read from the Parquet parts with pyarrow (not through the report)."""
    out = {}
    for part in sorted((run_dir / "store" / family).glob("rank=*/*.parquet")):
        rank = int(part.parent.name[5:])
        table = pq.read_table(part, columns=["name", "step", "norm"]).to_pydict()
        for name, step, value in zip(table["name"], table["step"], table["norm"]):
            out[(rank, name, step)] = value
    return out


def _page(path: Path) -> dict:
    return json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>',
                                path.read_text(), re.S).group(1))


def _codes(grid: dict, mode: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(grid[mode]["data"]), np.uint8).reshape(grid["shape"])


def test_llama_names_are_those_of_the_real_model():
    pytest.importorskip("transformers", reason="transformers builds LlamaForCausalLM on the meta device")
    from benchmarks.sizing import MODELS

    assert [name for name, _ in MODELS["7B shape"]().named_parameters()] == NAMES


def test_rows_are_grouped_by_layer_and_block_in_forward_order():
    forward = order_rows([(0, name) for name in NAMES], range(len(NAMES)))
    backward = order_rows([(0, name) for name in NAMES], range(len(NAMES), 0, -1))  # lm_head runs first
    shuffled = np.random.default_rng(0).permutation(len(NAMES))
    scrambled = order_rows([(0, NAMES[i]) for i in shuffled], [float(i) for i in shuffled])
    assert forward == backward == scrambled
    assert [name for _, name in forward.keys] == NAMES  # embeddings, layers 0..31, norm, head
    assert forward.groups == ("model.embed_tokens.weight", *[f"model.layers.{i}" for i in range(32)],
                              "model.norm.weight", "lm_head.weight")
    layer = [i for i, (_, name) in enumerate(forward.keys) if name.startswith("model.layers.12.")]
    assert [forward.blocks[i] for i in layer] == ["self_attn"] * 4 + ["mlp"] * 3 + [
        "input_layernorm", "post_attention_layernorm"]
    assert [forward.kinds[i] for i in layer] == [0] * 4 + [1] * 3 + [2] * 2  # attention, mlp, norm
    assert parse_name("decoder.layers.3.self_attention.linear_qkv.weight").stack == "decoder.layers"
    assert parse_name("transformer.h.5.attn.c_attn.weight").layer == 5
    stages = order_rows([(1, "layers.0.w"), (0, "layers.1.w"), (0, "layers.0.w")], [0, 1, 2])
    assert stages.keys == ((0, "layers.0.w"), (0, "layers.1.w"), (1, "layers.0.w"))
    assert stages.to_json()["names"][-1] == "layers.0.w (vpp 1)"


def test_running_median_against_statistics():
    rng = np.random.default_rng(1)
    values = rng.lognormal(size=(5, 60))
    values[rng.random(values.shape) < 0.2] = np.nan
    got = running_median(values, window=7)
    for r in range(5):
        for c in range(60):
            previous = [v for v in values[r, max(0, c - 7):c] if not math.isnan(v)]
            want = statistics.median(previous) if previous else math.nan
            assert (math.isnan(want) and math.isnan(got[r, c])) or got[r, c] == pytest.approx(want)


def test_views_hold_the_envelope_of_the_stored_values(run):
    stored = _stored(run, "grad_reduced")
    source = open_source(run, report_data.sources(run))
    try:
        (steps,) = step_grids(source, "grad_reduced", ["norm"], [2], 0, STEPS - 1, columns=40)
        ranks = rank_grids(source, "grad_reduced", ["norm"], [SPIKE_STEP, 199])
        (module,) = module_grids(source, "grad_reduced", ["norm"], [(0, NAMES[100])], 10, 129, columns=30)
    finally:
        source.close()
    width = steps.cols.width
    assert width == 5 and steps.cols.starts == list(range(0, STEPS, 5)) and len(steps.row_keys) == 291
    for r, (_, name) in enumerate(steps.row_keys):
        for c, start in enumerate(steps.cols.starts):
            cell = [stored[(2, name, s)] for s in range(start, start + width)]
            assert steps.high[r, c] == max(cell) and steps.low[r, c] == min(cell)
    assert [grid.at for grid in ranks] == [SPIKE_STEP, 199]
    for grid in ranks:
        assert grid.cols.starts == list(range(RANKS)) and grid.cols.width == 1
        for r, (_, name) in enumerate(grid.row_keys):
            assert grid.high[r].tolist() == [stored[(rank, name, grid.at)] for rank in range(RANKS)]
    assert module.cols.width == 4 and module.cols.starts[0] == 10 and module.rank_rows.starts == list(range(RANKS))
    for rank in range(RANKS):
        for c, start in enumerate(module.cols.starts):
            cell = [stored[(rank, NAMES[100], s)] for s in range(start, min(start + 4, 130))]
            assert module.high[rank, c] == max(cell) and module.low[rank, c] == min(cell)


def test_ranks_beyond_the_limit_are_bucketed_with_their_envelope(run):
    """More ranks than ``max_ranks``: buckets of consecutive ranks, each cell the envelope over its ranks too."""
    stored = _stored(run, "grad_reduced")
    source = open_source(run, report_data.sources(run))
    try:
        (ranks,) = rank_grids(source, "grad_reduced", ["norm"], [50], max_ranks=2)
        (module,) = module_grids(source, "grad_reduced", ["norm"], [(0, NAMES[7])], 0, 9, columns=10, max_ranks=3)
    finally:
        source.close()
    assert ranks.cols.starts == [0, 2] and ranks.cols.width == 2
    for r, (_, name) in enumerate(ranks.row_keys):
        for c, start in enumerate((0, 2)):
            cell = [stored[(rank, name, 50)] for rank in (start, start + 1)]
            assert ranks.high[r, c] == max(cell) and ranks.low[r, c] == min(cell)
    assert module.rank_rows.starts == [0, 2] and module.rank_rows.width == 2
    assert module.high[1].tolist() == [max(stored[(2, NAMES[7], s)], stored[(3, NAMES[7], s)]) for s in range(10)]


def test_the_change_view_shows_a_one_layer_spike(run, tmp_path):
    """Rank 0's layer 12 jumps x8 at one step: in the default (change) view those cells are the largest change and
    near the top of the scale, every other cell near no change, although the rows' values differ by decades."""
    out = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    page = _page(out)
    assert page["catalog"]["default"] == {"family": "grad_reduced", "metric": "norm", "rank": 0}  # not exp_avg
    grid = next(g for g in page["grids"] if (g["view"], g["family"], g["metric"], g["at"]) ==
                ("steps", "grad_reduced", "norm", 0))
    names = page["rowsets"]["grad_reduced"]["names"]
    spiked = [i for i, name in enumerate(names) if name.startswith(f"model.layers.{SPIKE_LAYER}.")]
    column = grid["cols"]["steps"].index(SPIKE_STEP)
    change = _codes(grid, "change")
    # x8 is 0.90 decades, times the 10% noise of each step: above x5 (0.7 decades) in every spiked row
    assert len(spiked) == 9 and all(change[i, column] >= 124 + 0.7 * 124 for i in spiked)
    others = np.delete(change, spiked, axis=0)
    assert np.abs(others.astype(int) - 124).max() < 0.35 * 124  # noise and the early decay: under x2.2
    assert names[grid["largest"]["row"]].startswith(f"model.layers.{SPIKE_LAYER}.")
    assert grid["cols"]["steps"][grid["largest"]["col"]] == SPIKE_STEP
    assert grid["abs"]["hi"] - grid["abs"]["lo"] > 3  # the value scale spans the rows' decades (stripes by type)
    # the views people debug with are in the page: module x rank at the spike, rank x step of the spiked rows
    assert any(g["view"] == "ranks" and g["at"] == SPIKE_STEP for g in page["grids"])
    assert any(g["view"] == "module" and g["at"].startswith(f"model.layers.{SPIKE_LAYER}.") for g in page["grids"])


def test_a_one_step_spike_in_100000_steps_stays_in_its_column(tmp_path):
    """100,000 steps in 1,000 columns of 100 steps: the one step x8 of one row is its column's largest magnitude
    and the largest change of the grid (an average over the bucket would have hidden it: x1.07)."""
    run = tmp_path / "run"
    names = llama_names(1)
    write_store(run, names, steps=100_000, steps_per_part=25_000, events=False,
                spikes=[Spike(61_234, r"mlp\.up_proj", 8.0)])
    source = open_source(run, report_data.sources(run))
    try:
        (grid,) = step_grids(source, "grad_reduced", ["norm"], [0], 0, 99_999, columns=1000)
    finally:
        source.close()
    assert grid.cols.width == 100 and len(grid.cols.starts) == 1000
    row, col = grid.row_keys.index((0, "model.layers.0.mlp.up_proj.weight")), 61_234 // 100
    spike = _stored(run, "grad_reduced")[(0, "model.layers.0.mlp.up_proj.weight", 61_234)]
    assert grid.high[row, col] == spike
    found = largest_change(grid)
    assert found is not None and found[:2] == (row, col) and found[2] > 0.6


def test_the_page_keeps_within_its_size_limit(run, tmp_path, capsys):
    out = tmp_path / "small.html"
    assert main(["report", str(run), "-o", str(out), "--max-size", "1", "--max-columns", "1000"]) == 0
    assert out.stat().st_size <= 1_000_000
    page = _page(out)
    kept = [(g["view"], g["family"], g["metric"], g["at"]) for g in page["grids"]]
    assert kept[0] == ("steps", "grad_reduced", "norm", 0)  # the most telling first
    assert any("left out to keep the page under 1 MB" in note for note in page["notes"])
    full = tmp_path / "full.html"
    assert main(["report", str(run), "-o", str(full)]) == 0
    assert len(_page(full)["grids"]) > len(kept)


@pytest.mark.parametrize("args, expected", [
    (["--ranks", "0,9"], "--ranks 9: the run has ranks 0,1,2,3"),
    (["--ranks", "7-9"], "--ranks 7-9: the run has ranks 0,1,2,3"),
    (["--families", "exp_avgg"], "--families exp_avgg: no such family in {run} (did you mean exp_avg?)"),
    (["--metrics", "norms"], "--metrics norms: no such metric in {run} (did you mean norm?)"),
])
def test_unknown_filters_exit_2_with_one_line(run, tmp_path, capsys, args, expected):
    assert main(["report", str(run), "-o", str(tmp_path / "r.html"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected.format(run=run) in err, err
    assert not (tmp_path / "r.html").exists()


def test_ranks_limit_what_is_read_and_shown(run, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(run), "-o", str(out), "--ranks", "1-2"]) == 0
    page = _page(out)
    assert page["ranks"] == [1, 2] and page["catalog"]["families"]["grad_reduced"]["ranks"] == [1, 2]
    assert {g["at"] for g in page["grids"] if g["view"] == "steps"} <= {1, 2}
    assert all(g["shape"][1] == 2 for g in page["grids"] if g["view"] == "ranks")
