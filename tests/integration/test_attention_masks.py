"""An additive attention mask's -inf are its values, not an anomaly.

``nn.Transformer.generate_square_subsequent_mask`` marks the future with -inf; pytorch/examples' word_language_model
passes it to ``nn.TransformerEncoder`` every step, and trainmon reported a "first non-finite value" in it at every
collected step (a false alarm on a healthy run). The truth: torch's mask (its -inf counted by numpy), the run's
events, and a NaN put into the mask, which still is an anomaly.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from trainmon import TrainerMonitor
from trainmon.tools.cli import main as cli_main

SEQ, D = 6, 8


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, D)
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(D, 16)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), mask=mask))


def _run(tmp_path, name: str, poison_step: int | None,
         sinks: tuple[str, ...] = ("csv",)) -> tuple[list[dict], pd.DataFrame, torch.Tensor]:
    torch.manual_seed(0)
    model = CausalLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": name, "sinks": list(sinks),
                              "step_interval": 1,
                              "activations": {"enabled": True, "metrics": ["norm", "min", "max", "nans", "infs"]}})
    monitor.attach(model, optimizer)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
    for step in range(4):
        tokens = torch.randint(0, 16, (2, SEQ), generator=torch.Generator().manual_seed(step))
        step_mask = mask.clone()
        if step == poison_step:
            step_mask[-1, 0] = float("nan")
        loss = nn.functional.cross_entropy(model(tokens, step_mask).reshape(-1, 16), tokens.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
    monitor.close()
    rank = tmp_path / name / "rank0"
    path = rank / "anomalies.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return events, pd.read_csv(rank / "actv.csv"), mask


def test_a_causal_masks_minus_inf_is_no_anomaly_and_a_nan_in_it_is(tmp_path):
    events, rows, mask = _run(tmp_path, "healthy", poison_step=None)
    assert not [e for e in events if e["detector"] == "nonfinite"], events
    masks = rows[rows["name"].str.endswith(".input.src_mask") | rows["name"].str.endswith(".input.mask")]
    assert len(masks) and (masks["infs"] == np.isneginf(mask.numpy().astype(np.float64)).sum()).all()
    assert (masks["min"] == -np.inf).all()  # recorded as it is

    events, _, _ = _run(tmp_path, "poisoned", poison_step=2)
    nonfinite = [e for e in events if e["detector"] == "nonfinite"]
    assert [e["step"] for e in nonfinite][:1] == [2] and "mask" in nonfinite[0]["name"], nonfinite


def test_tensorboards_overview_counts_a_nan_in_a_mask_not_its_minus_inf(tmp_path):
    """The overview's ``actv/nonfinite_tensors`` (the sink's, and ``csv2tb``'s from the CSV rows) agrees."""
    pytest.importorskip("tensorboard", reason="reading event files back needs tensorboard")
    sinks = ("csv", "tensorboard")
    _run(tmp_path, "healthy", poison_step=None, sinks=sinks)
    assert _overview_nonfinite(tmp_path / "healthy" / "rank0") == {step: 0.0 for step in range(4)}
    _run(tmp_path, "poisoned", poison_step=2, sinks=sinks)
    assert _overview_nonfinite(tmp_path / "poisoned" / "rank0")[2] >= 1

    # csv2tb from the CSV rows gives TensorBoard the same overview as the sink did
    assert cli_main(["csv2tb", str(tmp_path / "healthy"), "-o", str(tmp_path / "tb")]) == 0
    exported = [path.parent for path in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    counts = [_overview_nonfinite(path) for path in exported]
    assert {step: 0.0 for step in range(4)} in counts and all(set(c.values()) <= {0.0} for c in counts), counts


def _overview_nonfinite(log_dir) -> dict[int, float]:
    """The overview's ``actv/nonfinite_tensors`` per step, as TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.endswith("actv/nonfinite_tensors")]
    return {event.step: event.value for tag in tags for event in events.Scalars(tag)}
