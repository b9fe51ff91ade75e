"""The grad probe in the run store (``sinks`` with ``parquet``): rows and sign bits equal float64 numpy of the
gradients the optimizer stepped with, the store and the per-file layout hold the same data (``grad-compare`` and
``report`` give the same answers on both), a bounded number of files, a ``kill -9`` leaves readable files."""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from torch import nn

from tests.integration.test_grad_probe import TwoTowers
from trainmon import TrainerMonitor
from trainmon.probe.storage import interval_labels
from trainmon.probe.store import interval_names, read_summary, stored_ranks
from trainmon.sinks.store_layout import GRAD_DIRECTIONS, GRAD_PROBE
from trainmon.tools.cli import main as cli_main
from trainmon.tools.grad_compare import scan_run
from trainmon.tools.store import open_run

BOUNDS = [-0.01, 0.0, 0.01]


def _train(tmp_path, run_name: str, sinks: list[str], seed_b: int = 2, steps: int = 4, model: nn.Module | None = None,
           **probe) -> list[dict]:
    """Train with the probe; returns, per step, the float64 gradients and ``exp_avg`` the optimizer stepped with."""
    model = model if model is not None else TwoTowers(seed_b)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = {"output_dir": str(tmp_path), "run_name": run_name, "sinks": sinks,
              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
              "grad_probe": {"enabled": True, "level": "L2", "bounds": BOUNDS, **probe}}
    seen: list[dict] = []

    def before_step(opt, args, kwargs) -> None:
        state = {n: opt.state.get(p, {}).get("exp_avg") for n, p in model.named_parameters()}
        seen.append({n: (p.grad.double().numpy().copy(), None if state[n] is None else state[n].double().numpy().copy())
                     for n, p in model.named_parameters()})

    handle = optimizer.register_step_pre_hook(before_step)
    data = torch.randn(8 * steps, 8, generator=torch.Generator().manual_seed(5))
    with TrainerMonitor(config).attach(model, optimizer) as monitor:
        for step in range(steps):
            model(data[step * 8:(step + 1) * 8]).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    handle.remove()
    return seen


def _agree(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a > 0) == (b > 0)))


def test_store_rows_and_bits_equal_numpy_of_the_real_gradients(tmp_path):
    seen = _train(tmp_path, "run", ["parquet"])
    run = tmp_path / "run"
    assert not (run / "rank0" / "grad_probe").exists()  # the store replaces the per-file layout
    with open_run(run) as con:
        rows = con.execute("SELECT * FROM grad_probe ORDER BY step, name").df()
        bits = con.execute("SELECT step, name, vpp_stage, shape, numel, count, sample, \"first\", bits, rank "
                           "FROM grad_directions ORDER BY step, name").df()
    assert len(rows) == 4 * 6 and len(bits) == 4 * 6 and set(rows["rank"]) == {0}
    for _, row in rows.iterrows():
        g, momentum = seen[row["step"]][row["name"]]
        flat = g.ravel()
        assert row["shape"] == str(list(g.shape)) and row["numel"] == flat.size
        assert np.isclose(row["norm"], np.linalg.norm(flat), rtol=1e-5)
        assert row["max"] == np.float32(flat.max()) and row["min"] == np.float32(flat.min())
        edges = [-math.inf, *BOUNDS, math.inf]
        for name, lo, hi in zip(interval_names(BOUNDS), edges[:-1], edges[1:]):
            assert np.isclose(row[name], np.mean((flat > lo) & (flat <= hi)), atol=1e-6), name
        assert np.isclose(row["zero_fraction"], np.mean(flat == 0), atol=1e-7)
        if row["step"] == 0:
            assert math.isnan(row["sign_agree_prev"]) and math.isnan(row["sign_agree_exp_avg"])
        else:
            assert np.isclose(row["sign_agree_prev"], _agree(flat, seen[row["step"] - 1][row["name"]][0].ravel()),
                              atol=1e-6)
            m = momentum.ravel()
            assert np.isclose(row["sign_agree_exp_avg"], _agree(flat, m), atol=1e-6)
            assert np.isclose(row["cos_exp_avg"], flat @ m / (np.linalg.norm(flat) * np.linalg.norm(m)), atol=1e-5)
    for _, row in bits.iterrows():
        g = seen[row["step"]][row["name"]][0].ravel()
        assert row["count"] == g.size and row["first"] == 0 and row["sample"] is None
        assert bytes(row["bits"]) == np.packbits(g > 0, bitorder="little").tobytes()  # exactly


def _summary_csv(path) -> pd.DataFrame:
    frame = pd.read_csv(path, keep_default_na=False, na_values=["nan"])
    return frame.rename(columns=dict(zip(interval_labels(BOUNDS), interval_names(BOUNDS))))


