"""``trainmon serve``: the page and its JSON endpoints on a loopback port, a drill-down to full resolution checked
against the stored values (read back with pyarrow), bad requests, and a clean stop on Ctrl-C (SIGINT)."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from benchmarks.synthetic_store import Spike, llama_names, write_store
from trainmon.tools.cli import main
from trainmon.tools.serve import Server, open_views

NAMES = llama_names(2)
RANKS, STEPS = 3, 300


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    write_store(run_dir, NAMES, ranks=RANKS, steps=STEPS, families=("grad_reduced",), steps_per_part=100,
                spikes=[Spike(250, r"layers\.1\.mlp", 8.0, rank=2)])
    return run_dir


@pytest.fixture
def server(run):
    views = open_views(run, max_columns=50)
    server = Server(views, "127.0.0.1", 0)
    server.start()
    yield server
    server.stop()
    views.source.close()


def _get(server: Server, path: str, host: str | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(server.url + path, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body, status, kind = response.read(), response.status, response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        body, status, kind = exc.read(), exc.code, exc.headers["Content-Type"]
    return status, json.loads(body) if kind == "application/json" else body.decode()


def _stored(run_dir: Path) -> dict[tuple[int, str, int], float]:
    out = {}
    for part in sorted((run_dir / "store" / "grad_reduced").glob("rank=*/*.parquet")):
        table = pq.read_table(part, columns=["name", "step", "norm"]).to_pydict()
        for name, step, value in zip(table["name"], table["step"], table["norm"]):
            out[(int(part.parent.name[5:]), name, step)] = value
    return out


def test_the_page_and_a_drill_down_to_full_resolution(server, run):
    status, page = _get(server, "")
    assert status == 200 and '"serve":true' in page and "<canvas" not in page.split("<script")[0]
    assert "https://" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    status, grid = _get(server, "api/grid?view=steps&family=grad_reduced&metric=norm&rank=2")
    assert status == 200 and grid["cols"]["width"] == 6 and grid["shape"] == [len(NAMES), 50]  # 300 steps, 50 columns
    names = grid["rowset"]["names"]
    assert names == NAMES and names[grid["largest"]["row"]].startswith("model.layers.1.mlp")
    # the bucket of the spike, at full resolution: one column per step, each cell the stored value
    status, zoom = _get(server, "api/grid?view=steps&family=grad_reduced&metric=norm&rank=2&lo=240&hi=259")
    assert status == 200 and zoom["cols"] == {"steps": list(range(240, 260)), "width": 1, "last": 259}
    stored = _stored(run)
    value = np.frombuffer(base64.b64decode(zoom["abs"]["data"]), np.uint8).reshape(zoom["shape"])
    logs = np.log10([[stored[(2, name, step)] for step in range(240, 260)] for name in names])
    assert zoom["abs"]["lo"] == pytest.approx(logs.min()) and zoom["abs"]["hi"] == pytest.approx(logs.max())
    assert np.array_equal(value, np.rint((logs - logs.min()) / (logs.max() - logs.min()) * 249))
    change = np.frombuffer(base64.b64decode(zoom["change"]["data"]), np.uint8).reshape(zoom["shape"])
    spiked = [i for i, name in enumerate(names) if name.startswith("model.layers.1.mlp")]
    assert all(change[i, 10] > 124 + 0.7 * 124 for i in spiked)  # the history before 240 is the reference
    assert np.abs(np.delete(change[:, 10], spiked).astype(int) - 124).max() < 0.35 * 124
    # the stored values themselves
    module = "0:model.layers.1.mlp.up_proj.weight"
    status, values = _get(server, f"api/values?family=grad_reduced&metric=norm&module={module}&rank=0&rank_hi=2"
                                  "&lo=249&hi=250")
    assert status == 200 and values["columns"] == ["rank", "step", "micro_step", "norm"]
    assert values["rows"] == [[rank, step, 0, stored[(rank, "model.layers.1.mlp.up_proj.weight", step)]]
                              for step in (249, 250) for rank in range(RANKS)]


def test_the_other_views(server, run):
    stored = _stored(run)
    status, ranks = _get(server, "api/grid?view=ranks&family=grad_reduced&metric=norm&step=250")
    assert status == 200 and ranks["at"] == 250 and ranks["cols"]["ranks"] == list(range(RANKS))
    status, module = _get(server, "api/grid?view=module&family=grad_reduced&metric=norm&module=0:model.norm.weight"
                                  "&lo=10&hi=19")
    assert status == 200 and module["rank_rows"]["ranks"] == list(range(RANKS)) and module["cols"]["width"] == 1
    value = np.frombuffer(base64.b64decode(module["abs"]["data"]), np.uint8).reshape(module["shape"])
    logs = np.log10([[stored[(rank, "model.norm.weight", step)] for step in range(10, 20)] for rank in range(RANKS)])
    assert np.array_equal(value, np.rint((logs - logs.min()) / (logs.max() - logs.min()) * 249))
    status, rows = _get(server, "api/rows?family=grad_reduced")
    assert status == 200 and rows["names"] == NAMES and rows["groups"][1] == "model.layers.0"
    status, curves = _get(server, "api/curves?rank=1")
    assert status == 200 and set(curves) == {"loss", "grad_norm", "lr/group0"}
    loss = curves["loss"]  # 2 x --max-columns points: buckets of 3 steps
    assert loss["per_bin"] == 3 and loss["steps"] == list(range(0, STEPS, 3))
    assert all(lo is not None and lo <= hi for lo, hi in zip(loss["lo"], loss["hi"]))
    status, catalog = _get(server, "api/catalog")
    assert status == 200 and catalog["families"]["grad_reduced"]["ranks"] == list(range(RANKS))


@pytest.mark.parametrize("path, status, message", [
    ("api/grid?view=steps&family=actv&metric=norm", 400, "family 'actv': no such family"),
    ("api/grid?view=steps&family=grad_reduced&metric=mean", 400, "metric 'mean': no such metric of grad_reduced"),
    ("api/grid?view=steps&family=grad_reduced&metric=norm&rank=7", 400, "rank 7: no rows of grad_reduced"),
    ("api/grid?view=steps&family=grad_reduced&metric=norm&rank=x", 400, "rank 'x': not an integer"),
    ("api/grid?view=sideways&family=grad_reduced&metric=norm", 400, "view 'sideways'"),
    ("api/grid?view=steps&family=grad_reduced&metric=norm&lo=500", 400, "steps 500..299: empty"),
    ("api/grid?view=module&family=grad_reduced&metric=norm&module=0:nope", 400, "module '0:nope': no such row"),
    ("api/grid?view=module&family=grad_reduced&metric=norm&module=nope", 400, "expected VPP:NAME"),
    ("api/nothing", 404, "no such page"),
])
def test_bad_requests_are_answered_with_one_line(server, path, status, message):
    got, body = _get(server, path)
    assert got == status and message in body["error"] and "\n" not in body["error"], body


def test_a_request_for_another_host_is_refused(server):
    """Bound to the loopback, a page that reached it through another name (DNS rebinding) is refused."""
    status, body = _get(server, "api/catalog", host="attacker.example:8050")
    assert status == 403 and "refused" in body["error"]
    assert _get(server, "api/catalog", host=f"localhost:{server.server_address[1]}")[0] == 200


def test_a_bug_is_a_500_and_the_server_goes_on(server, monkeypatch, capsys):
    def broken(query):
        raise RuntimeError("boom")

    monkeypatch.setattr(server.views, "grid", broken)
    status, body = _get(server, "api/grid?view=steps&family=grad_reduced&metric=norm")
    assert status == 500 and "boom" in body["error"]
    assert "error answering /api/grid" in capsys.readouterr().err
    assert _get(server, "api/catalog")[0] == 200


def test_serve_stops_cleanly_on_ctrl_c(run):
    """The command on a free loopback port: it answers a drill-down, then SIGINT ends it with exit 0."""
    process = subprocess.Popen([sys.executable, "-m", "trainmon", "serve", str(run), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving {run} at http://127.0.0.1:"), line + process.stderr.read()
        url = line.split(" at ")[1].split(" ")[0]
        with urllib.request.urlopen(url + "api/grid?view=steps&family=grad_reduced&metric=norm&rank=0&lo=5&hi=9",
                                    timeout=60) as response:
            grid = json.loads(response.read())
        assert grid["cols"]["steps"] == [5, 6, 7, 8, 9]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert "stopped" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.parametrize("args, expected", [
    (["--port", "70000"], "--port: must be an integer in 0..65535"),
    (["--max-columns", "3"], "--max-columns: must be an integer in 10..100000"),
])
def test_bad_arguments_exit_2(run, capsys, args, expected):
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(run), *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and expected in err, err


def test_not_a_run_exits_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainmon serve: error: ") and "no such directory" in err, err
