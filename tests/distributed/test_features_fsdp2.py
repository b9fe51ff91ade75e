"""Spectral features of FSDP2-sharded matrices (``Shard(0)`` and ``Shard(1)``) on 2 gloo CPU ranks
(scripts/fsdp2_spectral.py): the power iteration on the shards, combined by one all-reduce per iteration over the
shard group, equals numpy's largest singular value of the ``full_tensor()`` on both ranks; attn rows are written
while FSDP has the blocks unsharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_ranks
from tests.reference import read_family

SCRIPT = Path(__file__).parent / "scripts" / "fsdp2_spectral.py"


def test_fsdp2_sharded_spectral_norms_match_the_full_tensors(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_ranks([SCRIPT, out], timeout=300)
    tables = [read_family(out / f"rank{rank}", "weight_features") for rank in (0, 1)]
    assert tables[0].equals(tables[1])  # the same combined values on both ranks
    for rank, table in enumerate(tables):
        refs = json.loads((out / f"refs_rank{rank}.json").read_text())
        assert set(table["name"]) == set(refs["0"])
        assert {refs["0"][name]["split_dim"] for name in refs["0"]} == {0, 1}
        for row in table.itertuples():
            want = refs[str(row.step)][row.name]
            assert row.spectral_norm == pytest.approx(want["spectral_norm"], rel=1e-3), (rank, row.name)
            assert row.stable_rank == pytest.approx(want["stable_rank"], rel=2e-3), (rank, row.name)
        attn = read_family(out / f"rank{rank}", "attn")
        assert len(attn) == 3 * 2 * 4 and attn[["max_logit", "entropy"]].notna().all().all()
