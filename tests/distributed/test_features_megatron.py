"""Model features under Megatron-Core on CPU, 2 gloo ranks (scripts/mcore_features_run.py), against the script's
float64 references from the same tensors.

- TP=2, 4 heads in 2 query groups: each rank writes the attn rows of its own heads under their global indices
  (rank 0 heads 0-1, rank 1 heads 2-3), equal to the features of those heads computed from the all-gathered query and
  key; weight_features of every matrix, the TP-split ones (column- and row-parallel) combined exactly over the TP
  group, equal numpy's largest singular value of the all-gathered matrix.
- MoE (TP=1, DP=2, Megatron's TopKRouter, 4 experts, top-2): router and expert_load rows equal the features of the
  router's float64 logits, its routing map and its local experts' weights.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("megatron.core")

from tests.launch import child_env, torchrun
from tests.reference import read_family

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "mcore_features_run.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mcore_features")
    proc = subprocess.run(torchrun(SCRIPT, out), env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def _refs(runs: Path, case: str, rank: int) -> dict:
    return json.loads((runs / case / f"refs_rank{rank}.json").read_text())


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_heads_are_global_and_match_the_gathered_float64_heads(runs: Path, rank: int) -> None:
    refs = _refs(runs, "tp2", rank)
    assert refs["tp"] == 2 and refs["tp_rank"] == rank
    attn = read_family(runs / "tp2" / f"rank{rank}", "attn")
    mine = [2 * rank, 2 * rank + 1]
    assert sorted({int(n.rpartition("head")[2]) for n in attn["name"]}) == mine
    checked = 0
    for row in attn.itertuples():
        module, _, head = row.name.rpartition(".head")
        max_logit, entropy = refs["steps"][str(row.step)]["captured"][module][row.micro_step][int(head)]
        assert row.max_logit == pytest.approx(max_logit, rel=2e-5), row
        assert row.entropy == pytest.approx(entropy, rel=2e-5), row
        checked += 1
    assert checked == 2 * 2 * 2 * 2  # steps x micro-steps x layers x own heads


@pytest.mark.parametrize("case", ["tp2", "moe"])
def test_spectral_norms_of_split_matrices_match_numpy(runs: Path, case: str) -> None:
    tables = [read_family(runs / case / f"rank{rank}", "weight_features") for rank in (0, 1)]
    assert tables[0][["name", "step"]].equals(tables[1][["name", "step"]])
    for rank, table in enumerate(tables):
        refs = _refs(runs, case, rank)["steps"]
        names = set(table["name"])
        assert names == set(refs["0"]["weights"]), case
        if case == "tp2":
            assert {"decoder.layers.0.self_attention.linear_qkv.weight",  # column-parallel (partition_dim 0)
                    "decoder.layers.0.self_attention.linear_proj.weight"} <= names  # row-parallel (dim 1)
        for row in table.itertuples():
            want = refs[str(row.step)]["weights"][row.name]
            assert row.micro_step == 0
            assert row.spectral_norm == pytest.approx(want["spectral_norm"], rel=1e-3), (case, rank, row.name)
            assert row.stable_rank == pytest.approx(want["stable_rank"], rel=2e-3), (case, rank, row.name)


@pytest.mark.parametrize("rank", [0, 1])
def test_megatron_router_features_match_its_logits_and_routing_map(runs: Path, rank: int) -> None:
    steps = _refs(runs, "moe", rank)["steps"]
    router = read_family(runs / "moe" / f"rank{rank}", "router")
    load = read_family(runs / "moe" / f"rank{rank}", "expert_load")
    assert len(router) == 2 * 2 * 2 and len(load) == 2 * 2 * 2 * 4
    for row in router.itertuples():
        want = steps[str(row.step)]["captured"][row.name][row.micro_step]
        assert want["tokens"] == want["tokens_from_logits"]  # the routing map is the top-k of the logits
        for metric in ("imbalance", "entropy", "z_loss", "expert_similarity"):
            assert getattr(row, metric) == pytest.approx(want[metric], rel=2e-5, abs=1e-6), (row.name, metric)
        own = load[(load["step"] == row.step) & (load["micro_step"] == row.micro_step)
                   & load["name"].str.startswith(row.name + ".expert")]
        expected = pd.Series(want["tokens"], index=[f"{row.name}.expert{e}" for e in range(4)])
        assert own.set_index("name")["tokens"].to_dict() == expected.to_dict()
        assert own["share"].sum() == pytest.approx(1.0)
