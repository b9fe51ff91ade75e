"""Writing one dump step to disk (on the dump's writer thread), and the stack frames worth keeping.

Layout (msprobe's L0 dump)::

    dump/step{S}/dump.json  stack.json  construct.json  dump_tensor_data/{key}.{input|output|...}.{i}.pt|.npy
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.base.safe_io import is_within, make_dirs, open_output, write_json

if TYPE_CHECKING:
    from trainmon.actions.capture import Capture

_MAX_NAMES = 100  # dump directories tried for one step (a resumed run dumping the same step again)


@functools.lru_cache(maxsize=4)
def _package_dirs(frameworks: tuple[str, ...]) -> tuple[Path, ...]:
    """The resolved directories of the installed trainmon and framework packages (their frames are plumbing)."""
    directories = []
    for name in ("trainmon",) + frameworks:
        package = sys.modules.get(name)
        file: str | None = getattr(package, "__file__", None) if package is not None else None
        if file:
            directories.append(Path(file).resolve().parent)
    return tuple(directories)


@functools.lru_cache(maxsize=4096)
def is_plumbing(filename: str, frameworks: tuple[str, ...] = ("torch",)) -> bool:
    """Whether a frame's file lies inside the trainmon or framework package (not: a folder that happens to
    be called ``trainmon``, such as a clone of the repository or a user's project)."""
    if filename.startswith("<"):  # <frozen ...>, <string>: not a package file
        return False
    try:
        path = Path(filename).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(path.is_relative_to(directory) for directory in _package_dirs(frameworks))


def new_directory(directory: Path, root: Path) -> Path:
    """``directory``, or ``{directory}-{n}`` when it exists: an earlier dump is never overwritten."""
    for n in range(_MAX_NAMES):
        candidate = directory if n == 0 else directory.with_name(f"{directory.name}-{n}")
        try:
            make_dirs(candidate, root, exist_ok=False)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"{directory}: {_MAX_NAMES} dumps of this step already exist")


def canonical_order(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the forward entries in call order, then the backward entries and the parameter
    gradients in reverse call order: the same order for two dumps of the same modules, whatever order
    the gradient hooks fired in (a NaN injected into a module's output changes it), so msprobe's
    order-sensitive compare matches them."""
    def kind(key: str) -> str:  # Module.{name}.{Class}.{forward|backward}.{call} or ...parameters_grad
        parts = key.rsplit(".", 2)
        return parts[1] if len(parts) == 3 else ""

    forward = [key for key in data if kind(key) == "forward"]
    position = {key: i for i, key in enumerate(forward)}
    first_call: dict[str, int] = {}
    for key in forward:
        first_call.setdefault(key.rsplit(".", 2)[0], position[key])

    def forward_of(key: str) -> str:
        head, _, call = key.rsplit(".", 2)
        return f"{head}.forward.{call}"

    backward = sorted((key for key in data if kind(key) == "backward"),
                      key=lambda key: -position.get(forward_of(key), -1))
    rest = sorted((key for key in data if kind(key) not in ("forward", "backward")),
                  key=lambda key: -first_call.get(key.rsplit(".", 1)[0], -1))
    return {key: data[key] for key in forward + backward + rest}


def write_dump(capture: Capture, values: list[list[float]], directory: Path, root: Path,
               extra: dict[str, Any] | None = None) -> Path:
    """Write ``dump.json``, ``stack.json``, ``construct.json`` and the tensor files of one dump step.

    Args:
        capture: what the step captured (host copies included).
        values: ``[Max, Min, Mean, Norm]`` of each described tensor, in ``capture.stat_targets`` order.
        directory: ``dump/step{S}`` (``-{n}`` is appended when it exists).
        root: the run directory; nothing below it is followed if it is a symlink.
        extra: top-level keys added to ``dump.json`` (the parallel layout of a Megatron rank).

    Returns:
        The directory written.
    """
    framework = capture.framework
    directory = new_directory(directory, root)
    for desc, (hi, lo, mean, norm) in zip(capture.stat_targets, values):
        desc.update(Max=hi, Min=lo, Mean=mean, Norm=norm)
    for desc, host in capture.hashes:
        desc["md5"] = hashlib.md5(framework.host_bytes(host)).hexdigest()  # host copy, writer thread: no sync
    tensor_dir = directory / "dump_tensor_data"
    for file_name, host in capture.files.items():
        path = tensor_dir / file_name
        if not is_within(tensor_dir, path):  # safe_file_name guarantees this; checked regardless
            raise AssertionError(f"dump file {file_name!r} escapes {tensor_dir}")
        with open_output(path, "xb", root) as handle:
            framework.save(host, handle)
    task = "tensor" if capture.mode == "tensor" else "statistics"
    write_json(directory / "dump.json", {
        "task": task, "level": "L0", "framework": framework.name,
        "dump_data_dir": str(tensor_dir) if capture.mode == "tensor" else None,
        "summary_mode": "md5" if capture.mode == "md5" else "statistics",
        **(extra or {}),
        "data": canonical_order(capture.data),
    }, root)
    write_json(directory / "stack.json", capture.stack, root)
    write_json(directory / "construct.json", capture.construct, root)
    return directory
