"""Communication monitoring: 2-rank gloo collectives measured against a numpy float64 reference."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.launch import run_ranks
from tests.reference import METRICS, assert_close, np_stats

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "comm_ranks.py"
N = 16  # comm_ranks.N


def _load_script():
    spec = importlib.util.spec_from_file_location("comm_ranks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(script: Path, out_dir: Path, world_size: int = 2, timeout: float = 120) -> list[dict]:
    """Run ``script OUT_DIR`` on ``world_size`` local ranks (env:// rendezvous) and read ``rank{r}.json``."""
    run_ranks([script, out_dir], world_size=world_size, timeout=timeout)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch(SCRIPT, tmp_path_factory.mktemp("comm"))


def _rows(result: dict, step: int) -> dict[str, dict]:
    return {row["name"]: row for row in result["steps"][str(step)]["rows"]}


def _check(rows: dict[str, dict], expected: dict[str, np.ndarray]) -> None:
    assert sorted(rows) == sorted(expected)
    for name, array in expected.items():
        assert rows[name]["family"] == "comm"
        assert_close(rows[name]["values"], np_stats(array), METRICS, label=name)
    orders = [row["order"] for row in rows.values()]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)


@pytest.mark.slow
def test_comm_collectives_two_ranks(ranks):
    data = _load_script().inputs
    both = (0, 1)

    def summed(seed: int) -> np.ndarray:
        return data(0, seed) + data(1, seed)  # float32, as gloo sums

    for rank, result in enumerate(ranks):
        half = slice(8 * rank, 8 * rank + 8)
        expected = {
            # two calls of one op on one group: a row each, named by the call's index in the step
            "all_reduce.g0-1.call0.pre.0": data(rank, 1),
            "all_reduce.g0-1.call0.post.0": summed(1),
            "all_reduce.g0-1.call1.pre.0": data(rank, 2, 2 * N),
            "all_reduce.g0-1.call1.post.0": data(0, 2, 2 * N) + data(1, 2, 2 * N),
            "reduce_scatter_tensor.g0-1.call0.pre.0": data(rank, 3),
            "reduce_scatter_tensor.g0-1.call0.post.0": summed(3)[half],
            "reduce_scatter.g0-1.call0.pre.0": data(rank, 4)[:8],
            "reduce_scatter.g0-1.call0.pre.1": data(rank, 4)[8:],
            "reduce_scatter.g0-1.call0.post.0": summed(4)[half],
            "all_gather.g0-1.call0.pre.0": data(rank, 5),
            **{f"all_gather.g0-1.call0.post.{j}": data(j, 5) for j in both},
            "all_gather_into_tensor.g0-1.call0.pre.0": data(rank, 6),
            "all_gather_into_tensor.g0-1.call0.post.0": np.concatenate([data(0, 6), data(1, 6)]),
            "broadcast.g0-1.call0.post.0": data(0, 7),
        }
        if rank == 0:  # only the source's buffer holds data before a broadcast
            expected["broadcast.g0-1.call0.pre.0"] = data(0, 7)
            expected["send.g0-1.call0.pre.0"] = data(0, 8)
        else:  # a group of rank 1 alone is named by its rank; rank 0 is not in it
            expected["recv.g0-1.call0.post.0"] = data(0, 8)
            expected["all_reduce.g1.call0.pre.0"] = expected["all_reduce.g1.call0.post.0"] = data(1, 9)
        _check(_rows(result, 0), expected)
        scalars = result["steps"]["0"]["scalars"]
        assert scalars["comm/all_reduce.g0-1/calls"] == 2
        assert scalars["comm/all_reduce.g0-1/bytes"] == (16 + 32) * 4
        assert scalars["comm/all_gather.g0-1/bytes"] == 2 * 16 * 4  # the gathered output
        assert scalars["comm/reduce_scatter_tensor.g0-1/bytes"] == 16 * 4  # the scattered input

        # async: the output is measured after wait(), not at the call
        assert result["checks"]["work_is_work"]
        assert result["checks"]["rows_before_wait"] == [["all_reduce.g0-1.call0.pre.0", 0]]
        _check(_rows(result, 1), {"all_reduce.g0-1.call0.pre.0": data(rank, 10),
                                  "all_reduce.g0-1.call0.post.0": summed(10),
                                  "batch_isend_irecv.g0-1.call0.pre.0": data(rank, 15),  # i: position in the op list
                                  "batch_isend_irecv.g0-1.call0.post.1": data(1 - rank, 15)})
        assert result["steps"]["1"]["scalars"]["comm/batch_isend_irecv.g0-1/calls"] == 1  # not isend + irecv
        assert result["checks"]["internal_measured"] == 0  # collectives after before_transfer()

        assert result["steps"]["2"] == {"rows": [], "scalars": {}}  # uncollected step

        # call sites and the call-site filter; the two calls of one site (16 and 48 elements) are
        # combined exactly: the mean is weighted by element count, the norm is sqrt(sum of norm^2)
        rows = _rows(result, 4)
        assert len(rows) == 2 and all(re.fullmatch(r"all_reduce\.g0-1@comm_ranks:reduce_here:\d+\.(pre|post)\.0", n)
                                      for n in rows)
        pre = next(n for n in rows if n.endswith(".pre.0"))
        assert_close(rows[pre]["values"], np_stats(np.concatenate([data(rank, 13), data(rank, 16, 3 * N)])), METRICS)
        big_sum = data(0, 16, 3 * N) + data(1, 16, 3 * N)
        assert_close(rows[pre.replace(".pre.", ".post.")]["values"], np_stats(np.concatenate([summed(13), big_sum])),
                     METRICS)
        unweighted = (np.mean(summed(13), dtype=np.float64) + np.mean(big_sum, dtype=np.float64)) / 2
        assert abs(rows[pre.replace(".pre.", ".post.")]["values"]["mean"] - unweighted) > 1e-3
        assert result["steps"]["4"]["scalars"]["comm/all_reduce.g0-1@comm_ranks:reduce_here:" +
                                              pre.split(":")[-1].split(".")[0] + "/calls"] == 2


