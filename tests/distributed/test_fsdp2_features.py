"""Dump, free benchmark and grad probe on FSDP2 (``fully_shard``), for real on 2 gloo CPU ranks.

The worker (``scripts/fsdp2_features.py``) trains an FSDP2 model beside a plain unsharded copy of it on each
rank's data (parameters loaded from ``full_tensor()`` every step): the references are that copy's tensors
in float64. A dump requested by hand and a dump after a NaN injected into ``blocks.1.fc1`` must hold the
full tensors the module used (unsharded parameters, this rank's whole gradient); msprobe 1.2.1's compare
must read them; the free benchmark must re-run FSDP modules on their unsharded parameters and skip, on
both ranks, the module whose nested FSDP module is resharded when it returns. The grad probe of the
sharded model (``Shard(0)`` and ``Shard(1)``) must equal float64 statistics of the full gradients the optimizer
stepped with (``full_tensor()`` in the test's own optimizer hook) and the probe of an unsharded single-process
run on both ranks' data, with one extra collective per collected step; written into the run store
(``sinks: [parquet]``) it holds the same rows and bits, once (rank 0's partition).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests.launch import RankServers, child_env
from tests.reference import read_family

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_features.py"
PRELOAD = ("numpy", "torch", "torch.distributed.fsdp", "torch.distributed.tensor", "trainmon")
ACTION_STEP, DUMP_STEP = 1, 4  # the script's: a dump by hand, and the dump after the NaN (step 2) is localised
FC1 = "Module.blocks.1.fc1.PoisonLinear"
BLOCK = "Module.blocks.1.Block"
PROBE_CASES = ("probe", "probe_dim1", "probe_hsdp_2x1")  # Shard(0) with every weight family; matrices Shard(1),
# grad probe only; HSDP with 2 replicas of whole tensors (each rank writes its own)
PROBE_COLLECTED, BOUNDS = (0, 2, 4), (-0.01, 0.0, 0.01)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2_features")
    servers = RankServers(2, PRELOAD, out / "_logs")
    try:
        ok, output = servers.run([SCRIPT, out, "actions", *PROBE_CASES, "probe_l0", "probe_dim1_store"],
                                 out / "_logs" / "run",
                                 timeout=300.0)
    finally:
        servers.close()
    assert ok, output[-8000:]
    return out


def _info(runs: Path, rank: int) -> dict:
    return json.loads((runs / "actions" / f"info_rank{rank}.json").read_text())


def _refs(runs: Path, rank: int, case: str = "actions") -> dict[str, np.ndarray]:
    with np.load(runs / case / f"refs_rank{rank}.npz") as npz:
        return dict(npz)


def _loaded(dump_dir: Path, desc: dict) -> np.ndarray:
    return torch.load(dump_dir / "dump_tensor_data" / desc["data_name"], weights_only=True).double().numpy()


def _same(got: np.ndarray, want: np.ndarray, label: str) -> None:
    assert got.shape == want.shape, (label, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=label)


def _check_module(dump_dir: Path, data: dict, prefix: str, module: str, params: list[str], refs: dict,
                  step: int, label: str) -> None:
    """The forward's input, output and unsharded parameters, and this rank's whole parameter gradients."""
    forward = data[f"{prefix}.forward.0"]
    _same(_loaded(dump_dir, forward["input_args"][0]), refs[f"{step}|{module}|input"], f"{label} input")
    _same(_loaded(dump_dir, forward["output"][0]), refs[f"{step}|{module}|output"], f"{label} output")
    grads = data[f"{prefix}.parameters_grad"] if params else {}
    for param in params:
        desc = forward["parameters"][param]
        want = refs[f"{step}|{module}.{param}|param"]
        assert desc["shape"] == list(want.shape), (label, param, desc["shape"])  # full, not a shard
        _same(_loaded(dump_dir, desc), want, f"{label} {param}")
        assert desc["Norm"] == pytest.approx(float(np.linalg.norm(want)), rel=1e-5)
        _same(_loaded(dump_dir, grads[param][0]), refs[f"{step}|{module}.{param}|grad"], f"{label} {param} grad")


@pytest.mark.parametrize("rank", [0, 1])
def test_dump_by_hand_holds_the_full_tensors_the_modules_used(runs: Path, rank: int) -> None:
    dump_dir = runs / "actions" / f"rank{rank}" / "dump" / f"step{ACTION_STEP}"
    data = json.loads((dump_dir / "dump.json").read_text())["data"]
    refs = _refs(runs, rank)
    assert f"{BLOCK}.forward.0" in data and not any("FSDP" in key for key in data)  # the user's class names
    _check_module(dump_dir, data, FC1, "blocks.1.fc1", ["weight", "bias"], refs, ACTION_STEP, f"rank {rank} fc1")
    # blocks.1.fc2 is an FSDP module of its own, nested in the FSDP module blocks.1
    _check_module(dump_dir, data, "Module.blocks.1.fc2.Linear", "blocks.1.fc2", ["weight", "bias"], refs,
                  ACTION_STEP, f"rank {rank} fc2")
    _check_module(dump_dir, data, BLOCK, "blocks.1", [], refs, ACTION_STEP, f"rank {rank} block")
    _check_module(dump_dir, data, "Module.blocks.1.norm.LayerNorm", "blocks.1.norm", ["weight", "bias"], refs,
                  ACTION_STEP, f"rank {rank} norm")


@pytest.mark.parametrize("rank", [0, 1])
def test_nan_in_one_layer_is_localised_and_that_layer_dumped_with_full_tensors(runs: Path, rank: int) -> None:
    info = _info(runs, rank)
    (found,) = info["localisations"]
    assert (found["anomaly_step"], found["step"], found["phase"], found["module"], found["kind"],
            found["dump_step"]) == (2, 3, "forward", "blocks.1.fc1", "output", DUMP_STEP)
    rank_dir = runs / "actions" / f"rank{rank}"
    first = json.loads((rank_dir / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["name"]) == (2, "loss")  # default families: the loss is the first origin
    dump_dir = rank_dir / "dump" / f"step{DUMP_STEP}"
    data = json.loads((dump_dir / "dump.json").read_text())["data"]
    refs = _refs(runs, rank)
    output = refs[f"{DUMP_STEP}|blocks.1.fc1|output"]
    assert np.isnan(output[:, 3]).all() and np.isfinite(np.delete(output, 3, axis=1)).all()
    _check_module(dump_dir, data, FC1, "blocks.1.fc1", ["weight", "bias"], refs, DUMP_STEP, f"rank {rank} fc1")
    assert f"{BLOCK}.forward.0" in data  # its parent (depth 1)
    assert math.isnan(data[f"{FC1}.forward.0"]["output"][0]["Max"])


def test_msprobe_compare_reads_the_fsdp_dumps(runs: Path, tmp_path: Path) -> None:
    from tests.integration.msprobe_dump_compare import compare_dumps
    from tests.integration.test_msprobe_dump_compare import check_compare

    dumps = runs / "actions" / "rank0" / "dump"
    table = compare_dumps(dumps / f"step{DUMP_STEP}", dumps / f"step{ACTION_STEP}", tmp_path / "compare")
    check_compare(table, nan_rows={f"{FC1}.forward.0.output.0"},
                  finite_rows={f"{FC1}.forward.0.input.0", f"{FC1}.forward.0.parameters.weight"})


@pytest.mark.parametrize("rank", [0, 1])
def test_free_benchmark_reruns_fsdp_modules_on_their_unsharded_parameters(runs: Path, rank: int) -> None:
    info = _info(runs, rank)
    got = {r["name"]: r["max_rel"] for r in info["results"]}
    assert {r["step"] for r in info["results"]} == {ACTION_STEP}
    # blocks.0 and blocks.1.fc2 are FSDP modules; blocks.1.fc1 is a plain module inside one
    assert sorted(got) == ["blocks.0", "blocks.1.fc1", "blocks.1.fc2"]
    for name, value in got.items():
        want = info["ratios"][name]  # the float64 re-run of the unsharded copy on the same swapped input
        assert value == want or value == pytest.approx(want, rel=1e-4), (name, value, want)
    assert any(math.isfinite(v) for v in got.values())
    skipped = [m for m in info["warnings"] if m.startswith("free_benchmark: blocks.1 communicates")]
    assert len(skipped) == 1 and "'fc2.weight' is sharded again by FSDP" in skipped[0], info["warnings"]
    failures = (runs / "actions" / f"rank{rank}" / "free_benchmark.csv").read_text().splitlines()
    assert len(failures) == 1 + sum(not r["passed"] for r in info["results"]) and failures[1].startswith(f"{rank},")
    assert not info["hooks_left"]


def _summary(runs: Path, case: str, rank: int = 0) -> pd.DataFrame:
    return read_family(runs / case / f"rank{rank}" / "grad_probe", "grad_summary")


def _writers(case: str) -> tuple[int, ...]:
    return (0, 1) if case == "probe_hsdp_2x1" else (0,)  # the lowest selected rank of each shard group


def _expected_summary(grad: np.ndarray, previous: np.ndarray | None, exp_avg: np.ndarray | None) -> dict[str, float]:
    g = grad.ravel()
    out = {"max": g.max(), "min": g.min(), "norm": np.sqrt(np.sum(g * g)), "zero_fraction": np.mean(g == 0),
           "sign_agree_prev": np.mean((g > 0) == (previous.ravel() > 0)) if previous is not None else np.nan,
           "cos_prev": np.nan}
    edges = [-np.inf, *BOUNDS, np.inf]
    for lo, hi in zip(edges[:-1], edges[1:]):
        out[f"({lo:g}, {hi:g}]".replace("inf]", "inf)")] = np.mean((g > lo) & (g <= hi))
    if exp_avg is not None:
        m = exp_avg.ravel()
        out["sign_agree_exp_avg"] = np.mean((g > 0) == (m > 0))
        out["cos_exp_avg"] = np.dot(g, m) / (np.linalg.norm(g) * np.linalg.norm(m))
    else:
        out["sign_agree_exp_avg"] = out["cos_exp_avg"] = np.nan
    return out


@pytest.mark.parametrize("case", PROBE_CASES)
def test_grad_probe_equals_float64_statistics_of_the_full_gradients(runs: Path, case: str) -> None:
    for rank in _writers(case):
        _check_probe_rows(runs, case, rank)


def _check_probe_rows(runs: Path, case: str, rank: int) -> None:
    from trainmon.probe.storage import direction_path, read_direction_header

    refs = _refs(runs, rank, case)
    frame = _summary(runs, case, rank)
    names = sorted({key.split("|")[2] for key in refs if "|grad|" in key})
    assert "head.weight" in names  # one row: an empty shard on rank 1 (1-D meshes)
    assert sorted(set(frame.step)) == list(PROBE_COLLECTED) and sorted(set(frame.name)) == names
    for i, step in enumerate(PROBE_COLLECTED):
        for name in names:
            grad = refs[f"{step}|grad|{name}"]
            previous = refs[f"{PROBE_COLLECTED[i - 1]}|grad|{name}"] if i else None
            expected = _expected_summary(grad, previous, refs.get(f"{step}|exp_avg|{name}"))
            row = frame[(frame.name == name) & (frame.step == step)].iloc[0]
            assert row["shape"] == str(list(grad.shape)) and row["numel"] == grad.size
            for column, want in expected.items():
                got = float(row[column])
                assert (np.isnan(got) and np.isnan(want)) or np.isclose(got, want, rtol=1e-5, atol=1e-7), \
                    (case, step, name, column, got, want)
            direction = read_direction_header(direction_path(runs / case / f"rank{rank}" / "grad_probe", step, name,
                                                             0))
            assert direction.header["count"] == grad.size
            np.testing.assert_array_equal(direction.bits(), np.packbits(grad.ravel() > 0, bitorder="little"))


@pytest.mark.parametrize("case", PROBE_CASES)
def test_grad_probe_equals_an_unsharded_run_and_grad_compare_gives_one(runs: Path, case: str, tmp_path: Path) -> None:
    sharded, plain = _summary(runs, case), _summary(runs, "probe_plain")
    assert len(sharded) == len(plain) == 3 * 16
    merged = sharded.merge(plain, on=["name", "step"], suffixes=("", "_plain"))
    for column in ("max", "min", "norm", "sign_agree_prev", "sign_agree_exp_avg", "cos_exp_avg", "zero_fraction"):
        np.testing.assert_allclose(merged[column], merged[f"{column}_plain"], rtol=1e-5, atol=1e-7, err_msg=column)
    scalars = {run: read_family(runs / run / "rank0", "scalars") for run in (case, "probe_plain")}
    for metric in ("sign_agree_prev", "sign_agree_exp_avg", "cos_exp_avg"):
        got, want = (frame[frame.name == f"grad_probe/{metric}"].value.to_numpy() for frame in scalars.values())
        assert len(got) == 2 and np.allclose(got, want, rtol=1e-5), (metric, got, want)
    result = subprocess.run([sys.executable, "-m", "trainmon", "grad-compare", str(runs / case),
                             str(runs / "probe_plain"), "-o", str(tmp_path), "--no-plots"], capture_output=True,
                            text=True, env=child_env(), timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    similarities = pd.read_csv(tmp_path / "similarities.csv")
    assert len(similarities[similarities.kind == "param"]) == 3 * 16
    assert (similarities.similarity == 1.0).all(), similarities[similarities.similarity != 1.0]


def test_grad_probe_l0_hash_is_the_hash_of_the_full_gradient(runs: Path) -> None:
    """Each shard's checksum shares add up to the whole gradient's: the hash is numpy's of ``full_tensor()``."""
    from tests.integration.test_grad_probe_deepspeed import _numpy_hash

    refs, frame = _refs(runs, 0, "probe_l0"), _summary(runs, "probe_l0")
    assert len(frame) == 3 * 16 and frame["hash"].nunique() == len(frame)
    for step in PROBE_COLLECTED:
        for name in sorted(set(frame.name)):
            row = frame[(frame.name == name) & (frame.step == step)].iloc[0]
            assert row["hash"] == _numpy_hash(refs[f"{step}|grad|{name}"]), (step, name)


