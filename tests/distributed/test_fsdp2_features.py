"""Dump and free benchmark on FSDP2 (``fully_shard``), for real on 2 gloo CPU ranks.

The worker (``scripts/fsdp2_features.py``) trains an FSDP2 model beside a plain unsharded copy of it on each
rank's data (parameters loaded from ``full_tensor()`` every step): the references are that copy's tensors
in float64. A dump requested by hand and a dump after a NaN injected into ``blocks.1.fc1`` must hold the
full tensors the module used (unsharded parameters, this rank's whole gradient); msprobe 1.2.1's compare
must read them; the free benchmark must re-run FSDP modules on their unsharded parameters and skip, on
both ranks, the module whose nested FSDP module is resharded when it returns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launch import RankServers

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_features.py"
PRELOAD = ("numpy", "torch", "torch.distributed.fsdp", "torch.distributed.tensor", "trainmon")
ACTION_STEP, DUMP_STEP = 1, 4  # the script's: a dump by hand, and the dump after the NaN (step 2) is localised
FC1 = "Module.blocks.1.fc1.PoisonLinear"
BLOCK = "Module.blocks.1.Block"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2_features")
    servers = RankServers(2, PRELOAD, out / "_logs")
    try:
        ok, output = servers.run([SCRIPT, out, "actions"], out / "_logs" / "actions", timeout=300.0)
    finally:
        servers.close()
    assert ok, output[-8000:]
    return out


def _info(runs: Path, rank: int) -> dict:
    return json.loads((runs / "actions" / f"info_rank{rank}.json").read_text())


def _refs(runs: Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(runs / "actions" / f"refs_rank{rank}.npz") as npz:
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
