"""The rollback's host side, framework-free: batch identities, the skip list and its sampler, reading rollbacks, the
keeper's health and decisions, events that carry their batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from trainmon.actions.resume import Rollback, read_rollback
from trainmon.actions.rollback import RollbackExit, RollbackKeeper
from trainmon.actions.skip_list import SkipList, SkipSampler, batch_identity, merge_identities
from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import _FAST, analyse_run
from trainmon.base.records import StepRecord
from trainmon.config import ConfigError, RollbackConfig, load_config


# ----------------------------------------------------------------------------- identities
@pytest.mark.parametrize(("value", "expected"), [
    ((8, 16), [[8, 16]]), ((8, 8), []), (range(3, 7), [[3, 7]]), (5, [[5, 6]]), ([9, 3, 4, 5, 3], [[3, 6], [9, 10]]),
    (np.array([[2, 1], [7, 0]]), [[0, 3], [7, 8]]), (range(0, 10, 3), [[0, 1], [3, 4], [6, 7], [9, 10]]), ([], []),
])
def test_batch_identity_of_ranges_and_indices(value, expected):
    assert batch_identity(value) == {"samples": expected}


def test_batch_identity_of_a_cpu_tensor_and_of_an_identity_dict():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    assert batch_identity(torch.tensor([4, 2, 3])) == {"samples": [[2, 5]]}
    assert batch_identity({"batches": [[1, 5, 6], [0, 2, 3], [1, 4, 5]], "samples": [[4, 8], [0, 4]]}) == {
        "samples": [[0, 8]], "batches": [[0, 2, 3], [1, 4, 6]]}
    with pytest.raises(TypeError, match="on the CPU"):
        batch_identity(torch.zeros(3, dtype=torch.long, device="meta"))


@pytest.mark.parametrize(("value", "error", "match"), [
    ([1.5, 2.0], TypeError, "integers"), (True, TypeError, "range"), ("12", TypeError, "str"),
    ([-1, 2], ValueError, ">= 0"), ((9, 3), ValueError, "ends before"), ({"sample": [[0, 1]]}, ValueError, "keys"),
    ({"batches": [[0, 1]]}, ValueError, "epoch, first, end"), ({"samples": [[0, "a"]]}, ValueError, "start, end"),
])
def test_batch_identity_refuses_what_is_not_sample_indices(value, error, match):
    with pytest.raises(error, match=match):
        batch_identity(value)


def test_the_micro_batches_of_a_step_merge():
    merged = merge_identities(batch_identity((0, 4)), batch_identity([4, 5, 9]))
    assert merged == {"samples": [[0, 6], [9, 10]]}
    assert merge_identities(None, merged) is merged and merge_identities(merged, None) is merged


# ----------------------------------------------------------------------------- the skip list and its sampler
def _skip(*ranges: tuple[int, int]) -> SkipList:
    return SkipList([{"step": i, "batch": {"samples": [list(r)]}} for i, r in enumerate(ranges)])


def test_skip_sampler_leaves_out_the_samples_and_keeps_the_order_of_a_random_sampler():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    data = list(range(50))
    inner = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(3))
    order = list(torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(3)))
    sampler = SkipSampler(inner, _skip((10, 20), (45, 60)))
    assert list(sampler) == [i for i in order if not (10 <= i < 20 or 45 <= i < 60)]
    assert len(sampler) == 35
    sequential = SkipSampler(torch.utils.data.SequentialSampler(data), [(0, 5)])
    assert list(sequential) == list(range(5, 50)) and len(sequential) == 45


def test_skip_sampler_of_an_unknown_sampler_and_set_epoch():
    class Shard:  # yields some indices, each epoch differently (like a DistributedSampler)
        def __init__(self) -> None:
            self.epoch = 0

        def __iter__(self):
            return iter([self.epoch, 10, 11, 12])

        def __len__(self) -> int:
            return 4

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    sampler = SkipSampler(Shard(), _skip((10, 12)))
    sampler.set_epoch(7)
    assert list(sampler) == [7, 12] and len(sampler) == 4  # an upper bound where the sampler is not a permutation
    assert list(SkipSampler([3, 1, 2], None)) == [3, 1, 2]


def test_skip_list_queries():
    skip = SkipList([{"step": 9, "batch": {"batches": [[1, 4, 5]]}}, {"step": 3, "batch": {"samples": [[5, 9]]}},
                     {"step": 4, "batch": None}, {"step": 5, "batch": {"samples": [[9, 10]], "batches": [[1, 5, 6]]}}])
    assert skip.steps() == [3, 4, 5, 9] and skip.samples() == [(5, 10)] and skip.batches() == {1: [(4, 6)]}
    assert 5 in skip and 9 in skip and 10 not in skip and 4 not in skip and "5" not in skip
    assert [entry["step"] for entry in skip.after(5)] == [9, 5]
    assert len(skip.union(skip.entries)) == 4


def test_skip_list_read_every_rank_ignores_a_line_cut_short_and_names_a_corrupt_line(tmp_path):
    for rank, steps in ((0, [3, 7]), (1, [3])):
        lines = [json.dumps({"step": s, "rank": rank, "batch": {"samples": [[s * 8 + rank, s * 8 + rank + 1]]}})
                 for s in steps]
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "skip_list.jsonl").write_text("\n".join(lines) + "\n")
    with open(tmp_path / "rank1" / "skip_list.jsonl", "a") as handle:
        handle.write('{"step": 9, "ba')  # a crash while writing
    skip = SkipList.read(tmp_path)
    assert [(entry["rank"], entry["step"]) for entry in skip] == [(0, 3), (0, 7), (1, 3)]
    assert skip.samples() == [(24, 26), (56, 57)]
    (tmp_path / "rank1" / "skip_list.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"rank1/skip_list.jsonl:2: not a skip-list entry"):
        SkipList.read(tmp_path)


# ----------------------------------------------------------------------------- reading rollbacks
def _rollback(path: Path, **fields: object) -> dict:
    data = {"version": 1, "step": 7, "rank": 0, "start_step": 0, "exit_code": 17, "time": "2026-01-01T00:00:01.000Z",
            "reason": "loss is nan", "checkpoint": "ckpt/6.pt", "resume_step": 6,
            "skip": [{"step": 7, "batch": {"samples": [[56, 64]]}}], "events": [], **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


def test_read_rollback_from_a_file_a_run_and_a_folder_of_runs(tmp_path):
    run = tmp_path / "out" / "run"
    (run / "rank0").mkdir(parents=True)
    _rollback(run / "rollback.json")
    _rollback(run / "rollback.1.json", rank=1, time="2026-01-01T00:00:02.000Z", checkpoint="ckpt/3.pt",
              resume_step=3, skip=[{"step": 5, "batch": {"samples": [[40, 48]]}}])
    direct = read_rollback(run / "rollback.json")
    assert isinstance(direct, Rollback) and direct.checkpoint == "ckpt/6.pt" and direct.skip.samples() == [(56, 64)]
    merged = read_rollback(run)  # two ranks of one launch: every rank's data, the earliest checkpoint
    assert merged is not None and merged.rank == 1 and merged.checkpoint == "ckpt/3.pt" and merged.resume_step == 3
    assert merged.skip.samples() == [(40, 48), (56, 64)]
    assert read_rollback(tmp_path / "out").path == merged.path
    assert read_rollback(run, checkpoint="ckpt/6.pt").checkpoint == "ckpt/6.pt"
    assert read_rollback(run, checkpoint="ckpt/9.pt") is None
    assert read_rollback(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else tmp_path) is None


@pytest.mark.parametrize(("fields", "match"), [
    ({"version": 2}, "version 1"), ({"step": "7"}, "integers"), ({"resume_step": -1}, "resume_step"),
    ({"checkpoint": 3}, "checkpoint"), ({"skip": [{"batch": None}]}, "skip"),
    ({"skip": [{"step": 1, "batch": {"samples": [[-4, 2]]}}]}, ">= 0"),
])
def test_a_broken_rollback_is_named(tmp_path, fields, match):
    _rollback(tmp_path / "rollback.json", **fields)
    with pytest.raises(ValueError, match=rf"rollback.json: not a trainmon rollback.*{match}"):
        read_rollback(tmp_path / "rollback.json")
    (tmp_path / "rollback.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_rollback(tmp_path / "rollback.json")


# ----------------------------------------------------------------------------- the keeper
def _event(step: int, detector: str = "nonfinite", message: str = "loss is nan") -> AnomalyEvent:
    return AnomalyEvent(step, 0, 0, "loss", "scalars", "loss", "value", math.nan, 1.0, detector, message, 0)


def _keeper(tmp_path: Path | None = None, actions=("log", "rollback"), escalate=(), start_step=0, **settings):
    run = tmp_path / "run" if tmp_path is not None else None
    return RollbackKeeper(RollbackConfig(**settings), list(actions), list(escalate), rank=0, run_dir=run,
                          rank_dir=run / "rank0" if run is not None else None, start_step=start_step)


def _record(step: int, skipped: float | None = None, samples: tuple[int, int] | None = None) -> StepRecord:
    scalars = {} if skipped is None else {"step_skipped": skipped}
    return StepRecord(step, 0, scalars=scalars, batch=batch_identity(samples) if samples else None)


def test_the_keeper_names_the_last_healthy_checkpoint_and_the_poisoned_data(tmp_path):
    keeper = _keeper(tmp_path)
    keeper.checkpoint(3, "ckpt/3.pt")
    assert keeper.observe(_record(3, samples=(24, 32)), [_event(3, "spike")], None) is None  # not a rollback kind
    keeper.checkpoint(6, "ckpt/6.pt")
    stop = keeper.observe(_record(7, samples=(56, 64)), [_event(7)], None)
    assert isinstance(stop, RollbackExit) and isinstance(stop, SystemExit) and stop.code == 17
    assert stop.rollback["checkpoint"] == "ckpt/6.pt" and stop.rollback["resume_step"] == 6
    assert [entry["batch"] for entry in stop.rollback["skip"]] == [{"samples": [[56, 64]]}]
    assert keeper.observe(_record(8), [_event(8)], None) is None  # once per attach
    assert keeper.checkpoint(9, "ckpt/9.pt")["healthy"] is False and keeper.last_healthy["checkpoint"] == "ckpt/6.pt"
    keeper.close()
    written = read_rollback(tmp_path / "run")
    assert written is not None and written.checkpoint == "ckpt/6.pt" and written.skip.samples() == [(56, 64)]
    lines = (tmp_path / "run" / "rank0" / "skip_list.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [7]  # step 8 came after the state was unhealthy


def test_a_step_the_guard_skipped_stays_healthy_and_enters_the_skip_list():
    keeper = _keeper()
    guard = _event(4, "step_guard", "step 4, rank 0: the step guard skipped the update (nonfinite): ...")
    assert keeper.observe(_record(4, skipped=1.0, samples=(32, 40)), [guard, _event(4)], None) is None
    assert keeper.healthy and [(e["step"], e["reason"], e["applied"]) for e in keeper.entries] == [
        (4, "step_guard (nonfinite)", False)]
    keeper.checkpoint(5, None)
    stop = keeper.observe(_record(6, skipped=0.0, samples=(48, 56)), [_event(6)], None)
    assert stop is not None and stop.rollback["resume_step"] == 5 and stop.rollback["checkpoint"] is None
    assert [entry["step"] for entry in stop.rollback["skip"]] == [6]  # step 4 is before the resume step


def test_rollback_on_guard_skips_and_on_escalation():
    keeper = _keeper(detectors=["nonfinite", "step_guard"])
    guard = _event(2, "step_guard")
    assert keeper.observe(_record(2, skipped=1.0), [guard], None) is not None
    escalating = _keeper(actions=("log",), escalate=("log", "rollback"))
    assert escalating.observe(_record(2, skipped=1.0), [guard], None) is None
    stop = escalating.observe(_record(3, skipped=1.0), [_event(3, "step_guard")], _event(3, "step_guard"))
    assert stop is not None and stop.rollback["resume_step"] == 0 and len(stop.rollback["skip"]) == 2


def test_the_keeper_state_round_trips_and_a_resumed_run_keeps_its_rollbacks_data():
    keeper = _keeper(start_step=6)
    assert keeper.last_healthy is None  # a resumed run knows no healthy state until it loads or saves one
    keeper.observe(_record(6), [_event(6)], None)
    state = json.loads(json.dumps(keeper.state_dict()))
    fresh = _keeper(start_step=6)
    fresh.load_state_dict(state)
    assert not fresh.healthy and fresh.unhealthy_since == 6
    with pytest.raises(ValueError, match="health state"):
        fresh.load_state_dict({"healthy": "yes"})
    resumed = _keeper(start_step=3)
    resumed.resume(Rollback(Path("r.json"), 5, 0, 17, "", "ckpt/3.pt", 3, _skip((40, 48))))
    stop = resumed.observe(_record(9, samples=(72, 80)), [_event(9)], None)
    assert stop is not None and stop.rollback["checkpoint"] == "ckpt/3.pt"
    assert SkipList(stop.rollback["skip"]).samples() == [(40, 48), (72, 80)]


def test_the_keeper_keeps_each_steps_data_until_its_record_is_checked():
    keeper = _keeper()
    keeper.add_batch(batch_identity((0, 4)))
    keeper.add_batch(batch_identity((4, 8)))
    keeper.end_step(0)
    keeper.end_step(1)  # no data given
    assert keeper.batch_of(0) == {"samples": [[0, 8]]} and keeper.batch_of(0) is None and keeper.batch_of(1) is None
    for step in range(2, 1000):
        keeper.add_batch(batch_identity(step))
        keeper.end_step(step)
    assert keeper.batch_of(2) is None and keeper.batch_of(999) == {"samples": [[999, 1000]]}


# ----------------------------------------------------------------------------- events and config
def test_an_event_carries_its_batch_through_json_and_analyse(tmp_path):
    event = _event(7)
    event.batch = {"samples": [[56, 64]], "batches": [[0, 7, 8]]}
    line = event.to_json()
    assert _FAST.match(line) and AnomalyEvent.from_json(line).batch == event.batch
    plain = _event(8)
    assert "batch" not in plain.to_dict() and AnomalyEvent.from_json(plain.to_json()).batch is None
    with pytest.raises(ValueError, match="batch"):
        AnomalyEvent.from_dict({**plain.to_dict(), "batch": [1, 2]})
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "anomalies.jsonl").write_text(line + "\n" + plain.to_json() + "\n")
    result = analyse_run(tmp_path)
    assert result["events"] == 2 and result["corrupt_total"] == 0 and result["top"][0]["batch"] == event.batch


def test_the_rollback_config():
    config = load_config({"anomaly": {"actions": ["log", "rollback"], "guard": {"escalate": ["rollback"]},
                                      "rollback": {"detectors": ["nonfinite", "step_guard"], "exit_code": 42}}})
    assert config.anomaly.rollback.exit_code == 42
    for bad, key in (({"exit_code": 1}, "exit_code"), ({"exit_code": 126}, "exit_code"),
                     ({"detectors": ["nan"]}, r"detectors\[0\]"), ({"skip": True}, "skip")):
        with pytest.raises(ConfigError, match=f"anomaly.rollback.{key}"):
            load_config({"anomaly": {"rollback": bad}})
    with pytest.raises(ConfigError, match=r"anomaly.actions\[0\]"):
        load_config({"anomaly": {"actions": ["roll_back"]}})
