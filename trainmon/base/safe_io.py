"""Opening output files without following symlinks (framework-free).

Every file trainmon writes goes through this module. A path is split into a *root* (a directory the
user chose, e.g. the run directory ``{output_dir}/{run_name}``, which may itself be a symlink the
user placed on purpose) and the components below it. Those components are opened one at a time
relative to their parent's descriptor with ``O_NOFOLLOW``, so a symlink placed anywhere inside the
root (``rank0 -> /etc``, ``rank0/scalars.csv -> ~/.bashrc``) is refused with
:class:`UnsafePathError` instead of being followed, and nothing is written outside the root. The
file itself must be a regular file with no other hard link (a hard link is another name for a file
that may live outside), and a FIFO never blocks the open.

Files are created, appended to or replaced atomically; nothing here truncates an existing file.

Example:
    >>> with open_output(Path("out/run/rank0/scalars.csv"), "a", root=Path("out/run")) as f:  # doctest: +SKIP
    ...     f.write("step,name,value\\n")
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["UnsafePathError", "atomic_output", "open_output", "write_atomic", "make_dirs", "remove_file"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_BINARY = getattr(os, "O_BINARY", 0)
# openat()-style opens are what make the walk race-free; platforms without them (Windows) fall back
# to checking each component with lstat before opening it by path.
_RELATIVE = os.open in os.supports_dir_fd and bool(_NOFOLLOW) and bool(_DIRECTORY)
_FLAGS = {"r": os.O_RDONLY, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}


class UnsafePathError(OSError):
    """A component of an output path is a symlink, not a directory, or the file is not a plain file.

    It is an :class:`OSError`, so every writer treats it like any other output failure: warn once,
    count what it drops, never raise into training.
    """


def _parts(path: Path, root: Path | None) -> tuple[Path, tuple[str, ...], str]:
    """``(root, directories below root, file name)``; the path must lie inside the root."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    try:
        relative = path.relative_to(root)
    except ValueError:
        raise UnsafePathError(errno.EXDEV, f"{path} is not inside the output directory {root}") from None
    parts = relative.parts
    if not parts or any(part in ("..", ".") for part in parts):
        raise UnsafePathError(errno.EINVAL, f"{path}: not a file name inside {root}")
    return root, parts[:-1], parts[-1]


def _refuse(exc: OSError, where: Path) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return UnsafePathError(exc.errno, f"refusing to follow a symlink or non-directory at {where}")
    return exc


def _open_dir(root: Path, directories: tuple[str, ...], create: bool) -> int:
    """A descriptor of ``root/directories...`` reached without following any symlink below root."""
    if create:
        root.mkdir(parents=True, exist_ok=True)  # the root is the user's choice: symlinks there are honoured
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    where = root
    try:
        for name in directories:
            where = where / name
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
            child = _open_dir_at(fd, name, where)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir_at(dir_fd: int, name: str, where: Path) -> int:
    """Open the directory ``name`` inside ``dir_fd``, refusing a symlink or a non-directory."""
    try:
        return os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise _refuse(exc, where) from None


def _check_path_fallback(root: Path, directories: tuple[str, ...], name: str | None, create: bool) -> Path:
    """Without openat(): refuse symlinks found by lstat (racy, but the best such platforms allow)."""
    if create:
        root.mkdir(parents=True, exist_ok=True)
    where = root
    for part in directories:
        where = where / part
        if create and not where.is_symlink():
            where.mkdir(exist_ok=True)
        if where.is_symlink() or not where.is_dir():
            raise UnsafePathError(errno.ELOOP, f"refusing to follow a symlink or non-directory at {where}")
    if name is None:
        return where
    where = where / name
    if where.is_symlink():
        raise UnsafePathError(errno.ELOOP, f"refusing to follow a symlink at {where}")
    return where


def _check_file(fd: int, path: Path, check_links: bool) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(errno.EINVAL, f"refusing to use {path}: not a regular file")
    if check_links and info.st_nlink > 1:
        raise UnsafePathError(errno.EMLINK, f"refusing to write to {path}: it has other hard links")


