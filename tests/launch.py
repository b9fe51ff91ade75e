"""Launching test scripts in processes of their own: free ports, local ranks, capability checks, and
DeepSpeed cases run one per process (lazily, each at most once) so one failing case fails only the
tests that read it. The one launcher of the multi-process tests: :func:`run_ranks` (a script on N local
ranks), :func:`torchrun` and :func:`msrun` (the frameworks' own launchers, on a free port),
:class:`RankServers` (warm fork servers) and :class:`DeepSpeedCases`.

Nothing here assumes where the repository was cloned: paths come from this file's location and the
package's own ``__file__``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # after one rank fails, how long the others get before they are killed (they may wait in a collective)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: one OMP thread, DeepSpeed's CPU accelerator, the repo importable,
    and Python's fault handler on (a rank that crashes prints every thread's Python stack)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p), **extra}


def rendezvous_env(rank: int, world_size: int, port: int | str) -> dict[str, str]:
    """The ``env://`` rendezvous variables of one local rank (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_ranks(args: Sequence[str | Path], world_size: int = 2, timeout: float = 120.0, **env: str) -> list[str]:
    """Run ``python *args`` as ``world_size`` local ranks (``env://`` on a free port, :func:`child_env` plus
    ``env``) and wait for every one. Each rank runs through ``tests/rank_main.py``: the script as ``__main__``,
    then an exit without interpreter finalisation (where torch's Gloo threads can abort a finished rank).

    Fails the test with every rank's output when a rank exits non-zero; the ranks still running
    ``GRACE_S`` after that (they may wait in a collective) are killed, and all of them after ``timeout``.

    Returns:
        Each rank's output (stdout and stderr), in rank order.
    """
    port = free_port()
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+", errors="replace")) for _ in range(world_size)]
        procs = [subprocess.Popen([sys.executable, "-m", "tests.rank_main", *map(str, args)], stdout=logs[rank],
                                  stderr=subprocess.STDOUT, text=True,
                                  env=child_env(**rendezvous_env(rank, world_size, port), **env))
                 for rank in range(world_size)]
        note = _wait_all(procs, timeout)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    codes = [proc.returncode for proc in procs]
    if any(codes) or note:
        pytest.fail("".join(f"----- rank {rank} (exit {code}) -----\n{output[-3000:]}\n"
                            for rank, (code, output) in enumerate(zip(codes, outputs))) + note, pytrace=False)
    return outputs


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> str:
    """Wait for every process; kill the rest ``GRACE_S`` after one failed, or all after ``timeout`` (then
    say so)."""
    deadline, kill_at = time.monotonic() + timeout, None
    while [proc.poll() for proc in procs].count(None):  # polls every process (sets its returncode)
        now = time.monotonic()
        if kill_at is None and any(proc.returncode not in (None, 0) for proc in procs):
            kill_at = now + GRACE_S
        if now > deadline or (kill_at is not None and now > kill_at):
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            return f"[launch] killed the ranks still running {'after a failed rank' if kill_at else 'at the timeout'}"
        time.sleep(0.05)
    return ""


def torchrun(*args: str | Path, nproc: int = 2) -> list[str]:
    """The command that runs ``python *args`` on ``nproc`` local ranks with ``torch.distributed.run``, on a
    free port (run it with :func:`child_env`)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", *map(str, args)]


def msrun(*args: str | Path, log_dir: Path, workers: int = 2) -> list[str]:
    """The command that runs ``python *args`` as ``workers`` local MindSpore workers with ``msrun``, on a free
    port, waiting for them; each worker writes ``log_dir/worker_{i}.log`` (run it with :func:`msrun_env`)."""
    return ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port()}",
            f"--log_dir={log_dir}", "--join=True", *map(str, args)]


def msrun_env() -> dict[str, str]:
    """:func:`child_env` with this interpreter's ``bin`` first on ``PATH`` (where ``msrun`` is installed)."""
    return child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def fp16_unsupported_reason() -> str | None:
    """Why fp16 cannot train on this CPU, or None when it can.

    DeepSpeed's CPU accelerator accepts fp16 only where oneDNN supports it (AMD EPYC machines, for one,
    do not), and then fails with "Type fp16 is not supported on your device".
    """
    import torch

    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the oneDNN query
        supported = False
    if supported:
        return None
    return ("this CPU has no fp16 in oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False), "
            "so DeepSpeed's CPU accelerator refuses fp16")


