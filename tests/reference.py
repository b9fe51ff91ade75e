"""Independent float64 numpy references for the statistics, and output readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

METRICS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]


def np_stats(array: np.ndarray, eps: float = 1e-8) -> dict[str, float]:
    a = np.asarray(array, dtype=np.float64).ravel()
    return {
        "norm": float(np.sqrt(np.sum(a * a))),
        "min": float(np.min(a)),  # NaN propagates, as in torch
        "max": float(np.max(a)),
        "mean": float(np.mean(a)),
        "zeros": float(np.mean(np.abs(a) < eps)),
        "nans": float(np.isnan(a).sum()),
        "infs": float(np.isinf(a).sum()),
    }


def adam_update_np(exp_avg: np.ndarray, exp_avg_sq: np.ndarray, step: float, betas: tuple[float, float],
                   eps: float) -> np.ndarray:
    m = np.asarray(exp_avg, np.float64) / (1 - betas[0] ** step)
    v = np.asarray(exp_avg_sq, np.float64) / (1 - betas[1] ** step)
    return m / (np.sqrt(v) + eps)


def read_family(rank_dir: Path, family: str) -> pd.DataFrame:
    return pd.read_csv(rank_dir / f"{family}.csv", keep_default_na=False, na_values=["nan"])


def written_by(run_dir: Path, rank: int, family: str) -> int:
    """The rank whose files hold ``rank``'s rows of ``family``: its data-parallel group's writer for a family written
    once per group (``run.json``'s ``"replicated"``), else ``rank`` itself."""
    import json

    layout = json.loads((run_dir / "run.json").read_text()).get("replicated") or {}
    return int(layout.get("writer", {}).get(str(rank), rank)) if family in layout.get("families", []) else rank


def read_rank_family(run_dir: Path, rank: int, family: str) -> pd.DataFrame:
    """``rank``'s rows of ``family`` from the CSV files of the rank that wrote them (:func:`written_by`)."""
    return read_family(run_dir / f"rank{written_by(run_dir, rank, family)}", family)


def assert_close(row: pd.Series, expected: dict[str, float], metrics: list[str], rtol: float = 1e-5,
                 atol: float = 1e-7, label: str = "") -> None:
    for metric in metrics:
        got, want = float(row[metric]), expected[metric]
        if np.isnan(want):
            assert np.isnan(got), f"{label} {metric}: got {got}, want nan"
        else:
            assert np.isclose(got, want, rtol=rtol, atol=atol), f"{label} {metric}: got {got!r}, want {want!r}"
