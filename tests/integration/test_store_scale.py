"""The run store read past one machine: Dask (``dask.dataframe.read_parquet``) and Spark (``pyspark``, local
mode) read the Parquet directories of a real 2-rank DDP run unchanged, and the first non-finite origin each
computes with the ordering of ``trainmon analyse`` (docs/scale.md) is the one ``trainmon analyse`` names.

The run: TinyNet under DistributedDataParallel on 2 gloo ranks, every row family on, a NaN written into one
weight of rank 1 only before step 2. Its forward output is the first non-finite value; rank 0 sees the NaN
only after the gradient all-reduce (``grad_reduced``), later in the step, although rank 0 sorts first among
equal keys: the queries must order by phase before rank. ``trainmon analyse``'s ``first_nonfinite`` is the event the
``nonfinite`` detector wrote during training (from the store's ``anomalies``), not a query over the rows: the engines
are checked against it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import run_ranks

pytestmark = [pytest.mark.slow,  # a 2-process gloo run (and a JVM for the Spark tests)
              pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning")]

STEPS = 3
NAN_STEP, NAN_RANK, NAN_MODULE = 2, 1, "layers.1.fc2"
# Families whose rows carry a non-finite flag and the execution-order columns (scalars have neither).
ROW_FAMILIES = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq",
                "update", "ratio")
COLUMNS = ["step", "micro_step", "phase", "pp_stage", "vpp_stage", "order", "rank", "name"]
PHASES = {"forward": 0, "loss": 1, "backward": 2, "communication": 3, "optimizer": 4}  # trainmon/anomaly/ordering.py
SPARK_SQL = """
SELECT family, rank, step, micro_step, phase, name FROM ({rows})
ORDER BY step, micro_step,
    CASE phase WHEN 'forward' THEN 0 WHEN 'loss' THEN 1 WHEN 'backward' THEN 2
               WHEN 'communication' THEN 3 WHEN 'optimizer' THEN 4 ELSE 5 END,
    CASE WHEN phase = 'backward' THEN -vpp_stage ELSE vpp_stage END,
    CASE WHEN phase = 'backward' THEN -pp_stage ELSE pp_stage END,
    `order`, rank
LIMIT 1
"""


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.models import TinyNet, batch, loss_fn
    from tests.reference import METRICS
    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TinyNet()
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    every = {"enabled": True, "metrics": METRICS}
    monitor = TrainerMonitor({"output_dir": out_dir, "run_name": "run", "sinks": ["parquet"],
                              "activations": every, "weight_grads": every, "params": every,
                              "optimizer_states": {"metrics": METRICS,
                                                   "states": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
                              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]}})
    monitor.attach(model, optimizer)
    try:
        for step in range(STEPS):
            if step == NAN_STEP and rank == NAN_RANK:  # one weight of one module on one rank
                with torch.no_grad():
                    net.get_submodule(NAN_MODULE).weight[0, 0] = float("nan")
            loss = loss_fn(model, *batch(100 * rank + step))  # different data on each rank
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    finally:
        monitor.close()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The run directory of the 2-rank DDP run (Parquet store and ``anomalies.jsonl`` per rank)."""
    out = tmp_path_factory.mktemp("scale")
    run_ranks([__file__, out], world_size=2, timeout=180)
    return out / "run"


