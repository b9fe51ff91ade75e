"""msprobe 1.2.1's ``compare`` reads trainmon's dumps: torch (``framework: pytorch``) and MindSpore.

Each run dumps the same modules twice through ``TrainerMonitor``: by hand on a clean step, and by the
``dump`` action after a NaN injected into one layer (default families: the dump localises the layer
first). msprobe compares the anomaly dump (its "NPU" side) with the clean one ("bench"): every tensor
of one is matched with the other's, finite tensors get a cosine and error measures from the tensor files,
and the poisoned layer's output is reported by msprobe itself as a NaN mismatch. The Megatron-Core dump is
compared in ``tests/distributed/test_megatron_actions.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from tests.integration.msprobe_dump_compare import compare_dumps, require_msprobe
from tests.integration.test_dump import Net
from trainmon import TrainerMonitor

NAN_MESSAGE = "The position of inf or nan in NPU and bench Tensor do not match."


def check_compare(table: pd.DataFrame, nan_rows: set[str], finite_rows: set[str]) -> None:
    """Every tensor is matched; ``nan_rows`` are msprobe's NaN mismatches, ``finite_rows`` got a cosine."""
    assert len(table) > 10
    unmatched = table[table["Bench Name"] == "N/A"]["NPU Name"].tolist()
    assert not unmatched, unmatched
    by_name = table.set_index("NPU Name")
    for name in nan_rows:
        assert by_name.loc[name, "Err_message"] == NAN_MESSAGE, (name, by_name.loc[name].to_dict())
    for name in finite_rows:
        cosine = float(by_name.loc[name, "Cosine"])
        assert 0.0 < cosine <= 1.0 + 1e-6, (name, by_name.loc[name].to_dict())


def test_torch_dump_is_read_by_msprobe_compare(tmp_path: Path) -> None:
    require_msprobe()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.ones(4, 1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": [],
                              "dump": {"enabled": True, "mode": "tensor"},
                              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump"]}})
    monitor.attach(model, opt)
    monitor.dump(["layers.2", "layers.2.*"], steps=[1])
    for step in range(6):
        model.layers[2].poison = step >= 3
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        monitor.step(loss=loss)
    monitor.close()
    dumps = tmp_path / "run" / "rank0" / "dump"
    assert json.loads((dumps / "localisation.jsonl").read_text())["dump_step"] == 5
    table = compare_dumps(dumps / "step5", dumps / "step1", tmp_path / "compare")
    check_compare(table, nan_rows={"Module.layers.2.Block.forward.0.output.0"},
                  finite_rows={"Module.layers.2.Block.forward.0.input.0",
                               "Module.layers.2.fc.Linear.forward.0.output.0",
                               "Module.layers.2.fc.Linear.forward.0.parameters.weight"})
    # the parameter gradients ({param: [description]}) are found in both dumps' tensor files
    grads = table[table["NPU Name"].str.contains("parameters_grad")]
    assert len(grads) == 2 and not grads["Err_message"].str.contains("does not have data file").any()


def test_mindspore_dump_is_read_by_msprobe_compare(tmp_path: Path) -> None:
    pytest.importorskip("mindspore")
    require_msprobe()
    from tests.integration.test_mindspore_actions import _train

    rank_dir, _ = _train(tmp_path)
    dumps = rank_dir / "dump"
    table = compare_dumps(dumps / "step5", dumps / "step1", tmp_path / "compare", framework="mindspore")
    check_compare(table, nan_rows={"Cell.block.fc1.PoisonDense.forward.0.output.0"},
                  finite_rows={"Cell.block.fc1.PoisonDense.forward.0.input.0",
                               "Cell.block.fc1.PoisonDense.forward.0.parameters.weight"})
