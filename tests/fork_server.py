"""A warm process that imports heavy modules once, then runs each script in a fresh forked child.

``python -m tests.fork_server MODULE...`` imports the modules (DeepSpeed and what its engine imports
lazily take ~5 s of CPU per process, most of a small test case), then reads one JSON request per line
on stdin: ``{"argv": [script, *args], "env": {...}, "log": path}``. For each it forks a child that
runs ``script`` as ``__main__`` (as ``python script args`` would, with ``env`` added to its
environment and its output in ``log``), answers ``{"pid": PID}`` at once and ``{"pid": PID, "exit":
CODE}`` when the child ends (a signal -N). The child is a process of its own: whatever it does (a
process group, monkey-patches, a crash) dies with it. The server ends when stdin closes.

Used by ``tests/launch.py``; Linux only (fork). The server starts no thread, so forking is safe.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from tests.rank_main import run_main


def _child(request: dict) -> int:
    """Runs in the forked child: the script as ``__main__``; returns its exit code."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the server's stdin carries requests: not for the child
    os.close(devnull)
    os.environ.update(request["env"])
    return run_main(request["argv"])


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    for module in sys.argv[1:]:
        try:
            importlib.import_module(module)
        except ImportError as error:  # a preload only saves time: the child imports what it needs itself
            print(f"fork_server: not preloaded: {module} ({error})", file=sys.stderr)
    sys.path[0] = ""  # as `python script` would replace it (the child sets the script's folder)
    _answer({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(request)
            finally:
                os._exit(code)
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