@pytest.mark.parametrize("case", PROBE_CASES + ("probe_l0",))
def test_grad_probe_adds_one_gather_per_collected_step_written_by_the_lowest_rank(runs: Path, case: str) -> None:
    # "probe": the FSDP statistics' all_gather and the probe's gather; "probe_dim1": the probe's gather only
    per_step = {"probe": 2, "probe_hsdp_2x1": 0}.get(case, 1)
    for rank in range(2):
        info = json.loads((runs / case / f"info_rank{rank}.json").read_text())
        assert info["collectives"] == [per_step if step in PROBE_COLLECTED else 0 for step in range(5)]
        assert info["warnings"] == []
    if case != "probe_hsdp_2x1":
        assert not (runs / case / "rank1" / "grad_probe").exists()  # the combined files are written once


def test_grad_probe_of_a_sharded_run_in_the_store_holds_the_same_rows_and_bits_once(runs: Path, tmp_path: Path) -> None:
    """``probe_dim1`` written into the run store: the rows of its grad_summary.csv (float32, exactly), the bits of
    the whole gradients (``packbits(full > 0)``), in rank 0's partition only, and still one gather per step."""
    from trainmon.probe.storage import interval_labels
    from trainmon.probe.store import interval_names, read_summary, stored_ranks
    from trainmon.tools.grad_compare import scan_run

    run = runs / "probe_dim1_store"
    assert not (run / "rank0" / "grad_probe").exists() and not (run / "rank1" / "grad_probe").exists()
    assert list(stored_ranks(run, "grad_probe")) == list(stored_ranks(run, "grad_directions")) == [0]
    stored = read_summary(stored_ranks(run, "grad_probe")[0]).to_pandas()
    files = _summary(runs, "probe_dim1").rename(columns=dict(zip(interval_labels(BOUNDS), interval_names(BOUNDS))))
    assert len(stored) == len(files) == 3 * 16
    merged = files.merge(stored, on=["step", "name"], suffixes=("", "_store"))
    for column in [c for c in stored.columns if stored[c].dtype.kind == "f"]:
        np.testing.assert_array_equal(merged[column].to_numpy(np.float32), merged[f"{column}_store"].to_numpy(),
                                      err_msg=column)
    refs = _refs(runs, 0, "probe_dim1_store")
    tree = scan_run(run)[0]
    assert sorted(tree) == list(PROBE_COLLECTED)
    for step, entries in tree.items():
        for (_, name), entry in entries.items():
            grad = refs[f"{step}|grad|{name}"]
            assert entry.header["count"] == grad.size and entry.header["shape"] == list(grad.shape)
            np.testing.assert_array_equal(entry.bits(), np.packbits(grad.ravel() > 0, bitorder="little"))
    for rank in range(2):
        info = json.loads((run / f"info_rank{rank}.json").read_text())
        assert info["collectives"] == [1 if step in PROBE_COLLECTED else 0 for step in range(5)]
        assert info["warnings"] == []
