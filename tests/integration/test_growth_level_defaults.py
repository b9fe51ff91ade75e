"""The ``growth`` and ``level`` defaults on a real model: the attention and precursor rows reach them, an attention
logit made to grow fires the growth default on that block's heads and nowhere before, close twice."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from trainmon import TrainerMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_gpt import TinyGPT, gpt_loss, make_batch

GROW_FROM, STEPS, GROWTH = 50, 100, 1.08


def _run(tmp_path: Path, grow: bool) -> tuple[list[tuple[int, str, str, str]], TrainerMonitor, list[float]]:
    """A TinyGPT with the attention and precursor families on; with ``grow`` block 0's query and key weights are
    multiplied by 1.08 per step from step 50 (its logits by 1.17), as a logit growth does."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {"output_dir": str(tmp_path), "run_name": f"grow{int(grow)}", "sinks": [],
              "optimizer_states": {"precursors": True}, "features": {"attention": {"enabled": True}},
              "anomaly": {"actions": ["callback"]}}
    monitor = TrainerMonitor(config)
    events: list = []
    monitor.on_anomaly(events.append)
    largest: list[float] = []
    monitor.attach(model, optimizer)
    for step in range(STEPS):
        tokens, targets = make_batch(step, 8, 16, 64)
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if grow and step >= GROW_FROM:
            with torch.no_grad():
                model.blocks[0].attn.qkv.weight[:64] *= GROWTH  # the query and key rows
        record = monitor.step(loss=loss.detach())
        assert record is not None
        largest.append(max(row.values["max_logit"] for row in record.rows if row.key.family == "attn"))
    monitor.close()
    monitor.close()  # idempotent
    return [(e.step, e.detector, e.family, e.name) for e in events], monitor, largest


def test_growth_default_fires_on_a_growing_attention_logit_only(tmp_path):
    events, _, largest = _run(tmp_path, grow=True)
    growth = [e for e in events if e[1] == "growth"]
    assert growth, (events, largest)
    assert all(family == "attn" and name.startswith("blocks.0.attn.head") for _, _, family, name in growth)
    first = growth[0][0]
    # a full window of 40 steps, 1.7x from the first block's median to the last's, the last above 25
    assert first > GROW_FROM and largest[first] > 25 and math.isfinite(largest[first])
    assert not [e for e in events if e[1] == "level"]
    quiet, _, _ = _run(tmp_path, grow=False)
    assert not [e for e in quiet if e[1] in ("growth", "level")]


def test_the_attention_and_precursor_rows_reach_the_defaults(tmp_path):
    from trainmon.anomaly.engine import AnomalyEngine
    from trainmon.config import load_config

    engine = AnomalyEngine(load_config({}).anomaly, rank=0, rank_dir=None)
    assert [d.type_name for d in engine.detectors][-3:] == ["growth", "level", "level"]  # the last: zero gradients
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "r", "sinks": [],
                              "optimizer_states": {"precursors": True}, "features": {"attention": {"enabled": True}}})
    largest = []
    with monitor.attach(model, optimizer):
        for step in range(3):
            loss = gpt_loss(model, *make_batch(step, 8, 16, 64))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record = monitor.step(loss=loss.detach())
            heads = {row.key.name: row.values["max_logit"] for row in record.rows if row.key.family == "attn"}
            assert sorted(heads) == [f"blocks.{b}.attn.head{h}" for b in range(2) for h in range(4)]
            largest.append(max(heads.values()))
        state = monitor.state_dict()["anomaly"]["detectors"]
    growth, level = state[-3]["state"]["series"], state[-2]["state"]["series"]
    # the growth default watches one series: the largest of the 8 heads' max_logit at each step
    assert [key for key, _ in growth] == [["*", "max", "value", 0, 0]] and growth[0][1]["values"] == largest
    assert {key[0] for key, _ in level} == {"precursors"} and len(level) >= 8  # one per Adam weight matrix at least
