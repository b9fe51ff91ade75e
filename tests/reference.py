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


def precursors_np(grad: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, param: np.ndarray, step: float,
                  betas: tuple[float, float], eps: float, lr: float, adam_step: np.ndarray | None = None,
                  coupled_decay: float = 0.0, param_before: np.ndarray | None = None,
                  maximize: bool = False) -> dict[str, float]:
    """The ``precursors`` row of one parameter in float64 (docs/precursors.md): ``param`` after the step;
    ``adam_step`` the step the optimizer took without its decoupled weight decay (default ``lr * update``, from
    the moments; a test passes ``param_before - param_after - lr * wd * param_before`` measured on the weights).
    The gradient is the one the moments took: ``-grad`` with ``maximize``, plus ``coupled_decay * param_before``
    under Adam's coupled (L2) decay."""
    g, m, v, p = (np.asarray(x, np.float64).ravel() for x in (grad, exp_avg, exp_avg_sq, param))
    if maximize:
        g = -g
    if coupled_decay:
        g = g + coupled_decay * np.asarray(param_before, np.float64).ravel()
    update = adam_update_np(m, v, step, betas, eps).ravel()
    taken = lr * update if adam_step is None else np.asarray(adam_step, np.float64).ravel()
    v_hat = v / (1 - betas[1] ** step)
    with np.errstate(divide="ignore", invalid="ignore"):
        stale = np.where(g != 0, g * g / np.maximum(v_hat, eps * eps), 0.0)

    def cosine(a: np.ndarray, b: np.ndarray) -> float:
        denominator = np.linalg.norm(a) * np.linalg.norm(b)
        if np.isnan(denominator):
            return float("nan")
        return float(np.clip(np.dot(a, b) / denominator, -1, 1)) if denominator > 0 else 0.0

    param_norm = np.linalg.norm(p)
    return {
        "update_weight_ratio": float(np.linalg.norm(taken) / param_norm) if param_norm > 0 else 0.0,
        "g2_v_rms": float(np.sqrt(np.mean(stale))),
        "g2_v_max": float(np.max(stale)),
        "eps_underflow": float(np.mean(np.sqrt(v_hat) < eps)),
        "cos_update_grad": cosine(update, g),
        "cos_m_g": cosine(m, g),
    }