@pytest.mark.slow
def test_comm_nan_attributed_to_its_rank(ranks):
    data = _load_script().inputs
    poisoned = data(1, 12).copy()
    poisoned[3] = np.nan
    for rank, result in enumerate(ranks):
        rows = _rows(result, 3)
        pre, post = rows["all_reduce.g0-1.call0.pre.0"], rows["all_reduce.g0-1.call0.post.0"]
        assert pre["values"]["nans"] == (1.0 if rank == 1 else 0.0)
        assert pre["nonfinite"] is (rank == 1)
        assert_close(pre["values"], np_stats(poisoned if rank == 1 else data(0, 12)), METRICS)
        assert post["values"]["nans"] == 1.0 and post["nonfinite"]  # it arrives on both ranks
        assert pre["order"] < post["order"]


@pytest.mark.slow
def test_comm_close_restores_originals_and_keeps_foreign_wrappers(ranks):
    for result in ranks:
        checks = result["checks"]
        assert checks["wrapped"] and checks["restored"]  # every wrapped function, in both modules
        assert checks["foreign_kept"] and checks["c10d_restored"]
        assert checks["foreign_calls"] == 1 and checks["foreign_result"] == [2.0] * 4
        assert result["steps"]["5"] == {"rows": [], "scalars": {}}  # our wrapper under it only calls through


def test_comm_group_labels():
    from trainmon.collect.comm_ops import group_label

    assert group_label([0, 1, 2, 3]) == "g0-3"
    assert group_label([1, 5, 9, 13]) == "g1-13step4"
    assert group_label([0, 3, 4]) == "g0_3_4"
    assert group_label([0, 4]) == "g0_4"
    assert group_label([2]) == "g2"


