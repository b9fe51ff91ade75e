"""Model features under DeepSpeed on one gloo CPU rank (scripts/ds_features.py): ZeRO-2 measures the whole matrices
each rank holds (against numpy's SVD); ZeRO-3 refuses features.weights at attach (its flat partitions cannot be
combined by the power iteration) and measures attention on the parameters it gathers for the forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_ranks
from tests.reference import read_family

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_features.py"


def test_deepspeed_zero2_measures_and_zero3_refuses_the_weights(tmp_path: Path) -> None:
    run_ranks([SCRIPT, tmp_path], world_size=1, timeout=300)
    refs = json.loads((tmp_path / "z2" / "refs.json").read_text())
    weights = read_family(tmp_path / "z2" / "rank0", "weight_features")
    last = weights[weights["step"] == 1].set_index("name")["spectral_norm"]
    assert set(last.index) == set(refs)
    for name, sigma in refs.items():
        assert last[name] == pytest.approx(sigma, rel=1e-3), name
    assert "features.weights under DeepSpeed ZeRO-3" in (tmp_path / "z3_error.txt").read_text()
    for run in ("z2", "z3"):
        attn = read_family(tmp_path / run / "rank0", "attn")
        assert len(attn) == 2 * 2 * 4 and attn[["max_logit", "entropy"]].notna().all().all(), run
    z2, z3 = (read_family(tmp_path / run / "rank0", "attn").set_index(["name", "step"]) for run in ("z2", "z3"))
    assert z3["max_logit"].to_numpy() == pytest.approx(z2["max_logit"].to_numpy(), rel=1e-5)  # the same model
