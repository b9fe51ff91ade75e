"""Fixtures for every test: no monitor may leave a hook, a process group, a trainmon thread or an open
output file behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _hook_objects(model, optimizer):
    """``(object, hook attribute names)`` for everything a monitor may hook on a torch model."""
    import torch

    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if isinstance(chunk, torch.nn.Module):
            for module in chunk.modules():
                yield module, _MODULE_HOOKS
            for param in chunk.parameters():
                yield param, ("_post_accumulate_grad_hooks",)
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if candidate is not None and isinstance(candidate, torch.optim.Optimizer):
            yield candidate, _OPTIMIZER_HOOKS


def _keys(obj, attrs):
    return {attr: set(getattr(obj, attr, None) or ()) for attr in attrs}


@pytest.fixture(autouse=True)
def forced_device_path(monkeypatch):
    """``TRAINMON_TEST_DEVICE_PATH=1`` (scripts/test.sh's device-path lane): every CPU tensor of this process
    takes the device path that CUDA and Ascend run (fused kernels, grouped activations), not the numpy one,
    so that every float64-reference test checks both. Tests that start processes of their own keep their
    numpy path.

    ``TRAINMON_TEST_DEVICE_PATH=triton`` with ``TRITON_INTERPRET=1`` (the Triton lane): the same, with CUDA's
    kernels too: the Triton launchers and kernels (span tables, unmasked whole spans, the NaN/Inf recount,
    ``_combine_spans``, the Adam kernel) run on the CPU tensors in Triton's interpreter."""
    mode = os.environ.get("TRAINMON_TEST_DEVICE_PATH")
    if mode in ("1", "triton"):
        from trainmon.collect import stats

        monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())
        from trainmon.collect import param_check

        monkeypatch.setattr(param_check, "COUNTED_AT_ONCE", ())
    if mode != "triton":
        yield
        return
    assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton lane needs TRITON_INTERPRET=1 (no GPU here)"
    from trainmon.collect import kernels

    for table in (kernels.PARTIALS, kernels.ADAM, kernels.ADAM_DIRECT):
        monkeypatch.setitem(table, "cpu", None)  # the entries as they were come back after the test
    kernels.use_triton("cpu")
    triton_partials = kernels.PARTIALS["cpu"]
    yield
    # a kernel that raised would have been given up for the plain torch ops, with right values: fail instead
    assert kernels.PARTIALS.get("cpu") is triton_partials, "the Triton kernels failed (see the log): given up"


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch):
    """Fails a test whose monitor leaves a hook on a module, parameter or optimizer it attached to,
    a global module hook, or a process group alive.

    Hook dictionaries are snapshotted when a monitor attaches; hooks the framework itself installs
    (DeepSpeed's ZeRO-3 hooks, say) are in the snapshot, so only the monitor's are checked.
    """
    snapshots: list = []
    from trainmon.runtime import session as session_module

    original = session_module.Session.__init__

    def recording_init(self, model, optimizer, *args, **options):
        snapshots.extend((weakref.ref(obj), attrs, _keys(obj, attrs)) for obj, attrs in _hook_objects(model, optimizer))
        original(self, model, optimizer, *args, **options)

    monkeypatch.setattr(session_module.Session, "__init__", recording_init)
    torch_loaded = "torch" in sys.modules
    global_before = _global_hook_keys() if torch_loaded else {}
    yield
    leftovers = []
    for ref, attrs, before in snapshots:
        obj = ref()
        if obj is None:
            continue
        for attr, keys in _keys(obj, attrs).items():
            if keys - before[attr]:
                leftovers.append(f"{type(obj).__name__}.{attr}")
    if "torch" in sys.modules:
        after = _global_hook_keys()
        leftovers += [f"global {name}" for name, keys in after.items() if keys - global_before.get(name, set())]
    assert not leftovers, f"hooks left behind: {sorted(set(leftovers))}"
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        alive = dist.is_available() and dist.is_initialized()
        if alive:
            dist.destroy_process_group()
        assert not alive, "a process group was left alive"


def _global_hook_keys() -> dict[str, set]:
    from torch.nn.modules import module as module_globals

    return {name: set(getattr(module_globals, name, None) or ()) for name in _GLOBAL_HOOKS}


@pytest.fixture(autouse=True)
def _trainmon_logs(caplog):
    caplog.set_level(logging.INFO, logger="trainmon")
    yield


def _trainmon_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("trainmon") and t.is_alive()}


def _open_files(roots: tuple[str, ...]) -> dict[str, str]:
    """``{fd: path}`` of this process's descriptors open on a file under one of ``roots`` (or any
    ``trainmon_output`` directory, the default output_dir)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing to compare
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listing (the listing's own descriptor)
            continue
        if target.startswith(roots) or f"{os.sep}trainmon_output{os.sep}" in target:
            out[fd] = target
    return out


@pytest.fixture(autouse=True)
def no_trainmon_threads_or_open_files(tmp_path_factory):
    """Fails a test that leaves a ``trainmon*`` thread alive or a file open under the tests' temporary
    directories (every output a test's monitor writes lives there): each ``close()`` must end its
    threads and close its files. Threads get a short grace period to finish after their close returned.
    """
    roots = (str(tmp_path_factory.getbasetemp().resolve()) + os.sep,)
    threads_before, files_before = _trainmon_threads(), _open_files(roots)
    yield
    deadline = time.monotonic() + 1.0
    while (_trainmon_threads() - threads_before) and time.monotonic() < deadline:
        time.sleep(0.01)
    threads = sorted(t.name for t in _trainmon_threads() - threads_before)
    files = sorted(path for fd, path in _open_files(roots).items() if files_before.get(fd) != path)
    assert not threads, f"trainmon threads left alive: {threads}"
    assert not files, f"files left open: {files}"


@pytest.fixture
def tmpfs_1m(tmp_path):
    """A real 1 MiB tmpfs (a disk that fills up: writes fail with ENOSPC); skipped where mounting is not
    allowed (it needs root on Linux)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    yield from _tmpfs(mount, "size=1m", "the full-disk case needs root on Linux")


def _tmpfs(mount, options: str, why: str):
    """Mount a tmpfs with ``options`` on ``mount``, yield it, unmount it; skip (saying ``why``) where it cannot."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc}); {why}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}; {why}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory that refuses writes: ``chmod 555`` where that denies (not root), else a read-only tmpfs
    (root ignores permission bits); skipped where neither is possible."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    folder.chmod(0o755)
    yield from _tmpfs(folder, "ro,size=1m", "chmod does not deny here (root), and a read-only tmpfs needs root")
