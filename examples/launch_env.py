"""Environment for running DeepSpeed in one plain process (no launcher) on CPU."""

from __future__ import annotations

import os
import socket


def single_process_env() -> None:
    """Set ``DS_ACCELERATOR=cpu`` (unless set) and, without a launcher's ``RANK``, a world of one
    on a free local port (else DeepSpeed looks for MPI). Call it before importing deepspeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
