"""``trainmon --version``: one line, ``trainmon X.Y.Z``, exit 0."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import trainmon
from trainmon.tools.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == f"trainmon {trainmon.__version__}\n" and re.fullmatch(r"trainmon \d+\.\d+\.\d+\n", out)


def test_version_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "trainmon", "--version"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout == f"trainmon {trainmon.__version__}\n", done.stderr
