"""Dump and free benchmark on Megatron-Core, for real on CPU: 2 gloo ranks, one torchrun for both cases.

``tp2``: tensor parallelism over the 2 ranks with the default families; a NaN injected into
``decoder.layers.1.mlp`` is localised (the first origin is the loss) and dumped on both TP ranks, each
naming its shard; msprobe 1.2.1's compare reads the dump. ``vpp2``: two virtual pipeline stages with
full activation recomputation: dump keys carry the chunk, recompute re-runs are neither dumped nor checked.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from tests.integration.msprobe_dump_compare import compare_dumps, require_msprobe
from tests.integration.test_msprobe_dump_compare import check_compare
from tests.launch import child_env, torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "mcore_actions_run.py"
MLP = "Module.decoder.layers.1.mlp.MLP"
FC1 = "Module.decoder.layers.1.mlp.linear_fc1.ColumnParallelLinear"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron_actions")
    proc = subprocess.run(torchrun(SCRIPT, out, "tp2", "vpp2"), env=child_env(), capture_output=True, text=True,
                          timeout=500, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join([line for line in lines if "Error" in line or "[rank" in line][-60:]
                                           or lines[-60:])
    return out


def _info(runs: Path, case: str, rank: int) -> dict:
    return json.loads((runs / case / f"info_rank{rank}.json").read_text())


def _dump(runs: Path, case: str, rank: int, step: int) -> dict:
    return json.loads((runs / case / f"rank{rank}" / "dump" / f"step{step}" / "dump.json").read_text())


def _close(desc: dict, ref: dict) -> None:
    for key in ("Max", "Min", "Mean", "Norm"):
        assert desc[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, desc[key], ref[key])


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_nan_is_localised_and_dumped_on_each_tp_rank(runs: Path, rank: int) -> None:
    info = _info(runs, "tp2", rank)
    assert info["tp_rank"] == rank
    first = json.loads((runs / "tp2" / f"rank{rank}" / "anomalies.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["name"]) == (2, "loss")  # default families: the loss is the first origin
    (found,) = info["localisations"]
    assert (found["anomaly_step"], found["step"], found["phase"], found["module"], found["kind"],
            found["dump_step"]) == (2, 3, "forward", "decoder.layers.1.mlp", "output", 4)
    assert sorted(p.name for p in (runs / "tp2" / f"rank{rank}" / "dump").iterdir()) == [
        "localisation.jsonl", "step1", "step4"]
    anomaly = _dump(runs, "tp2", rank, 4)
    assert anomaly["parallel"] == {"tp_rank": rank, "tp_size": 2, "pp_rank": 0, "pp_size": 1}
    layer, fc2 = "Module.decoder.layers.1.TransformerLayer", "Module.decoder.layers.1.mlp.linear_fc2.RowParallelLinear"
    depth_one = {f"{MLP}.forward.0", f"{MLP}.forward.1", f"{FC1}.forward.0", f"{layer}.forward.0", f"{fc2}.forward.1",
                 f"{FC1}.backward.1", f"{FC1}.parameters_grad"}
    assert depth_one <= set(anomaly["data"])  # the MLP, its parent layer and its two linear layers, 2 micro-batches
    for micro in (0, 1):
        assert math.isnan(anomaly["data"][f"{MLP}.forward.{micro}"]["output"][0]["Max"])
    clean = _dump(runs, "tp2", rank, 1)
    assert set(clean["data"]) == set(anomaly["data"])
    # Each TP rank dumps its own shard: fc1 (column-parallel) holds 64 of the 128 rows, partition_dim 0
    weight = clean["data"][f"{FC1}.forward.0"]["parameters"]["weight"]
    assert weight["shape"] == [64, 32] and weight["tp_partition_dim"] == 0
    _close(weight, info["refs"]["fc1_weight"])
    (grad,) = clean["data"][f"{FC1}.parameters_grad"]["weight"]
    assert grad["shape"] == [64, 32] and grad["tp_partition_dim"] == 0
    for micro, ref in enumerate(info["refs"]["mlp_output"]):  # the MLP output is all-reduced: the full tensor
        _close(clean["data"][f"{MLP}.forward.{micro}"]["output"][0], ref)
    files = list((runs / "tp2" / f"rank{rank}" / "dump" / "step1" / "dump_tensor_data").iterdir())
    assert any(p.name == f"{FC1}.forward.0.parameters.weight.pt" for p in files)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_free_benchmark_checks_local_modules_and_skips_communicating_ones(runs: Path, rank: int) -> None:
    info = _info(runs, "tp2", rank)
    checked = [(step, name, chunk, index, passed) for step, name, chunk, index, _, passed in info["free_benchmark"]]
    assert checked == [(1, "decoder.layers.1.mlp.linear_fc1", 0, 0, True), (1, "decoder.layers.1.mlp.linear_fc1", 0, 1,
                                                                             True)]
    (warned,) = [w for w in info["warnings"] if w.startswith("free_benchmark:")]
    assert "decoder.layers.1.mlp communicates in its forward" in warned and "c10d.allreduce_" in warned


def test_msprobe_compare_reads_the_megatron_dump(runs: Path, tmp_path: Path) -> None:
    require_msprobe()
    dumps = runs / "tp2" / "rank0" / "dump"
    table = compare_dumps(dumps / "step4", dumps / "step1", tmp_path)
    check_compare(table, nan_rows={f"{MLP}.forward.0.output.0", f"{MLP}.forward.1.output.0"},
                  finite_rows={f"{FC1}.forward.0.input.0", f"{FC1}.forward.0.parameters.weight",
                               f"{MLP}.forward.0.input.0"})


@pytest.mark.parametrize("rank", [0, 1])
def test_vpp2_chunks_and_recompute(runs: Path, rank: int) -> None:
    info = _info(runs, "vpp2", rank)
    assert info["pp_rank"] == rank and info["warnings"] == []
    data = _dump(runs, "vpp2", rank, 1)["data"]
    layer = "decoder.layers.0.TransformerLayer"
    # Module.{chunk}.{name}: both virtual stages; two micro-batches each; the recompute re-run during
    # backward is not a third forward, and the backward entries come from the re-run's tensors
    assert set(data) == {f"Module.{chunk}.{layer}.{kind}.{micro}" for chunk in (0, 1)
                         for kind in ("forward", "backward") for micro in (0, 1)}
    for chunk in (0, 1):
        backward = data[f"Module.{chunk}.{layer}.backward.0"]
        assert backward["input"] and np.isfinite(backward["input"][0]["Norm"])
    checked = {(name, chunk) for _, name, chunk, index, _, passed in info["free_benchmark"] if index == 0 and passed}
    assert checked == {("decoder.layers.0.mlp", 0), ("decoder.layers.0.mlp", 1)}
    assert all(step == 1 for step, *_ in info["free_benchmark"])
