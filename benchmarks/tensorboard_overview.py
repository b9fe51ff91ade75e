"""The TensorBoard sink's cost per step at a 7B shape: its overview against per-tensor tags (docs/tensorboard.md).

Usage: ``python benchmarks/tensorboard_overview.py [--steps 20]``

Feeds the real ``TensorBoardSink`` (on this thread: in a run it is the sink's writer thread) ``StepRecord``s of the
7B Llama's 291 parameter names x the default six families x the 7 metrics (1,746 rows, normal values), and prints
per step: the sink's time, the summaries' own time, and the event file's bytes and tags.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from trainmon.base.records import METRICS, Row, RowKey, StepRecord
from trainmon.sinks.tensorboard import TensorBoardSink
from trainmon.sinks.tensorboard_overview import Overview, TagSelection

FAMILIES = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")
LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
         *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
LLAMA_7B = ["model.embed_tokens.weight", *(f"model.layers.{i}.{n}" for i in range(32) for n in LAYER),
            "model.norm.weight", "lm_head.weight"]


def records(steps: int) -> list[StepRecord]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        values = rng.normal(size=(len(FAMILIES) * len(LLAMA_7B), len(METRICS))).tolist()
        rows = [Row(RowKey(family, name, 0, 0, i), step, dict(zip(METRICS, values[f * len(LLAMA_7B) + i])), False)
                for f, family in enumerate(FAMILIES) for i, name in enumerate(LLAMA_7B)]
        out.append(StepRecord(step=step, rank=0, rows=rows, scalars={"loss": 1.0, "grad_norm": 2.0,
                                                                     "lr/group0": 1e-3}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    steps = records(args.steps)
    for per_tensor in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            sink = TensorBoardSink(Path(tmp), selection=TagSelection(per_tensor=per_tensor))
            sink.write(steps[0])  # the file, the layout
            start = time.perf_counter()
            for record in steps[1:]:
                sink.write(record)
            seconds = (time.perf_counter() - start) / (len(steps) - 1)
            sink.close()
            size = sum(p.stat().st_size for p in Path(tmp).glob("events.out.tfevents.*"))
        label = "per-tensor tags + overview" if per_tensor else "overview (default)"
        print(f"{label}: {seconds * 1e3:.1f} ms per step, {size / len(steps) / 1e3:.1f} kB per step")
    overview = Overview()
    start = time.perf_counter()
    for record in steps:
        overview.record_blocks(record.step, record.rows)
    print(f"the summaries alone: {(time.perf_counter() - start) / len(steps) * 1e3:.1f} ms per step "
          f"({len(steps[0].rows):,} rows)")


if __name__ == "__main__":
    main()
