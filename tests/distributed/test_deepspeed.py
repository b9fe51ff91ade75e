"""DeepSpeed ZeRO 1/2/3 with 2 ranks (gloo, CPU): shard statistics equal ZeRO-0's, rank attribution.

Each case trains in 2 processes of its own (one process group per case, ``tests/launch.py``), on first
use by a test, so a case that fails fails only the tests that read it. ZeRO-0 is checked against numpy float64 of
the full tensors it saved, ZeRO 1/2/3 against ZeRO-0 (same seed and data, 1e-5 relative), and bf16 ZeRO 1/2/3 against
bf16 ZeRO-0 at bf16 precision. The script counts the collectives trainmon issues and makes
DeepSpeed's full-gather accessors raise for the whole run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.launch import ROOT, DeepSpeedCases
from tests.reference import adam_update_np, np_stats, precursors_np, read_family
from trainmon.anomaly.merge import analyse_run
from trainmon.base.precursors import PRECURSOR_METRICS

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "ds_train.py"
METRICS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
FAMILIES = ["grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio", "param"]
SUBSET = ["layers.*.fc*"]
NAN_PARAM = "layers.0.fc1.weight"
CASES = [
    {"name": "z0", "stage": 0, "ref": True},
    {"name": "z1", "stage": 1},
    {"name": "z2", "stage": 2},
    {"name": "z3", "stage": 3},
    {"name": "z0_gas", "stage": 0, "gas": 2},
    {"name": "z1_gas_subset", "stage": 1, "gas": 2, "params": SUBSET},
    {"name": "z2_gas_subset", "stage": 2, "gas": 2, "params": SUBSET},
    {"name": "z3_gas_subset", "stage": 3, "gas": 2, "params": SUBSET},
    {"name": "z3_nan", "stage": 3, "nan_step": 1, "nan_param": NAN_PARAM},
    # `ranks` without rank 0: the lowest selected rank writes the combined rows; interval 2 leaves
    # step 1 uncollected (no collective there)
    {"name": "z0_rank1", "stage": 0, "ranks": [1]},
    {"name": "z3_rank1", "stage": 3, "ranks": [1], "interval": 2},
    {"name": "z0_bf16", "stage": 0, "dtype": "bf16"},
    {"name": "z1_bf16", "stage": 1, "dtype": "bf16"},
    {"name": "z2_bf16", "stage": 2, "dtype": "bf16"},
    {"name": "z0_bf16_gas", "stage": 0, "dtype": "bf16", "gas": 2},
    {"name": "z3_bf16_gas", "stage": 3, "dtype": "bf16", "gas": 2},
]
SHARDED = {case["name"] for case in CASES if case["stage"] > 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[DeepSpeedCases]:
    """``runs[name]``: the case's output directory, trained (once, on 2 ranks of its own) on first use."""
    cases = DeepSpeedCases(SCRIPT, CASES, tmp_path_factory.mktemp("ds"), world_size=2)
    yield cases
    cases.close()


def _table(run: Path, family: str) -> pd.DataFrame:
    return read_family(run / "rank0", family).set_index(["name", "step"]).sort_index()


def _assert_frames_close(got: pd.DataFrame, want: pd.DataFrame, label: str, rtol: float = 1e-5) -> None:
    assert list(got.index) == list(want.index), f"{label}: rows differ"
    for metric in METRICS:
        g, w = got[metric].to_numpy(float), want[metric].to_numpy(float)
        # a mean of a gradient that sums to ~0 (a softmax bias) is rounding noise: scale by the norm
        atol = 1e-7 * want["norm"].to_numpy(float) if metric == "mean" else 1e-9
        ok = np.isclose(g, w, rtol=rtol, atol=0.0, equal_nan=True) | (np.abs(g - w) <= atol)
        assert ok.all(), f"{label} {metric}: {list(got.index[~ok])[:3]} got {g[~ok][:3]} want {w[~ok][:3]}"


def test_zero0_matches_numpy(runs):
    run = runs["z0"]
    ref = np.load(run / "ref_rank0.npz")
    for family in FAMILIES:
        table = read_family(run / "rank0", family)
        assert len(table) == 3 * len(ref["names"]), family
        for _, row in table.iterrows():
            key = f"{row.step}/{{}}/{row['name']}"
            if family in ("grad_reduced", "param", "exp_avg", "exp_avg_sq"):
                array = ref[key.format(family)]
            else:
                update = adam_update_np(ref[key.format("exp_avg")], ref[key.format("exp_avg_sq")],
                                        float(ref[key.format("step")]), (0.9, 0.999), 1e-8)
                after = ref[key.format("param_after")]
                ratio = np.where(after != 0, update / np.where(after != 0, after, 1), 0)
                array = update if family == "update" else ratio
            want = np_stats(array)
            for metric in METRICS:
                atol = 1e-7 * want["norm"] if metric == "mean" else 1e-7
                assert np.isclose(row[metric], want[metric], rtol=1e-5, atol=atol), (family, row["name"], metric)