def make_dirs(path: Path, root: Path | None = None, *, exist_ok: bool = True) -> None:
    """Create the directory ``path`` (and its parents below ``root``) without following symlinks.

    Args:
        path: the directory.
        root: the directory the user chose (default: ``path``'s parent); only components below it are checked.
        exist_ok: when false, an existing ``path`` raises FileExistsError (its parents may exist).

    Raises:
        UnsafePathError: a component below ``root`` is a symlink or not a directory.
        FileExistsError: ``path`` exists and ``exist_ok`` is false.
        OSError: the directories cannot be created.
    """
    root, directories, name = _parts(path, root)
    if not _RELATIVE:
        parent = _check_path_fallback(root, directories, None, create=True)
        (parent / name).mkdir(exist_ok=exist_ok)
        _check_path_fallback(root, (*directories, name), None, create=False)
        return
    dir_fd = _open_dir(root, directories, create=True)
    try:
        try:
            os.mkdir(name, 0o777, dir_fd=dir_fd)
        except FileExistsError:
            if not exist_ok:
                raise
        os.close(_open_dir_at(dir_fd, name, Path(path)))
    finally:
        os.close(dir_fd)


def open_output(path: Path, mode: str = "a", root: Path | None = None, *, encoding: str = "utf-8",
                newline: str | None = "") -> IO[Any]:
    """Open a file inside ``root`` without following symlinks; missing directories are created.

    Args:
        path: the file.
        mode: ``"a"`` (append, created if missing), ``"x"`` (create; FileExistsError if it exists) or
            ``"r"`` (read), each optionally with ``"b"``. There is no truncating mode.
        root: the directory the user chose (default: the file's directory); only the components
            below it are checked.
        encoding, newline: for text modes (``newline=""`` suits the csv module).

    Raises:
        UnsafePathError: a symlink, a non-directory or a non-regular file on the way, or a hard link.
        OSError: any other failure to open.
    """
    kind, binary = mode.replace("b", ""), "b" in mode
    if kind not in _FLAGS:
        raise ValueError(f"open_output mode must be r, a or x (with an optional b), got {mode!r}")
    root, directories, name = _parts(path, root)
    flags = _FLAGS[kind] | _NOFOLLOW | _CLOEXEC | _NONBLOCK | _BINARY  # NONBLOCK: a FIFO fails instead of hanging
    create = kind != "r"
    if _RELATIVE:
        dir_fd = _open_dir(root, directories, create=create)
        try:
            existed = _exists(name, dir_fd)
            fd = os.open(name, flags, 0o666, dir_fd=dir_fd)
        except OSError as exc:
            raise _refuse(exc, Path(path)) from None
        finally:
            os.close(dir_fd)
    else:
        target = _check_path_fallback(root, directories, name, create=create)
        existed = target.exists()
        fd = os.open(target, flags & ~_NONBLOCK, 0o666)
    try:
        _check_file(fd, Path(path), check_links=kind == "a" and existed)
        if _NONBLOCK:
            os.set_blocking(fd, True)
        raw = io.FileIO(fd, "r" if kind == "r" else "a" if kind == "a" else "w", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    handle: io.BufferedReader | io.BufferedWriter = io.BufferedReader(raw) if kind == "r" else io.BufferedWriter(raw)
    if binary:
        return handle
    return io.TextIOWrapper(handle, encoding=encoding, newline=newline)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def write_atomic(path: Path, data: bytes, root: Path | None = None, *, exclusive: bool = False) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``.

    Readers see the old file or the new one, never half a file; a crash or a full disk leaves at
    most a hidden ``.{name}.*.tmp`` file. A symlink at ``path`` is refused, not replaced, and
    nothing below ``root`` is followed. With ``exclusive``, an existing ``path`` is never replaced
    (FileExistsError): the file is linked into place, which fails when the name exists.

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists.
        UnsafePathError: a symlink or non-directory below ``root``, or ``path`` is a symlink.
        OSError: the write failed (the temporary file is removed).
    """
    root, directories, name = _parts(path, root)
    tmp_name = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    if not _RELATIVE:
        target = _check_path_fallback(root, directories, name, create=True)
        tmp = target.with_name(tmp_name)
        try:
            with open(tmp, "xb") as handle:
                handle.write(data)
            if exclusive:
                os.link(tmp, target)
                tmp.unlink()
            else:
                os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return
    dir_fd = _open_dir(root, directories, create=True)
    try:
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666, dir_fd=dir_fd)
        try:
            with io.FileIO(fd, "w", closefd=True) as handle:
                view = memoryview(data)
                while view:
                    view = view[handle.write(view):]
            try:
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    raise UnsafePathError(errno.ELOOP, f"refusing to replace the symlink {path}")
            except FileNotFoundError:
                pass
            if exclusive:  # link(2) fails with EEXIST where rename(2) would replace
                _link_exclusive(tmp_name, name, dir_fd)
            else:
                os.replace(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def atomic_output(path: Path, root: Path | None = None) -> Iterator[IO[bytes]]:
    """A binary file to write ``path`` through, as :func:`write_atomic` with ``exclusive`` writes it, for data too
    large to hold in memory: the data goes to a hidden temporary file beside ``path``, which is linked into place
    when the block ends without an exception (and removed when it raises). Never over an existing file.

    Raises:
        FileExistsError: ``path`` exists (at the end of the block).
        UnsafePathError: a symlink or non-directory below ``root``.
        OSError: the write failed (the temporary file is removed).
    """
    root, directories, name = _parts(path, root)
    tmp_name = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    if not _RELATIVE:
        target = _check_path_fallback(root, directories, name, create=True)
        tmp = target.with_name(tmp_name)
        try:
            with open(tmp, "xb") as handle:
                yield handle
            os.link(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return
    dir_fd = _open_dir(root, directories, create=True)
    try:
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666, dir_fd=dir_fd)
        try:
            with io.BufferedWriter(io.FileIO(fd, "w", closefd=True), 1 << 20) as handle:
                yield handle
            _link_exclusive(tmp_name, name, dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _link_exclusive(tmp_name: str, name: str, dir_fd: int) -> None:
    """Give the temporary file its name unless the name exists; a file system without hard links gets a check
    and a rename (the check and the rename are not one step there)."""
    try:
        os.link(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        if _exists(name, dir_fd):
            raise FileExistsError(errno.EEXIST, f"{name} exists") from None
        os.replace(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    os.unlink(tmp_name, dir_fd=dir_fd)


def remove_file(path: Path, root: Path | None = None) -> None:
    """Remove the file ``path`` (one trainmon wrote: a store part merged into a larger one), reaching its
    directory without following a symlink below ``root``; a missing file is not an error.

    Raises:
        UnsafePathError: a symlink or non-directory below ``root``.
        OSError: the file cannot be removed.
    """
    root, directories, name = _parts(path, root)
    if not _RELATIVE:
        _check_path_fallback(root, directories, name, create=False).unlink(missing_ok=True)
        return
    dir_fd = _open_dir(root, directories, create=False)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)  # unlink never follows a symlink named ``name``: it removes the link
    finally:
        os.close(dir_fd)


def write_json(path: Path, data: object, root: Path | None = None) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file.

    Args:
        path: the file.
        data: anything ``json.dumps`` can write (other objects as ``str``).
        root: the directory below which no symlink is followed (default: the file's directory);
            a symlink at ``path`` itself is refused, never replaced or followed.

    Raises:
        OSError: the file cannot be written (:class:`UnsafePathError` for a symlink).
    """
    write_atomic(path, json.dumps(data, indent=1, default=str).encode("utf-8"), root=root)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_DOTS = re.compile(r"\.{2,}")
MAX_FILE_NAME = 200
"""Longest file name written (most file systems allow 255 bytes)."""


def safe_file_name(name: str, suffix: str = "") -> str:
    """A file name built from ``name`` that can only ever name a file in its own directory.

    Characters outside ``[A-Za-z0-9_.-]`` (``/``, ``\\``, ``:``, NUL, spaces, ...) become ``_``,
    runs of dots become ``_``, a leading dot is dropped, and the result is cut to
    :data:`MAX_FILE_NAME` characters. When anything was changed, a short hash of the original
    name is appended so two different names never share a file.

    Example:
        >>> safe_file_name("Module.layers.0.Linear.forward.0.input.0", ".pt")
        'Module.layers.0.Linear.forward.0.input.0.pt'
        >>> safe_file_name("../../etc/passwd").startswith("_")
        True
    """
    cleaned = _DOTS.sub("_", _UNSAFE.sub("_", name)).lstrip(".") or "_"
    limit = MAX_FILE_NAME - len(suffix)
    if cleaned != name or len(cleaned) > limit:
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        cleaned = f"{cleaned[:limit - 11]}-{digest}"
    return cleaned + suffix


def is_within(base: Path, path: Path) -> bool:
    """Whether ``path`` resolves to a location inside ``base`` (symlinks followed)."""
    return path.resolve().is_relative_to(base.resolve())