@pytest.fixture(scope="module")
def analysed(run: Path) -> dict:
    """``trainmon analyse RUN``'s first non-finite event (the CLI, as a user runs it)."""
    done = subprocess.run([sys.executable, "-m", "trainmon", "analyse", str(run)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    first = json.loads((run / "anomaly_analyse.json").read_text())["first_nonfinite"]
    assert first is not None, done.stdout
    return first


def _key(first: dict) -> tuple:
    return (first["family"], int(first["rank"]), int(first["step"]), int(first["micro_step"]), first["phase"],
            first["name"])


def _families(run: Path) -> list[str]:
    return [family for family in ROW_FAMILIES if (run / "store" / family).is_dir()]


def test_analyse_names_the_injected_nan(analysed):
    assert (analysed["step"], analysed["rank"], analysed["phase"]) == (NAN_STEP, NAN_RANK, "forward")
    assert analysed["family"] == "actv" and analysed["name"].startswith(f"{NAN_MODULE}.output"), analysed


def test_both_ranks_have_nonfinite_rows(run):
    """Rank 0 has non-finite rows in the NaN step too (after the all-reduce): ordering by step and rank alone
    would name rank 0, so agreeing with analyse needs the phase and execution order before the rank."""
    pq = pytest.importorskip("pyarrow.parquet")
    ranks = set()
    for family in _families(run):
        for part in sorted((run / "store" / family).glob("rank=*/*.parquet")):
            # through a handle closed here: a dataset read may close its files on a thread of its own, later
            with open(part, "rb") as handle:
                table = pq.read_table(handle, filters=[("nonfinite", "=", True), ("step", "=", NAN_STEP)])
            if table.num_rows:
                ranks.add(int(part.parent.name.removeprefix("rank=")))
    assert ranks == {0, 1}


@pytest.fixture(scope="module")
def dd():
    """``dask.dataframe``, or a skip (requested before ``run``: no training run when the test would skip)."""
    return pytest.importorskip("dask.dataframe", reason="dask[dataframe] is not installed (the scale extra)")


def test_dask_first_origin_agrees_with_analyse(dd, run, analysed):
    import pandas as pd

    started = time.perf_counter()
    candidates = []
    for family in _families(run):
        # filters: row groups without a non-finite row are skipped by their statistics; the mask keeps the rows
        frame = dd.read_parquet(str(run / "store" / family), columns=[*COLUMNS, "nonfinite"],
                                filters=[("nonfinite", "==", True)])
        rows = frame[frame["nonfinite"]].compute()  # the non-finite rows only: small whatever the run's size
        candidates.append(rows.assign(family=family, rank=rows["rank"].astype("int64")))
    rows = pd.concat(candidates, ignore_index=True)
    sign = rows["phase"].eq("backward").map({True: -1, False: 1}).astype("int64")
    rows = rows.assign(phase_rank=rows["phase"].map(PHASES).fillna(len(PHASES)).astype("int64"),
                       vpp_key=sign * rows["vpp_stage"], pp_key=sign * rows["pp_stage"])
    first = rows.sort_values(["step", "micro_step", "phase_rank", "vpp_key", "pp_key", "order", "rank"],
                             kind="stable").iloc[0]
    elapsed = time.perf_counter() - started
    assert _key(first.to_dict()) == _key(analysed), (first.to_dict(), analysed)
    print(f"dask first origin: {elapsed:.2f} s over {len(_families(run))} families")


def _java_reason(pyspark_version: str) -> str | None:
    """Why Spark cannot run here (no ``java`` that starts, or one too old for this pyspark), or None."""
    needed = 17 if int(pyspark_version.split(".")[0]) >= 4 else 8  # Debian 12's default-jre-headless is 17
    home = os.environ.get("JAVA_HOME")  # Spark's launcher runs $JAVA_HOME/bin/java when it is set, else PATH's
    java = shutil.which("java", path=os.path.join(home, "bin")) if home else shutil.which("java")
    if java is None:
        where = f"no java in JAVA_HOME={home}/bin" if home else "java not on PATH"
        return f"no Java runtime ({where}; scripts/setup.sh installs Debian's default-jre-headless)"
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"java does not start: {error}"
    if done.returncode != 0:
        return f"java -version exits {done.returncode}"
    found = re.search(r'version "(?:1\.)?(\d+)', done.stderr + done.stdout)  # "17.0.15", or "1.8.0" for Java 8
    major = int(found.group(1)) if found else 0
    if major < needed:
        return f"pyspark {pyspark_version} needs Java {needed} or newer; {java} is {major or 'of an unknown version'}"
    return None


@pytest.fixture(scope="module")
def spark():
    """One local Spark session for the module (the JVM takes ~15 s to start): 1 core, small memory, no UI.
    Requested before ``run``: no training run when the test would skip."""
    pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (the scale extra)")
    reason = _java_reason(pyspark.__version__)
    if reason:
        pytest.skip(reason)
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[1]").appName("trainmon-test")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", "512m")
               .config("spark.sql.shuffle.partitions", "1").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def test_spark_first_origin_agrees_with_analyse(spark, run, analysed):
    started = time.perf_counter()
    for family in _families(run):
        spark.read.parquet(str(run / "store" / family)).createOrReplaceTempView(family)
    columns = ", ".join(f"`{column}`" for column in COLUMNS)
    rows = " UNION ALL ".join(f"SELECT '{family}' AS family, {columns} FROM {family} WHERE nonfinite"
                              for family in _families(run))
    (first,) = spark.sql(SPARK_SQL.format(rows=rows)).collect()
    elapsed = time.perf_counter() - started
    assert _key(first.asDict()) == _key(analysed), (first.asDict(), analysed)
    print(f"spark first origin: {elapsed:.2f} s over {len(_families(run))} families")


def test_spark_reads_every_row_and_prunes_by_rank(spark, run):
    """Every stored row is there once (the same count as pyarrow), and a ``rank =`` filter reads one folder."""
    pq = pytest.importorskip("pyarrow.parquet")

    def rows(folder: Path) -> int:  # through handles closed here (see test_both_ranks_have_nonfinite_rows)
        total = 0
        for part in sorted(folder.rglob("*.parquet")):
            with open(part, "rb") as handle:
                total += pq.ParquetFile(handle).metadata.num_rows
        return total

    path = str(run / "store" / "grad_reduced")
    frame = spark.read.parquet(path)
    assert frame.count() == rows(run / "store" / "grad_reduced") > 0
    rank1 = frame.where("rank = 1")
    assert rank1.count() == rows(run / "store" / "grad_reduced" / "rank=1")
    plan = rank1._jdf.queryExecution().executedPlan().toString()
    assert "PartitionFilters: [isnotnull(rank" in plan and "= 1)]" in plan, plan


if __name__ == "__main__":
    _worker(sys.argv[1])
