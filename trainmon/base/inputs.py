"""Reading files and folders the user names (framework-free): no hang, no surprise.

Every reader of user-given input (config files, CSV, ``anomalies.jsonl``, direction files) opens
files through :func:`open_regular`, which refuses anything but a regular file *before* it can block:
opening a named pipe (FIFO) for reading waits for a writer forever, so the file is opened
non-blocking and checked with ``fstat``. :func:`find_runs` tells a run folder from a parent folder
holding several runs, for the commands' error messages.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal, TextIO, overload

INT64_MAX = 2**63 - 1
"""The largest step, rank or count the offline tools accept (numpy, TensorBoard and protobuf use int64)."""

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_BINARY = getattr(os, "O_BINARY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_RANK_DIR = re.compile(r"rank\d+")


class NotRegularFileError(OSError):
    """A path names a directory, a named pipe, a device or a socket where a file is expected."""


@overload
def open_regular(path: str | os.PathLike[str], text: Literal[False] = False, encoding: str = "utf-8",
                 newline: str | None = None) -> BinaryIO: ...


@overload
def open_regular(path: str | os.PathLike[str], text: Literal[True], encoding: str = "utf-8",
                 newline: str | None = None) -> TextIO: ...


def open_regular(path: str | os.PathLike[str], text: bool = False, encoding: str = "utf-8",
                 newline: str | None = None) -> IO[Any]:
    """Open a regular file for reading; anything else fails at once instead of blocking.

    Args:
        path: the file.
        text: return a text handle (``encoding``, ``newline``) instead of a binary one.

    Raises:
        NotRegularFileError: a directory, named pipe, device or socket (an :class:`OSError` whose
            ``filename`` is the path and ``strerror`` says what it is).
        OSError: the file cannot be opened. ValueError never escapes: a path with a NUL byte is an
            OSError too.

    Example:
        >>> open_regular("/")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        NotRegularFileError: [Errno 21] a directory, not a regular file: '/'
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _BINARY | _CLOEXEC)
    except ValueError as exc:  # embedded NUL byte
        raise OSError(errno.EINVAL, f"invalid path ({exc})", str(path)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a device")
            code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
            raise NotRegularFileError(code, f"{kind}, not a regular file", str(path))
        if _NONBLOCK:
            os.set_blocking(fd, True)
        handle = open(fd, "rb", closefd=True)  # noqa: SIM115 - returned: the caller closes it
    except BaseException:
        os.close(fd)
        raise
    if text:
        return io.TextIOWrapper(handle, encoding=encoding, newline=newline)
    return handle


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a regular file (see :func:`open_regular`)."""
    with open_regular(path) as handle:
        return handle.read()


def describe_os_error(exc: OSError, path: object = None) -> str:
    """``path: reason`` for an OSError, e.g. ``out/x: Permission denied``."""
    where = exc.filename if exc.filename is not None else path
    reason = exc.strerror or str(exc)
    return f"{where}: {reason}" if where is not None else reason


def is_dir(path: Path) -> bool:
    """``path.is_dir()`` that is False, not an exception, for any unusable path."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def rank_dirs_of(run_dir: Path) -> list[Path]:
    """The ``rank{R}`` directories of a run, by rank number."""
    try:
        children = list(run_dir.iterdir())
    except (OSError, ValueError):
        return []
    ranks = [p for p in children if _RANK_DIR.fullmatch(p.name) and is_dir(p)]
    return sorted(ranks, key=lambda p: int(p.name[4:]))


def find_runs(folder: Path, limit: int = 1000) -> list[Path]:
    """Child directories of ``folder`` that are runs (hold ``rank{R}/`` directories), by name.

    Used to recognise a parent output folder (``{output_dir}``) given where a run is expected.
    """
    try:
        children = sorted(p for p in folder.iterdir() if is_dir(p))
    except (OSError, ValueError):
        return []
    return [p for p in children[:limit] if rank_dirs_of(p)]


def runs_hint(folder: Path, runs: list[Path], command: str) -> str:
    """One line saying that ``folder`` holds runs, not a run, and which to pass."""
    names = ", ".join(p.name for p in runs[:10]) + (f", ... ({len(runs)} in all)" if len(runs) > 10 else "")
    # the example: the last run with a file in a rank folder, not an empty one an attach that failed left
    example = next((run for run in reversed(runs[-20:]) if _holds_files(run)), runs[-1])
    return (f"{folder} is a folder of {len(runs)} runs, not a run: pass one of them, "
            f"e.g. trainmon {command} {example} (runs: {names})")


def _holds_files(run: Path) -> bool:
    """Whether a rank folder of ``run`` holds anything."""
    try:
        return any(any(rank.iterdir()) for rank in rank_dirs_of(run))
    except (OSError, ValueError):
        return False