def test_store_and_file_layouts_hold_the_same_data(tmp_path):
    """The same training written with sinks [csv] (the per-file layout) and [parquet] (the store), with sampled
    directions for the larger parameters: equal summary values, direction headers and bits, and grad-compare
    gives byte-identical similarities on either layout and across layouts."""
    for sinks, suffix in ((["csv"], "csv"), (["parquet"], "store")):
        for name, seed_b in (("base", 2), ("other", 3)):
            _train(tmp_path, f"{name}_{suffix}", sinks, seed_b, sample_elements=40)
    assert (tmp_path / "base_csv" / "rank0" / "grad_probe").is_dir() and not (tmp_path / "base_csv" / "store").exists()

    csv_rows = _summary_csv(tmp_path / "base_csv" / "rank0" / "grad_probe" / "grad_summary.csv")
    (parts,) = stored_ranks(tmp_path / "base_store", GRAD_PROBE).values()
    stored = read_summary(parts).to_pandas()
    assert list(stored.columns) == list(csv_rows.columns[[2, 0, 1, *range(3, len(csv_rows.columns))]])
    assert len(stored) == len(csv_rows) == 24
    for column in csv_rows.columns:
        if csv_rows[column].dtype.kind == "f":  # the CSV's shortest float32 text, read back to float32
            np.testing.assert_array_equal(csv_rows[column].to_numpy(np.float32), stored[column].to_numpy(np.float32))
        else:
            assert csv_rows[column].tolist() == stored[column].tolist(), column

    files, store = scan_run(tmp_path / "base_csv"), scan_run(tmp_path / "base_store")
    assert files.keys() == store.keys() == {0} and files[0].keys() == store[0].keys() == {0, 1, 2, 3}
    sampled = 0
    for step, entries in files[0].items():
        assert entries.keys() == store[0][step].keys()
        for key, entry in entries.items():
            assert entry.header == store[0][step][key].header
            assert entry.bits().tobytes() == store[0][step][key].bits().tobytes()
            sampled += entry.header["sample"] is not None
    assert sampled == 4 * 2  # a.0.weight and b.weight: 128 and 256 elements, 40 stored

    outputs = {}
    for label, a, b in (("csv", "base_csv", "other_csv"), ("store", "base_store", "other_store"),
                        ("mixed", "base_csv", "other_store")):
        out = tmp_path / f"cmp_{label}"
        assert cli_main(["grad-compare", str(tmp_path / a), str(tmp_path / b), "-o", str(out), "--no-plots"]) == 0
        outputs[label] = (out / "similarities.csv").read_text()
    assert outputs["csv"] == outputs["store"] == outputs["mixed"]
    similarities = pd.read_csv(tmp_path / "cmp_store" / "similarities.csv")
    params = similarities[similarities["kind"] == "param"]
    assert (params[params["name"].str.startswith("a.")]["similarity"] == 1.0).all()
    assert (params[params["name"].str.startswith("b.")]["similarity"] < 1.0).all()
    same = tmp_path / "cmp_same"
    assert cli_main(["grad-compare", str(tmp_path / "base_csv"), str(tmp_path / "base_store"), "-o", str(same),
                     "--no-plots"]) == 0
    assert (pd.read_csv(same / "similarities.csv")["similarity"] == 1.0).all()


def test_report_reads_the_probe_from_the_store(tmp_path):
    """The report's grad-probe heatmaps of a store run equal those of the same run's grad_summary.csv."""
    from trainmon.tools.report import build
    from trainmon.tools.report import data as report_data

    _train(tmp_path, "files", ["csv"])
    _train(tmp_path, "store", ["parquet"])
    csv_path = report_data.probe_files(tmp_path / "files", [0])[0]
    folder = report_data.probe_files(tmp_path / "store", [0])[0]
    assert csv_path.name == "grad_summary.csv" and folder == tmp_path / "store" / "store" / GRAD_PROBE / "rank=0"
    from_csv, from_store = report_data.read_probe_table(csv_path), report_data.read_probe_table(folder)
    assert from_csv.metrics == from_store.metrics == ["sign_agree_prev", "cos_prev", "sign_agree_exp_avg",
                                                      "cos_exp_avg"]
    assert from_csv.keys == from_store.keys
    for field in ("rows", "steps", "micro_steps"):
        np.testing.assert_array_equal(getattr(from_csv, field), getattr(from_store, field))
    np.testing.assert_array_equal(from_csv.values.astype(np.float32), from_store.values.astype(np.float32))
    maps = [report_data.heatmaps("grad_probe", [table], 0, 50, scales=report_data.PROBE_METRICS)
            for table in (from_csv, from_store)]
    assert maps[0] == maps[1] and len(maps[0]) == 4
    built = build(tmp_path / "store", tmp_path / "report.html", progress=False)
    assert built["heatmaps"] == 4 and built["files"] == 2  # the scalars table and the probe's
    # csv2tb converts the families and scalars of a store: the probe's tables are none of them
    assert cli_main(["csv2tb", str(tmp_path / "store"), "-o", str(tmp_path / "tb")]) == 0


