"""Progress bars of the CLI (tqdm): drawn on stderr only when it is a terminal, one unit per file.

The commands run as users run them, in a subprocess whose stderr is a pseudo-terminal.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import pytest

from tests.unit.test_anomaly_analyse import write_run
from tests.unit.test_csv2tb import _run

fcntl = pytest.importorskip("fcntl", reason="needs a pseudo-terminal (POSIX)")
pty = pytest.importorskip("pty", reason="needs a pseudo-terminal (POSIX)")
termios = pytest.importorskip("termios", reason="needs a pseudo-terminal (POSIX)")


def _trainmon(args: list[str], tty: bool, size: tuple[int, int] = (30, 150)) -> tuple[int, str, str]:
    """Run ``python -m trainmon ARGS``; stderr on a pseudo-terminal of ``size`` (rows, columns) when ``tty``.

    Returns (exit code, stdout, stderr).
    """
    if not tty:
        done = subprocess.run([sys.executable, "-m", "trainmon", *args], capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout, done.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
    with subprocess.Popen([sys.executable, "-m", "trainmon", *args], stdout=subprocess.PIPE, stderr=slave,
                          text=True) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        out = proc.stdout.read()
        code = proc.wait(timeout=120)
    os.close(master)
    return code, out, b"".join(chunks).decode("utf-8", "replace")


def _last_bar(stderr: str) -> str:
    return re.split(r"[\r\n]+", stderr.strip())[-1]


def test_csv2tb_advances_per_file_with_rate_and_eta(tmp_path):
    run_dir = _run(tmp_path, ranks=2)
    files = len(list(run_dir.glob("rank*/*.csv")))
    assert files == 14  # 6 families + scalars, 2 ranks
    code, out, err = _trainmon(["csv2tb", str(run_dir)], tty=True)
    assert code == 0 and f"wrote 192 scalars to {run_dir / 'tensorboard'}" in out  # 2 ranks x 96
    bar = _last_bar(err)
    assert bar.startswith("csv2tb: 100%") and f"{files}/{files}" in bar, err
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, +([\d.]+file/s|[\d.]+s/file)\]$", bar), bar  # elapsed<ETA, rate


def test_analyse_bar_counts_files_and_events(tmp_path):
    write_run(tmp_path, ranks=2, per_rank=5)
    code, out, err = _trainmon(["analyse", str(tmp_path)], tty=True)
    assert code == 0 and "wrote" in out
    bar = _last_bar(err)
    assert bar.startswith("analyse: 100%") and "2/2" in bar and "events=10" in bar, err


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path):
    run_dir = _run(tmp_path, ranks=1)
    code, out, err = _trainmon(["csv2tb", str(run_dir)], tty=False)
    assert code == 0 and err == "" and "wrote" in out


def test_a_terminal_that_reports_no_size_still_gets_a_bar(tmp_path):
    run_dir = _run(tmp_path, ranks=1)
    code, _, err = _trainmon(["csv2tb", str(run_dir)], tty=True, size=(0, 0))
    assert code == 0 and _last_bar(err).startswith("csv2tb: 100%") and "7/7" in _last_bar(err), err
