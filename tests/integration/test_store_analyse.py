"""``trainmon analyse`` of real runs written with ``sinks: [parquet, csv]``: the answer from the store (SQL) is the
answer from the ``anomalies.jsonl`` files (the JSON reader) for every field they share, the first non-finite row is
where the ``nonfinite`` detector points, the spread across ranks is numpy's from the CSV files, and ``trainmon
convert`` of the CSV files gives a store with the sink's values and the same analysis.

Runs: TinyNet on one rank (two micro-steps per step, a gradient spike, then a NaN weight), and TinyNet under DDP on
2 gloo ranks (a NaN weight on rank 1 only, a gradient spike on rank 0).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launch import run_ranks
from tests.models import TinyNet, batch, loss_fn
from tests.reference import METRICS
from trainmon import TrainerMonitor
from trainmon.tools.cli import main
from trainmon.tools.readers import family_of, read_table
from trainmon.tools.store import open_run

STEPS, SPIKE_STEP, NAN_STEP = 14, 9, 12
DDP_STEPS, DDP_SPIKE_STEP, DDP_NAN_STEP, NAN_RANK = 10, 7, 8, 1
ROW_KEYS = ("first_nonfinite_row", "nonfinite_rows", "spread", "deviating_ranks")


def _config(out: str, sinks: list[str]) -> dict:
    every = {"enabled": True, "metrics": METRICS}
    return {"output_dir": out, "run_name": "run", "sinks": sinks, "activations": every, "weight_grads": every,
            "optimizer_states": {"metrics": METRICS, "states": ["exp_avg", "update"]},
            "anomaly": {"detectors": [{"type": "nonfinite"},
                                      {"type": "spike", "series": ["grad_reduced/*/norm"], "method": "mad",
                                       "warmup": 5, "min_relative_change": 1.0}],
                        "actions": ["jsonl"]}}


def _train(model, monitor, steps: int, spike_step: int, nan_step: int, spike: bool, nan: bool, grad_acc: int,
           data_offset: int = 0) -> None:
    current = {"step": 0}
    handle = model.head.weight.register_hook(lambda g: g * 1000 if spike and current["step"] == spike_step else g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        monitor.attach(model, optimizer, grad_acc_steps=grad_acc)
        for step in range(steps):
            current["step"] = step
            if nan and step == nan_step:
                with torch.no_grad():
                    model.layers[1].fc2.weight[0, 0] = float("nan")
            for micro_step in range(grad_acc):
                loss = loss_fn(model, *batch(data_offset + grad_acc * step + micro_step)) / grad_acc
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    finally:
        handle.remove()
        monitor.close()


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("analyse_single")
    torch.manual_seed(0)
    model = TinyNet()
    _train(model, TrainerMonitor(_config(str(out), ["parquet", "csv"])), STEPS, SPIKE_STEP, NAN_STEP, True, True, 2)
    return out / "run"


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TinyNet()
    model = torch.nn.parallel.DistributedDataParallel(net)
    try:
        monitor = TrainerMonitor(_config(out_dir, ["parquet", "csv"]))
        current = {"step": 0}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        handle = net.head.weight.register_hook(lambda g: g * 1000 if rank == 0 and current["step"] == DDP_SPIKE_STEP
                                               else g)
        monitor.attach(model, optimizer)
        try:
            for step in range(DDP_STEPS):
                current["step"] = step
                if step == DDP_NAN_STEP and rank == NAN_RANK:
                    with torch.no_grad():
                        net.layers[1].fc2.weight[0, 0] = float("nan")
                loss = loss_fn(model, *batch(100 * rank + step))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                monitor.step(loss=loss)
        finally:
            handle.remove()
            monitor.close()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("analyse_ddp")
    run_ranks([__file__, out], world_size=2, timeout=240)
    return out / "run"


def _analyse(run: Path, out: Path, *options: str) -> dict:
    assert main(["analyse", str(run), "-o", str(out), *options]) == 0
    return json.loads(out.read_text())


def _without(run: Path, copy: Path, pattern: str) -> Path:
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(pattern))
    return copy


def _check_store_equals_jsonl(run: Path, tmp_path: Path, capsys) -> tuple[dict, dict]:
    from_store = _analyse(run, tmp_path / "store.json")
    assert "from the store (SQL)" in capsys.readouterr().out
    from_jsonl = _analyse(_without(run, tmp_path / "csv_only", "store"), tmp_path / "jsonl.json")
    assert "trainmon convert" in capsys.readouterr().out  # how to get the row sections
    shared = set(from_jsonl) - {"run_dir", *ROW_KEYS}
    assert shared >= {"first_origin", "first_nonfinite", "first_spike", "top", "first_by_step", "counts"}
    for key in shared:
        assert from_store[key] == from_jsonl[key], key
    assert all(from_jsonl[key] is None for key in ROW_KEYS) and from_store["spread"] is not None
    for options in (["--steps", "0-9"], ["--detector", "spike", "--top", "3"]):
        narrowed = _analyse(run, tmp_path / "a.json", *options)
        want = _analyse(tmp_path / "csv_only", tmp_path / "b.json", *options)
        assert all(narrowed[key] == want[key] for key in shared), options
    return from_store, from_jsonl


def _location(item: dict) -> tuple:
    return item["family"], item["name"], item["step"], item["micro_step"], item["rank"], item["phase"]


def test_single_rank_store_answer_equals_the_jsonl_answer(single, tmp_path, capsys):
    from_store, _ = _check_store_equals_jsonl(single, tmp_path, capsys)
    assert from_store["first_spike"]["step"] == SPIKE_STEP and from_store["first_spike"]["detector"] == "spike"
    assert from_store["first_nonfinite"]["step"] == NAN_STEP
    row = from_store["first_nonfinite_row"]
    assert _location(row) == _location(from_store["first_nonfinite"])  # where the detector pointed
    assert row["name"] == "layers.1.fc2.output" and row["values"]["nans"] > 0
    assert from_store["spread"] == [] and from_store["deviating_ranks"]["groups"] == 0  # one rank


def _store_rows(run: Path, family: str) -> list[tuple]:
    con = open_run(run)
    try:
        if family == "scalars":
            return con.execute("SELECT * FROM scalars ORDER BY rank, step, name").fetchall()
        return con.execute(f'SELECT * EXCLUDE ("order") FROM {family} ORDER BY rank, step, micro_step, vpp_stage, '
                           "phase, name").fetchall()
    finally:
        con.close()


def _check_convert(run: Path, tmp_path: Path, from_store: dict) -> None:
    """The CSV files converted: every family's rows equal the sink's (values bit for bit, the non-finite flag as
    recorded), and the analysis is the same (the order of a converted row is its position in its family)."""
    converted = _without(run, tmp_path / "converted", "store")
    assert main(["convert", str(converted)]) == 0
    families = sorted({family_of(p) for p in run.glob("rank*/*.csv")} - {"scalars"})
    assert len(families) >= 5
    for family in [*families, "scalars"]:
        want, got = _store_rows(run, family), _store_rows(converted, family)
        assert len(got) == len(want) > 0, family
        for a, b in zip(want, got):
            assert len(a) == len(b) and all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                                             for x, y in zip(a, b)), (family, a, b)
    again = _analyse(converted, tmp_path / "converted.json")
    for key in set(from_store) - {"run_dir", "first_nonfinite_row"}:
        assert again[key] == from_store[key], key
    assert {k: v for k, v in again["first_nonfinite_row"].items() if k != "order"} == {
        k: v for k, v in from_store["first_nonfinite_row"].items() if k != "order"}


def test_single_rank_convert_gives_the_sinks_store_and_answer(single, tmp_path):
    _check_convert(single, tmp_path, _analyse(single, tmp_path / "store.json"))


def _reference_spread(run: Path, top: int) -> list[tuple]:
    """(relative spread, spread, family, name, step, micro-step, min rank, max rank) of the ``norm`` of every
    row recorded by both ranks, from the CSV files (numpy, float64), largest first."""
    norms: dict[tuple, dict[int, float]] = {}
    for path in sorted(run.glob("rank*/*.csv")):
        family = family_of(path)
        if family == "scalars":
            continue
        table = read_table(path)
        column = table.metrics.index("norm")
        rank = int(path.parent.name[4:])
        for row, step, micro, value in zip(table.rows, table.steps, table.micro_steps, table.values[:, column]):
            if math.isfinite(value):
                key = (family, table.keys[row][1], int(step), int(micro), table.keys[row][0])
                norms.setdefault(key, {})[rank] = float(value)
    out = []
    for (family, name, step, micro, _), by_rank in norms.items():
        if len(by_rank) == 2:
            values = np.array([by_rank[0], by_rank[1]])
            spread, median = float(np.ptp(values)), float(np.median(values))
            relative = spread / abs(median) if median else (math.inf if spread else 0.0)
            low, high = (0, 1) if values[0] < values[1] else (1, 0) if values[0] > values[1] else (0, 0)
            out.append((relative, spread, family, name, step, micro, low, high))
    out.sort(key=lambda g: (-g[0], -g[1], g[4], g[2], g[3], g[5]))
    return out[:top]


@pytest.mark.slow  # 2 processes with gloo
def test_two_ranks_store_answer_equals_the_jsonl_answer(ddp, tmp_path, capsys):
    from_store, _ = _check_store_equals_jsonl(ddp, tmp_path, capsys)
    assert from_store["first_nonfinite"]["rank"] == NAN_RANK and from_store["first_nonfinite"]["step"] == DDP_NAN_STEP
    assert from_store["first_spike"]["step"] == DDP_SPIKE_STEP
    row = from_store["first_nonfinite_row"]
    assert _location(row) == _location(from_store["first_nonfinite"]) and row["phase"] == "forward"
    assert from_store["nonfinite_rows"]["ranks"] == 2  # rank 0 after the all-reduce, later in the step
    want = _reference_spread(ddp, 20)
    got = from_store["spread"]
    assert len(got) == len(want) == 20
    for g, w in zip(got, want):
        assert (g["family"], g["name"], g["step"], g["micro_step"], g["min_rank"], g["max_rank"]) == w[2:]
        assert g["relative_spread"] == pytest.approx(w[0], rel=1e-12)
        assert g["spread"] == pytest.approx(w[1], rel=1e-12) and g["ranks"] == 2
    assert from_store["deviating_ranks"]["groups"] == 0  # robust z needs 3 ranks


@pytest.mark.slow
def test_two_ranks_convert_gives_the_sinks_store_and_answer(ddp, tmp_path):
    _check_convert(ddp, tmp_path, _analyse(ddp, tmp_path / "store.json"))


if __name__ == "__main__":
    _worker(sys.argv[1])
