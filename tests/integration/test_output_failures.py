"""Every output of a real monitor on a full disk and next to planted symlinks: training never sees
an error, nothing outside the run directory is touched; dump stacks keep user frames.

The full disk is a real 1 MiB tmpfs (skipped where it cannot be mounted).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.integration.test_dump import Net  # layer 2 can be poisoned with a NaN
from trainmon import TrainerMonitor
from trainmon.actions.dump import TargetedDump
from trainmon.config import DumpConfig

EVERY_OUTPUT = {
    "run_name": "run", "sinks": ["csv", "tensorboard"], "print_struct": True,
    "activations": {"enabled": True},
    "grad_probe": {"enabled": True, "level": "L1"},
    "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["log", "jsonl", "dump", "free_benchmark"]},
    "dump": {"enabled": True, "mode": "tensor", "depth": 1, "max_dumps": 50},
    # change_value swaps two input elements: a Linear fails the check, so every step has CSV rows.
    "free_benchmark": {"enabled": True, "pert_mode": "change_value", "targets": ["layers.*.fc"]},
}


def _train(monitor: TrainerMonitor, steps: int, poisoned: set[int]) -> list[int]:
    """Adam on a fixed batch; returns the steps whose ``monitor.step()`` raised (must be none)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.ones(4, 1)
    monitor.attach(model, optimizer)
    raised = []
    try:
        for step in range(steps):
            model.layers[2].poison = step in poisoned
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            try:
                monitor.step(loss=loss)
            except Exception:  # counted: the test fails on any
                raised.append(step)
    finally:
        monitor.close()
    return raised


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_full_disk_never_reaches_training_and_each_output_warns_once(tmpfs_1m, caplog):
    monitor = TrainerMonitor({**EVERY_OUTPUT, "output_dir": str(tmpfs_1m)})
    raised = _train(monitor, 25, poisoned=set(range(3, 25, 2)))  # anomalies (jsonl, dumps) all along
    assert raised == []
    messages = _warnings(caplog)
    failed = [m for m in messages if "failed and is disabled" in m or "a write failed" in m]
    names = [m.split("output ", 1)[1].split(" ", 1)[0] for m in failed]
    assert len(names) == len(set(names)) and {"csv", "tensorboard"} <= set(names), failed  # once per output
    assert all("No space left on device" in m for m in failed), failed
    reports = [m for m in messages if " did not write " in m]
    assert {m.split("output ", 1)[1].split(" ", 1)[0] for m in reports} >= {"csv", "tensorboard"}
    # What was written before the disk filled is whole rows of the first steps.
    with open(tmpfs_1m / "run" / "rank0" / "grad_reduced.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    steps = sorted({int(row[2]) for row in rows[1:] if len(row) == len(rows[0])})
    assert steps == list(range(len(steps))) and steps, steps


def test_planted_symlinks_are_not_followed_by_any_output(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("do not touch\n")
    rank_dir = tmp_path / "out" / "run" / "rank0"
    rank_dir.mkdir(parents=True)
    for name in ("scalars.csv", "anomalies.jsonl", "free_benchmark.csv", "module_struct.json"):
        (rank_dir / name).symlink_to(outside / "precious.txt")
    for name in ("dump", "grad_probe"):
        (rank_dir / name).symlink_to(outside, target_is_directory=True)
    monitor = TrainerMonitor({**EVERY_OUTPUT, "output_dir": str(tmp_path / "out")})
    assert _train(monitor, 6, poisoned={2, 4}) == []
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    assert (outside / "precious.txt").read_text() == "do not touch\n"
    refused = [m for m in _warnings(caplog) if "refusing to" in m]
    assert len(refused) >= 4, _warnings(caplog)
    # Outputs without a planted symlink still work.
    assert (rank_dir / "grad_reduced.csv").exists() and json.loads((tmp_path / "out" / "run" / "run.json").read_text())


USER_LOOP = textwrap.dedent('''
    def run_one_step(dump, model, x):
        dump.begin_step(0)
        model(x).sum().backward()
        return dump.end_step()
''')


def test_dump_stack_keeps_user_frames_in_a_folder_named_trainmon(tmp_path):
    """A project (or a clone of this repository) in a folder called ``trainmon`` is user code, not plumbing."""
    folder = tmp_path / "trainmon"
    folder.mkdir()
    (folder / "user_loop.py").write_text(USER_LOOP)
    spec = importlib.util.spec_from_file_location("user_loop_in_trainmon_folder", folder / "user_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = Net()
    dump = TargetedDump(model, tmp_path / "run" / "rank0", DumpConfig(enabled=True, depth=0))
    dump.request(["layers.1.fc"], steps=[0])
    try:
        module.run_one_step(dump, model, torch.randn(4, 6))
        assert dump.flush()
    finally:
        dump.close()
    (frames,) = json.loads((tmp_path / "run" / "rank0" / "dump" / "step0" / "stack.json").read_text()).values()
    assert any(str(folder / "user_loop.py") in frame and "run_one_step" in frame for frame in frames), frames
    assert any("test_output_failures.py" in frame for frame in frames)
    package = str(Path(sys.modules["trainmon"].__file__).resolve().parent)
    torch_dir = str(Path(torch.__file__).resolve().parent)
    assert not any(package in frame or torch_dir in frame for frame in frames), frames


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_failed_attach_leaves_nothing_behind_and_the_tools_skip_an_empty_run(tmp_path, capsys):
    """An attach refused at its last part (a ``free_benchmark.targets`` pattern matching nothing, checked after
    the directories are made) removes the directories it created, and only those; an empty run folder that an
    older version left does not stop ``trainmon csv2tb OUTPUT_DIR`` or ``trainmon report``."""
    from trainmon import TargetError
    from trainmon.tools.cli import main

    out = tmp_path / "out"
    good = TrainerMonitor({"output_dir": str(out), "run_name": "good", "sinks": ["csv"]})
    assert _train(good, 3, poisoned=set()) == []
    before = _tree(out)
    (tmp_path / "old" / "rank0").mkdir(parents=True)  # folders that existed before the attach are kept
    refused = {"free_benchmark": {"enabled": True, "targets": ["nothing.*"]}}
    for output_dir, run_name in ((out, "failed"), (tmp_path / "new" / "out", "failed"), (tmp_path, "old")):
        monitor = TrainerMonitor({**refused, "output_dir": str(output_dir), "run_name": run_name})
        model = Net()
        with pytest.raises(TargetError, match="free_benchmark.targets"):
            monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        monitor.close()
    assert _tree(out) == before
    assert _tree(tmp_path / "new") == []  # output_dir itself (made by the attach) is gone, its parent is outside
    assert _tree(tmp_path / "old") == ["rank0"]
    # The empty run folder an attach used to leave: every tool skips it with a note, the other runs go on.
    (out / "failed" / "rank0").mkdir(parents=True)
    capsys.readouterr()
    assert main(["csv2tb", str(out)]) == 0
    err = capsys.readouterr().err
    assert err == f"note: skipped {out / 'failed'}: no CSV files in rank0\n", err
    assert list((out / "good" / "tensorboard" / "rank0").glob("events.out.tfevents.*"))
    assert main(["report", str(out)]) == 2  # a folder of runs: the hint names a run that holds files
    assert f"e.g. trainmon report {out / 'good'} " in capsys.readouterr().err
    assert main(["report", str(out / "good")]) == 0 and (out / "good" / "report.html").exists()
    assert main(["analyse", str(out / "good")]) == 0


def test_a_reused_run_name_says_at_attach_that_it_appends(tmp_path, caplog):
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"]}
    assert _train(TrainerMonitor(config), 4, poisoned=set()) == []
    assert not [m for m in _warnings(caplog) if "already holds a run" in m]
    model = Net()
    monitor = TrainerMonitor(config)
    monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), start_step=2)
    monitor.close()
    (message,) = [m for m in _warnings(caplog) if "already holds a run" in m]
    assert message == (f"trainmon: {tmp_path / 'run'} already holds a run (last step 3); this run appends to it "
                       "from step 2 (start_step) - attach(..., start_step=4) continues its step count, or set "
                       "another run_name")
    # the default sinks (the store, no CSV): the last step from the store's part names; past it, no overlap
    caplog.clear()
    config = {"output_dir": str(tmp_path), "run_name": "stored"}
    assert _train(TrainerMonitor(config), 4, poisoned=set()) == []
    monitor = TrainerMonitor(config)
    monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), start_step=4)
    monitor.close()
    (message,) = [m for m in _warnings(caplog) if "already holds a run" in m]
    assert message.endswith("(last step 3); this run appends to it from step 4 (start_step) - set another run_name "
                            "to start a new run"), message
