"""Fixtures for every test: no monitor may leave a hook or a process group behind."""

from __future__ import annotations

import logging
import sys
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
def no_leftovers(monkeypatch):
    """Fails a test whose monitor leaves a hook on a module, parameter or optimizer it attached to,
    a global module hook, or a process group alive.

    Hook dictionaries are snapshotted when a monitor attaches; hooks the framework itself installs
    (DeepSpeed's ZeRO-3 hooks, say) are in the snapshot, so only the monitor's are checked.
    """
    snapshots: list = []
    from trainmon import session as session_module

    original = session_module.Session.__init__

    def recording_init(self, monitor, model, optimizer, **options):
        snapshots.extend((weakref.ref(obj), attrs, _keys(obj, attrs)) for obj, attrs in _hook_objects(model, optimizer))
        original(self, monitor, model, optimizer, **options)

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