def test_query_sees_the_probe_tables(tmp_path, capsys):
    _train(tmp_path, "run", ["parquet"], steps=2)
    assert cli_main(["query", str(tmp_path / "run"), "--tables"]) == 0
    tables = capsys.readouterr().out
    assert "grad_probe: step BIGINT" in tables and "grad_directions: step BIGINT" in tables and "bits BLOB" in tables
    assert cli_main(["query", str(tmp_path / "run"), "SELECT name, bits FROM grad_directions WHERE name = 'b.weight' "
                                                     "ORDER BY step"]) == 0
    assert "<32 bytes>" in capsys.readouterr().out  # 256 signs; table format prints the size, not the bytes
    assert cli_main(["query", str(tmp_path / "run"), "SELECT bits FROM grad_directions WHERE name = 'b.bias' "
                                                     "AND step = 0", "--format", "csv"]) == 0
    assert len(capsys.readouterr().out.splitlines()[1]) == 8  # 32 signs: 4 bytes in hex


class Many(nn.Module):
    """25 linear layers: 50 parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(25)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x[:, :4]).square().mean()


def test_file_count_is_bounded(tmp_path):
    """50 parameters x 40 steps, every step rolled into small files (flush_seconds 0.01): the store holds one part
    per table at close, where the per-file layout writes 2,001 files."""
    model = Many()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["parquet"], "flush_seconds": 0.01,
              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
              "grad_probe": {"enabled": True, "level": "L1"}}
    x = torch.randn(4, 8)
    small_files = 0
    with TrainerMonitor(config).attach(model, optimizer) as monitor:
        for step in range(40):
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
            if step == 20:
                time.sleep(0.5)  # the probe's writer rolls what it holds when idle
                small_files = len(list((tmp_path / "run" / "store" / GRAD_DIRECTIONS).rglob("*.parquet")))
    store = tmp_path / "run" / "store"
    probe_files = sorted(p.relative_to(store) for table in (GRAD_PROBE, GRAD_DIRECTIONS)
                         for p in (store / table).rglob("*") if p.is_file() and not p.name.startswith("_schema-"))
    assert len(probe_files) == 2, probe_files  # one merged part per table (beside its schema's mark)
    assert small_files >= 2  # rolled into small files while training, merged at close
    assert not (tmp_path / "run" / "rank0" / "grad_probe").exists()
    with open_run(tmp_path / "run") as con:
        assert con.execute("SELECT count(*), count(DISTINCT step), count(DISTINCT name) FROM grad_directions"
                           ).fetchall() == [(2000, 40, 50)]
        assert con.execute("SELECT count(*) FROM grad_probe").fetchall() == [(2000,)]


def test_kill_9_leaves_readable_probe_tables(tmp_path):
    """A training process killed with SIGKILL: every grad-probe part reads whole, no (step, name) twice, only the
    last ``flush_seconds`` of steps missing, and grad-compare reads the killed run."""
    import pyarrow.parquet as pq

    from tests.integration.test_crash_loss import FLUSH_SECONDS, _train_and_kill

    config = {"sinks": ["parquet"], "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
              "grad_probe": {"enabled": True, "level": "L1"}}
    done, killed_at = _train_and_kill(tmp_path, config, 150, 0.02)
    run = tmp_path / "out" / "run"
    tables = {}
    for table in (GRAD_PROBE, GRAD_DIRECTIONS):
        parts = []
        for path in sorted((run / "store" / table).rglob("*.parquet")):
            with open(path, "rb") as handle:
                parts.append(pq.read_table(handle))
        assert parts, f"no {table} part rolled in ~4 s"
        tables[table] = pa.concat_tables(parts).select(["step", "name"]).to_pandas()
        assert not tables[table].duplicated().any(), table
    assert not [p for p in (run / "store").rglob("*") if p.name.startswith(".")], "a temporary file became visible"
    per_step = tables[GRAD_DIRECTIONS].groupby("step").size()
    complete = {int(step) for step, count in per_step.items() if count == 8}  # 4 layers: 8 parameters
    lost = sorted(set(done) - complete)
    assert all(done[step] > killed_at - FLUSH_SECONDS - 1.0 for step in lost), lost
    out = tmp_path / "cmp"
    assert cli_main(["grad-compare", str(run), str(run), "-o", str(out), "--no-plots"]) == 0


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_other_levels(tmp_path, level):
    """L0 stores the hash column and no directions; L1 no interval columns."""
    _train(tmp_path, "run", ["parquet", "csv"], steps=2, level=level)
    run = tmp_path / "run"
    assert not (run / "rank0" / "grad_probe").exists()  # parquet among the sinks: the store
    (parts,) = stored_ranks(run, GRAD_PROBE).values()
    columns = read_summary(parts).column_names
    assert ("hash" in columns) == (level == "L0") and ("sign_agree_prev" in columns) == (level == "L1")
    assert not any(name.startswith("interval_") for name in columns)
    assert bool(stored_ranks(run, GRAD_DIRECTIONS)) == (level == "L1")