def _assert_precursors_close(got: pd.DataFrame, want: pd.DataFrame, label: str, rtol: float = 1e-4) -> None:
    """Precursor rows equal: relative, or absolute 1e-6 for a cosine near 0 (a dot product of float32 sums)."""
    assert list(got.index) == list(want.index), f"{label}: rows differ"
    for metric in PRECURSOR_METRICS:
        g, w = got[metric].to_numpy(float), want[metric].to_numpy(float)
        ok = np.isclose(g, w, rtol=rtol, atol=1e-6 if metric.startswith("cos") else 0.0)
        assert ok.all(), f"{label} {metric}: {list(got.index[~ok])[:3]} got {g[~ok][:3]} want {w[~ok][:3]}"


def test_zero0_precursors_match_numpy(runs):
    """``precursors`` against float64 from the tensors the step used: the averaged gradient, the moments after the
    step, the weights before and after it (AdamW without weight decay: the applied step is lr * update)."""
    run = runs["z0"]
    ref = np.load(run / "ref_rank0.npz")
    table = read_family(run / "rank0", "precursors")
    assert len(table) == 3 * len(ref["names"])
    for _, row in table.iterrows():
        key = f"{row.step}/{{}}/{row['name']}"
        want = precursors_np(ref[key.format("grad_reduced")], ref[key.format("exp_avg")],
                             ref[key.format("exp_avg_sq")], ref[key.format("param_after")],
                             float(ref[key.format("step")]), (0.9, 0.999), 1e-8, 1e-2,
                             adam_step=ref[key.format("param")] - ref[key.format("param_after")])
        for metric, value in want.items():
            assert np.isclose(row[metric], value, rtol=1e-3, atol=1e-7), (row["name"], row.step, metric, value)


@pytest.mark.parametrize("run,ref", [("z1", "z0"), ("z2", "z0"), ("z3", "z0"), ("z3_gas_subset", "z0_gas"),
                                     ("z1_bf16", "z2_bf16")])
def test_sharded_precursors_equal_the_unsharded_ones(runs, run, ref):
    """ZeRO 1/2/3 combine their shards' precursor sums exactly (the inner optimizer's flat partitions, one
    all-gather with the other rows); bf16 stage 1 and 2 run the same arithmetic."""
    got = _table(runs[run], "precursors")
    want = _table(runs[ref], "precursors").loc[got.index]
    assert len(got) == 3 * len({name for name, _ in got.index})
    _assert_precursors_close(got, want, f"{run}/precursors", rtol=1e-4 if "gas" in run else 2e-5)


@pytest.mark.parametrize("run", ["z0", "z3", "z0_rank1"])
def test_run_json_records_the_rows_written_once(runs, run):
    """ZeRO-0 (no collective: each rank has the whole averaged gradient) writes the rows once too, as ZeRO 1-3 do,
    and run.json says whose they are (write_replicated_once); with ``ranks: [1]`` rank 1 writes its own."""
    layout = json.loads((runs[run] / "run.json").read_text())["replicated"]
    assert layout["groups"] == ([] if run == "z0_rank1" else [[0, 1]])
    assert set(layout["families"]) == (set() if run == "z0_rank1" else {*FAMILIES, "precursors"}), layout
    assert (runs[run] / "rank1" / "param.csv").exists() == (run == "z0_rank1")


@pytest.mark.parametrize("run", ["z1", "z2", "z3"])
def test_sharded_stages_equal_zero0(runs, run):
    for family in FAMILIES:
        want = _table(runs["z0"], family)
        _assert_frames_close(_table(runs[run], family), want, f"{run}/{family}")
    # replicated statistics are written by data-parallel rank 0 only; rank-local ones by both
    assert not (runs[run] / "rank1" / "grad_reduced.csv").exists()
    unreduced = [read_family(runs[run] / f"rank{r}", "grad_unreduced") for r in (0, 1)]
    assert not np.allclose(unreduced[0]["norm"], unreduced[1]["norm"])  # each rank its own gradient


@pytest.mark.parametrize("run", ["z1_gas_subset", "z2_gas_subset", "z3_gas_subset"])
def test_subset_with_accumulation_equals_zero0(runs, run):
    for family in FAMILIES:
        got = _table(runs[run], family)
        names = sorted({name for name, _ in got.index})
        assert names and all(n.startswith("layers.") and ".fc" in n for n in names), names
        want = _table(runs["z0_gas"], family)
        # With accumulation ZeRO 2/3 sum micro-step gradients in another order than ZeRO-0 (reduce
        # per micro-step); ratio = update / param amplifies that rounding near param == 0.
        rtol = 1e-4 if family == "ratio" else 1e-5
        _assert_frames_close(got, want.loc[got.index], f"{run}/{family}", rtol)
    steps = pd.read_csv(runs[run] / "rank0" / "scalars.csv")
    assert steps.loc[steps["name"] == "global_steps", "value"].tolist() == [1.0, 2.0, 3.0]


