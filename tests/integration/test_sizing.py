"""The size projection logged at attach (``trainmon.runtime.sizing``) against what a real torch run writes:
rows per collected step counted in the CSV files (parameter families exactly, activations within 15%), bytes
per collected step against the CSV and TensorBoard files' sizes (within 30%)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.models import TinyNet, batch, loss_fn
from trainmon import TrainerMonitor

STEPS = 12
ACTIVATION_TOLERANCE = 0.15
BYTES_TOLERANCE = 0.30


def _train(out: Path, optimizer_of, config: dict, grad_acc_steps: int = 1, freeze: str | None = None) -> Path:
    torch.manual_seed(0)
    model = TinyNet()
    if freeze:
        model.get_parameter(freeze).requires_grad_(False)
    optimizer = optimizer_of([p for p in model.parameters() if p.requires_grad])
    with TrainerMonitor({"output_dir": str(out), "run_name": "run", **config}) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=grad_acc_steps)
        for step in range(STEPS):
            for micro_step in range(grad_acc_steps):
                (loss_fn(model, *batch(step * grad_acc_steps + micro_step)) / grad_acc_steps).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    return out / "run"


def _rows_per_step(rank_dir: Path) -> dict[str, float]:
    """Rows per collected step of every family CSV."""
    out = {}
    for path in sorted(rank_dir.glob("*.csv")):
        if path.stem != "scalars":
            frame = pd.read_csv(path)
            out[path.stem] = len(frame) / frame["step"].nunique()
    return out


def _logged(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "rows per collected step" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def test_projection_matches_a_real_run(tmp_path, caplog):
    config = {"sinks": ["csv", "tensorboard"], "activations": {"enabled": True}, "params": {"enabled": True},
              "tensorboard": {"per_tensor": True}}
    run = _train(tmp_path, lambda params: torch.optim.AdamW(params, lr=1e-3), config)
    sizing = json.loads((run / "run.json").read_text())["sizing"]
    projected = sizing["rows_per_collected_step"]
    written = _rows_per_step(run / "rank0")
    n_params = len(list(TinyNet().parameters()))
    for family in ("grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio"):
        assert projected[family] == written[family] == n_params, family
    for family in ("actv", "actv_grad"):
        assert written[family] == pytest.approx(projected[family], rel=ACTIVATION_TOLERANCE), family
    assert sizing["estimated"] == ["actv", "actv_grad"]
    line = _logged(caplog)
    assert re.search(rf"about {sum(projected.values()):,} rows per collected step \(actv ~\d+, actv_grad ~\d+, "
                     rf"grad_unreduced {n_params}, ", line), line
    assert "with sinks [csv, tensorboard]" in line and "see docs/sizing.md" in line

    # bytes: the family CSVs (their header aside) and the event file against the projection per sink
    csv_bytes = sum(p.stat().st_size - len(p.read_text().split("\n", 1)[0]) - 2
                    for p in (run / "rank0").glob("*.csv") if p.stem != "scalars")
    per_row = sizing["bytes_per_row"]
    projected_csv = sum(projected[f] * per_row[f]["csv"] for f in projected) * STEPS
    assert csv_bytes == pytest.approx(projected_csv, rel=BYTES_TOLERANCE)
    events = sum(p.stat().st_size for p in (run / "rank0").glob("events.out.tfevents.*"))
    overview = sizing["tensorboard_overview_bytes_per_collected_step"]
    projected_tb = (sum(projected[f] * per_row[f]["tensorboard"] for f in projected) + overview) * STEPS
    assert events == pytest.approx(projected_tb, rel=BYTES_TOLERANCE)
    assert sizing["bytes_per_collected_step"] == pytest.approx((projected_csv + projected_tb) / STEPS, rel=1e-3)


def test_tensorboard_overview_projection_is_a_constant_per_step(tmp_path):
    """The default TensorBoard output: the overview's summaries per collected step (the projection counts them
    alone: the scalars, the tables of tensors and the layout are the rest of the file, up to half as much again
    on this 12-step run)."""
    config = {"sinks": ["tensorboard"], "activations": {"enabled": True}, "params": {"enabled": True}}
    run = _train(tmp_path, lambda params: torch.optim.AdamW(params, lr=1e-3), config)
    sizing = json.loads((run / "run.json").read_text())["sizing"]
    assert {row["tensorboard"] for row in sizing["bytes_per_row"].values()} == {0.0}
    projected = sizing["tensorboard_overview_bytes_per_collected_step"] * STEPS
    events = sum(p.stat().st_size for p in (run / "rank0").glob("events.out.tfevents.*"))
    assert projected <= events <= 1.5 * projected


def test_projection_follows_the_optimizer_and_the_schedule(tmp_path, caplog):
    """SGD with momentum keeps no Adam state; a frozen parameter has no rows; micro-steps multiply the rows of
    activations and of ``grad_unreduced`` with ``per_micro_step``; ``step_interval`` thins the steps."""
    config = {"sinks": ["csv"], "step_interval": 3, "activations": {"enabled": True, "inputs": False},
              "weight_grads": {"per_micro_step": True, "metrics": ["norm", "nans"]},
              "optimizer_states": {"states": ["exp_avg", "momentum"]}}
    run = _train(tmp_path, lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9), config,
                 grad_acc_steps=2, freeze="head.bias")
    projected = json.loads((run / "run.json").read_text())["sizing"]["rows_per_collected_step"]
    written = _rows_per_step(run / "rank0")
    trained = len(list(TinyNet().parameters())) - 1
    assert projected["grad_unreduced"] == written["grad_unreduced"] == 2 * trained
    assert projected["grad_reduced"] == written["grad_reduced"] == trained
    assert projected["momentum"] == written["momentum"] == trained
    assert projected["exp_avg"] == 0 and "exp_avg" not in written
    for family in ("actv", "actv_grad"):
        assert written[family] == pytest.approx(projected[family], rel=ACTIVATION_TOLERANCE), family
    assert pd.read_csv(run / "rank0" / "grad_reduced.csv")["step"].nunique() == STEPS // 3
    line = _logged(caplog)
    assert "per 1,000 steps at step_interval 3;" in line, line


def test_activation_estimate_on_a_hugging_face_llama(tmp_path):
    """A 2-layer Llama of ``transformers`` (the 7B shape's modules): its decoder layers also take the rotary
    ``position_embeddings`` (cos, sin) as inputs, its attention returns a tuple; the estimate stays within 15%."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "activations": {"enabled": True}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(2):
            tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    projected = json.loads((tmp_path / "run" / "run.json").read_text())["sizing"]["rows_per_collected_step"]
    written = _rows_per_step(tmp_path / "run" / "rank0")
    assert projected["grad_reduced"] == written["grad_reduced"] == len(list(model.parameters()))
    for family in ("actv", "actv_grad"):
        assert written[family] == pytest.approx(projected[family], rel=ACTIVATION_TOLERANCE), family
