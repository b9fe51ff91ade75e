"""Grad probe on Megatron-Core, for real on CPU with gloo (tests/launch.py fork servers).

A tiny GPTModel trains 3 steps in a single process (TP=1, DP=1: the unsharded run) and with 2 ranks:
TP=2 (column- and row-parallel partitions and TP-replicated layernorms/biases), DP=2 with the
distributed optimizer, PP=2 with 2 virtual-pipeline chunks, and TP=2 at level L0. Every summary
column and direction file equals float64 numpy of the whole gradients the optimizers stepped with
(assembled by the script from each rank's pieces), the sharded runs equal the unsharded run (1e-5),
and ``trainmon grad-compare`` of a sharded run against the unsharded run gives 1.0 everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "mcore_grad_probe_run.py"
PRELOAD = ("numpy", "pandas", "torch", "megatron.core", "megatron.core.models.gpt.gpt_model",
           "megatron.core.optimizer", "megatron.core.pipeline_parallel", "trainmon", "trainmon.probe.sharded")
CASES = {"single": dict(world=1), "tp2": dict(world=2, tp=2), "dp2_distopt": dict(world=2, distopt=True),
         "vpp2": dict(world=2, pp=2, vpp=2), "tp2_l0": dict(world=2, tp=2, level="L0"),
         "single_l0": dict(world=1, level="L0")}
STEPS = 3
BOUNDS = [-0.01, 0.0, 0.01]
STATS = ["max", "min", "norm", "sign_agree_prev", "sign_agree_exp_avg", "cos_exp_avg",
         "(-inf, -0.01]", "(-0.01, 0]", "(0, 0.01]", "(0.01, inf)", "zero_fraction"]


class _Runs:
    """Each case trained on first use in processes forked from warm servers (one per world size)."""

    def __init__(self, out: Path) -> None:
        from tests.launch import RankServers

        self.out = out
        self.servers = {n: RankServers(n, PRELOAD, out / f"_servers{n}") for n in (1, 2)}
        self.failed: dict[str, str] = {}

    def __getitem__(self, name: str) -> Path:
        if name in self.failed:
            pytest.fail(f"case {name} failed (earlier):\n{self.failed[name][-3000:]}", pytrace=False)
        run = self.out / name
        if not (run / "done").exists():
            case = {"name": name, **{k: v for k, v in CASES[name].items() if k != "world"}}
            ok, output = self.servers[CASES[name]["world"]].run([SCRIPT, self.out, json.dumps(case)],
                                                                self.out / "_logs" / name, timeout=400)
            if not ok:
                self.failed[name] = output
                pytest.fail(f"case {name} failed:\n{output[-6000:]}", pytrace=False)
            (run / "done").touch()
        return run

    def close(self) -> None:
        for servers in self.servers.values():
            servers.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = _Runs(tmp_path_factory.mktemp("gp_mcore"))
    yield runs
    runs.close()


def _arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file (read at once; the file is closed)."""
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def _summary(run: Path, rank: int = 0) -> pd.DataFrame:
    table = pd.read_csv(run / f"rank{rank}" / "grad_probe" / "grad_summary.csv", keep_default_na=False,
                        na_values=["nan"])
    return table.set_index(["vpp_stage", "name", "step"]).sort_index()


def _reference(grads: dict[str, np.ndarray]) -> dict[tuple[int, str, int], dict]:
    """float64 numpy of every summary column and the direction bits; exp_avg recomputed (Adam beta1 0.9)."""
    out, momentum, previous = {}, {}, {}
    for step in range(STEPS):
        for key in [k for k in list(grads) if k.startswith(f"{step}|")]:
            _, vpp, name = key.split("|", 2)
            g = grads[key].ravel()
            edges = [-np.inf, *BOUNDS, np.inf]
            row = {"max": g.max(), "min": g.min(), "norm": np.sqrt(g @ g), "zero_fraction": np.mean(g == 0),
                   "shape": str(list(grads[key].shape)),
                   **{f"({lo:g}, {hi:g}{')' if hi == np.inf else ']'}": np.mean((g > lo) & (g <= hi))
                      for lo, hi in zip(edges[:-1], edges[1:])}}
            ident = (int(vpp), name)
            row["sign_agree_prev"] = np.mean((g > 0) == (previous[ident] > 0)) if ident in previous else np.nan
            m = momentum.get(ident)
            row["sign_agree_exp_avg"] = np.mean((g > 0) == (m > 0)) if m is not None else np.nan
            row["cos_exp_avg"] = g @ m / np.sqrt((g @ g) * (m @ m)) if m is not None else np.nan
            row["bits"] = np.packbits(g > 0, bitorder="little")
            out[(int(vpp), name, step)] = row
            previous[ident] = g
            momentum[ident] = 0.9 * (m if m is not None else 0.0) + 0.1 * g
    return out


def _bits(run: Path, rank: int) -> dict[tuple[int, str, int], np.ndarray]:
    from trainmon.probe.storage import read_direction_header

    out = {}
    for path in (run / f"rank{rank}" / "grad_probe").glob("step*/*.bits"):
        info = read_direction_header(path)
        h = info.header
        if h["vpp_stage"]:
            assert path.name.startswith(f"vpp{h['vpp_stage']}."), path.name
        out[(h["vpp_stage"], h["name"], h["step"])] = info.bits()
    return out


