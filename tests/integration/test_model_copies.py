"""Copies of a monitored model, as training scripts make them: an EMA model by ``copy.deepcopy``, a checkpoint by
``torch.save(model)`` (the whole module pickled, as pytorch/examples' word_language_model does every epoch).

Before trainmon kept its hooks out of copies (trainmon/collect/copies.py), ``torch.save(model)`` raised in the
user's loop (a hook closure cannot be pickled) and a deep copy shared trainmon's hooks, so an EMA model's forward fed
the monitor rows under the monitored model's names. The truth here: the same loop without the copies (its rows),
and the model's own outputs.
"""

from __future__ import annotations

import copy
import io
import pickle

import pandas as pd
import torch

from tests.models import Block, TinyNet, batch, loss_fn
from trainmon import TrainerMonitor

STEPS = 4
SAFE = [TinyNet, Block, torch.nn.Embedding, torch.nn.ModuleList, torch.nn.LayerNorm, torch.nn.Linear, torch.nn.GELU]


def _run(tmp_path, name: str, copies: bool) -> tuple[pd.DataFrame, list[torch.nn.Module]]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": name, "sinks": ["csv"], "step_interval": 1,
                              "activations": {"enabled": True}, "weight_grads": {"enabled": True},
                              "optimizer_states": {"enabled": True}})
    monitor.attach(model, optimizer)
    saved: list[torch.nn.Module] = []
    ema = copy.deepcopy(model) if copies else None
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = loss_fn(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if ema is not None:
            with torch.no_grad():
                for shadow, param in zip(ema.parameters(), model.parameters()):
                    shadow.lerp_(param, 0.1)
                ema(tokens)  # the EMA model's evaluation
            loss_fn(ema, tokens, targets).backward()  # and a backward through it (a distillation teacher, say)
            buffer = io.BytesIO()
            torch.save(model, buffer)  # the whole module, while attached
            assert b"trainmon" not in buffer.getvalue()  # it loads where trainmon is not installed
            buffer.seek(0)
            with torch.serialization.safe_globals(SAFE):  # as the script loads it: weights_only, its own classes
                saved.append(torch.load(buffer))
            copy.deepcopy(optimizer)
        monitor.step(loss=loss)
    monitor.close()
    rows = pd.concat(pd.read_csv(path) for path in sorted((tmp_path / name / "rank0").glob("*.csv"))
                     if path.name != "scalars.csv")
    return rows, saved + ([model] if ema is None else [ema, model])


def test_deep_copies_and_whole_module_saves_neither_fail_nor_feed_the_monitor(tmp_path):
    plain, _ = _run(tmp_path, "plain", copies=False)
    with_copies, models = _run(tmp_path, "copies", copies=True)
    key = ["step", "name"]
    pd.testing.assert_frame_equal(with_copies.sort_values(key).reset_index(drop=True),
                                  plain.sort_values(key).reset_index(drop=True), check_like=True)
    *saved, ema, model = models
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    for copied in (ema, *saved):  # the copies carry no hook at all (nor torch's backward-hook machinery)
        assert not any(getattr(module, name) for module in copied.modules() for name in hooks)
    tokens, _ = batch(99)
    with torch.no_grad():
        for loaded in saved[-1:]:
            assert torch.equal(loaded(tokens), model(tokens))  # the loaded checkpoint is the model
        assert not torch.equal(ema(tokens), model(tokens))
    pickle.loads(pickle.dumps(saved[-1]))  # and saves again