def test_nan_on_rank1_is_attributed_to_layer_and_rank(runs):
    run = runs["z3_nan"]
    rows = {r: read_family(run / f"rank{r}", "grad_unreduced") for r in (0, 1)}
    bad = rows[1][(rows[1]["nans"] > 0)]
    assert set(bad["name"]) == {NAN_PARAM} and set(bad["step"]) == {1}
    assert (rows[0]["nans"] == 0).all()  # rank 0 computed a clean gradient
    first = analyse_run(run)["first_origin"]  # the anomaly analysis over every rank's anomalies.jsonl
    assert (first["rank"], first["family"], first["name"], first["step"]) == (1, "grad_unreduced", NAN_PARAM, 1)


@pytest.mark.parametrize("run,steps", [("z0_rank1", [0, 1, 2]), ("z3_rank1", [0, 2])])  # z3_rank1: every 2nd step
def test_ranks_without_rank0_write_combined_rows_on_lowest_selected_rank(runs, run, steps):
    assert not (runs[run] / "rank0").exists()  # rank 0 is not selected: no files
    for family in FAMILIES:
        got = read_family(runs[run] / "rank1", family).set_index(["name", "step"]).sort_index()
        assert sorted(got.index.get_level_values("step").unique()) == steps, family
        _assert_frames_close(got, _table(runs["z0"], family).loc[got.index], f"{run}/{family}")


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_one_collective_per_collected_step_and_no_full_gather(runs, case):
    """Per step, [collectives trainmon caused anywhere, collectives inside monitor.step()]:
    exactly one (the all-gather of the partials) per collected sharded step, none otherwise.
    The script made DeepSpeed's safe_get_full_* raise, so no case used a full gather."""
    collected = [step % case.get("interval", 1) == 0 for step in range(3)]
    want = [[1, 1] if c and case["name"] in SHARDED else [0, 0] for c in collected]
    for rank in (0, 1):
        counts = json.loads((runs[case["name"]] / f"extra_rank{rank}.json").read_text())["collectives"]
        assert counts == want, rank


BF16_RTOL = 2e-2  # bf16 keeps 8 mantissa bits (2**-8 = 3.9e-3 per rounding), a few roundings per value
BETAS = (0.9, 0.999)
# DeepSpeed's ZeRO-0 bf16 wrapper (FP16_UnfusedOptimizer) initialises Adam's state with one zero-gradient
# step, so its first real step runs with step=2 where ZeRO 1/2/3 run step=1: same m and v, other bias
# correction. Update at step 0 under ZeRO 1/2/3 = ZeRO-0's x this factor (eps is negligible here).
FIRST_UPDATE_FACTOR = ((1 - BETAS[0] ** 2) / (1 - BETAS[0])) * np.sqrt((1 - BETAS[1]) / (1 - BETAS[1] ** 2))


def _bf16_frames_close(got: pd.DataFrame, want: pd.DataFrame, label: str, factor: float = 1.0) -> None:
    """Equal at bf16 precision: relative to the value, or to the row's largest magnitude for values
    near zero (a min of exp_avg_sq, a mean of a gradient that sums to ~0)."""
    assert list(got.index) == list(want.index), f"{label}: rows differ"
    scale = np.maximum(np.abs(want["min"].to_numpy(float)), np.abs(want["max"].to_numpy(float))) * factor
    for metric in ("norm", "min", "max", "mean"):
        g, w = got[metric].to_numpy(float), want[metric].to_numpy(float) * factor
        ok = np.isclose(g, w, rtol=BF16_RTOL, atol=0.0) | (np.abs(g - w) <= BF16_RTOL * scale)
        assert ok.all(), f"{label} {metric}: {list(got.index[~ok])[:3]} got {g[~ok][:3]} want {w[~ok][:3]}"
    for metric in ("nans", "infs"):
        assert (got[metric] == 0).all() and (want[metric] == 0).all(), f"{label} {metric}"


@pytest.mark.parametrize("run,ref", [("z1_bf16", "z0_bf16"), ("z2_bf16", "z0_bf16"), ("z3_bf16_gas", "z0_bf16_gas")])
def test_bf16_sharded_stages_match_zero0_bf16(runs, run, ref):
    """Step 0 (same weights, same data): every family equals bf16 ZeRO-0 at bf16 precision, ``update``
    after DeepSpeed's ZeRO-0 step-count offset. Later steps follow different trajectories (that offset
    changes the applied updates), so they are compared stage against stage below; ``ratio`` divides
    by the already-diverged master weights and is compared stage against stage only."""
    for family in ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "update"):
        got, want = (_table(runs[r], family).xs(0, level="step", drop_level=False) for r in (run, ref))
        _bf16_frames_close(got, want, f"{run}/{family}", FIRST_UPDATE_FACTOR if family == "update" else 1.0)
    for family in FAMILIES:  # later steps: well-formed rows for every parameter
        table = _table(runs[run], family)
        assert sorted(table.index.get_level_values("step").unique()) == [0, 1, 2], (run, family)
        assert (table[["nans", "infs"]] == 0).all().all() and np.isfinite(table["norm"]).all(), (run, family)


def test_bf16_stage1_equals_stage2(runs):
    """ZeRO 1 and 2 run the same bf16 arithmetic on the same shards: equal at every step, every family."""
    for family in FAMILIES:
        _assert_frames_close(_table(runs["z2_bf16"], family), _table(runs["z1_bf16"], family), f"z2 vs z1/{family}")
