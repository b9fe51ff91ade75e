"""Shared pieces of the recipe loops: a model, data, the test's own float64 captures, output readers.

Every reference here is taken by the test itself from the tensors the framework used (the
test's own hooks and reads, copied to float64 numpy), never from trainmon's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from tests.reference import METRICS, np_stats, read_family

GRAD_METRICS = ["norm", "min", "max", "mean"]


class MLP(nn.Module):
    """Two linear layers with a GELU: small, deterministic, with distinct gradients per layer."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def data(step: int, n: int = 16, d_in: int = 8, d_out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d_in, generator=g)
    return x, torch.randn(n, d_out, generator=g)


def config(tmp_path: Path, **sections: object) -> dict:
    base = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
            "weight_grads": {"enabled": True, "metrics": METRICS}}
    return {**base, **sections}


def grads64(model: nn.Module, divide: float = 1.0) -> dict[str, np.ndarray]:
    """``name -> p.grad`` as float64 numpy (divided by ``divide``: a loss scale)."""
    return {name: p.grad.detach().double().numpy() / divide for name, p in model.named_parameters()
            if p.grad is not None}


def global_norm(grads: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(g * g) for g in grads.values())))


def rank_dir(tmp_path: Path) -> Path:
    return tmp_path / "run" / "rank0"


def scalars(tmp_path: Path) -> pd.DataFrame:
    """``scalars.csv`` pivoted to one row per step, one column per scalar."""
    frame = pd.read_csv(rank_dir(tmp_path) / "scalars.csv", keep_default_na=False, na_values=["nan"])
    return frame.pivot(index="step", columns="name", values="value")


def rows(tmp_path: Path, family: str) -> pd.DataFrame:
    return read_family(rank_dir(tmp_path), family)


def assert_rows_match(frame: pd.DataFrame, step: int, reference: dict[str, np.ndarray],
                      metrics: list[str] = GRAD_METRICS, rtol: float = 1e-5, micro_step: int | None = None) -> None:
    """Every reference tensor has a row at ``step`` whose metrics equal its float64 statistics."""
    at = frame[frame.step == step]
    if micro_step is not None:
        at = at[at.micro_step == micro_step]
    assert sorted(at.name) == sorted(reference), (step, sorted(at.name), sorted(reference))
    for _, row in at.iterrows():
        want = np_stats(reference[row["name"]])
        for metric in metrics:
            assert np.isclose(float(row[metric]), want[metric], rtol=rtol, atol=1e-7), \
                (step, row["name"], metric, float(row[metric]), want[metric])


@contextlib.contextmanager
def one_rank_gloo() -> Iterator[Any]:
    """A 1-rank gloo process group in this process (an in-memory store), destroyed after; yields its CPU device
    mesh, for ``fully_shard(module, mesh=...)``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized(), "a process group is already alive"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