def test_comm_single_rank_lifecycle_and_reload_chain(tmp_path):
    """One process: measured after wait() through the Work subclass; a second collector wrapping the
    first (a config reload) is spliced correctly whichever closes first; close() twice is harmless."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from trainmon.base.records import finalize
    from trainmon.collect.buffer import StepBuffer
    from trainmon.collect.comm import CommCollector
    from trainmon.collect.context import StepContext
    from trainmon.collect.stats_base import StatsSpec
    from trainmon.config import CommunicationConfig

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        original, original_c10d = dist.all_gather_into_tensor, c10d.all_gather_into_tensor
        ctx = StepContext(specs={"comm": StatsSpec.from_metrics(METRICS, 1e-8)}, metrics={"comm": list(METRICS)},
                          collecting=True)
        first = CommCollector(ctx, CommunicationConfig(enabled=True, ops=["all_gather_into_tensor"]))
        second = CommCollector(ctx, CommunicationConfig(enabled=True, ops=["all_gather_into_tensor"]))
        first.close()  # the older one goes first, as in a config reload
        assert dist.all_gather_into_tensor is c10d.all_gather_into_tensor is not original
        x = torch.linspace(-2.0, 3.0, 11)
        out = torch.empty(11)
        work = dist.all_gather_into_tensor(out, x, async_op=True)
        assert isinstance(work, dist.Work)
        assert work.wait() and work.is_completed() and work.is_success()
        second.before_transfer()
        host = ctx.buffer.transfer()
        rows = {key.name: finalize(partial, METRICS)[0] for key, partial in zip(host.keys, host.partials)}
        assert sorted(rows) == ["all_gather_into_tensor.g0.call0.post.0", "all_gather_into_tensor.g0.call0.pre.0"]
        for values in rows.values():
            assert_close(values, np_stats(np.linspace(-2.0, 3.0, 11, dtype=np.float32)), METRICS)
        assert host.scalars == {"comm/all_gather_into_tensor.g0/calls": 1.0,
                                "comm/all_gather_into_tensor.g0/bytes": 44.0}
        ctx.buffer = StepBuffer()
        second.close()
        second.close()
        assert dist.all_gather_into_tensor is original and c10d.all_gather_into_tensor is original_c10d
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_comm_monitor_run_attributes_forward_nan_to_its_rank_and_phase(ranks, tmp_path_factory, capsys):
    """Through TrainerMonitor: a collective inside a layer's forward is a forward row, ordered among the
    forward rows, so rank 1's all_reduce pre row is the first origin (not a downstream row of rank 0)."""
    import pandas as pd

    from trainmon.anomaly.merge import analyse_run
    from trainmon.tools.cli import main

    run_dir = Path(ranks[0]["run_dir"])
    for rank, result in enumerate(ranks):
        assert result["checks"]["monitor_wrapped"] and result["checks"]["monitor_restored"]
        phases = result["monitor"]["phases"]
        assert phases["all_reduce.g0-1.call0.pre.0"][0] == "forward"  # inside ReducingLayer.forward
        assert phases["all_reduce.g0-1.call1.pre.0"][0] == "backward"  # the gradient hook, inside autograd
        assert {phases[f"all_reduce.g0-1.call{i}.pre.0"][0] for i in range(2, 8)} == {"communication"}
        callbacks = result["monitor"]["events"]
        assert [(e["step"], e["detector"]) for e in callbacks] == [(3, "nonfinite")]  # on_anomaly, per rank
        comm = pd.read_csv(run_dir / f"rank{rank}" / "comm.csv")
        assert {"all_reduce.g0-1.call0.pre.0", "all_reduce.g0-1.call0.post.0"} <= set(comm["name"])
        assert sorted(set(comm["step"])) == [0, 1, 2, 3]
        nan_at_pre = comm[(comm["name"] == "all_reduce.g0-1.call0.pre.0") & (comm["step"] == 3)]["nans"]
        assert nan_at_pre.tolist() == [1.0 if rank == 1 else 0.0]
        scalars = pd.read_csv(run_dir / f"rank{rank}" / "scalars.csv")
        step0 = dict(zip(scalars[scalars["step"] == 0]["name"], scalars[scalars["step"] == 0]["value"]))
        assert step0["comm/all_reduce.g0-1/calls"] == 8  # forward, backward hook, 6 gradients
        assert step0["comm/all_reduce.g0-1/bytes"] == 4 * (2 * 4 * 8 + 8 * 8 + 8 + 8 * 8 + 8 + 8 + 1)

    result = analyse_run(run_dir)
    first = result["first_origin"]
    assert (first["rank"], first["step"], first["phase"], first["family"], first["name"]) == (
        1, 3, "forward", "comm", "all_reduce.g0-1.call0.pre.0")
    assert [e["rank"] for e in result["first_by_step"]] == [1]
    second = result["top"][1]  # rank 0 sees the NaN arrive after the call
    assert (second["rank"], second["name"]) == (0, "all_reduce.g0-1.call0.post.0")

    out = tmp_path_factory.mktemp("analyse")
    capsys.readouterr()
    assert main(["analyse", str(run_dir), "--top", "3", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("first origin: first non-finite value at step 3, micro-step 0, rank 1: "
            "forward communication all_reduce.g0-1.call0.pre.0") in printed
    written = json.loads((out / "anomaly_analyse.json").read_text())
    assert written["first_origin"]["name"] == "all_reduce.g0-1.call0.pre.0" and written["first_origin"]["rank"] == 1
