"""Rows written once per data-parallel group: the layout ``run.json`` records, and reading it back for every rank
(``open_run``'s views and ``replicas`` table, the report's and csv2tb's labels, the sizing projection)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.config import load_config
from trainmon.runtime.replicas import ReplicaPlan
from trainmon.runtime.sizing import FamilySize, Sizing
from trainmon.sinks.parquet import ParquetSink
from trainmon.sinks.store_replicas import (
    ReplicaLayout,
    ReplicaLayoutError,
    ranks_text,
    replica_groups,
    replica_layouts,
    replica_map,
)
from trainmon.tools.store import StoreError, describe, open_run

FAMILIES = ("grad_reduced", "param")
INT64_MAX = 2**63 - 1


def value(rank: int, family: str, step: int, name: str) -> float:
    """A value that tells its writer, family, step and row apart."""
    return 1000.0 * rank + 100.0 * FAMILIES.index(family) + 10.0 * step + len(name) if family in FAMILIES \
        else -1.0 - rank - step


def record(rank: int, step: int, families: tuple[str, ...]) -> StepRecord:
    rows = []
    for family in families:
        for name in ("fc1.weight", "head.bias"):
            rows.append(Row(RowKey(family, name, 0, 0, len(rows)), step, {"norm": value(rank, family, step, name)},
                            False))
    return StepRecord(step, rank, rows, scalars={"loss": float(rank)})


def write_run(run: Path, layouts: list[ReplicaLayout], writes: dict[int, list[tuple[int, tuple[str, ...]]]]) -> None:
    """A run directory: ``run.json`` (and ``run.resume{n}.json``) with ``layouts``, and each rank's store rows
    (``writes[rank]``: ``(step, families written)``)."""
    run.mkdir(parents=True)
    for i, layout in enumerate(layouts):
        name = "run.json" if i == 0 else f"run.resume{i}.json"
        (run / name).write_text(json.dumps({"world_size": 4, "replicated": layout.as_json()}))
    for rank, steps in writes.items():
        (run / f"rank{rank}").mkdir()
        sink = ParquetSink(run / f"rank{rank}", run)
        for step, families in steps:
            sink.write(record(rank, step, families))
        sink.close()


def query(run: Path, sql: str) -> list[tuple]:
    con = open_run(run)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


# ----------------------------------------------------------------------------- the layout record
def test_layout_from_every_ranks_writer():
    layout = ReplicaLayout.of_writers(5, FAMILIES, [0, 0, 2, 2, -1, 5])
    assert layout.groups() == [[0, 1], [2, 3]]  # rank 4 writes nothing, rank 5 is a group of one: left out
    assert layout.writer == {0: 0, 1: 0, 2: 2, 3: 2}
    assert (layout.writes(1, "param"), layout.writes(1, "actv"), layout.writes(0, "param"), layout.writes(5, "param")) \
        == (False, True, True, True)
    entry = layout.as_json()
    assert entry == {"from_step": 5, "families": list(FAMILIES), "groups": [[0, 1], [2, 3]],
                     "writer": {"0": 0, "1": 0, "2": 2, "3": 2}}
    assert ReplicaLayout.from_json(json.loads(json.dumps(entry)), "run.json") == layout
    # no group of two or more: nothing is written once, whatever the families
    assert ReplicaLayout.of_writers(0, FAMILIES, [0, 1]).as_json() == {"from_step": 0, "families": [], "groups": [],
                                                                       "writer": {}}


@pytest.mark.parametrize("entry", [[], {"from_step": -1}, {"families": "param"}, {"writer": []},
                                   {"families": ["param"], "writer": {"x": 0}}, {"writer": {"1": True}}])
def test_a_bad_layout_names_the_file(tmp_path, entry):
    (tmp_path / "run.json").write_text(json.dumps({"replicated": entry}))
    with pytest.raises(ReplicaLayoutError, match=r"run\.json: 'replicated' cannot be read"):
        replica_layouts(tmp_path)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ReplicaLayoutError, match=r"run\.json: not a readable run\.json"):
        replica_layouts(tmp_path)


def test_map_covers_each_layout_until_a_later_one_starts():
    once = ReplicaLayout.of_writers(0, FAMILIES, [0, 0])
    # every rank writes from step 10; a run resumed from step 5 (an earlier checkpoint) writes once again
    layouts = [once, ReplicaLayout(10), ReplicaLayout.of_writers(5, ("param",), [0, 0])]
    assert replica_map(layouts) == [("grad_reduced", 0, 0, 0, 4), ("grad_reduced", 1, 0, 0, 4),
                                    ("param", 0, 0, 0, 4), ("param", 1, 0, 0, 4),
                                    ("param", 0, 0, 5, INT64_MAX), ("param", 1, 0, 5, INT64_MAX)]
    assert replica_groups(layouts) == {("grad_reduced", 0): [0, 1], ("param", 0): [0, 1]}
    assert ranks_text([3, 0, 1, 2]) == "0-3"


def test_an_old_run_json_has_no_layout(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"world_size": 2}))
    assert replica_layouts(tmp_path) == []


# ----------------------------------------------------------------------------- what the sinks get
def test_the_plan_drops_only_its_families_from_what_the_sinks_get():
    full = record(1, 3, ("grad_unreduced", "grad_reduced", "param"))
    plan = ReplicaPlan(ReplicaLayout.of_writers(0, FAMILIES, [0, 0]), frozenset(FAMILIES))
    stored = plan.stored(full)
    assert [row.family for row in stored.rows] == ["grad_unreduced", "grad_unreduced"]
    assert (stored.step, stored.rank, stored.scalars) == (3, 1, {"loss": 1.0})
    assert len(full.rows) == 6  # the record itself (the detectors', the user's) keeps every row
    assert ReplicaPlan(ReplicaLayout()).stored(full) is full


# ----------------------------------------------------------------------------- open_run
def test_every_rank_reads_its_group_writers_rows(tmp_path):
    run = tmp_path / "run"
    layout = ReplicaLayout.of_writers(0, FAMILIES, [0, 0, 2, 2])
    every = ("grad_unreduced", *FAMILIES)
    write_run(run, [layout], {0: [(0, every), (1, every)], 1: [(0, ("grad_unreduced",)), (1, ("grad_unreduced",))],
                              2: [(0, every), (1, every)], 3: [(0, ("grad_unreduced",)), (1, ("grad_unreduced",))]})
    assert not (run / "store" / "grad_reduced" / "rank=1").exists()
    for family in FAMILIES:
        got = query(run, f"SELECT rank, step, name, norm FROM {family} ORDER BY rank, step, name")
        want = [(rank, step, name, value(rank - rank % 2, family, step, name))
                for rank in range(4) for step in (0, 1) for name in ("fc1.weight", "head.bias")]
        assert got == want
        assert query(run, f"SELECT count(*) FROM {family} WHERE rank = 1") == [(4,)]
    # each rank's own family is read as written
    assert query(run, "SELECT rank, count(*) FROM grad_unreduced GROUP BY rank ORDER BY rank") == \
        [(rank, 4) for rank in range(4)]
    assert query(run, "SELECT family, rank, writer FROM replicas WHERE family = 'param' ORDER BY rank") == \
        [("param", 0, 0), ("param", 1, 0), ("param", 2, 2), ("param", 3, 2)]
    assert "replicas: family VARCHAR, rank BIGINT, writer BIGINT" in describe(open_run(run))


def test_a_resumed_run_that_changed_the_layout_reads_each_part_once(tmp_path):
    """Steps 0-1 written once per group, steps 2-3 by every rank (a resume with write_replicated_once: false)."""
    run = tmp_path / "run"
    layouts = [ReplicaLayout.of_writers(0, FAMILIES, [0, 0]), ReplicaLayout(2)]
    every = ("grad_unreduced", *FAMILIES)
    write_run(run, layouts, {0: [(step, every) for step in range(4)],
                             1: [(0, ("grad_unreduced",)), (1, ("grad_unreduced",)), (2, every), (3, every)]})
    got = query(run, "SELECT rank, step, norm FROM param WHERE name = 'head.bias' ORDER BY rank, step")
    assert got == [(0, 0, value(0, "param", 0, "head.bias")), (0, 1, value(0, "param", 1, "head.bias")),
                   (0, 2, value(0, "param", 2, "head.bias")), (0, 3, value(0, "param", 3, "head.bias")),
                   (1, 0, value(0, "param", 0, "head.bias")), (1, 1, value(0, "param", 1, "head.bias")),
                   (1, 2, value(1, "param", 2, "head.bias")), (1, 3, value(1, "param", 3, "head.bias"))]


def test_a_run_without_layout_has_plain_views_and_no_replicas_table(tmp_path):
    run = tmp_path / "run"
    write_run(run, [ReplicaLayout()], {0: [(0, FAMILIES)], 1: [(0, FAMILIES)]})
    assert query(run, "SELECT rank, count(*) FROM param GROUP BY rank ORDER BY rank") == [(0, 2), (1, 2)]
    assert "replicas" not in describe(open_run(run))


def test_open_run_names_a_broken_run_json(tmp_path):
    run = tmp_path / "run"
    write_run(run, [ReplicaLayout()], {0: [(0, FAMILIES)]})
    (run / "run.json").write_text(json.dumps({"replicated": {"writer": "all"}}))
    with pytest.raises(StoreError, match=r"run\.json: 'replicated' cannot be read"):
        open_run(run)


# ----------------------------------------------------------------------------- sizing
def test_sizing_counts_replicated_families_on_their_writers_only():
    families = (FamilySize("grad_unreduced", 10, False, {"parquet": 16.0}),
                FamilySize("grad_reduced", 10, False, {"parquet": 16.0}))
    sizing = Sizing(families, ("parquet",), world_size=64, replicated=("grad_reduced",), replica_writers=1)
    assert sizing.bytes_per_step == 320.0  # one rank that writes both
    assert sizing.bytes_per_run(1000) == 1000 * 160.0 * (64 + 1)
    assert "x64 ranks, grad_reduced by 1 of them (once per data-parallel group): 10 MB" in sizing.line()
    assert sizing.as_dict()["bytes_per_1000_steps_all_ranks"] == 10_400_000
    every = Sizing(families, ("parquet",), world_size=64)
    assert every.bytes_per_run(1000) == 1000 * 320.0 * 64
    assert load_config({}).write_replicated_once is True


# ----------------------------------------------------------------------------- report and csv2tb
def _once_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    every = ("grad_unreduced", *FAMILIES)
    write_run(run, [ReplicaLayout.of_writers(0, FAMILIES, [0, 0])],
              {0: [(0, every), (1, every)], 1: [(0, ("grad_unreduced",)), (1, ("grad_unreduced",))]})
    return run


def test_report_shows_every_rank_with_its_group_writers_rows_and_says_so(tmp_path, capsys):
    import re

    from trainmon.tools.cli import main

    run = _once_run(tmp_path)
    assert main(["report", str(run), "-o", str(tmp_path / "report.html")]) == 0
    html = (tmp_path / "report.html").read_text()
    data = json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>', html, re.S)
                      .group(1))
    assert data["ranks"] == [0, 1]
    (by_rank,) = [g for g in data["grids"] if g["view"] == "ranks" and g["family"] == "grad_reduced"]
    assert by_rank["cols"]["ranks"] == [0, 1]  # rank 1 wrote no grad_reduced: its column holds rank 0's rows
    assert "grad_reduced, param: written once per data-parallel group: the rows of rank 0 for ranks 0-1" \
        in data["notes"]


def test_csv2tb_notes_whose_event_files_hold_the_families_written_once(tmp_path, capsys):
    from trainmon.tools.cli import main

    run = _once_run(tmp_path)
    assert main(["csv2tb", str(run)]) == 0
    err = capsys.readouterr().err
    assert (f"note: {run}: grad_reduced, param: written once per data-parallel group: the event files of rank 0 "
            "for ranks 0-1") in err
    assert main(["csv2tb", str(run), "--families", "grad_unreduced", "-o", str(tmp_path / "tb")]) == 0
    assert "written once" not in capsys.readouterr().err  # not about families it did not convert


# ----------------------------------------------------------------------------- what the torch integration assumes
def test_torch_replicas_are_ddps_group_or_the_dp_group_given(monkeypatch):
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tests.launch import free_port
    from trainmon.integrations.base import REPLICATED_FAMILIES, AttachOptions
    from trainmon.integrations.torch import replicated_families

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        adam = torch.optim.Adam(net.parameters())
        found = replicated_families(ddp, [adam], AttachOptions())
        assert found is not None and found.families == REPLICATED_FAMILIES and found.group is ddp.process_group
        compiled = torch.compile(ddp, backend="eager")  # a wrapper around DDP: DDP's group all the same
        assert replicated_families(compiled, [adam], AttachOptions()) == found
        # ZeroRedundancyOptimizer: each rank keeps the states of its own parameters, not the replicas' shared ones
        zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam)
        assert replicated_families(ddp, [zero], AttachOptions()).families == ("grad_reduced", "param")
        # without DDP: only a dp_group given to attach says the gradients are averaged over it
        assert replicated_families(net, [adam], AttachOptions()) is None
        group = dist.new_group([0])
        assert replicated_families(net, [adam], AttachOptions(dp_group=group)).group is group
        # DDP that leaves parameters out of its reduction: nothing is assumed
        ignored = torch.nn.Sequential(torch.nn.Linear(4, 4))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ignored, ["0.bias"])
        assert replicated_families(torch.nn.parallel.DistributedDataParallel(ignored), [adam], AttachOptions()) is None
    finally:
        dist.destroy_process_group()


def test_analyse_spreads_only_families_that_differ_across_ranks(tmp_path):
    """trainmon analyse's cross-rank spread skips the families written once per group (the same on every rank of
    the group by construction) and ranks the others: here grad_unreduced, whose values differ per rank."""
    from trainmon.tools.store_analyse import row_sections

    run = tmp_path / "run"
    every = ("grad_unreduced", *FAMILIES)
    write_run(run, [ReplicaLayout.of_writers(0, FAMILIES, [0, 0, 2, 2])],
              {0: [(0, every)], 1: [(0, ("grad_unreduced",))], 2: [(0, every)], 3: [(0, ("grad_unreduced",))]})
    con = open_run(run)
    try:
        sections = row_sections(con)
    finally:
        con.close()
    assert {group["family"] for group in sections["spread"]} == {"grad_unreduced"}
    norms = [-1.0 - rank for rank in range(4)]  # value() of grad_unreduced at step 0
    for group in sections["spread"]:
        assert group["min"] == min(norms) and group["max"] == max(norms) and group["ranks"] == 4
