"""The README's demo and the DeepSpeed example run as a user runs them (subprocesses, real training)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.launch import child_env, torchrun

ROOT = Path(__file__).resolve().parents[2]


def _run(command: list[str], tmp_path: Path) -> str:
    proc = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_demo_finds_the_injected_bug(tmp_path):
    out = _run([sys.executable, str(ROOT / "examples" / "demo.py"), "--output-dir", str(tmp_path / "out")], tmp_path)
    assert "step 30, micro-step 0, rank 0, forward of blocks.2.mlp.fc2.output" in out
    (run_dir,) = (tmp_path / "out").iterdir()
    events = pd.read_json(run_dir / "rank0" / "anomalies.jsonl", lines=True)
    first = events.sort_values(["step", "order"]).iloc[0]
    assert (first.step, first.phase, first["name"]) == (30, "forward", "blocks.2.mlp.fc2.output")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_deepspeed_example_trains_with_the_monitor(tmp_path, ranks):
    """As docs/deepspeed.md runs it: one process, or torchrun with 2 processes (ZeRO-3 shards)."""
    pytest.importorskip("deepspeed")
    script = [str(ROOT / "examples" / "deepspeed_train.py"), "--stage", "3", "--out", str(tmp_path / "out")]
    out = _run(torchrun(*script) if ranks == 2 else [sys.executable, *script], tmp_path)
    assert out.strip(), "the example printed nothing"
    written = sorted(p.parent.name for p in (tmp_path / "out").rglob("grad_reduced.csv"))
    assert written == ["rank0"]  # shard statistics are combined and written once, by rank 0
