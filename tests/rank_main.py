"""Run a script as ``__main__`` and leave without interpreter finalisation.

``python -m tests.rank_main SCRIPT ARGS...`` runs ``SCRIPT`` as ``python SCRIPT ARGS...`` would, then ends
the process with ``os._exit`` (0, the script's ``SystemExit`` code, or 1 after printing what it raised),
as the fork server's children do. The ranks of the multi-process tests run this way: torch's Gloo worker
threads can still release a tensor held by Python while ``Py_FinalizeEx`` runs, and taking the GIL then
aborts the process ("terminate called without an active exception", pytorch/pytorch#190489) after the
test's work is done and checked. Nothing a test checks happens at finalisation: the scripts close their
monitors themselves, and trainmon registers no ``atexit`` handler.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def run_main(argv: list[str]) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` (its folder first on ``sys.path``); returns its
    exit code, with stdout and stderr flushed."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # report anything the script raised, as python would
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    os._exit(run_main(sys.argv[1:]))