def _check_against_numpy(run: Path, rank: int) -> int:
    got = _summary(run, rank)
    reference = _reference(_arrays(run / f"grads_rank{rank}.npz"))
    bits = _bits(run, rank)
    assert sorted(got.index) == sorted(reference) == sorted(bits)
    for key, want in reference.items():
        row = got.loc[key]
        assert row["shape"] == want["shape"], key
        for column in STATS:
            np.testing.assert_allclose(row[column], want[column], rtol=1e-5, atol=1e-7, equal_nan=True,
                                       err_msg=f"{run.name} rank {rank} {key} {column}")
        np.testing.assert_array_equal(bits[key], want["bits"], err_msg=f"{run.name} rank {rank} {key}")
    return len(reference)


@pytest.mark.parametrize("case", ["single", "tp2", "dp2_distopt"])
def test_probe_equals_float64_numpy_of_the_whole_gradient(runs, case):
    """Summaries and bits of every parameter equal numpy of the whole gradient; sharded runs write once (rank 0)."""
    run = runs[case]
    assert _check_against_numpy(run, 0) > 0
    if case != "single":
        assert not (run / "rank1" / "grad_probe").exists()


def _sign_flips(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[tuple[int, str, int], np.ndarray]:
    """Per (vpp, name, step): the elements whose gradient signs (``> 0``) differ between two runs' gradients."""
    out = {}
    for key in a:
        step, vpp, name = key.split("|", 2)
        x, y = a[key].ravel(), b[key].ravel()
        out[(int(vpp), name, int(step))] = np.flatnonzero((x > 0) != (y > 0))
    return out


@pytest.mark.parametrize("case", ["tp2", "dp2_distopt"])
def test_sharded_run_equals_the_unsharded_run(runs, case, capsys):
    """TP=2 (partitions combined, replicated parameters counted once) and the distributed optimizer give the
    single-process run's summaries (1e-5), and grad-compare of the two runs gives 1.0.

    Exception, checked rather than hidden: the key part of the QKV bias has a gradient of exactly 0 in
    exact arithmetic (softmax ignores a constant added to every key), so its float32 gradient is rounding
    noise (|g| ~ 1e-12) whose signs differ between any two layouts. For those elements the test asserts they
    are noise, and that grad-compare reports exactly numpy's sign agreement of the two runs' gradients."""
    from trainmon.tools.cli import main as cli_main

    single, sharded = runs["single"], runs[case]
    want, got = _summary(single), _summary(sharded)
    assert list(got.index) == list(want.index)
    assert (got["shape"] == want["shape"]).all() and (got["numel"] == want["numel"]).all()
    grads_a, grads_b = _arrays(single / "grads_rank0.npz"), _arrays(sharded / "grads_rank0.npz")
    flips = _sign_flips(grads_a, grads_b)
    noisy = {key for key, where in flips.items() if where.size}
    assert {name for _, name, _ in noisy} <= {f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in (0, 1)}
    for vpp, name, step in noisy:
        g = grads_a[f"{step}|{vpp}|{name}"].ravel()
        assert np.abs(g[flips[(vpp, name, step)]]).max() < 1e-7 * np.abs(g).max()  # float32 rounding of terms ~max|g|
    # columns that see the signs of the noise (vs the previous step too); numpy-checked per run above
    sign_columns = ("sign_agree_prev", "sign_agree_exp_avg", "(-0.01, 0]", "(0, 0.01]", "zero_fraction")
    clean = [key not in noisy and (key[0], key[1], key[2] - 1) not in noisy for key in want.index]
    for column in STATS:
        rows = clean if column in sign_columns else [True] * len(want)
        np.testing.assert_allclose(got.loc[rows, column].to_numpy(float), want.loc[rows, column].to_numpy(float),
                                   rtol=1e-5, atol=1e-7, equal_nan=True, err_msg=f"{case} {column}")
    compare = sharded.parent / f"cmp_{case}"
    assert cli_main(["grad-compare", str(single), str(sharded), "-o", str(compare), "--no-plots"]) == 0
    sims = pd.read_csv(compare / "similarities.csv", keep_default_na=False)
    params = sims[sims["kind"] == "param"]
    assert len(params) == len(want)
    for row in params.itertuples():
        key = (int(row.vpp_stage), row.name, int(row.step))
        assert row.similarity == 1.0 - flips[key].size / row.count, key
        assert row.similarity == 1.0 or key in noisy
    assert (params["similarity"] == 1.0).sum() >= len(params) - 2 * STEPS
    assert not (compare / "problems.txt").exists()
    names = set(pd.read_csv(sharded / "rank0" / "scalars.csv")["name"])
    assert {"grad_probe/sign_agree_prev", "grad_probe/sign_agree_exp_avg", "grad_probe/cos_exp_avg"} <= names
    capsys.readouterr()


def test_virtual_pipeline_chunks(runs):
    """PP=2 with 2 virtual-pipeline chunks: each stage's rank writes its chunks' parameters (``vpp1.`` files
    for chunk 1), equal to numpy of its gradients."""
    run = runs["vpp2"]
    for rank in (0, 1):
        assert _check_against_numpy(run, rank) > 0
        assert {v for v, _, _ in _summary(run, rank).index} == {0, 1}


def test_tp2_l0_hash_equals_numpy_and_the_unsharded_run(runs):
    """L0 with TP=2: the partitions' checksum shares (row-parallel blocks at their global positions) give
    the hash of the whole gradient: equal to numpy's, whose own unsharded run's hashes are numpy's too."""
    from tests.integration.test_grad_probe_deepspeed import _numpy_hash

    for case in ("tp2_l0", "single_l0"):
        run = runs[case]
        got = _summary(run)
        grads = _arrays(run / "grads_rank0.npz")
        assert len(got) == len(grads) and got["hash"].nunique() == len(got)
        for key in list(grads):
            step, vpp, name = key.split("|", 2)
            assert got.loc[(int(vpp), name, int(step)), "hash"] == _numpy_hash(grads[key]), (case, key)
