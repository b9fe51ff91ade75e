"""scripts/demo.sh sets up a light venv of its own; examples/demo.py ends with where its output went."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_demo_script_uses_a_light_venv_pinned_by_the_constraints():
    script = (ROOT / "scripts" / "demo.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "demo.sh")], check=True)
    assert "VENV=.venv-demo" in script and "bash scripts/setup.sh" not in script  # not the 3.9 GB test environment
    installs = [line for line in script.splitlines() if "pip\" install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs)  # torch stays 2.13.0
    assert not re.search(r"deepspeed|megatron|mindspore|\[test\]", " ".join(installs), re.IGNORECASE)
    assert "exec \"$VENV/bin/python\" examples/demo.py" in script


@pytest.mark.slow
def test_demo_ends_with_the_run_dir_and_the_tensorboard_command(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "2", "--bad-step", "-1",
                           "--output-dir", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert done.stdout.startswith("training a 4-layer")  # says what it does before the long part
    last = done.stdout.strip().splitlines()[-2:]
    assert last[0].endswith(f"monitor output (monitor.run_dir): {run_dir}")
    assert last[1].endswith(f"tensorboard --logdir {run_dir}")