class RankServers:
    """``world_size`` warm fork servers (``tests/fork_server.py``), one per rank, started on first use.

    Each server imports ``preload`` once; :meth:`run` then starts a script on every rank as a fresh
    forked child of its rank's server: a process of its own (a failure or crash takes nothing else with
    it) that skips the seconds of imports a new interpreter would pay.
    """

    def __init__(self, world_size: int, preload: tuple[str, ...], log_dir: Path) -> None:
        self.world_size, self.preload, self.log_dir = world_size, preload, log_dir
        self._servers: list[subprocess.Popen] = []
        self._pending: dict[int, bytes] = {}

    def _start(self) -> None:
        self.close()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(self.world_size):
            with open(self.log_dir / f"server{rank}.log", "ab") as log:  # the server's own output (preload warnings)
                self._servers.append(subprocess.Popen([sys.executable, "-m", "tests.fork_server", *self.preload],
                                                      env=child_env(), cwd=ROOT, stdin=subprocess.PIPE,
                                                      stdout=subprocess.PIPE, stderr=log, bufsize=0))
        self._pending = {}
        for rank, server in enumerate(self._servers):
            if self._read(server, timeout=300.0) != {"ready": True}:
                log = (self.log_dir / f"server{rank}.log").read_text(errors="replace")
                self.close()
                raise RuntimeError(f"the fork server of rank {rank} did not start:\n{log[-3000:]}")

    def _read(self, server: subprocess.Popen, timeout: float) -> dict | None:
        """The server's next message, or None when none came within ``timeout`` s (or it died)."""
        deadline = time.monotonic() + timeout
        fd = server.stdout.fileno()
        while b"\n" not in self._pending.get(fd, b""):
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the server died
            self._pending[fd] = self._pending.get(fd, b"") + chunk
        line, self._pending[fd] = self._pending[fd].split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], log_dir: Path, timeout: float = 300.0) -> tuple[bool, str]:
        """Run ``python *args`` on every rank (env:// rendezvous on a free port); output in ``log_dir/rank{r}.log``.

        Returns ``(every rank exited 0, their output)``. When a rank fails the others are killed after
        ``GRACE_S`` (they may wait in a collective for gloo's 30-minute timeout); all of them after ``timeout``.
        """
        if not self._servers or any(server.poll() is not None for server in self._servers):
            self._start()
        log_dir.mkdir(parents=True, exist_ok=True)
        port, pids = str(free_port()), []
        for rank, server in enumerate(self._servers):
            env = rendezvous_env(rank, self.world_size, port)
            request = {"argv": [str(a) for a in args], "env": env, "log": str(log_dir / f"rank{rank}.log")}
            try:
                server.stdin.write((json.dumps(request) + "\n").encode())
                server.stdin.flush()
            except OSError:  # the server died since the check above
                pass
            if (answer := self._read(server, timeout=30.0)) is None:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.close()
                return False, (f"[launch] the fork server of rank {rank} did not start the script "
                               "(it is restarted next time)")
            pids.append(answer["pid"])
        codes: dict[int, int] = {}
        deadline, kill_at, give_up_at, note = time.monotonic() + timeout, None, None, ""
        while len(codes) < self.world_size:
            for rank, server in enumerate(self._servers):
                if rank in codes:
                    continue
                if (message := self._read(server, timeout=0.05)) is not None:
                    codes[rank] = message["exit"]
                elif server.poll() is not None:
                    codes[rank], note = -9, note + f"\n[launch] the fork server of rank {rank} died"
            now = time.monotonic()
            if kill_at is None and any(code != 0 for code in codes.values()):
                kill_at = now + GRACE_S
            if give_up_at is None and (now > deadline or (kill_at is not None and now > kill_at)):
                when = "after a failed rank" if kill_at else f"after {timeout:.0f} s"
                note += f"\n[launch] killed the ranks still running {when}"
                for rank, pid in enumerate(pids):
                    if rank not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                give_up_at = now + 30.0  # the servers report the killed children
            if give_up_at is not None and now > give_up_at:
                note += "\n[launch] the fork servers did not report their killed children: restarting them"
                self.close()
                break
        output = "".join(f"----- rank {r} (exit {codes.get(r)}) -----\n"
                         f"{(log_dir / f'rank{r}.log').read_text(errors='replace')}" for r in range(self.world_size))
        return all(codes.get(r) == 0 for r in range(self.world_size)), output + note

    def close(self) -> None:
        """Stop the servers (closing their stdin ends them)."""
        for server in self._servers:
            with contextlib.suppress(OSError):
                server.stdin.close()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self._servers = []


# Imported once per rank by the fork servers: DeepSpeed, and what its engine imports lazily on first
# use (torch._dynamo through torch.compile in its optimizer checks, the ZeRO optimizers).
DEEPSPEED_PRELOAD = ("numpy", "pandas", "torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.engine",
                     "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
                     "deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.zero.muon.muon_optimizer",
                     "trainmon", "tests.models")


class DeepSpeedCases:
    """DeepSpeed cases of ``script``, each trained in its own processes and process group on first use.

    ``cases[name]`` (a dict with at least ``name`` and ``stage``; ``dtype`` fp32/bf16/fp16) is run as
    ``python script OUT CASE_JSON`` on ``world_size`` ranks (forked from warm servers, see
    :class:`RankServers`) and writes ``OUT/<name>/``. ``runs[name]`` returns that directory; it skips
    the test (with the reason) when this machine cannot run the case's dtype, and fails it with the
    ranks' output when the case failed. A case runs at most once: later tests that need a failed case
    fail at once with the same output. Call :meth:`close` at the end (a fixture's teardown).
    """

    def __init__(self, script: Path, cases: list[dict], out: Path, world_size: int, timeout: float = 300.0) -> None:
        self.script, self.out, self.timeout = script, out, timeout
        self.cases = {case["name"]: case for case in cases}
        self.servers = RankServers(world_size, DEEPSPEED_PRELOAD, out / "_logs")
        self._failures: dict[str, str] = {}

    def __getitem__(self, name: str) -> Path:
        case = self.cases[name]
        if case.get("dtype") == "fp16" and (reason := fp16_unsupported_reason()):
            pytest.skip(f"case {name}: {reason}")
        run_dir = self.out / name
        if name in self._failures:
            pytest.fail(f"case {name} failed (in an earlier test):\n{self._failures[name][-3000:]}", pytrace=False)
        if not (run_dir / "done").exists():
            ok, output = self.servers.run([self.script, self.out, json.dumps(case)], self.out / "_logs" / name,
                                          timeout=self.timeout)
            if not ok:
                self._failures[name] = output
                pytest.fail(f"case {name} failed:\n{output[-8000:]}", pytrace=False)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "done").touch()
        return run_dir

    def close(self) -> None:
        self.servers.close()
