"""The step guard on a CUDA device: a fused optimizer's verdict adds no synchronisation (CUDA's own sync detector),
and the skipped step leaves the parameters and the optimizer state as a run without that batch.

Skipped without a CUDA device (CI has none). On a GPU machine: ``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_cuda import CUDA, _sync_warnings
from tests.models import TinyNet, batch, loss_fn
from trainmon import TrainerMonitor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
STEPS, BAD = 8, 6
GUARD = {"enabled": True, "window": 8, "warmup": 4}


def _run(tmp_path, guard: dict | None, poison: bool, skip: int | None = None):
    torch.manual_seed(0)
    data = [tuple(t.to(CUDA) for t in batch(step, vocab=64)) for step in range(STEPS)]
    model = TinyNet(vocab=64, d=128).to(CUDA, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    monitor = None
    if guard is not None:
        monitor = TrainerMonitor({"output_dir": str(tmp_path), "sinks": ["csv"], "step_interval": 100,
                                  "anomaly": {"guard": guard}}).attach(model, optimizer)
    counts = []
    for step, (tokens, targets) in enumerate(data):
        if step == skip:
            continue

        def one_step(tokens=tokens, targets=targets, step=step):
            loss = loss_fn(model, tokens, targets)
            if poison and step == BAD:
                loss = loss * float("nan")
            loss.float().backward()
            optimizer.step()
            optimizer.zero_grad()
            if monitor is not None:
                monitor.step(loss=loss)

        counts.append(_sync_warnings(one_step))
    if monitor is not None:
        monitor.close()
    return counts, model, optimizer


def test_a_fused_optimizer_is_guarded_without_a_synchronisation(tmp_path):
    _run(tmp_path, None, poison=False)  # CUDA's own lazy set-up syncs once per process: not counted
    baseline, _, _ = _run(tmp_path, None, poison=False)
    guarded, model, optimizer = _run(tmp_path, GUARD, poison=True)
    unguarded, _, _ = _run(tmp_path, {"enabled": False}, poison=False)
    assert guarded == unguarded, (baseline, unguarded, guarded)  # the guard adds none, the NaN step included
    _, reference, reference_optimizer = _run(tmp_path, None, poison=False, skip=BAD)
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param, expected)
    for param, expected in zip(model.parameters(), reference.parameters()):
        for key, value in reference_optimizer.state[expected].items():
            assert torch.equal(optimizer.state[param][key], value), key
