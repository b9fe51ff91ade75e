"""Families identical on every data-parallel replica, written once per group: torch DDP on 2 gloo ranks.

``write_replicated_once: true`` (the default): rank 1 writes no ``grad_reduced``, ``param`` or Adam-state files, and
reading the run's store back (``open_run``) gives rank 1 its rows all the same, equal to float64 numpy references
the script computed on rank 1 from its own tensors (``p.grad`` after DDP's all-reduce, read in an optimizer step
pre-hook of the script's own; the parameters there; Adam's states after the step), and to rank 0's. Rank 1's anomaly
detectors still see those rows (a NaN put into the reduced gradient is reported on both ranks). ``false``: every
rank writes every family. Both runs in one launch (two monitors one after the other).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launch import run_ranks
from tests.reference import METRICS, adam_update_np, assert_close, np_stats

STEPS = 3
NAN_STEP = STEPS - 1
REPLICATED = ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio")
BETAS, EPS = (0.9, 0.999), 1e-8


def _train(out_dir: Path, run_name: str, once: bool) -> dict[str, list[list[str]]]:
    """One monitored DDP run: saves this rank's float64 references (``{run_name}_refs_rank{R}.npz``) and returns the
    families of the records ``monitor.step()`` returned."""
    import torch.distributed as dist

    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TinyNet()
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS)
    names = {p: name for name, p in net.named_parameters()}
    refs: dict[str, dict[str, np.ndarray]] = {family: {} for family in REPLICATED}
    step = 0

    def before_step(opt, args, kwargs):  # what the optimizer steps with: after DDP's all-reduce
        for p, name in names.items():
            refs["grad_reduced"][f"{step}|{name}"] = p.grad.double().numpy().copy()
            refs["param"][f"{step}|{name}"] = p.detach().double().numpy().copy()

    def after_step(opt, args, kwargs):
        for p, name in names.items():
            state = opt.state[p]
            m, v = state["exp_avg"].double().numpy(), state["exp_avg_sq"].double().numpy()
            update = adam_update_np(m, v, float(state["step"]), BETAS, EPS)
            after = p.detach().double().numpy()
            refs["exp_avg"][f"{step}|{name}"], refs["exp_avg_sq"][f"{step}|{name}"] = m.copy(), v.copy()
            refs["update"][f"{step}|{name}"] = update
            refs["ratio"][f"{step}|{name}"] = np.where(after != 0, update / np.where(after != 0, after, 1), 0)

    handles = [optimizer.register_step_pre_hook(before_step), optimizer.register_step_post_hook(after_step)]
    monitor = TrainerMonitor({
        "output_dir": str(out_dir), "run_name": run_name, "sinks": ["parquet"], "write_replicated_once": once,
        "weight_grads": {"metrics": METRICS}, "params": {"enabled": True, "metrics": METRICS},
        "optimizer_states": {"states": ["exp_avg", "exp_avg_sq", "update", "ratio"], "metrics": METRICS},
        "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]}})
    monitor.attach(model, optimizer)
    recorded: list[list[str]] = []
    try:
        for step in range(STEPS):
            tokens, targets = batch(100 * rank + step)  # different data on each rank
            loss_fn(model, tokens, targets).backward()
            if step == NAN_STEP:  # after the all-reduce, the same on both ranks: the detectors must see it
                net.head.bias.grad[0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
            record = monitor.step()
            recorded.append(sorted({row.family for row in record.rows}))
    finally:
        monitor.close()
        for handle in handles:
            handle.remove()
    np.savez(out_dir / f"{run_name}_refs_rank{rank}.npz",
             **{f"{family}|{key}": array for family, arrays in refs.items() for key, array in arrays.items()})
    return {"families": recorded}


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        results = {name: _train(Path(out_dir), name, once) for name, once in (("once", True), ("every", False))}
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"recorded_rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replicated")
    run_ranks([__file__, out], world_size=2, timeout=240)
    return out


def _refs(runs: Path, run_name: str, rank: int) -> dict[tuple[str, int, str], np.ndarray]:
    refs = np.load(runs / f"{run_name}_refs_rank{rank}.npz")
    out = {}
    for key in refs.files:
        family, step, name = key.split("|")
        out[(family, int(step), name)] = refs[key]
    return out


def _rows(runs: Path, run_name: str, family: str, rank: int) -> dict[tuple[int, str], dict[str, float]]:
    from trainmon.tools.store import open_run

    con = open_run(runs / run_name)
    try:
        frame = con.execute(f"SELECT step, name, {', '.join(METRICS)} FROM {family} WHERE rank = ?", [rank]).df()
    finally:
        con.close()
    assert not frame.duplicated(["step", "name"]).any(), (run_name, family, rank)
    return {(int(row.step), row["name"]): row for _, row in frame.iterrows()}


def _check_against_references(runs: Path, run_name: str) -> int:
    checked = 0
    for rank in (0, 1):
        refs = _refs(runs, run_name, rank)
        for family in REPLICATED:
            rows = _rows(runs, run_name, family, rank)
            wanted = {(step, name): array for (f, step, name), array in refs.items() if f == family}
            assert set(rows) == set(wanted), (run_name, family, rank)
            for (step, name), array in wanted.items():
                adam = family in ("update", "ratio")
                metrics = [m for m in METRICS if not (adam and m == "zeros")]
                assert_close(rows[(step, name)], np_stats(array), metrics, rtol=1e-4 if adam else 1e-5,
                             label=f"{run_name} rank {rank} {family} step {step} {name}")
                checked += 1
    return checked


@pytest.mark.slow
def test_replicated_families_are_written_once_and_read_back_for_every_rank(runs):
    from trainmon.tools.store import open_run

    run = runs / "once"
    store = run / "store"
    for family in REPLICATED:
        assert (store / family / "rank=0").is_dir(), family
        assert not (store / family / "rank=1").exists(), f"rank 1 wrote {family}"
    for table in ("grad_unreduced", "scalars"):  # each rank's own rows: written by each
        assert (store / table / "rank=1").is_dir(), table
    info = json.loads((run / "run.json").read_text())
    assert info["replicated"] == {"from_step": 0, "families": list(info["replicated"]["families"]),
                                  "groups": [[0, 1]], "writer": {"0": 0, "1": 0}}
    assert set(REPLICATED) <= set(info["replicated"]["families"])
    assert set(info["sizing"]["replicated"]) >= set(REPLICATED) and info["sizing"]["replica_writers"] == 1

    assert _check_against_references(runs, "once") > 100
    # the premise: what DDP's replicas step with and keep is bit-identical on both ranks
    refs0, refs1 = _refs(runs, "once", 0), _refs(runs, "once", 1)
    assert refs0.keys() == refs1.keys() and all(np.array_equal(refs0[k], refs1[k], equal_nan=True) for k in refs0)
    for family in REPLICATED:
        assert _rows(runs, "once", family, 1).keys() == _rows(runs, "once", family, 0).keys()
    con = open_run(run)
    try:  # rank 1's rows are rank 0's, value for value; each rank's grad_unreduced its own
        differ = con.execute("SELECT count(*) FROM grad_reduced a JOIN grad_reduced b USING (step, name) "
                             "WHERE a.rank = 0 AND b.rank = 1 AND a.norm IS DISTINCT FROM b.norm").fetchone()[0]
        own = con.execute("SELECT count(*) FROM grad_unreduced a JOIN grad_unreduced b USING (step, name) "
                          "WHERE a.rank = 0 AND b.rank = 1 AND a.norm <> b.norm").fetchone()[0]
    finally:
        con.close()
    assert differ == 0 and own > 0

    # rank 1 computed the rows all the same: its record has them and its detector saw the NaN
    recorded = json.loads((runs / "recorded_rank1.json").read_text())["once"]["families"]
    assert all(set(REPLICATED) <= set(families) for families in recorded)
    for rank in (0, 1):
        events = [json.loads(line) for line in (run / f"rank{rank}" / "anomalies.jsonl").read_text().splitlines()]
        assert any(e["family"] == "grad_reduced" and e["name"] == "head.bias" and e["step"] == NAN_STEP
                   for e in events), rank


@pytest.mark.slow
def test_with_the_key_off_every_rank_writes_every_family(runs):
    run = runs / "every"
    for family in REPLICATED:
        for rank in (0, 1):
            assert (run / "store" / family / f"rank={rank}").is_dir(), (family, rank)
    info = json.loads((run / "run.json").read_text())
    assert info["replicated"] == {"from_step": 0, "families": [], "groups": [], "writer": {}}
    assert _check_against_references(runs, "every") > 100


if __name__ == "__main__":
    _worker(sys.argv[1])
